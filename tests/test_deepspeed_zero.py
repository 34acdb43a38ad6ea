"""ZeRO stages 1 and 2 under shardopt's DeepSpeed plugin: 4 gloo ranks as 2 nodes × 2 ("shardopt":
{"mesh": {"replicate": 2, "shard": 2}}), one worker pool for the module. Pinned here, for Dion and Sign-Muon:
- stages 1 and 2 follow stage 0 on the same mesh (full-precision node mean, compressed exchange across
  nodes) to float tolerance, with gradient accumulation 2;
- per-rank optimizer state ≤ 0.6× stage 0's, replicate-axis bytes per step ≤ 1.1× stage 0's (stage 0
  with every rank a replica, the plugin's default), all four ranks' weights bitwise identical, loss down;
- the shard-axis bytes equal the reduce-scatter + all-gather formulas;
- bf16 at stage 2 (non-matrix params on Lion's vote) trains with identical replicas; stage 1 through
  client_optimizer + attach (code that calls deepspeed.initialize itself) equals initialize's;
- engine.save_checkpoint / load_checkpoint at stages 1 and 2: the resumed run continues the saving run's
  trajectory exactly.
- overlap_backward at stage 2 (fp32, bf16): bitwise the plain stage 2, the same bytes, bucket steps started inside the
  boundary's backward as the owned gradients' reduces complete.
- local steps on the mesh at stages 0, 1 and 2: nothing crosses the nodes between syncs, the nodes are bitwise
  equal after a sync and the ranks of a node always; at 1/2 each rank syncs and keeps the outer state of
  what it owns (about half the bytes and state of stage 0 per rank); a checkpoint mid-round resumes bit-exact.
"""

import os

import pytest
import torch
import torch.distributed as dist

deepspeed = pytest.importorskip("deepspeed")  # imported before the pool forks: the workers inherit it
pytestmark = pytest.mark.usefixtures("deepspeed_cpu_ops")   # the CPU op compiled before the pool forks

import shardopt.deepspeed as sds  # noqa: E402
from shardopt.deepspeed import masters  # noqa: E402
from shardopt.optim import traffic  # noqa: E402
from shardopt.wire.comm import Axis, collective_bytes, split_world  # noqa: E402
from shardopt.optim.guard import replicas_equal  # noqa: E402
from workers import WorkerPool  # noqa: E402

TIMEOUT_S = 300
MESH = {"replicate": 2, "shard": 2}
# Dion's P and R cross the replicate axis in float32 here: with the bf16 default the stage-2 rounding difference
# (see the test's doc) is rounded to bf16 too and reaches ~4e-4 in the weights after 12 steps.
PARAMS = {"Dion": {"lr": 0.05, "rank_fraction": 0.25, "weight_decay": 0.01, "wire_dtype": "float32"},
          "SignMuon": {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.0}}
STEPS = 12


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(4, collective_timeout_s=120)
    yield p
    p.close()


def _env() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


def _model() -> torch.nn.Module:
    """Six matrices (several of one size, so whole tensors balance over 2 owners) and their biases."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 32), torch.nn.Tanh()]
    for _ in range(4):
        layers += [torch.nn.Linear(32, 32), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(32, 8))


def _data():
    """This rank's fixed batch (different on every rank)."""
    generator = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(8, 16, generator=generator)
    return x, torch.sin(3 * x[:, :8])


def _config(optimizer, stage, mesh, precision="fp32", vote=None, nonmatrix_algorithm="adamw"):
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 10**6,
              "zero_optimization": {"stage": stage},
              "optimizer": {"type": optimizer, "params": {**PARAMS[optimizer], **({"vote": vote} if vote else {})}}}
    config["shardopt"] = {"nonmatrix_algorithm": nonmatrix_algorithm, **({"mesh": mesh} if mesh else {})}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _steps(engine, count) -> float:
    """`count` optimizer steps of 2 micro-batches on this rank's fixed batch; the last step's mean loss."""
    x, y = _data()
    dtype = next(engine.module.parameters()).dtype
    for _ in range(count):
        total = 0.0
        for micro in range(2):
            loss = ((engine(x[4 * micro:4 * micro + 4].to(dtype)).float() - y[4 * micro:4 * micro + 4]) ** 2).mean()
            engine.backward(loss)
            engine.step()
            total += loss.item() / 2
    return total


