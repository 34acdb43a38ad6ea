"""shardopt.lightning.ShardoptCallback under lightning.Trainer, 2 CPU processes under torchrun (gloo;
Lightning takes torchrun's environment): docs/trainers.md's Lightning block as written, and
tests/lightning_scenarios.py (DDP: replicas bitwise identical, replicate bytes per step ≤ 1/25 of an
fp32 all-reduce, momenta agreed at each save, resume bit-exact; FSDP2 through ModelParallelStrategy,
resume bit-exact, and HSDP there with the compressed exchange; gradient_clip_val and a missing
replicate_mesh refused)."""

import pytest

from two_processes import check_docs_bytes, check_exchange, import_without, run_docs_block

pytest.importorskip("lightning", reason="the [lightning] extra is not installed")
SCENARIOS = "lightning_scenarios"   # the `scenarios` fixture (tests/conftest.py) runs it once for the module


def test_docs_lightning_block_trains_with_ddp_on_two_processes(tmp_path):
    out = run_docs_block("Lightning", tmp_path, RUN_DIR=str(tmp_path))
    assert "'bytes_sent'" in out, out


def test_ddp_replicas_identical_one_bit_exchange_and_bit_exact_resume(scenarios):
    for result in scenarios:
        ddp = result["ddp"]
        assert ddp["steps"] == 6 and ddp["trained"] and ddp["replicas_consistent"], ddp
        check_exchange(ddp, steps=6, saved_after=3)   # a checkpoint at each epoch end
        assert ddp["resume_bit_exact"], ddp


def test_the_bytes_docs_trainers_md_quotes_are_this_run_s(scenarios):
    check_docs_bytes(SCENARIOS, scenarios)


def test_fsdp2_model_parallel_strategy_shards_and_resumes_bit_exact(scenarios):
    for result in scenarios:
        fsdp2 = result["fsdp2"]
        assert fsdp2["steps"] == 6 and fsdp2["sharded"] and fsdp2["shard_bytes"] > 0, fsdp2
        assert fsdp2["replicate_bytes"] == 0 and fsdp2["resume_bit_exact"], fsdp2   # no replicate axis


def test_hsdp_under_model_parallel_strategy_exchanges_one_bit_and_resumes_bit_exact(scenarios):
    for result in scenarios:
        hsdp = result["hsdp"]
        assert hsdp["steps"] == 6 and hsdp["sharded"] and hsdp["replicas_consistent"], hsdp
        check_exchange(hsdp, steps=6, saved_after=3)
        assert hsdp["resume_bit_exact"], hsdp


def test_overlap_backward_under_ddp_is_bitwise_and_begins_in_the_last_micro_batch(scenarios):
    """Lightning runs accumulate_grad_batches' inner micro-batches under DDP's no_sync(), which the adapter
    registers as accumulation: the exchange begins in the last one's backward, and no step runs twice."""
    for result in scenarios:
        overlap = result["overlap"]
        assert overlap["bitwise"] and overlap["bytes"][0] == overlap["bytes"][1] > 0, overlap
        off, on = overlap["started"]
        assert len(on) == 6 and all(n > 0 for n in on) and off == [0] * 6, overlap


def test_gradient_clip_val_missing_replicate_mesh_and_local_steps_are_refused(scenarios):
    for result in scenarios:
        refused = result["refused"]
        assert "gradient_clip_val=1.0" in refused["gradient_clip_val"] and \
            "max_grad_norm=1.0" in refused["gradient_clip_val"], refused
        assert "replicate_mesh=torch.distributed.group.WORLD" in refused["no_replicate_mesh"], refused
        assert "does not run shardopt.LocalSteps" in refused["local_steps"], refused
        assert "Local steps at the end of training" in refused["local_steps"], refused


def test_shardopt_imports_without_lightning_and_the_adapter_says_what_to_install():
    done = import_without("shardopt.lightning", "lightning")
    assert done.returncode == 1 and "pip install 'shardopt[lightning]'" in done.stderr, done.stderr[-2000:]
