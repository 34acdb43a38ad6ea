"""Train the small GPT on Shakespeare bytes with FSDP2 and a shardopt optimizer on a (replicate, shard) mesh.

    python integrations/data.py                                   # once: fetch and prepare the data
    torchrun --standalone --nproc_per_node 4 integrations/fsdp/train.py \\
        --replicate 2 --shard 2 --optimizer dion --rank-fraction 0.25

The world is a mesh of `--replicate` × `--shard` × `--tp` ranks. With --tp T > 1 every block is
first tensor-parallel over the innermost T ranks (model.parallelize: ColwiseParallel on the
q/k/v and fc weights, RowwiseParallel on the projections; the T ranks read the same batches).
FSDP2 shards every block and the root over the shard axis (it reduce-scatters gradients there, as usual); nobody averages
gradients over the replicate axis except the optimizer, which exchanges them in its own
compressed form (Dion: low-rank factors; Sign-Muon: a 1-bit majority vote). Embeddings,
norms and the (tied) output head use --nonmatrix-algorithm: AdamW with a full-precision mean
(default) or Lion with a 1-bit majority vote, the same in every run, so
the baselines differ only in the optimizer of the 2-D weights:

    adamw     AdamW (full-precision gradient mean over the replicate axis)
    muon      Muon (full-precision gradient mean, Newton–Schulz direction)
    dion      Dion (rank r = rank_fraction · min(m, n); exchanges (m + n)·r numbers, not m·n)
    signmuon  Sign-Muon (Newton–Schulz direction, sign, majority vote; 1 bit per number or less)

All replicate-axis traffic goes through shardopt, so opt.comm_stats() counts every run's
bytes the same way. Every rank reads its own batches, drawn from (seed, step, rank) alone,
so `--resume` continues from the latest checkpoint (DCP: model, optimizer, lr scheduler) on the same
trajectory as an uninterrupted run; a checkpoint also resumes on another --replicate × --shard
(DCP reshards it). Written to --out-dir: metrics.csv (one row per log
step), loss.png (if matplotlib is installed: pip install -e '.[train]'), summary.json and
checkpoints/step_NNNNNN/ (on several nodes, put --out-dir where every node sees it),
tensorboard/ with --tensorboard. With --local-steps H a last step off a sync step ends the last round
with a sync (LocalSteps.sync_now: at most one round's bytes), so the final evaluation, checkpoint and
every replica hold the same model (with --fault-tolerant too: one more torchft round).

Everyday options: --bf16 (FSDP2 MixedPrecisionPolicy: bf16 compute, fp32 weights, gradients and
optimizer state), --grad-accum N (N micro-batches per step; FSDP2 reduce-scatters on the last one
only), --clip MAX (the optimizer's max_grad_norm: every rank scales its gradients by the same
factor, from a norm agreed over replicas and shards; docs/design.md §5). The lr schedule is a torch.optim.lr_scheduler.LambdaLR (linear warm-up, cosine to 10%) saved in every
checkpoint. Defaults: integrations/gpt.json (model, data, schedule; shared with launch/bench/train_ddp.py)
integrations/fsdp/defaults.json (the rest) and LocalSteps' signature (the --outer-* options); --config FILE.json
overrides them, the command line both.
"""

import argparse
import contextlib
import inspect
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

try:
    from tqdm import tqdm
except ImportError as error:
    raise SystemExit(f"train.py needs the 'train' extra ({error}): pip install -e '.[train]'") from error

import shardopt
from integrations import data, step_profile, training
from integrations.model import GPT, GPTConfig, parallelize
from shardopt.algorithms.polar import SCHEDULES
from shardopt.wire.vote import resolve_vote

import checkpoint  # integrations/fsdp/checkpoint.py, fault_tolerant.py and world.py, beside this script
import fault_tolerant
import world

started = time.perf_counter()

# ---- command line over --config over the defaults files ----------------------------------------
parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--replicate", type=int, help="replicas (data parallel, optimizer-compressed); "
                    "default: world size / --shard")
