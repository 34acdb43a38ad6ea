#!/bin/bash
# One replica group of launch/slurm/torchft.sbatch: a torchrun world on this node (its own store on a
# local port), replica id = the SLURM node index; TORCHFT_LIGHTHOUSE, MIN_REPLICAS and REPLICA_GROUPS
# come from the batch script. Rerun it on a fresh node with REPLICA_ID set to bring a group back.
set -euo pipefail
REPLICA_ID=${REPLICA_ID:-$SLURM_NODEID}
NPROC=${SLURM_GPUS_ON_NODE:-1}
exec torchrun --nnodes 1 --nproc_per_node "$NPROC" --master_port "${GROUP_PORT:-29600}" \
    integrations/fsdp/train.py --fault-tolerant --replica-id "$REPLICA_ID" --lighthouse "$TORCHFT_LIGHTHOUSE" \
    --min-replicas "$MIN_REPLICAS" --replica-groups "$REPLICA_GROUPS" --shard "$NPROC" \
    --out-dir "${OUT_DIR:-runs/torchft}/group$REPLICA_ID" "$@"