def _run(optimizer, stage, mesh, precision="fp32", vote=None, nonmatrix_algorithm="adamw"):
    engine, *_ = sds.initialize(model=_model(), config=_config(optimizer, stage, mesh, precision, vote, nonmatrix_algorithm))
    ours = sds.shard_optimizer(engine)
    mean_losses = torch.tensor([_steps(engine, 1) for _ in range(STEPS)])
    dist.all_reduce(mean_losses)
    identical = replicas_equal([p.detach() for p in engine.module.parameters()], Axis("replicate", dist.group.WORLD))
    stats = ours.comm_stats()
    return {"weights": [p.detach().float().clone() for p in engine.module.parameters()],
            "losses": (mean_losses / dist.get_world_size()).tolist(),
            "identical": identical,
            "state_bytes": sum(v.numel() * v.element_size() for s in ours.state.values() for v in s.values()
                               if torch.is_tensor(v)),
            "replicate_per_step": stats["replicate"]["bytes_sent"] / STEPS,
            "shard_per_step": stats["shard"]["bytes_sent"] / STEPS,
            "grad_norm": float(engine.get_global_grad_norm()), "consistent": ours.replicas_consistent(),
            "zero": ours.zero, "engine_stage": engine.zero_optimization_stage()}


def _stages(optimizer, vote):
    _env()
    runs = {"stage0": _run(optimizer, 0, None, vote=vote), "stage0_mesh": _run(optimizer, 0, MESH, vote=vote),
            "stage1": _run(optimizer, 1, MESH, vote=vote), "stage2": _run(optimizer, 2, None, vote=vote)}
    # stage 2 on the default mesh: one replica per node (LOCAL_WORLD_SIZE = 2)
    reference = runs["stage0_mesh"]["weights"]
    for run in runs.values():
        diffs = torch.cat([(a - b).abs().reshape(-1) for a, b in zip(run.pop("weights"), reference)])
        run["diff"], run["differing"] = diffs.max().item(), (diffs > 1e-5).float().mean().item()
        zero = run.pop("zero")
        run["owned_elements"] = sum(zero.sizes[i] for i in range(len(zero.sizes)) if zero.owns(i)) if zero else None
        run["chunk"] = zero.chunk if zero else None
        run["all_elements"] = sum(zero.sizes) if zero else None
    return runs


@pytest.mark.parametrize("optimizer,vote", [("Dion", None), ("SignMuon", "auto"), ("SignMuon", "allreduce_int8")])
def test_zero_1_and_2_on_2_nodes_x_2_partition_state_keep_bytes_and_follow_stage_0(pool, optimizer, vote):
    """With 2 replicas a 1-bit vote ("auto" here) breaks ties by coins drawn per bucket, and ZeRO buckets only
    the matrices a rank owns, so its coins differ from stage 0's: the trajectory is checked against stage 0
    where no coin is drawn (Dion at stages 1 and 2; the int8 vote, which abstains on a tie, at stage 1). Stage 2
    adds the node means of the micro-batches (stage 0 and 1: the node mean of their sum), a float rounding
    difference that Dion carries continuously; a sign within rounding of zero flips, and Sign-Muon's
    trajectory then parts from stage 0's (printed: the share of entries differing)."""
    for rank, runs in enumerate(pool.run(_stages, optimizer, vote, timeout_s=TIMEOUT_S)):
        base, mesh0 = runs["stage0"], runs["stage0_mesh"]
        for stage in ("stage1", "stage2"):
            run = runs[stage]
            print(f"rank {rank} {optimizer} {vote or ''} {stage}: state {run['state_bytes']} B vs {base['state_bytes']} B "
                  f"({run['state_bytes'] / base['state_bytes']:.2f}x); replicate {run['replicate_per_step']:.0f} B/step "
                  f"vs {base['replicate_per_step']:.0f} ({run['replicate_per_step'] / base['replicate_per_step']:.2f}x); "
                  f"shard {run['shard_per_step']:.0f} B/step; loss {run['losses'][0]:.4f} -> {run['losses'][-1]:.4f}; "
                  f"max |w - w_stage0(mesh)| {run['diff']:.2e}, entries differing {run['differing']:.2%}")
            assert run["engine_stage"] == 0          # DeepSpeed runs stage 0; shardopt partitions
            assert run["state_bytes"] <= 0.6 * base["state_bytes"]
            assert run["replicate_per_step"] <= 1.1 * base["replicate_per_step"]
            assert run["identical"] and run["consistent"]
            assert run["losses"][-1] < 0.8 * run["losses"][0]
            if vote is None or (vote != "auto" and stage == "stage1"):
                assert run["diff"] <= 1e-5
                assert abs(run["grad_norm"] - mesh0["grad_norm"]) <= 1e-4 * mesh0["grad_norm"]
        # shard axis per step: stage 1 an fp32 reduce-scatter of 2 chunks at the step, stage 2 every gradient
        # this rank does not own sent to its owner in fp32 in each of the 2 backwards; the all-gather of this
        # rank's chunk, and the agreed flag and gradient norm (4-byte all-reduces); at step 1 the verdict of the
        # double-averaging check (2 bytes all-reduced over the node)
        one = runs["stage1"]
        small = 2 * collective_bytes("all_reduce", 4, 2) + traffic.double_averaging_check_bytes(2, 2) / STEPS
        all_gather = collective_bytes("all_gather", 4 * one["chunk"], 2)
        assert one["shard_per_step"] == collective_bytes("reduce_scatter", 8 * one["chunk"], 2) + all_gather + small
        sent_to_owners = 2 * 4 * (one["all_elements"] - one["owned_elements"])
        assert runs["stage2"]["shard_per_step"] == sent_to_owners + all_gather + small
        assert mesh0["identical"] and base["identical"]