parser.add_argument("--shard", type=int, help="FSDP2 shard ranks per replica")
parser.add_argument("--tp", type=int, help="tensor-parallel ranks per shard rank (innermost mesh dim)")
parser.add_argument("--optimizer", choices=("adamw", "dion", "muon", "signmuon"), help="of the 2-D weights (above)")
parser.add_argument("--lr", type=float, help="lr of the 2-D weights; default by optimizer "
                    "(lr_by_optimizer in integrations/fsdp/defaults.json)")
parser.add_argument("--weight-decay", type=float, help="weight decay of the 2-D weights")
parser.add_argument("--rank-fraction", type=float, help="dion: rank / min(m, n)")
parser.add_argument("--mu", type=float, help="dion: error-feedback momentum")
parser.add_argument("--wire-dtype", choices=("bfloat16", "float32"),
                    help="dion: precision of the low-rank factors on the replicate axis")
parser.add_argument("--momentum", type=float, help="signmuon, muon: EMA momentum")
parser.add_argument("--ns-steps", type=int, help="signmuon, muon: Newton–Schulz steps")
parser.add_argument("--ns-coefficients", choices=tuple(SCHEDULES), help="signmuon, muon: Newton–Schulz coefficient "
                    "schedule (Muon's quintic, or Polar Express's per-step quintics: shardopt/algorithms/polar.py)")
parser.add_argument("--vote", choices=shardopt.VOTE_FORMATS + ("auto",), help="signmuon: wire format of the majority vote")
training.add_renamed(parser, "--nonmatrix-algorithm", "--scalar-algorithm", choices=("adamw", "lion"), help="embeddings, "
                     "norms and head: AdamW (full-precision gradient mean) or Lion (1-bit majority vote over the replicas)")
training.add_renamed(parser, "--nonmatrix-lr", "--scalar-lr", type=float, help="lr of embeddings, norms and head; "
                     "default by algorithm (nonmatrix_lr_by_algorithm; lion's from results/scalar_quality.csv)")
training.add_renamed(parser, "--nonmatrix-betas", "--scalar-betas", type=float, nargs=2, metavar=("BETA1", "BETA2"),
                     help="betas of the non-matrix group (AdamW's, or Lion's interpolation and momentum)")
training.add_gpt_arguments(parser)
parser.add_argument("--grad-accum", type=int, metavar="N", help="gradient accumulation: micro-batches per "
                    "step (FSDP2 reduce-scatters once per step, on the last)")
parser.add_argument("--bf16", action="store_true", help="mixed precision: bf16 forward/backward (FSDP2 "
                    "MixedPrecisionPolicy), fp32 weights, gradient reduction and optimizer state")
parser.add_argument("--clip", type=float, metavar="MAX", help="clip gradients to norm MAX, agreed "
                    "over all ranks (the optimizer's max_grad_norm; 0: off)")
parser.add_argument("--overlap-backward", choices=("on", "off"), help="start each bucket's exchange during "
                    "backward (the optimizer's overlap_backward; docs/design.md §12)")
step_profile.add_argument(parser)
parser.add_argument("--stop-at", type=int, help="stop after this step (e.g. to resume later)")
parser.add_argument("--checkpoint-every", type=int, help="0: no checkpoints")
parser.add_argument("--checkpoint-momenta", choices=("mean", "sign_vote", "sign_mean", "own"), default="mean",
                    help="what a checkpoint saves of the replicas' decoupled momenta: their exact fp32 mean (the "
                    "default: resumes on another --replicate), a 1-bit agreement (sign_vote, sign_mean: at most "
                    "one step's bytes), or each replica its own (own: 0 bytes, the training unchanged; "
                    "resumes on the same --replicate only). Local steps: always own")
parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out-dir")
parser.add_argument("--out-dir", type=Path, help="default: runs/<optimizer>")
parser.add_argument("--tensorboard", action="store_true", help="log loss, lr, grad norm and bytes to "
                    "<out-dir>/tensorboard (torch.utils.tensorboard; pip install -e '.[train]')")
