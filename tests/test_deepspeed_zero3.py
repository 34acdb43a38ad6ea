"""ZeRO stage 3 under shardopt's DeepSpeed plugin (shardopt/deepspeed/zero3.py): 4 gloo ranks as 2 nodes × 2
("shardopt": {"mesh": {"replicate": 2, "shard": 2}}), gradient accumulation 2, real DeepSpeed engines. Pinned here,
for Sign-Muon (Dion: below):
- stage 3 is stage 2 with the weights released: the same losses and weights, bitwise, and replicate-axis bytes per
  node (the owners step the same gradients; a module computes with its owners' weights, broadcast; the element-wise
  groups' params split by rows as Dion's matrices below, per entry the same sums; Lion on "allreduce_int8");
- per rank, params + optimizer state (+ fp32 masters in bf16) ≤ 0.6× stage 0's on the same mesh, and between
  steps a rank holds the storage of the params it owns only;
- Newton–Schulz runs once per matrix per optimizer step on each node, on its owner (not once per micro-batch); inside
  the node each owned weight is broadcast and each row block all-gathered twice per micro-batch in place of stage
  2's all-gather after the step (counted bytes);
- the four ranks' weights are bitwise identical; the loss goes down;
- bf16 (non-matrix params on Lion's vote, gradient_clipping 0.5: the agreed norm) matches bf16 stage 2 bitwise;
- an infinite gradient on one rank skips the step on all four (fp32 and bf16), weights untouched;
- engine.save_checkpoint / load_checkpoint resume on the saving run's trajectory exactly; detach() restores
  every weight on every rank;
- a model built under deepspeed.zero.Init trains bitwise as the same model built normally (its partitions
  gathered into ds_shape weights before the param groups are made); at stage 2 it is refused naming the fix.
Dion's matrices are split by rows over the node instead (zero3.split_rows), and the element-wise groups with them
(AdamW or Lion): it trains bitwise as FSDP2 HSDP with the same config (AdamW and Lion, whose 1-bit vote's coins
follow the entries' places in each rank's run), and as stage 2 to float tolerance where both work on Xᵀ (m < n);
bytes across nodes per node are stage 2's (less its agreement on which params have a gradient); every rank holds
≈ 1/2 of stage 0's params + state even when one matrix dominates; the power iteration runs once per matrix per
step; checkpoints, the inf skip and zero.Init as for Sign-Muon, fp32 and bf16.
"""

import pytest
import torch
import torch.distributed as dist

deepspeed = pytest.importorskip("deepspeed")  # imported before the pool forks: the workers inherit it
pytestmark = pytest.mark.usefixtures("deepspeed_cpu_ops")   # the CPU op compiled before the pool forks

import shardopt.algorithms.dion as dion_module  # noqa: E402
import shardopt.algorithms.polar as polar_module  # noqa: E402
import shardopt.deepspeed as sds  # noqa: E402
from shardopt.algorithms.lowrank import dion_rank  # noqa: E402
from shardopt.deepspeed.optimizers import row_slots  # noqa: E402
from shardopt.optim.guard import replicas_equal  # noqa: E402
from shardopt.wire.comm import Axis, collective_bytes, split_world  # noqa: E402
from test_deepspeed_zero import MESH, PARAMS, _config, _data, _env, _model, _save_and_resume, _steps  # noqa: E402
from workers import WorkerPool  # noqa: E402

TIMEOUT_S = 300
STEPS = 6
MATRICES = 6   # _model's Linear weights


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(4, collective_timeout_s=120)
    yield p
    p.close()


def _row_blocks(engine) -> list:
    """This rank's row blocks of the weights split by rows over the node (Dion's matrices at stage 3; in the model's
    dtype: in fp32 the optimizer's params themselves)."""
    release = getattr(sds.shard_optimizer(engine).wiring, "release", None)
    return list(release.blocks.values()) if release is not None else []