def _bf16_stage2_and_client_path():
    _env()
    run = _run("SignMuon", 2, MESH, precision="bf16", nonmatrix_algorithm="lion")   # biases: Lion's 1-bit vote
    config = _config("Dion", 1, MESH)
    engine, *_ = sds.initialize(model=_model(), config=config)
    model = _model()       # the same at stage 1 for code that calls deepspeed.initialize itself
    client, *_ = deepspeed.initialize(model=model, optimizer=sds.client_optimizer(model, config),
                                      config=sds.engine_config(config))
    sds.attach(client)
    _steps(engine, 1)
    _steps(client, 1)
    same = all(torch.equal(a, b) for a, b in zip(engine.module.parameters(), client.module.parameters()))
    return run["identical"], run["consistent"], run["losses"], same, sds.shard_optimizer(client).zero.stage


def test_bf16_stage_2_with_lion_trains_identically_and_the_client_path_matches(pool):
    for identical, consistent, losses, same, client_stage in pool.run(_bf16_stage2_and_client_path,
                                                                       timeout_s=TIMEOUT_S):
        assert identical and consistent
        assert losses[-1] < 0.8 * losses[0], losses
        assert same and client_stage == 1


def _bf16_stage2_gradients_at_the_step(mesh):
    """One step of 2 micro-batches; what the optimizer's step finds: the model params' .grad, the masters'; whether
    the model's params are then their masters rounded to bf16."""
    _env()
    engine, *_ = sds.initialize(model=_model(), config=_config("SignMuon", 2, mesh, precision="bf16"))
    ours = sds.shard_optimizer(engine)
    local = {p: [] for p in engine.module.parameters()}   # each micro-batch's local gradient, before the reducer
    for param in engine.module.parameters():
        param.register_hook(lambda grad, param=param: local[param].append(grad.detach().float().clone()))
    seen = {}
    ours.register_step_pre_hook(lambda *_: seen.update(
        model=[p.grad for p in engine.module.parameters()], masters=[(p.grad, p.numel()) for p in ours._slots()]))
    _steps(engine, 1)
    node, shard = split_world(mesh["replicate"], mesh["shard"])[1], mesh["shard"]
    expected = []
    for model_param, _ in ours.wiring.masters:   # slot order: (1/S)·Σ_node per micro-batch in fp32, then summed
        means = [grad.clone() for grad in local[model_param]]
        for mean in means:
            dist.all_reduce(mean, group=node)
        expected.append(means[0].div_(shard).add_(means[1].div_(shard)))
    owned = [ours.zero.owns(slot) for slot in range(len(expected))]
    exact = [torch.equal(grad, want) for (grad, _), want, mine in zip(seen["masters"], expected, owned) if mine]
    finer_than_bf16 = any(not torch.equal(grad, grad.bfloat16().float()) for grad, _ in seen["masters"] if grad is not None)
    held = sum(grad.numel() * grad.element_size() for grad, _ in seen["masters"] if grad is not None)
    owned_elements = sum(n for (_, n), mine in zip(seen["masters"], owned) if mine)
    others = [grad for (grad, _), mine in zip(seen["masters"], owned) if not mine]
    with masters.all_present(ours.wiring):   # the packed bf16 masters rebuilt (masters.PackedMasters)
        follow = all(torch.equal(lp, fp32.to(lp.dtype)) for lp, fp32 in ours.wiring.masters if fp32.numel())
    return all(g is None for g in seen["model"]), exact, finer_than_bf16, held, owned_elements, others, follow