parser.add_argument("--summary-csv", type=Path, help="append one row of final numbers to this CSV")
parser.add_argument("--timeout", type=float, help="seconds a collective may wait for another rank "
                    "before this rank fails with a timeout error (a dead rank then stops the job, not hangs it)")
parser.add_argument("--check-replicas-every", type=int, help="every N steps check that the "
                    "replicas' weights are bitwise equal and stop with an error if not (0: never)")
parser.add_argument("--local-steps", type=int, metavar="H", help="local steps (docs/design.md §10): the "
                    "optimizer steps on the shard axis only and the replicas sync every H steps through "
                    "shardopt.LocalSteps (0: off, every step exchanges)")
parser.add_argument("--outer-exchange", choices=shardopt.localsteps.formats.EXCHANGES, help="local steps: the format of the "
                    "pseudo-gradient on the replicate axis")
parser.add_argument("--outer-lr", type=float, help="local steps: lr of the outer SGD (Nesterov)")
parser.add_argument("--outer-momentum", type=float, help="local steps: momentum of the outer SGD")
parser.add_argument("--outer-overlap", action="store_true", help="local steps: each sync's exchange runs during "
                    "the next round and is applied one round late")
parser.add_argument("--fragments", type=int, metavar="F", help="local steps: sync the model in F parts at "
                    "staggered steps")
parser.add_argument("--outer-rank-fraction", type=float, help="local steps, --outer-exchange lowrank: rank / "
                    "min(m, n) of each matrix's pseudo-gradient")
parser.add_argument("--outer-block", type=int, help="local steps: entries per scale of the int8, int4, sign_vote and "
                    "sign_mean exchanges (default: the format's, 128 for sign_*, 4096 for int8/int4/topk)")
parser.add_argument("--outer-density", type=float, help="local steps, --outer-exchange topk: the fraction of each "
                    "chunk of --outer-block entries sent")
fault_tolerant.add_arguments(parser)
# local steps' options default to LocalSteps' own (train.py name ← its parameter): one place says them
LOCAL_STEPS_OPTIONS = {"outer_exchange": "exchange", "outer_lr": "outer_lr", "outer_momentum": "outer_momentum",
                       "outer_overlap": "overlap", "fragments": "fragments", "outer_rank_fraction": "rank_fraction",
                       "outer_block": "block", "outer_density": "density"}
signature = inspect.signature(shardopt.LocalSteps).parameters
args = training.parse_args(parser, training.GPT_DEFAULTS, Path(__file__).with_name("defaults.json"),
                           **{option: signature[name].default for option, name in LOCAL_STEPS_OPTIONS.items()})
fault_tolerant.check(args, parser)
args.lr = args.lr_by_optimizer[args.optimizer] if args.lr is None else args.lr
args.nonmatrix_lr = args.nonmatrix_lr or args.nonmatrix_lr_by_algorithm[args.nonmatrix_algorithm]
args.out_dir = args.out_dir or Path("runs") / args.optimizer
if args.local_steps < 0:
    parser.error(f"--local-steps {args.local_steps} must be ≥ 0 (0: off)")
if args.grad_accum < 1 or args.clip < 0:
    parser.error(f"--grad-accum {args.grad_accum} must be ≥ 1 and --clip {args.clip} ≥ 0")
if args.tensorboard:
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError as error:
        parser.error(f"--tensorboard needs the tensorboard package ({error}): pip install -e '.[train]'")