def _held_bytes(engine) -> dict:
    """What this rank holds: the model params' storage and its row blocks of the weights, the optimizer state and
    the fp32 master copies."""
    ours = sds.shard_optimizer(engine)
    masters = ours._slots() if engine.optimizer is not ours else []
    return {"params": sum(p.untyped_storage().nbytes() for p in [*engine.module.parameters(), *_row_blocks(engine)]),
            "state": sum(v.numel() * v.element_size() for s in ours.state.values() for v in s.values()
                         if torch.is_tensor(v)),
            "masters": sum(p.untyped_storage().nbytes() for p in masters)}


def _owned_param_bytes(engine) -> int:
    """The bytes of the model params whose slot (the optimizer's param order) this rank owns whole, and of its row
    blocks of the others."""
    ours = sds.shard_optimizer(engine)
    model_params = ours.wiring.release.params if ours.zero.stage == 3 else \
        [low for low, _ in ours.wiring.masters] or ours._slots()
    return sum(p.numel() * p.element_size() for p in _row_blocks(engine)) + sum(
        p.numel() * p.element_size() for slot, p in enumerate(model_params)
        if ours.zero.owns(slot) and slot not in ours.zero.rows)


def _node_sends_per_micro_batch(engine) -> tuple[int, int]:
    """(gather, reduce): the bytes this rank sends inside the node per micro-batch, by the comm layer's counting
    (comm.collective_bytes; a rooted collective: the root sends (S−1) tensors, the others one), for stage 3's
    gather of the weights (a whole owned weight broadcast, a row slot's ⌈m/S⌉-row piece all-gathered) and stage
    2/3's reduce of the gradients in fp32 (a whole slot owned elsewhere sent to its owner, a row slot's S·⌈m/S⌉
    rows reduce-scattered)."""
    ours = sds.shard_optimizer(engine)
    zero, size = ours.zero, ours.zero.node.size
    params = ours.wiring.release.params if zero.stage == 3 else [low for low, _ in ours.wiring.masters] or ours._slots()
    gather = reduce = 0
    for slot, param in enumerate(params):
        if slot in zero.rows:
            padded_rows = size * zero.rows[slot][0] * (param.numel() // param.shape[0])
            gather += collective_bytes("all_gather", padded_rows // size * param.element_size(), size)
            reduce += collective_bytes("reduce_scatter", padded_rows * 4, size)
        elif zero.owns(slot):
            gather += (size - 1) * param.numel() * param.element_size()
        else:
            reduce += param.numel() * 4
    return gather if zero.stage == 3 else 0, reduce


def _matrices(X: torch.Tensor) -> int:
    """The matrices in a stack (k, m, n) (or one (m, n); an empty row block counts)."""
    return X.shape[0] if X.ndim == 3 else 1


def _counting(counts: dict):
    """Sign-Muon's Newton–Schulz and Dion's power iteration, each call counting the matrices it works on into
    `counts`; returns the function that puts the originals back."""
    newton_schulz, power_iteration = polar_module.newton_schulz, dion_module.power_iteration

    def counted_newton_schulz(X, coefficients):
        counts["newton_schulz"] += _matrices(X)
        return newton_schulz(X, coefficients)

    def counted_power_iteration(B, Q, **options):   # a generator of collectives, as the original
        counts["power_iteration"] += _matrices(B)
        return (yield from power_iteration(B, Q, **options))

    polar_module.newton_schulz, dion_module.power_iteration = counted_newton_schulz, counted_power_iteration

    def restore():
        polar_module.newton_schulz, dion_module.power_iteration = newton_schulz, power_iteration
    return restore


def _narrowing_model() -> torch.nn.Module:
    """Matrices with fewer rows than columns (12×16, 9×12: uneven rows over 2 ranks, 8×9), which Dion works on
    transposed whole (stage 2) as row-sharded (stage 3)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Tanh(), torch.nn.Linear(12, 9), torch.nn.Tanh(),
                               torch.nn.Linear(9, 8))


def _dominated_model() -> torch.nn.Module:
    """One 96×96 matrix holds 80 % of the weights (whole on one owner, its rank would hold most of the model)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 96), torch.nn.Tanh(), torch.nn.Linear(96, 96), torch.nn.Tanh(),
                               torch.nn.Linear(96, 8))