@pytest.mark.parametrize("mesh", [MESH, {"replicate": 4, "shard": 1}], ids=["2x2", "4x1"])
def test_bf16_stage_2_steps_the_exact_fp32_node_mean_on_the_owned_masters_only(pool, mesh):
    """masters.py: the node mean that backward reduces to the owner is the master copy's fp32 gradient itself, not
    rounded to bf16 and widened again; no model param keeps a bf16 .grad beside it: 4 bytes per owned element. The
    owned model params are their masters rounded after the step (a node of one rank owns them all: no gather)."""
    for no_model_grads, exact, finer_than_bf16, held, owned_elements, others, follow in pool.run(
            _bf16_stage2_gradients_at_the_step, mesh, timeout_s=TIMEOUT_S):
        assert no_model_grads
        assert exact and all(exact), exact
        assert finer_than_bf16 and follow
        assert held == 4 * owned_elements
        assert all(g is None for g in others) and (bool(others) == (mesh["shard"] > 1))


def _whole_masters(ours) -> None:
    """The path fp16 keeps (whole fp32 masters, the step's copy into the owned weights) on a wired bf16 optimizer."""
    ours.param_residency.unpack_all()
    ours.param_residency = None
    ours.zero.owned_weights_written = False


def _count_present(packed) -> dict:
    """Counts the elements of the masters rebuilt at once ("most") while `packed` (a PackedMasters) steps."""
    present, unpack, pack = {"now": 0, "most": 0}, packed.unpack, packed.pack

    def counting_unpack(master):
        present["now"] += master.numel() if master in packed.packed else 0
        present["most"] = max(present["most"], present["now"])
        unpack(master)

    def counting_pack(master):
        pack(master)
        present["now"] -= master.numel()

    packed.unpack, packed.pack = counting_unpack, counting_pack
    return present


def _packed_against_whole_masters(optimizer, stage):
    """6 steps of bf16 ZeRO 2 or 3 on 2×2 with the masters packed (the default) and kept whole; bucket_bytes 512:
    each matrix a bucket of its own, the biases cut across AdamW's buckets (a master read by two buckets)."""
    _env()
    config = _config(optimizer, stage, MESH, precision="bf16")
    config["optimizer"]["params"]["bucket_bytes"] = 512
    runs = []
    for packed in (True, False):
        engine, *_ = sds.initialize(model=_model(), config=config)
        ours = sds.shard_optimizer(engine)
        owned = sum(fp32.numel() for slot, (_, fp32) in enumerate(ours.wiring.masters) if ours.zero.owns(slot))
        kept = sum(low.numel() * low.element_size() + bits.numel() for low, bits in ours.param_residency.packed.values())
        storage = sum(fp32.untyped_storage().nbytes() for _, fp32 in ours.wiring.masters if fp32.numel())
        present = _count_present(ours.param_residency) if packed else _whole_masters(ours)
        losses = [_steps(engine, 1) for _ in range(6)]
        most_present = present["most"] if packed else None   # (all_present rebuilds every master: not a step's)
        with masters.all_present(ours.wiring), sds.gathered_weights(engine):
            values = [fp32.clone() for _, fp32 in ours.wiring.masters]
            weights = [p.detach().clone() for p in engine.module.parameters()]
        runs.append({"losses": losses, "weights": weights,
                     "masters": values, "norm": float(engine.get_global_grad_norm()), "owned": owned, "kept": kept,
                     "storage": storage, "most_present": most_present,
                     "consistent": ours.replicas_consistent()})
    packed, whole = runs

    def bitwise(a, b):
        return all(x.shape == y.shape and torch.equal(x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32),
                                                      y.view(torch.int16 if y.dtype == torch.bfloat16 else torch.int32))
                   for x, y in zip(a, b))
    return (packed["losses"] == whole["losses"], bitwise(packed["weights"], whole["weights"]),
            bitwise(packed["masters"], whole["masters"]), packed["norm"] == whole["norm"], packed["consistent"],
            {key: packed[key] for key in ("owned", "kept", "storage", "most_present")}, packed["losses"])


