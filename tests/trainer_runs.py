"""Training runs through HF Trainer and Accelerate, started by tests/test_trainers.py under torchrun:

    torchrun --nproc_per_node 2 tests/trainer_runs.py {hf|accelerate} BLOCK_FILE OUT_DIR

BLOCK_FILE is the docs/trainers.md block of the framework, run as shown (runpy, OUTPUT_DIR set); what it
built is then inspected here. `hf` also trains N steps straight and N/2 + resume + N/2 through Trainer with
optimizers=(opt, scheduler). Each rank writes OUT_DIR/result_<rank>.json for the test to check.
"""

import os
import runpy
import sys

import torch
import torch.distributed as dist

import shardopt
from shardopt.frameworks.common import shardopt_optimizer
from shardopt.optim.guard import bit_hash
from shardopt.hf import ShardoptCallback
from two_processes import finish

STEPS = 6   # the straight run; the resumed one restarts from the checkpoint at STEPS // 2


def run_block(block: str, output_dir: str) -> dict:
    """The block's globals after running it with OUTPUT_DIR=output_dir."""
    os.environ["OUTPUT_DIR"] = output_dir
    return runpy.run_path(block, run_name="__main__")


def flat_state(opt) -> dict:
    """Every tensor of opt.state_dict(), by '<param index>.<key>'."""
    return {f"{index}.{key}": value for index, state in opt.state_dict()["state"].items()
            for key, value in state.items() if isinstance(value, torch.Tensor)}


def state_differing(a, b) -> list[str]:
    """The flat_state keys where optimizers a and b differ (a key only one of them has included)."""
    first, second = flat_state(a), flat_state(b)
    return sorted(key for key in first.keys() | second.keys()
                  if key not in first or key not in second or not torch.equal(first[key], second[key]))


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64))