def _one_row_head_model() -> torch.nn.Module:
    """A 1×32 head: split over 2 ranks, one of them holds no row of it (an empty block)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


MODELS = {"six": _model, "narrowing": _narrowing_model, "dominated": _dominated_model,
          "one_row_head": _one_row_head_model}


def _run(optimizer, stage, precision="fp32", model="six", nonmatrix=None, nonmatrix_names=()):
    """nonmatrix: the element-wise group's algorithm (default: Lion in bf16, AdamW in fp32); nonmatrix_names: the
    config's (params whose name holds one go to the element-wise group)."""
    config = _config(optimizer, stage, MESH, precision, vote="allreduce_int8" if optimizer == "SignMuon" else None,
                     nonmatrix_algorithm=nonmatrix or ("lion" if precision == "bf16" else "adamw"))
    config["shardopt"]["nonmatrix_names"] = list(nonmatrix_names)
    if precision == "bf16":
        config["gradient_clipping"] = 0.5   # the agreed norm (ν over the replicas, the node's owned parts summed)
    engine, *_ = sds.initialize(model=MODELS[model](), config=config)
    ours = sds.shard_optimizer(engine)
    counts, per_step = {"newton_schulz": 0, "power_iteration": 0}, []
    restore = _counting(counts)
    try:
        losses = []
        for _ in range(STEPS):
            before = sum(counts.values())
            losses.append(_steps(engine, 1))
            per_step.append(sum(counts.values()) - before)
    finally:
        restore()
    held, stats = _held_bytes(engine), ours.comm_stats()   # (before gathering the weights to compare them)
    with sds.gathered_weights(engine):
        weights = [p.detach().float().clone() for p in engine.module.parameters()]
        identical = replicas_equal([p.detach() for p in engine.module.parameters()], Axis("replicate", dist.group.WORLD))
    consistent = ours.replicas_consistent()   # (every rank calls it: collectives)
    return {"losses": losses, "weights": weights, "identical": identical and consistent, "held": held,
            "grad_norm": float(engine.get_global_grad_norm()),
            "owned_param_bytes": _owned_param_bytes(engine) if ours.zero is not None else None,
            "node_sends_per_micro_batch": _node_sends_per_micro_batch(engine) if ours.zero is not None else None,
            "gather_bytes": (ours.zero.chunk * next(engine.module.parameters()).element_size()
                             if ours.zero is not None else None),
            "replicate_bytes": stats["replicate"]["bytes_sent"], "node_bytes": stats["node"]["bytes_sent"],
            "matrix_directions": per_step, "engine_stage": engine.zero_optimization_stage()}


def _stages(optimizer, precision, model="six", stages=(0, 2, 3)):
    _env()
    return {stage: _run(optimizer, stage, precision, model) for stage in stages}


def _stage_3_config(optimizer, precision="fp32"):
    return _config(optimizer, 3, MESH, precision, vote="allreduce_int8" if optimizer == "SignMuon" else None)