@pytest.mark.parametrize("optimizer,stage", [("SignMuon", 2), ("Dion", 2), ("SignMuon", 3)])
def test_bf16_packed_masters_train_bitwise_as_whole_masters_in_a_fraction_of_the_bytes(pool, optimizer, stage):
    """masters.PackedMasters (stage 3 shares the masters path): losses, model weights, fp32 masters and grad norm
    after 6 steps are bitwise those of whole masters; between steps an owned master takes 2 bytes and a bit per
    element (a 4-byte placeholder per tensor, not 4 bytes per element); during the step only the buckets in flight
    hold rebuilt masters."""
    for same_losses, same_weights, same_masters, same_norm, consistent, sizes, losses in pool.run(
            _packed_against_whole_masters, optimizer, stage, timeout_s=TIMEOUT_S):
        assert same_losses and same_weights and same_masters and same_norm and consistent
        assert losses[-1] < losses[0], losses
        owned = sizes["owned"]
        assert owned > 0 and 2 * owned + owned / 8 <= sizes["kept"] < 2 * owned + owned / 8 + 16, sizes
        assert sizes["storage"] < 0.05 * 4 * owned, sizes     # the placeholders: 4 bytes per owned tensor
        assert 0 < sizes["most_present"] < owned, sizes


def _packing_kept_off_and_undone():
    """bf16 stage 2: with overlap_backward in the config (whole masters); overlap_backward switched on after the wiring
    packed them (refused); detach() after 2 steps (the masters whole again, as rebuilt)."""
    _env()
    config = _config("SignMuon", 2, MESH, precision="bf16")
    config["optimizer"]["params"]["overlap_backward"] = True
    engine, *_ = sds.initialize(model=_model(), config=config)
    overlapping_whole = sds.shard_optimizer(engine).param_residency is None
    engine, *_ = sds.initialize(model=_model(), config=_config("SignMuon", 2, MESH, precision="bf16"))
    ours = sds.shard_optimizer(engine)
    _steps(engine, 2)
    with masters.all_present(ours.wiring):
        rebuilt = [fp32.clone() for _, fp32 in ours.wiring.masters if fp32.numel()]
    owned = [fp32 for slot, (_, fp32) in enumerate(ours.wiring.masters) if ours.zero.owns(slot)]
    try:
        ours.overlap_backward = True
        refusal = None
    except ValueError as error:
        refusal = str(error)
    sds.detach(engine)
    whole = all(fp32.is_contiguous() and fp32.untyped_storage().nbytes() == 4 * fp32.numel() for fp32 in owned)
    same = all(torch.equal(a, b) for a, b in zip(rebuilt, owned))
    return overlapping_whole, refusal, whole, same


def test_bf16_masters_stay_whole_with_overlap_backward_and_detach_rebuilds_them(pool):
    for overlapping_whole, refusal, whole, same in pool.run(_packing_kept_off_and_undone, timeout_s=TIMEOUT_S):
        assert overlapping_whole
        assert refusal is not None and "overlap_backward" in refusal and "config's optimizer params" in refusal
        assert whole and same


def _save_and_resume(directory, config, build_model=_model):
    """An engine saved after 3 steps and continued for 3 more; a fresh one (on other weights) loading that save."""
    saving, *_ = sds.initialize(model=build_model(), config=config)
    _steps(saving, 3)
    saving.save_checkpoint(directory, tag="step3")
    _steps(saving, 3)
    model = build_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)            # the load must overwrite these
    resumed, *_ = sds.initialize(model=model, config=config)
    path, _ = resumed.load_checkpoint(directory, tag="step3")
    return saving, resumed, path


