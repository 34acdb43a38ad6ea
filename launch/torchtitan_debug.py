"""torchtitan's debug trainer (llama3 "debugmodel", its own data loader, loss, lr scheduler and
checkpoints) with shardopt's optimizer through shardopt.torchtitan.use_shardopt, on CUDA GPUs:

    torchrun --nproc_per_node 2 launch/torchtitan_debug.py --assets ~/torchtitan/tests/assets

--assets: a torchtitan checkout's tests/assets (its tokenizer/ and c4_test/; the pip package has
neither). Every GPU is a replica (data_parallel_replicate_degree = world / --shard); FSDP2 shards
over --shard GPUs. Without CUDA it exits with a message: torchtitan's Trainer calls
torch.cuda.set_device and imports triton (tests/test_torchtitan.py covers shardopt.torchtitan on CPUs).
"""

import argparse
import os
import sys

import torch

DEBUGMODEL_QKV = (0, (256, 256, 256))   # llama3 debugmodel: dim 256, 16 heads, no GQA: wqkv is Q, K, V


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--assets", required=True, help="a torchtitan checkout's tests/assets directory")
    parser.add_argument("--algorithm", choices=("signmuon", "dion"), default="signmuon")
    parser.add_argument("--lr", type=float, default=0.02, help="the matrix params' lr")
    parser.add_argument("--nonmatrix-lr", type=float, default=8e-4, help="the Lion-vote params' lr")
    parser.add_argument("--shard", type=int, default=1, help="GPUs per FSDP2 shard group (the rest replicate)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="outputs/torchtitan_debug", help="torchtitan's dump folder")
    return parser.parse_args()


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("launch/torchtitan_debug.py needs CUDA GPUs: torchtitan's Trainer calls torch.cuda.set_device and "
                 "imports triton. On CPUs, tests/test_torchtitan.py runs shardopt.torchtitan with torchtitan's "
                 "container, lr scheduler and checkpoint manager.")
    for folder in ("tokenizer", "c4_test"):
        if not os.path.isdir(os.path.join(args.assets, folder)):
            sys.exit(f"--assets {args.assets} has no {folder}/: pass a torchtitan checkout's tests/assets")
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from torchtitan.tools.logging import init_logger

    from shardopt.torchtitan import use_shardopt

    init_logger()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = llama3_debugmodel()
    config.hf_assets_path = os.path.join(args.assets, "tokenizer")
    config.dataloader.dataset_path = os.path.join(args.assets, "c4_test")
    config.validator.enable = False                        # its data set (allenai/c4) is a download
    config.dump_folder = args.out
    config.training.steps = args.steps
    config.checkpoint.enable = True
    config.checkpoint.interval = max(1, args.steps // 2)
    config.checkpoint.last_save_model_only = False
    config.parallelism.spmd_backend = "partial_dtensor"    # torchtitan's FSDP2 path
    config.parallelism.data_parallel_shard_degree = args.shard
    config.parallelism.data_parallel_replicate_degree = world // args.shard
    use_shardopt(config, algorithm=args.algorithm, options={"lr": args.lr}, nonmatrix_options={"lr": args.nonmatrix_lr},
                 splits={"attention.wqkv": DEBUGMODEL_QKV})
    trainer = config.build()
    try:
        trainer.train()
        optimizer = trainer.optimizers.optimizers[0]
        consistent = optimizer.replicas_consistent()
        print(f"rank {torch.distributed.get_rank()}: replicas bitwise identical: {consistent}; "
              f"comm_stats {optimizer.comm_stats()}")
    finally:
        trainer.close()
        torch.distributed.destroy_process_group()
    if not consistent:
        sys.exit("the replicas' weights differ")


if __name__ == "__main__":
    main()