# ---- distributed set-up: a (replicate, shard, tensor) mesh -------------------------------------
world_size = int(os.environ.get("WORLD_SIZE", "1"))
args.replicate = args.replicate or max(1, world_size // max(1, args.shard * args.tp))
if args.replicate < 1 or args.shard < 1 or args.tp < 1 or args.replicate * args.shard * args.tp != world_size:
    tp = f" × --tp {args.tp}" if args.tp != 1 else ""
    parser.error(f"--replicate {args.replicate} × --shard {args.shard}{tp} = {args.replicate * args.shard * args.tp} "
                 f"ranks, but the world size is {world_size} (torchrun --nproc_per_node × --nnodes); choose "
                 f"--replicate, --shard{' and --tp' if tp else ''} with product {world_size}")
mesh, device = world.init_mesh(args.replicate, args.shard, args.tp, args.timeout)   # world.py
rank = dist.get_rank()
master = rank == 0
print(f"rank {rank}/{world_size} on {os.uname().nodename}: replicate {mesh.get_local_rank('replicate')}, "
      f"shard {mesh.get_local_rank('shard')}, tensor {mesh.get_local_rank('tensor')}", flush=True)


def log(message: str) -> None:
    if master:
        tqdm.write(message)   # (above the progress bar)


# ---- data and model: FSDP2 over the shard axis only --------------------------------------------
batches = training.Batches(args, args.replica_id * world_size + rank // args.tp if args.fault_tolerant else
                           rank // args.tp, device)   # the tensor-parallel ranks of a shard rank read the same
torch.manual_seed(args.seed)   # the same initial weights on every rank
model = GPT(GPTConfig(vocab_size=data.vocab_size(args.data_dir), block_size=args.block_size, n_layer=args.n_layer,
                      n_head=args.n_head, n_embd=args.n_embd)).to(device)
# (also when --shard is 1: the parameters are then DTensors all the same, so the optimizer state has
# one layout at every mesh shape and a checkpoint resumes on a different --replicate × --shard)
if args.tp > 1:
    parallelize(model, mesh["tensor"])
precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.bf16 else None, reduce_dtype=torch.float32)
for block in model.transformer.h:
    fully_shard(block, mesh=mesh["shard"], mp_policy=precision)
fully_shard(model, mesh=mesh["shard"], mp_policy=precision)
log(f"model: {model.num_params():,} params, {args.n_layer} layers, width {args.n_embd}, context {args.block_size}; "
    f"mesh {args.replicate} replicate × {args.shard} shard × {args.tp} tensor on {device.type}{', bf16 compute' if args.bf16 else ''}")

# ---- optimizer: the 2-D weights get --optimizer, everything else --nonmatrix-algorithm ----------
matrix_algorithm = "dion" if args.optimizer == "adamw" else args.optimizer
groups = shardopt.param_groups(model, matrix_algorithm, args.nonmatrix_algorithm, nonmatrix_options=dict(
    lr=args.nonmatrix_lr, weight_decay=0.0, betas=tuple(args.nonmatrix_betas)))
if args.optimizer in ("signmuon", "muon"):
    groups[0]["ns_coefficients"] = args.ns_coefficients
# with --local-steps the optimizer has no replicate axis: LocalSteps owns it (below)
replicate_mesh = fault_tolerant.manager(args) if args.fault_tolerant else mesh["replicate"]   # torchft: the manager
meshes = dict(replicate_mesh=None if args.local_steps else replicate_mesh, shard_mesh=mesh["shard"], seed=args.seed,
              max_grad_norm=args.clip, overlap_backward=args.overlap_backward == "on",
              **(dict(tensor_mesh=mesh["tensor"]) if args.tp > 1 else {}))
if args.optimizer == "dion":
    opt = shardopt.Dion(groups, lr=args.lr, mu=args.mu, rank_fraction=args.rank_fraction,
                        weight_decay=args.weight_decay, wire_dtype=args.wire_dtype, **meshes)
elif args.optimizer == "signmuon":
    opt = shardopt.SignMuon(groups, lr=args.lr, momentum=args.momentum, ns_steps=args.ns_steps, vote=args.vote,
                            weight_decay=args.weight_decay, **meshes)
else:   # the baselines: Muon, or AdamW on the matrices too; both average full-precision gradients
    groups[0]["algorithm"] = args.optimizer
    opt = shardopt.ShardOptimizer(groups, dict(lr=args.lr, momentum=args.momentum, ns_steps=args.ns_steps,
                                               weight_decay=args.weight_decay), **meshes)
if args.local_steps:
    opt = shardopt.LocalSteps(opt, replicate_mesh=replicate_mesh, sync_every=args.local_steps,
                              outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                              exchange=args.outer_exchange, overlap=args.outer_overlap, fragments=args.fragments,
                              rank_fraction=args.outer_rank_fraction, block=args.outer_block,
                              density=args.outer_density, seed=args.seed)
log(opt.describe())
# the scheduler's epoch counts the steps taken; step s (from 1) runs at base lr × lr_multiplier(s)
scheduler = torch.optim.lr_scheduler.LambdaLR(
    opt, lambda steps_taken: training.lr_multiplier(steps_taken + 1, args.warmup, args.steps))

# ---- checkpoints (checkpoint.py): DCP of model + optimizer + lr scheduler ----------------------
checkpoints = args.out_dir / "checkpoints"
replica = None   # with local steps (or --checkpoint-momenta own) each replica checkpoints its own state:
if args.local_steps or args.checkpoint_momenta == "own":   # (its index, the group of its ranks)
    ranks_per_replica = args.shard * args.tp
    replica_group, _ = dist.new_subgroups_by_enumeration(
        [list(range(r * ranks_per_replica, (r + 1) * ranks_per_replica)) for r in range(args.replicate)])
    replica = (mesh.get_local_rank("replicate"), replica_group)
start_step, found = 0, checkpoint.latest(checkpoints, replica, args.replicate if args.resume else None)
if found and not args.resume:
    log(f"note: {checkpoints} holds checkpoints of an earlier run (up to step {found[0]}); this run starts "
        f"from step 0 and overwrites them as it reaches their steps (--resume continues instead)")
if args.resume and found is None:
    log(f"resume: no checkpoint in {checkpoints}; starting from step 0")
elif args.resume:
    start_step, path = found
    checkpoint.load(path, model, opt, scheduler, replica)
    log(f"resume: loaded {path} (step {start_step}, lr scheduler at step {scheduler.last_epoch})")
if args.fault_tolerant:   # meet the other groups; a restarted group heals from a live one and continues
    start_step = fault_tolerant.join(opt, scheduler, args, log)

# ---- metrics: CSV rows (rank 0), kept up to the resumed step; TensorBoard --------------------
metrics = training.Metrics(args.out_dir / "metrics.csv", [
    "step", "tokens", "lr", "train_loss", "val_loss", "grad_norm", "tokens_per_s", "step_ms", "opt_step_ms",
    "replicate_bytes_per_step", "shard_bytes_per_step", "replicate_bytes", "link_tx_bytes", "elapsed_s"], master, start_step,
    tensorboard={"train_loss": "loss/train", "val_loss": "loss/val", "lr": "lr", "grad_norm": "grad_norm",
                 "tokens_per_s": "throughput/tokens_per_s", "replicate_bytes_per_step": "bytes/replicate_per_step",
                 "shard_bytes_per_step": "bytes/shard_per_step", "replicate_bytes": "bytes/replicate_total"}
    if args.tensorboard else None)

# ---- training loop -----------------------------------------------------------------------------
tokens_per_step = args.batch_size * args.block_size * args.grad_accum * dist.get_world_size() // args.tp
end_step = min(args.steps, args.stop_at or args.steps)
log(f"train: {args.optimizer} lr {args.lr:g}, steps {start_step + 1}..{end_step} of {args.steps}, "
    f"{tokens_per_step:,} tokens per step ({args.grad_accum} micro-batches), clip {args.clip or 'off'}, "
    f"out {args.out_dir}")
if start_step == 0 and args.eval_every:
    val_loss = training.evaluate(model, batches, args.eval_batches)
    log(f"step 0: val loss {val_loss:.4f}")
    metrics.add({"step": 0, "tokens": 0, "val_loss": f"{val_loss:.6f}", "replicate_bytes": 0, "elapsed_s": 0})
rows = metrics.rows
replicate_bytes = int(rows[-1]["replicate_bytes"]) if rows and rows[-1]["replicate_bytes"] else 0
loop_started = time.perf_counter()
window = dict(loss=torch.zeros((), device=device), steps=0, seconds=0.0, opt_seconds=0.0, replicate=0, shard=0)
totals = dict(steps=0, seconds=0.0, opt_seconds=0.0, replicate=0, shard=0, checkpoint_bytes=0)
steps = fault_tolerant.Steps(opt, scheduler, start_step, end_step) if args.fault_tolerant else \
    range(start_step + 1, end_step + 1)   # (fault-tolerant: a step whose round is not committed runs again)
progress = tqdm(steps, initial=start_step, total=end_step, desc=args.optimizer,
                unit="step", disable=not master, mininterval=1.0, dynamic_ncols=True)
replicas_checked_at = start_step
profile = step_profile.StepProfile(*args.profile_optimizer) if args.profile_optimizer and master else None
for step in progress:
    tick = time.perf_counter()
    lr = scheduler.get_last_lr()[0]   # this step's lr of the 2-D weights
    for micro in range(args.grad_accum):   # micro-batch i of step s is batch (s−1)·N + i + 1 of this rank
        last = micro == args.grad_accum - 1
        model.set_requires_gradient_sync(last)
        _, loss = model(*batches("train", (step - 1) * args.grad_accum + micro + 1))
        with contextlib.nullcontext() if last else opt.accumulating():   # the exchange starts on the last only
            (loss / args.grad_accum).backward()
        window["loss"] += loss.detach().float() / args.grad_accum
    if device.type == "cuda":
        torch.cuda.synchronize()
    opt_tick = time.perf_counter()
    with profile.step(step) if profile else contextlib.nullcontext():
        opt.step()    # clips (--clip), exchanges over the replicate axis, updates
    scheduler.step()
    opt.zero_grad(set_to_none=True)
    if args.local_steps and step == end_step:
        opt.sync_now()   # the last round ends here, synced: the final evaluation and checkpoint see one model
    if device.type == "cuda":
        torch.cuda.synchronize()
    tock = time.perf_counter()
    stats = opt.comm_stats()
    opt.reset_comm_stats()
    for counter in (window, totals):
        counter["steps"] += 1
        counter["seconds"] += tock - tick
        counter["opt_seconds"] += tock - opt_tick
        counter["replicate"] += stats["replicate"]["bytes_sent"]
        counter["shard"] += stats["shard"]["bytes_sent"]
    replicate_bytes += stats["replicate"]["bytes_sent"]
    if args.fault_tolerant and not steps.kept(step):   # rolled back everywhere (fault_tolerant.py)
        continue

    log_now, evaluate_now = training.log_and_eval(step, end_step, args)
    if log_now:
        n = window["steps"]
        train_loss = training.mean_over_ranks(window["loss"] / n)
        val_loss = training.evaluate(model, batches, args.eval_batches) if evaluate_now else None
        row = training.metrics_row(step, step * tokens_per_step, lr, train_loss, val_loss, n, window["seconds"],
                                   window["replicate"], loop_started) | {
            "grad_norm": "" if opt.last_grad_norm is None else f"{opt.last_grad_norm.item():.6g}",
            "tokens_per_s": f"{n * tokens_per_step / window['seconds']:.1f}",
            "opt_step_ms": f"{1000 * window['opt_seconds'] / n:.2f}", "shard_bytes_per_step": window["shard"] // n,
            "replicate_bytes": replicate_bytes}
        metrics.add(row)
        progress.set_postfix(loss=f"{train_loss:.3f}", refresh=False)
        log(f"step {step}/{args.steps}: train loss {train_loss:.4f}"
            + ("" if val_loss is None else f", val loss {val_loss:.4f}")
            + ("" if row["grad_norm"] == "" else f", grad norm {row['grad_norm']}")
            + f", {row['tokens_per_s']} tok/s, step {row['step_ms']} ms (optimizer {row['opt_step_ms']} ms), "
              f"replicate {int(row['replicate_bytes_per_step']):,} B/step, shard {int(row['shard_bytes_per_step']):,} B/step")
        window.update(loss=torch.zeros((), device=device), steps=0, seconds=0.0, opt_seconds=0.0, replicate=0, shard=0)

    # every --check-replicas-every steps; with local steps at the first sync of each period (the replicas are
    # equal right after a sync; with --outer-overlap the outer params are what is compared)
    synced = not args.local_steps or step % args.local_steps == 0 or step == end_step
    every = args.check_replicas_every
    if every and synced and step // every > replicas_checked_at // every:
        replicas_checked_at = step
        if not opt.replicas_consistent():
            raise SystemExit(f"rank {rank}: replicas diverged at step {step} (weights differ bitwise between "
                             f"replicas); stopping. Resume from the last checkpoint with --resume")
    if args.checkpoint_every and (step % args.checkpoint_every == 0 or step == end_step):
        totals["checkpoint_bytes"] += checkpoint.save(checkpoints, step, model, opt, scheduler, replica,
                                                      args.checkpoint_momenta)
progress.close()
metrics.close()
if profile:
    profile.write(args.out_dir / step_profile.PROFILE_CSV)
    log(f"profile: opt.step() of steps {profile.first}..{profile.last} on rank 0: "
        f"{args.out_dir / step_profile.PROFILE_CSV}")

# ---- summary, plot ------------------------------------------------------------------------------
dist.barrier()
if master and totals["steps"]:
    final_val = next((float(r["val_loss"]) for r in reversed(rows) if r["val_loss"] != ""), float("nan"))
    summary = {   # (the non-matrix group's keys keep their names: they are results/demo.csv's columns)
        "optimizer": args.optimizer, "scalar_algorithm": args.nonmatrix_algorithm, "scalar_lr": args.nonmatrix_lr,
        "scalar_betas": " ".join(map(str, args.nonmatrix_betas)),
        "tokenizer": args.tokenizer, "seed": args.seed, "replicate": args.replicate, "shard": args.shard,
        **({"tp": args.tp} if args.tp > 1 else {}), "lr": args.lr,
        "rank_fraction": args.rank_fraction if args.optimizer == "dion" else "",
        "vote": resolve_vote(args.vote, max(p.to_local().numel() for p in groups[0]["params"]), args.replicate)
        if args.optimizer == "signmuon" else "",   # the wire format "auto" picks for the largest matrix
        **({"local_steps": args.local_steps, "outer_exchange": args.outer_exchange, "outer_lr": args.outer_lr,
            "outer_momentum": args.outer_momentum, "outer_overlap": args.outer_overlap, "fragments": args.fragments}
           if args.local_steps else {}),
        "params": model.num_params(), "steps": end_step, "tokens": end_step * tokens_per_step,
        "final_train_loss": float(rows[-1]["train_loss"]), "final_val_loss": final_val,
        "replicate_bytes_per_step": totals["replicate"] // totals["steps"],
        **({"checkpoint_momenta": args.checkpoint_momenta, "checkpoint_bytes": totals["checkpoint_bytes"]}
           if args.checkpoint_every else {}),
        "shard_bytes_per_step": totals["shard"] // totals["steps"],
        "step_ms": round(1000 * totals["seconds"] / totals["steps"], 2),
        "opt_step_ms": round(1000 * totals["opt_seconds"] / totals["steps"], 2),
        "wall_s": round(time.perf_counter() - started, 1), "device": device.type,
        **({"torchft": fault_tolerant.summary(opt, steps)} if args.fault_tolerant else {}),
    }
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if args.summary_csv:
        training.append_csv(args.summary_csv, summary)
    log(f"done: {args.optimizer} val loss {final_val:.4f}, replicate {summary['replicate_bytes_per_step']:,} B/step, "
        f"wall {summary['wall_s']} s; wrote {metrics.path}")
    try:
        from integrations.plot import plot_runs
    except ImportError:
        log("plot: matplotlib is not installed, no loss.png (pip install -e '.[train]')")
    else:
        plot_runs([args.out_dir], args.out_dir / "loss.png",
                  title=f"{args.optimizer}, {args.replicate} replicas × {args.shard} shards")
        log(f"plot: wrote {args.out_dir / 'loss.png'}")
# the ranks tear their groups down together: one destroying its group while rank 0 still wrote the plot was seen
# to abort at exit under load ("terminate called without an active exception")
dist.barrier()
dist.destroy_process_group()