@pytest.mark.parametrize("optimizer,precision", [("SignMuon", "fp32"), ("SignMuon", "bf16")])
def test_stage_3_is_stage_2_bitwise_with_the_weights_released(pool, optimizer, precision):
    """Stage 0 here is on the same mesh (the node averages its gradients, every rank keeps everything): the
    memory reference. Newton–Schulz (Sign-Muon) and the power iteration (Dion) are counted on every rank (the
    matrices each call works on) and summed over each node."""
    results = pool.run(_stages, optimizer, precision, timeout_s=TIMEOUT_S)
    for rank, runs in enumerate(results):
        two, three, zero = runs[2], runs[3], runs[0]
        held = {stage: sum(run["held"].values()) for stage, run in runs.items()}
        print(f"rank {rank} {optimizer} {precision}: held B (params+state+masters) stage0 {held[0]} stage2 {held[2]} "
              f"stage3 {held[3]} ({held[3] / held[0]:.2f}x stage 0); replicate B stage2 {two['replicate_bytes']} "
              f"stage3 {three['replicate_bytes']}; node B stage2 {two['node_bytes']} stage3 {three['node_bytes']}; "
              f"loss {three['losses'][0]:.4f} -> {three['losses'][-1]:.4f}; matrix directions/step {three['matrix_directions']}")
        assert three["engine_stage"] == 0                    # DeepSpeed runs stage 0; shardopt partitions
        assert three["losses"] == two["losses"] and three["grad_norm"] == two["grad_norm"]   # bitwise
        assert all(torch.equal(a, b) for a, b in zip(three["weights"], two["weights"]))
        assert three["identical"] and two["identical"]
        assert three["losses"][-1] < 0.9 * three["losses"][0]
        assert held[3] <= 0.6 * held[0]
        assert three["held"]["params"] == three["owned_param_bytes"]   # between steps: the owned params only
        assert two["held"]["params"] == zero["held"]["params"]         # stage 2 keeps every weight
        # inside the node, per step of 2 micro-batches: each owned weight broadcast and each row slot's piece
        # all-gathered in forward and in backward instead of stage 2's all-gather of this rank's chunk after the
        # step; the gradients reduced to other owners (whole) or reduce-scattered (rows) in each backward
        (gather, reduce), (_, reduce_2) = three["node_sends_per_micro_batch"], two["node_sends_per_micro_batch"]
        assert three["node_bytes"] - two["node_bytes"] == STEPS * (2 * (2 * gather + reduce - reduce_2)
                                                                    - two["gather_bytes"])
    # across nodes a node sends stage 2's bytes, its element-wise entries split over its ranks by rows instead
    assert _node_sums(results, 3, "replicate_bytes") == _node_sums(results, 2, "replicate_bytes")
    for node in ((0, 1), (2, 3)):   # Newton–Schulz (Sign-Muon) or the power iteration (Dion), on each node
        per_step = [sum(results[r][3]["matrix_directions"][step] for r in node) for step in range(STEPS)]
        assert per_step == [MATRICES] * STEPS, per_step  # once per matrix per step of 2 micro-batches


def _has_gradient_agreement(slots: int) -> int:
    """The bytes a node sends across nodes at stage 2, and not at stage 3 where every rank steps its rows of every
    slot, to agree which params have a gradient (agreement.stepping: a rank lacking some, one byte per slot in an
    all-reduce over the 2 replicas, each of the node's 2 ranks, every step)."""
    return STEPS * 2 * collective_bytes("all_reduce", slots, 2)


def _node_sums(results, stage, key) -> list:
    """`key` of the stage's run summed over each node's ranks (nodes (0, 1) and (2, 3))."""
    return [results[first][stage][key] + results[first + 1][stage][key] for first in (0, 2)]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dion_at_stage_3_splits_every_matrix_by_rows_over_the_node(pool, precision):
    """Dion's matrices row-sharded over the node's 2 ranks (the FSDP2 layout, the node as the shard axis): each rank
    holds its rows of every weight, master and momentum, and Q's rows; every rank runs its part of one distributed
    power iteration per matrix per step of 2 micro-batches (its rows of each matrix counted); the bytes across
    nodes per node are stage 2's (a node sends (a + b)·r per matrix either way, split over its ranks here, and the
    biases' AdamW means or Lion votes by rows), less stage 2's agreement on which params have a gradient (each rank
    lacks the others' there: one byte per slot per rank per step over the replicate axis; at stage 3 every rank
    holds a gradient of its rows of every slot, so the agreement's flag alone says so). In bf16 Lion's votes pack
    8 signs a byte on each rank: splitting a node's entries over 2 ranks by rows instead of whole params may add
    a byte of packing per rank per step."""
    results = pool.run(_stages, "Dion", precision, timeout_s=TIMEOUT_S)
    agreement = _has_gradient_agreement(2 * MATRICES)   # 6 matrices, 6 biases
    packing = [three - (two - agreement) for three, two in zip(_node_sums(results, 3, "replicate_bytes"),
                                                                _node_sums(results, 2, "replicate_bytes"))]
    assert all(0 <= extra <= (STEPS * 2 if precision == "bf16" else 0) for extra in packing), packing
    for rank, runs in enumerate(results):
        three, zero = runs[3], runs[0]
        held = {stage: sum(run["held"].values()) for stage, run in runs.items()}
        print(f"rank {rank} Dion {precision}: held B stage0 {held[0]} stage2 {held[2]} stage3 {held[3]} "
              f"({held[3] / held[0]:.2f}x stage 0); replicate B stage2 {runs[2]['replicate_bytes']} stage3 "
              f"{three['replicate_bytes']}; node B stage2 {runs[2]['node_bytes']} stage3 {three['node_bytes']}; "
              f"loss {three['losses'][0]:.4f} -> {three['losses'][-1]:.4f}; power iterations/step "
              f"{three['matrix_directions']}")
        assert three["engine_stage"] == 0 and three["identical"]
        assert three["losses"][-1] < 0.9 * three["losses"][0]
        assert held[3] <= 0.6 * held[0]
        assert three["held"]["params"] == three["owned_param_bytes"]   # own rows and owned whole params only
        assert three["matrix_directions"] == [MATRICES] * STEPS   # each rank: its rows of the 6 matrices, once
        assert zero["identical"]