def recorder():
    """A Trainer callback (listed before ShardoptCallback) that records, per optimizer step, the replicate bytes
    the optimizer sends from before the agreed clip to after the step, a hash of the local gradients, and how many
    bucket steps had started in backward (overlap_backward)."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self):
            self.step_bytes, self.grad_hashes, self.started = [], [], []

        def on_pre_optimizer_step(self, args, state, control, optimizer=None, model=None, **kwargs):
            opt = shardopt_optimizer(optimizer, "")
            self.before = opt.comm_stats()["replicate"]["bytes_sent"]
            self.started.append(opt.backward_overlap.started() if opt.backward_overlap is not None else 0)   # units begun in backward
            self.grad_hashes.append(int(bit_hash(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))))

        def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            self.step_bytes.append(shardopt_optimizer(optimizer, "").comm_stats()["replicate"]["bytes_sent"] - self.before)
    return Recorder()


def trainer_run(output_dir: str, resume: str | None = None, overlap_backward: bool = True, **arguments):
    """STEPS steps of Trainer(optimizers=(SignMuon, LambdaLR)) with a checkpoint every STEPS // 2, Trainer's
    default max_grad_norm (1.0, which turns overlap_backward off) unless `arguments` set it, and gradient
    accumulation 2; from `resume` if given."""
    from transformers import Trainer, TrainingArguments
    args = TrainingArguments(output_dir, max_steps=STEPS, save_steps=STEPS // 2, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, use_cpu=True, report_to="none", disable_tqdm=True,
                             **arguments)
    model = tiny_gpt2()
    opt = shardopt.SignMuon(shardopt.param_groups(model, "signmuon", "lion", nonmatrix_options={"lr": 3e-4}), lr=3e-3,
                            replicate_mesh=dist.group.WORLD, overlap_backward=overlap_backward)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + 0.2 * step))
    tokens = torch.randint(0, 256, (128, 32), generator=torch.Generator().manual_seed(1))
    record = recorder()
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": t, "labels": t} for t in tokens],
                      optimizers=(opt, schedule), callbacks=[record, ShardoptCallback()])
    trainer.train(resume_from_checkpoint=resume)
    return trainer, model, opt, record


def hf(block: str, out: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel
    doc = run_block(block, os.path.join(out, "doc"))
    doc_opt = shardopt_optimizer(doc["trainer"].optimizer, "")
    straight, model, opt, record = trainer_run(os.path.join(out, "straight"))
    _, resumed_model, resumed_opt, _ = trainer_run(os.path.join(out, "resumed"),
                                                   os.path.join(out, "straight", f"checkpoint-{STEPS // 2}"))
    weights, resumed_weights = model.state_dict(), resumed_model.state_dict()
    state, resumed_state = flat_state(opt), flat_state(resumed_opt)
    overlap = [trainer_run(os.path.join(out, f"overlap_{on}"), overlap_backward=on, max_grad_norm=0.0)
               for on in (False, True)]
    (_, off_model, off_opt, off_record), (_, on_model, on_opt, on_record) = overlap
    return {
        "overlap_turned_off_by_clipping": not opt.overlap_backward,
        "overlap_weights_equal": all(torch.equal(a, b) for a, b in zip(off_model.parameters(), on_model.parameters())),
        "overlap_state_differing": state_differing(off_opt, on_opt),
        "overlap_bytes": [o.comm_stats()["replicate"]["bytes_sent"] for o in (off_opt, on_opt)],
        "overlap_started": [off_record.started, on_record.started],
        "doc_algorithms": [group["algorithm"] for group in doc_opt.param_groups],
        "doc_steps": doc["trainer"].state.global_step,
        "doc_checkpoints": sorted(name for name in os.listdir(os.path.join(out, "doc")) if name.startswith("checkpoint")),
        "doc_consistent": doc_opt.replicas_consistent(),
        "doc_bytes": doc_opt.comm_stats()["replicate"]["bytes_sent"],
        "doc_describe": doc_opt.describe(),
        "ddp": isinstance(straight.model_wrapped, DistributedDataParallel),
        "trainer_max_grad_norm": straight.args.max_grad_norm,
        "consistent": opt.replicas_consistent(),
        "weights_hash": weights_hash(model),
        "step_bytes": record.step_bytes,
        "grad_hash_step1": record.grad_hashes[0],
        "params": sum(p.numel() for p in model.parameters()),
        "resume_weights_equal": weights.keys() == resumed_weights.keys()
        and all(torch.equal(weights[k], resumed_weights[k]) for k in weights),
        "resume_state_equal": state.keys() == resumed_state.keys() and len(state) > 0
        and all(torch.equal(state[k], resumed_state[k]) for k in state),
        "unexchanged_optimizer_error": error_of(lambda: ShardoptCallback().on_train_begin(
            straight.args, straight.state, straight.control, model=model, optimizer=unexchanged_optimizer())),
    }


def accelerate(block: str, out: str) -> dict:
    steps = record_steps()
    first = run_block(block, out)
    first_steps, first_state = steps.pop(), flat_state(first["opt"])
    dist.barrier()   # rank 0 wrote the checkpoint
    saved = torch.load(os.path.join(out, "checkpoint", "optimizer.bin"), weights_only=True)
    saved_state = {f"{index}.{key}": value for index, state in saved["state"].items() for key, value in state.items()
                   if isinstance(value, torch.Tensor)}
    second = run_block(block, out)   # finds the checkpoint: loads it and trains on
    second_steps, opt = steps.pop(), shardopt_optimizer(second["opt"], "")
    attach = second["shardopt"].accelerate.attach
    return {
        "bare_model_error": error_of(lambda: attach(second["accelerator"], second["model"].module, second["opt"])),
        "unexchanged_optimizer_error": error_of(lambda: attach(second["accelerator"], second["model"],
                                                               unexchanged_optimizer())),
        "model": type(second["model"]).__name__,
        "consistent": opt.replicas_consistent(),
        "weights_hash": weights_hash(second["model"]),
        "saved_is_synchronized": first_state.keys() == saved_state.keys()
        and all(torch.equal(first_state[k], saved_state[k]) for k in first_state),
        "optimizer_steps": [len(first_steps), int(next(iter(opt.state.values()))["step"])],
        "overlap": accelerate_overlap(),
        "step_bytes": [[step["bytes"] for step in run] for run in (first_steps, second_steps)],
        "grad_hash_step1": first_steps[0]["grad_hash"],
        "params": sum(p.numel() for p in second["model"].parameters()),
    }


def accelerate_overlap() -> dict:
    """The Accelerate block's loop (gradient accumulation 2) with overlap_backward off and on, max_grad_norm=0:
    weights and state keyed by param, all replicate bytes, bucket steps begun in backward before each step."""
    from accelerate import Accelerator
    import shardopt.accelerate
    runs = []
    for on in (False, True):
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
        model = tiny_gpt2()
        opt = shardopt.SignMuon(shardopt.param_groups(model, "signmuon", "lion", nonmatrix_options={"lr": 3e-4}),
                                lr=3e-3, replicate_mesh=dist.group.WORLD, overlap_backward=on)
        tokens = torch.randint(0, 256, (64, 32), generator=torch.Generator().manual_seed(0))
        loader = torch.utils.data.DataLoader(tokens, batch_size=4)
        model, prepared, loader = accelerator.prepare(model, opt, loader)
        shardopt.accelerate.attach(accelerator, model, prepared)
        started = []
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(input_ids=batch, labels=batch).loss)
                if accelerator.sync_gradients:
                    started.append(opt.backward_overlap.started() if opt.backward_overlap is not None else 0)
                prepared.step()
                prepared.zero_grad()
        runs.append((weights_hash(model), opt, opt.comm_stats()["replicate"]["bytes_sent"], started))
    (off_hash, off_opt, off_bytes, off_started), (on_hash, on_opt, on_bytes, on_started) = runs
    return {"weights_equal": off_hash == on_hash, "bytes": [off_bytes, on_bytes], "started": [off_started, on_started],
            "state_differing": state_differing(off_opt, on_opt)}


def record_steps() -> list:
    """A list that gets one list per shardopt optimizer: per step() the replicate bytes it sent (comm_stats) and a
    hash of the local gradients it read (torch.optim's global step pre/post hooks)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    runs, before = [], {}

    def pre(optimizer, args, kwargs):
        if isinstance(optimizer, shardopt.ShardOptimizer):
            if optimizer not in before:
                runs.append([])
            grads = [p.grad.reshape(-1) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            before[optimizer] = (optimizer.comm_stats()["replicate"]["bytes_sent"], int(bit_hash(torch.cat(grads))))

    def post(optimizer, args, kwargs):
        if isinstance(optimizer, shardopt.ShardOptimizer):
            sent, grad_hash = before[optimizer]
            runs[-1].append({"bytes": optimizer.comm_stats()["replicate"]["bytes_sent"] - sent, "grad_hash": grad_hash})
    register_optimizer_step_pre_hook(pre)
    register_optimizer_step_post_hook(post)
    return runs


def unexchanged_optimizer():
    """A shardopt optimizer built without replicate_mesh (it exchanges nothing over the processes)."""
    return shardopt.SignMuon([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.1)


def error_of(call) -> str | None:
    """The message of the exception call() raises (None if it returns)."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the test checks the type through the message
        return f"{type(error).__name__}: {error}"
    return None


def weights_hash(model) -> int:
    return int(bit_hash(torch.cat([p.detach().reshape(-1) for p in model.parameters()])))


if __name__ == "__main__":
    scenario, block, out = sys.argv[1:]
    result = {"hf": hf, "accelerate": accelerate}[scenario](block, out)
    finish(os.path.join(out, f"result_{dist.get_rank()}.json"), result)