def _checkpoint_resumes(directory, stage, precision="fp32"):
    _env()
    saving, resumed, path = _save_and_resume(directory, _config("SignMuon", stage, MESH, precision=precision,
                                                                vote="allreduce_int8"))
    owned_state = len(sds.shard_optimizer(resumed).state)
    _steps(resumed, 3)
    diff = max((a - b).abs().max().item() for a, b in zip(saving.module.parameters(), resumed.module.parameters()))
    own_file = os.path.exists(os.path.join(directory, "step3", f"shardopt_zero_rank{dist.get_rank()}.safetensors"))
    if precision == "bf16":   # the fp32 master copies too: only this rank's own, bitwise those of the saving run
        pairs = [(a, b) for a, b in zip(sds.shard_optimizer(saving)._slots(), sds.shard_optimizer(resumed)._slots())]
        with masters.all_present(sds.shard_optimizer(saving).wiring), \
                masters.all_present(sds.shard_optimizer(resumed).wiring):
            diff = max([diff] + [(a - b).abs().max().item() for a, b in pairs if a.numel() or b.numel()])
        owned_state = (owned_state, sum(a.numel() for a, _ in pairs))
    return path is not None, own_file, diff, owned_state, len(sds.shard_optimizer(saving).state)


@pytest.mark.parametrize("stage,precision", [(1, "fp32"), (2, "fp32"), (2, "bf16")])
def test_engine_checkpoint_at_zero_stage_resumes_on_the_same_trajectory(pool, tmp_path, stage, precision):
    """Each rank writes its own partition next to DeepSpeed's files and reads it back; in bf16 at stage 2 its
    fp32 master copies of the params it owns (masters.py), which are all it holds."""
    total = sum(p.numel() for p in _model().parameters())
    for loaded, own_file, diff, owned_state, saving_state in pool.run(_checkpoint_resumes, str(tmp_path), stage,
                                                                      precision, timeout_s=TIMEOUT_S):
        if precision == "bf16":
            owned_state, master_elements = owned_state
            assert master_elements < 0.75 * total   # masters of the owned params only (about half here)
        assert loaded and own_file
        assert diff == 0
        assert owned_state == saving_state    # only this rank's partition


LOCAL_STEPS = {"sync_every": 3, "exchange": "sign_mean", "block": 128, "outer_momentum": 0.0}


def _local_steps_engine(stage):
    config = _config("SignMuon", stage, MESH)
    config["shardopt"]["local_steps"] = dict(LOCAL_STEPS)
    return sds.initialize(model=_model(), config=config)[0]


def _local_steps_on_the_mesh(stage):
    _env()
    engine = _local_steps_engine(stage)
    ours = sds.shard_optimizer(engine)
    replicate, node, equal, losses, world = [], [], [], [], Axis("replicate", dist.group.WORLD)
    for step in range(1, 8):
        before = ours.comm_stats()
        losses.append(_steps(engine, 1))
        after = ours.comm_stats()
        replicate.append(after["replicate"]["bytes_sent"] - before["replicate"]["bytes_sent"])
        node.append(after["node"]["bytes_sent"] - before["node"]["bytes_sent"])
        if step in (6, 7):   # (world, node): the weights bitwise equal over all four ranks, over this node's two
            params = [p.detach() for p in engine.module.parameters()]
            equal.append((replicas_equal(params, world), replicas_equal(params, ours.inner.node)))
    outer_bytes = sum(v.numel() * v.element_size() for s in ours.state.values() for k, v in s.items()
                      if k.startswith("outer_") and v.dim())
    return replicate, node, equal, losses, sum(ours.sync_bytes()), outer_bytes


def _local_steps_at_every_stage():
    return {stage: _local_steps_on_the_mesh(stage) for stage in (0, 1, 2)}