def _fsdp2_hsdp_run(model_name, nonmatrix):
    """The config of `_run("Dion", 3, nonmatrix=nonmatrix)` without DeepSpeed: FSDP2 `fully_shard` on the shard dim of a (replicate 2,
    shard 2) mesh, shardopt.Dion on the replicate dim, the same param groups, micro-batches and loss scaling
    (1 / gradient_accumulation_steps, as engine.backward does)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import shardopt
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = MODELS[model_name]()
    fully_shard(model, mesh=mesh["shard"])
    options = {**PARAMS["Dion"], "wire_dtype": getattr(torch, PARAMS["Dion"]["wire_dtype"])}
    optimizer = shardopt.Dion(shardopt.param_groups(model, "dion", nonmatrix), replicate_mesh=mesh["replicate"],
                              **options)
    x, y = _data()
    losses = []
    for _ in range(STEPS):
        total = 0.0
        for micro in range(2):
            loss = ((model(x[4 * micro:4 * micro + 4]) - y[4 * micro:4 * micro + 4]) ** 2).mean()
            (loss / 2).backward()
            total += loss.item() / 2
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, [p.full_tensor().detach().clone() for p in model.parameters()]


def _stage_3_and_fsdp2_hsdp(model, nonmatrix):
    _env()
    return _run("Dion", 3, model=model, nonmatrix=nonmatrix), _fsdp2_hsdp_run(model, nonmatrix)


@pytest.mark.parametrize("model,nonmatrix", [("six", "adamw"), ("one_row_head", "adamw"), ("six", "lion"),
                                             ("one_row_head", "lion")])
def test_dion_at_stage_3_trains_as_fsdp2_hsdp(pool, model, nonmatrix):
    """Dion at stage 3 is the FSDP2-HSDP layout with the node as the shard axis: the same row blocks, the same
    bucket steps and collectives (P summed over the node, its rows split there for the replicate mean, the column
    norms summed over the node), the gradients' node sums added in the same order (FSDP2 divides each rank's
    gradient by 2 before the reduce-scatter, stage 3 the sum after it: exact either way), so losses and weights
    are bitwise those of FSDP2 HSDP, matrices with m ≥ n included (where stage 2, on whole matrices, works on W),
    and a 1-row head, of which one rank of each node holds no row (nor of its 1-entry bias). The element-wise
    groups (biases) are split by rows too, as FSDP2 splits them: AdamW steps each rank's entries after the fp32
    replicate mean, Lion votes on them with the coins of their places in the rank's run of entries, as there."""
    for three, (losses, weights) in pool.run(_stage_3_and_fsdp2_hsdp, model, nonmatrix, timeout_s=TIMEOUT_S):
        assert three["losses"] == losses
        assert all(torch.equal(a, b) for a, b in zip(three["weights"], weights))