def test_local_steps_on_the_mesh_sync_across_nodes_only_every_round_at_every_stage(pool):
    """Stage 0 on the 2×2 mesh: the node averages its gradients every step, every rank syncs the whole
    model. Stages 1/2: each rank syncs (and keeps θ_outer and e for) the params it owns, then the node
    gathers them: per rank about half the bytes and the outer state, the node's two ranks together the
    model once."""
    results = pool.run(_local_steps_at_every_stage, timeout_s=TIMEOUT_S)
    for rank, runs in enumerate(results):
        for stage, (replicate, node, (after_sync, mid_round), losses, sync_bytes, outer_bytes) in runs.items():
            assert [replicate[i] for i in (1, 3, 4, 6)] == [0] * 4, (stage, replicate)  # inner steps: nothing across,
            assert replicate[0] == collective_bytes("all_reduce", 24, 2), (stage, replicate)  # but step 1's check
            assert replicate[5] == sync_bytes > 0 and replicate[2] >= sync_bytes, (stage, replicate)
            assert min(node) > 0                              # the node's gradients, every step
            assert after_sync == (True, True), stage          # step 6: all four ranks bitwise equal
            assert mid_round == (False, True), stage          # step 7: the nodes differ, a node's ranks do not
            assert losses[-1] < losses[0], (stage, losses)
        stage0_sync, stage0_outer = runs[0][4], runs[0][5]
        for stage in (1, 2):
            node_sync = sum(results[r][stage][4] for r in (2 * (rank // 2), 2 * (rank // 2) + 1))
            assert runs[stage][4] < 0.7 * stage0_sync and abs(node_sync / stage0_sync - 1) < 0.05, (stage, node_sync)
            assert runs[stage][5] < 0.7 * stage0_outer, (stage, runs[stage][5], stage0_outer)


def _local_steps_checkpoint(directory, stage):
    _env()
    saving = _local_steps_engine(stage)
    _steps(saving, 4)                                 # one step into the second round
    saving.save_checkpoint(directory, tag="mid")
    resumed = _local_steps_engine(stage)
    resumed.load_checkpoint(directory, tag="mid")
    diffs = []
    for _ in range(4):
        _steps(saving, 1)
        _steps(resumed, 1)
        diffs.append(max((a - b).abs().max().item() for a, b in zip(saving.module.parameters(),
                                                                     resumed.module.parameters())))
    return diffs


@pytest.mark.parametrize("stage", [0, 2])
def test_local_steps_checkpoint_mid_round_resumes_bit_exact_on_the_mesh(pool, tmp_path, stage):
    for diffs in pool.run(_local_steps_checkpoint, str(tmp_path), stage, timeout_s=TIMEOUT_S):
        assert diffs == [0.0] * 4, diffs


def _mesh_of_the_wrong_size():
    _env()
    try:
        sds.initialize(model=_model(), config=_config("Dion", 1, {"replicate": 3, "shard": 2}))
    except ValueError as error:
        return str(error)
    return None


def test_a_mesh_that_does_not_cover_the_world_raises_on_every_rank(pool):
    for message in pool.run(_mesh_of_the_wrong_size, timeout_s=TIMEOUT_S):
        assert message and "replicate=3 × shard=2 = 6 ranks, but the world has 4" in message


def _gradients_held_during_backward():
    _env()
    config = _config("Dion", 2, MESH)
    config["zero_optimization"]["reduce_bucket_size"] = 1     # wait for each gradient's reduce at once
    engine, *_ = sds.initialize(model=_model(), config=config)
    ours = sds.shard_optimizer(engine)
    params = list(engine.module.parameters())
    owned = [ours.zero.owns(slot) for slot in range(len(params))]
    held_not_owned = []    # after each gradient is accumulated (the plugin's hook runs first)
    for param in params:
        param.register_post_accumulate_grad_hook(lambda _: held_not_owned.append(
            sum(p.grad.numel() for p, mine in zip(params, owned) if p.grad is not None and not mine)))
    _steps(engine, 2)
    return max(held_not_owned), len(held_not_owned), ours.replicas_consistent()


def test_zero_2_holds_no_gradient_it_does_not_own_during_backward(pool):
    for held, hook_calls, consistent in pool.run(_gradients_held_during_backward, timeout_s=TIMEOUT_S):
        assert hook_calls == 2 * 2 * len(list(_model().parameters()))    # 2 steps × 2 micro-batches
        assert held == 0 and consistent


def _overlap_at_stage_2(optimizer, precision):
    """overlap_backward at ZeRO 2 on the 2 × 2 mesh against the plain stage 2 (3 steps of 2 micro-batches): the
    overlapped engines' weights, optimizer state and replicate-axis bytes against the plain one's, and the most
    bucket steps started inside the boundary's backward (a hook after the plugin's, with reduce_bucket_size 1,
    so each gradient's reduce completes in its own hook) and inside the earlier micro-batch's."""
    _env()
    engines = []
    for on, cap in ((False, None), (True, None), (True, 1)):
        config = _config(optimizer, 2, MESH, precision)
        config["optimizer"]["params"]["overlap_backward"] = on
        if cap is not None:
            config["zero_optimization"]["reduce_bucket_size"] = cap
        engines.append(sds.initialize(model=_model(), config=config)[0])
    ours = [sds.shard_optimizer(engine) for engine in engines]
    started = {True: [0], False: [0]}           # boundary micro-batch or not → counts seen in backward
    engine = engines[2]
    for param in engine.module.parameters():
        param.register_post_accumulate_grad_hook(lambda _: started[engine.is_gradient_accumulation_boundary()].append(
            ours[2].backward_overlap.started() if ours[2].backward_overlap is not None else 0))
    for engine_ in engines:
        _steps(engine_, 3)
    weights = [[p.detach().clone() for p in engine_.module.parameters()] for engine_ in engines]
    same = [all(torch.equal(a, b) for a, b in zip(weights[0], w)) and
            all(torch.equal(x, y) for p, q in zip(ours[0]._slots(), o._slots())
                for x, y in zip(ours[0].state[p].values(), o.state[q].values())) for w, o in zip(weights[1:], ours[1:])]
    sent = [o.comm_stats()["replicate"]["bytes_sent"] for o in ours]
    return same, sent, max(started[True]), max(started[False]), ours[1].replicas_consistent()


@pytest.mark.parametrize("optimizer,precision", [("Dion", "fp32"), ("SignMuon", "fp32"), ("SignMuon", "bf16")])
def test_overlap_backward_at_zero_2_equals_the_plain_step_and_starts_in_the_boundary_backward(pool, optimizer, precision):
    for same, sent, in_boundary, before_boundary, consistent in pool.run(_overlap_at_stage_2, optimizer, precision,
                                                                          timeout_s=TIMEOUT_S):
        assert same == [True, True] and consistent
        # no round discarded and run again (the first included): the plain step's bytes, plus the stale flag's
        # byte beside the has-gradient bytes (sent at ZeRO 2, where a rank lacks the gradients it does not own)
        assert sent[1] == sent[2] == sent[0] + 3 and sent[0] > 0, sent
        assert in_boundary > 0 and before_boundary == 0, (in_boundary, before_boundary)


def _gather_in_windows(window_bytes):
    """ZeroPartition.gather_weights over a node of 4 ranks: each rank's owned slots hold rank-specific values, the
    others garbage; after the gather every rank holds the owners' values (in bf16 model weights where `weights` is
    set, the fp32 masters rounded), whatever the window."""
    from shardopt.deepspeed.zero import ZeroPartition
    node = Axis("node", dist.group.WORLD)
    shapes = [torch.Size(s) for s in ([7, 5], [33], [4, 4, 4], [1], [64, 3], [10])]
    zero = ZeroPartition(shapes, node, 2, window_bytes=window_bytes)
    values = [torch.randn(shape, generator=torch.Generator().manual_seed(slot)) for slot, shape in enumerate(shapes)]
    masters = [v.clone() if zero.owns(slot) else torch.full(v.shape, float(dist.get_rank()))
               for slot, v in enumerate(values)]
    zero.gather_weights(masters)
    fp32_same = all(torch.equal(m, v) for m, v in zip(masters, values))
    zero.weights = [torch.zeros(shape, dtype=torch.bfloat16) for shape in shapes]
    zero.gather_weights(masters)
    bf16_same = all(torch.equal(w, v.bfloat16()) for w, v in zip(zero.weights, values))
    return fp32_same, bf16_same


@pytest.mark.parametrize("window_bytes", [None, 8, 100, 10**6])
def test_gather_weights_in_windows_gives_every_rank_the_owners_values(pool, window_bytes):
    for fp32_same, bf16_same in pool.run(_gather_in_windows, window_bytes, timeout_s=TIMEOUT_S):
        assert fp32_same and bf16_same


@pytest.mark.parametrize("sizes,parts", [([1024, 1024, 1024, 512, 256, 32, 32, 8], 2), ([7, 7, 7, 7, 7], 3),
                                         ([100], 4), ([5, 1, 1, 1, 1, 1], 2)])
def test_owners_balance_within_the_largest_tensor_and_are_deterministic(sizes, parts):
    from shardopt.layout.placement import assign_owners
    owners = assign_owners(sizes, parts)
    loads = [sum(s for s, o in zip(sizes, owners) if o == k) for k in range(parts)]
    assert max(loads) <= sum(sizes) / parts + max(sizes)
    assert owners == assign_owners(list(sizes), parts) and set(owners) <= set(range(parts))