def test_dion_at_stage_3_matches_stage_2_where_both_work_on_the_transpose(pool):
    """Stage 2 runs Dion on whole matrices, stage 3 row-sharded as FSDP2 does, which works on B = Xᵀ (the shard
    axis must split b); with fewer rows than columns stage 2 works on Xᵀ too, so the two are the same equations:
    B·Q is summed over the row blocks (Σ_i B_i·Q_i) and the column norms over them, in another order than one
    whole product, hence float tolerance, not bitwise. Uneven rows (9 over 2 ranks) included. Bytes across nodes:
    stage 2's plus, per matrix, the padding of P's a = n rows to S equal pieces ((⌈n/S⌉·S − n)·r fp32 entries:
    the 8×9 matrix, whose 9 columns do not split over 2 ranks), less stage 2's agreement on which params have a
    gradient (3 matrices, 3 biases)."""
    results = pool.run(_stages, "Dion", "fp32", "narrowing", timeout_s=TIMEOUT_S)
    padding = sum((-(-n // 2) * 2 - n) * dion_rank(m, n, 0.25, 1) * 4 for m, n in ((12, 16), (9, 12), (8, 9)))
    assert padding == 8
    assert _node_sums(results, 3, "replicate_bytes") == [two + STEPS * padding - _has_gradient_agreement(6)
                                                         for two in _node_sums(results, 2, "replicate_bytes")]
    for runs in results:
        two, three = runs[2], runs[3]
        torch.testing.assert_close(three["losses"], two["losses"], rtol=1e-5, atol=1e-6)
        for a, b in zip(three["weights"], two["weights"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert three["identical"] and three["matrix_directions"] == [3] * STEPS


def test_dion_at_stage_3_balances_one_dominant_matrix_over_the_node(pool):
    """A model whose one matrix holds 80 % of the weights: whole on one owner (Sign-Muon at stage 3) its rank holds
    more than 0.6× stage 0's params + state; split by rows (Dion), every rank holds about half."""
    dion, signmuon = (pool.run(_stages, name, "fp32", "dominated", (0, 3), timeout_s=TIMEOUT_S) for name in ("Dion", "SignMuon"))
    shares = {name: [sum(runs[3]["held"].values()) / sum(runs[0]["held"].values()) for runs in results]
              for name, results in (("Dion", dion), ("SignMuon", signmuon))}
    print(f"held at stage 3 / stage 0 per rank: {shares}")
    assert max(shares["Dion"]) <= 0.6 and max(shares["SignMuon"]) > 0.6


def _dominant_element_wise_param(optimizer):
    """The "dominated" model with its 96×96 matrix (80 % of the weights) in the element-wise group (AdamW), as a tied
    embedding sits there in a GPT; stages 0, 2 and 3."""
    _env()
    return {stage: _run(optimizer, stage, model="dominated", nonmatrix_names=("2.",)) for stage in (0, 2, 3)}


@pytest.mark.parametrize("optimizer", ["SignMuon", "Dion"])
def test_stage_3_balances_a_dominant_element_wise_param_over_the_node(pool, optimizer):
    """Whole on one owner (stage 2) the AdamW moments of the 96×96 param make its rank's optimizer state more than
    0.6× stage 0's; split by rows at stage 3, every rank holds about half of stage 0's state and of its params +
    state (+ the gathered weights of no module between steps)."""
    results = pool.run(_dominant_element_wise_param, optimizer, timeout_s=TIMEOUT_S)
    state = {stage: [runs[stage]["held"]["state"] / runs[0]["held"]["state"] for runs in results] for stage in (2, 3)}
    held = [sum(runs[3]["held"].values()) / sum(runs[0]["held"].values()) for runs in results]
    print(f"{optimizer}: state / stage 0 per rank {state}; params + state at stage 3 / stage 0 per rank {held}")
    assert max(state[2]) > 0.6 and max(state[3]) <= 0.55 and max(held) <= 0.55
    for runs in results:
        assert runs[3]["losses"][-1] < 0.9 * runs[3]["losses"][0] and runs[3]["identical"]


def test_the_row_slots_are_dion_matrices_and_element_wise_params_with_a_dim_0_at_stage_3_only():
    """optimizers.row_slots: Dion's single matrices (not a `split` one) and the AdamW / Lion params that have a dim 0
    (a 0-d param stays whole on an owner: no rows to split); Sign-Muon's matrices never; no slot below stage 3."""
    groups = [{"algorithm": "dion", "params": [torch.zeros(4, 3), torch.zeros(6, 3)]},
              {"algorithm": "dion", "params": [torch.zeros(6, 3)], "split": (0, (2, 4))},
              {"algorithm": "signmuon", "params": [torch.zeros(4, 3)]},
              {"algorithm": "adamw", "params": [torch.zeros(()), torch.zeros(5), torch.zeros(2, 3, 4)]},
              {"algorithm": "lion", "params": [torch.zeros(1)]}]
    assert row_slots(groups, 3) == (0, 1, 5, 6, 7)
    assert row_slots(groups, 2) == ()


def _checkpoint_resumes(directory, precision, optimizer, model):
    _env()
    saving, resumed, path = _save_and_resume(directory, _stage_3_config(optimizer, precision), MODELS[model])
    held = (_held_bytes(saving)["params"], _held_bytes(resumed)["params"], _owned_param_bytes(resumed))
    _steps(resumed, 3)
    with sds.gathered_weights(saving), sds.gathered_weights(resumed):
        diff = max((a - b).abs().max().item() for a, b in zip(saving.module.parameters(), resumed.module.parameters()))
    sds.detach(resumed)   # the model whole again on every rank, as DeepSpeed built it
    whole = _held_bytes(resumed)["params"] == sum(p.numel() * p.element_size() for p in resumed.module.parameters())
    return path is not None, diff, held, whole


@pytest.mark.parametrize("precision,optimizer,model", [("fp32", "SignMuon", "six"), ("bf16", "SignMuon", "six"),
                                                       ("fp32", "Dion", "six"), ("bf16", "Dion", "six"),
                                                       ("fp32", "Dion", "narrowing"), ("bf16", "Dion", "one_row_head")])
def test_engine_checkpoint_at_stage_3_resumes_on_the_same_trajectory(pool, tmp_path, precision, optimizer, model):
    """DeepSpeed writes data-parallel rank 0's whole model (gathered for the save); each rank its own partition
    (and fp32 masters in bf16) next to it; after the save (and 3 more steps) and after the load only the owned
    weights are held; shardopt.deepspeed.detach(engine) gives every rank the whole model back. Dion's row blocks
    come from the loaded weights, their state from each rank's own file (uneven rows: the "narrowing" model's
    9 rows over 2 ranks, whose state shapes differ from rank 0's; the element-wise params split by rows as well, the
    1-row head's 1-entry bias an empty block, with empty Lion state, on one rank of each node)."""
    for loaded, diff, (after_save, after_load, owned), whole in pool.run(_checkpoint_resumes, str(tmp_path),
                                                                         precision, optimizer, model,
                                                                         timeout_s=TIMEOUT_S):
        assert loaded
        assert diff == 0
        assert after_save == after_load == owned
        assert whole


def _inf_on_one_rank_skips_everywhere(precision, optimizer):
    """2 steps, then a step whose second micro-batch has an infinite loss on rank 0 only, then 2 more."""
    _env()
    engine, *_ = sds.initialize(model=_model(), config=_stage_3_config(optimizer, precision))
    _steps(engine, 2)
    with sds.gathered_weights(engine):
        before = [p.detach().clone() for p in engine.module.parameters()]
    x, y = _data()
    dtype = next(engine.module.parameters()).dtype
    for micro in range(2):
        loss = ((engine(x[4 * micro:4 * micro + 4].to(dtype)).float() - y[4 * micro:4 * micro + 4]) ** 2).mean()
        engine.backward(loss * float("inf") if micro == 1 and dist.get_rank() == 0 else loss)
        engine.step()
    with sds.gathered_weights(engine):
        unchanged = all(torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))
    skipped = engine.skipped_steps
    losses = [_steps(engine, 1) for _ in range(2)]
    held = _held_bytes(engine)["params"] == _owned_param_bytes(engine)
    return skipped, unchanged, sds.shard_optimizer(engine).replicas_consistent(), held, losses


@pytest.mark.parametrize("optimizer", ["SignMuon", "Dion"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_inf_gradient_on_one_rank_skips_the_stage_3_step_on_every_rank(pool, precision, optimizer):
    """fp32: the optimizer's agreed non-finite check; bf16: the wrapper's overflow check, agreed over all ranks.
    The weights stay as they were, the replicas identical, and training goes on."""
    for skipped, unchanged, consistent, held, losses in pool.run(_inf_on_one_rank_skips_everywhere, precision,
                                                                 optimizer, timeout_s=TIMEOUT_S):
        assert skipped == 1 and unchanged and consistent and held
        assert all(loss == loss and abs(loss) < float("inf") for loss in losses), losses


def _zero_init_model(config):
    with deepspeed.zero.Init(config_dict_or_path=config):
        return _model()


def _zero_init_runs_as_a_plain_model(optimizer):
    """The same config on the same model built normally and under zero.Init (whose 2-D weights are 1-D partitions
    until shardopt gathers them), 3 steps each; and zero.Init at stage 2."""
    _env()
    config = _stage_3_config(optimizer)
    runs = {}
    for name, model in (("plain", _model()), ("zero_init", _zero_init_model(config))):
        placeholder = tuple(next(model.parameters()).shape)
        engine, *_ = sds.initialize(model=model, config=config)
        losses = [_steps(engine, 1) for _ in range(3)]
        held, owned = _held_bytes(engine)["params"], _owned_param_bytes(engine)
        matrices = len(sds.shard_optimizer(engine).param_groups[0]["params"])   # the matrix group
        with sds.gathered_weights(engine):
            weights = [p.detach().clone() for p in engine.module.parameters()]
        runs[name] = (placeholder, losses, weights, held == owned, matrices)
    try:
        sds.initialize(model=_zero_init_model(config), config=_config("SignMuon", 2, MESH))
        refusal = None
    except ValueError as error:
        refusal = str(error)
    return runs, refusal


@pytest.mark.parametrize("optimizer", ["SignMuon", "Dion"])
def test_a_model_built_under_zero_init_trains_as_the_same_model_built_normally(pool, optimizer):
    """Dion: its matrices split by rows from the gathered ds_shape weights."""
    for runs, refusal in pool.run(_zero_init_runs_as_a_plain_model, optimizer, timeout_s=TIMEOUT_S):
        plain, zero_init = runs["plain"], runs["zero_init"]
        assert plain[0] == (32, 16) and zero_init[0] == (0,)    # zero.Init's placeholder of the first weight
        assert zero_init[1] == plain[1]                          # losses, bitwise
        assert all(torch.equal(a, b) for a, b in zip(zero_init[2], plain[2]))
        assert zero_init[3] and plain[3]                         # only the owned weights held
        assert zero_init[4] == plain[4] == MATRICES              # every 2-D weight in the matrix group (ds_shape)
        assert refusal is not None and "deepspeed.zero.Init" in refusal and "set it to 3" in refusal


def _broadcast_inside_nodes():
    replicate, node = split_world(2, 2)
    axis = Axis("node", node)
    tensor = torch.tensor([-0.0, float("nan"), 1.5 + dist.get_rank()]) if axis.rank == 1 else torch.zeros(3)
    axis.broadcast(tensor, 1)
    return tensor.tolist(), torch.signbit(tensor[0]).item(), axis.stats()


def test_the_node_broadcast_copies_the_owner_exactly_and_counts_its_bytes(pool):
    """Axis.broadcast (stage 3's gather): the root's values bitwise (−0.0, NaN), the root sends (M−1)·S, each
    other rank receives S."""
    for rank, (values, negative_zero, stats) in enumerate(pool.run(_broadcast_inside_nodes, timeout_s=TIMEOUT_S)):
        root = 2 * (rank // 2) + 1
        assert negative_zero and values[1] != values[1] and values[2] == 1.5 + root
        assert (stats["bytes_sent"], stats["bytes_received"]) == ((12, 0) if rank == root else (0, 12))
        assert stats["calls"] == 1
