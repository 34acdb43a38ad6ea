#!/usr/bin/env bash
# One torchrun per node, joined by a c10d rendezvous: the multi-node launcher of the training scripts.
#
# Under SLURM, as one task per node (what launch/slurm/*.sbatch do); every setting comes from SLURM:
#     srun --ntasks-per-node=1 launch/torchrun_multinode.sh integrations/fsdp/train.py --replicate 2 --shard 8
# Without SLURM, run it on every node with the same MASTER_ADDR and NNODES and the node's own NODE_RANK:
#     MASTER_ADDR=10.0.0.1 NNODES=2 NODE_RANK=0 launch/torchrun_multinode.sh integrations/fsdp/train.py ...
#     MASTER_ADDR=10.0.0.1 NNODES=2 NODE_RANK=1 launch/torchrun_multinode.sh integrations/fsdp/train.py ...
#
# Settings (environment)   meaning                                        default (under SLURM)
#   MASTER_ADDR            host of the rendezvous; node 0 serves it        (always the first host of the job)
#   MASTER_PORT            its TCP port                                    29500 (20000 + job id % 10000)
#   NNODES                 number of nodes                                 (always $SLURM_NNODES)
#   NODE_RANK              this node, 0 .. NNODES-1                        (always $SLURM_NODEID)
#   NPROC_PER_NODE         processes per node, one per GPU                 1 ($SLURM_GPUS_ON_NODE, else 1)
#   RDZV_ID                run id, the same on every node                  shardopt (always $SLURM_JOB_ID)
#   RDZV_TIMEOUT           seconds to wait for all nodes to join           600
#   LOCAL_ADDR             this node's address as the others reach it; set it only where the
#                          hostname does not resolve to that (e.g. several nodes share a hostname)
#   PYTHON                 interpreter with torch and shardopt             python3
#
# Knobs a cluster admin changes (export them in the job script, or site-wide; set ones are kept):
#   SOCKET_IFNAME          network interface for NCCL's bootstrap and for gloo's traffic, e.g. ib0,
#                          bond0 or "^docker,lo" (NCCL syntax); default: the interface this node uses
#                          to reach MASTER_ADDR. NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME override it
#                          per library (gloo takes one name, or a comma list of names, no "^").
#   OMP_NUM_THREADS        CPU threads per process; default: the task's CPUs / NPROC_PER_NODE.
#   NCCL_IB_HCA            InfiniBand adapters NCCL may use, e.g. mlx5_0,mlx5_1 (NCCL picks all if unset).
#   NCCL_DEBUG             WARN (default here); INFO to see which interfaces and transports NCCL chose.
set -euo pipefail

if [ -n "${SLURM_JOB_ID:-}" ]; then
    if [ "${SLURM_STEP_NUM_TASKS:-1}" != "${SLURM_STEP_NUM_NODES:-1}" ]; then
        echo "torchrun_multinode: run one task per node (srun --ntasks-per-node=1), not" \
             "$SLURM_STEP_NUM_TASKS tasks on $SLURM_STEP_NUM_NODES nodes; torchrun starts the processes" >&2
        exit 2
    fi
    # Not taken from the environment, which sbatch copies from the submitting shell: a MASTER_ADDR
    # or NODE_RANK left there from a single-node run would be wrong here.
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    NNODES=$SLURM_NNODES
    NODE_RANK=$SLURM_NODEID
    RDZV_ID=$SLURM_JOB_ID
    : "${MASTER_PORT:=$((20000 + SLURM_JOB_ID % 10000))}"
    : "${NPROC_PER_NODE:=${SLURM_GPUS_ON_NODE:-1}}"
fi
: "${MASTER_ADDR:?set MASTER_ADDR (the host of node 0), or run under SLURM}"
: "${NNODES:?set NNODES (the number of nodes), or run under SLURM}"
: "${NODE_RANK:?set NODE_RANK (0 .. NNODES-1), or run under SLURM}"
: "${MASTER_PORT:=29500}"
: "${NPROC_PER_NODE:=1}"
: "${RDZV_ID:=shardopt}"
: "${RDZV_TIMEOUT:=600}"
: "${PYTHON:=python3}"

# The interface that carries this node's traffic to MASTER_ADDR: the one holding that address if it
# is ours, else the one the route to it leaves by. Empty if it cannot be told (then the libraries choose).
route_interface() {
    local address own
    address=$(getent ahostsv4 "$1" | awk '{ print $1; exit }') || return 0
    [ -n "$address" ] && command -v ip > /dev/null || return 0
    own=$(ip -o -4 addr show to "$address/32" | awk '{ print $2; exit }')
    if [ -n "$own" ]; then echo "$own"; return; fi
    ip -o route get "$address" 2> /dev/null | sed -n 's/.* dev \([^ ]*\).*/\1/p'
}
: "${SOCKET_IFNAME:=$(route_interface "$MASTER_ADDR")}"
if [ -n "$SOCKET_IFNAME" ]; then
    export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$SOCKET_IFNAME}"
    export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$SOCKET_IFNAME}"
fi
threads=$(( ${SLURM_CPUS_PER_TASK:-$(nproc)} / NPROC_PER_NODE ))
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"

# Node 0 serves the rendezvous store: said outright rather than guessed from hostnames, which
# fails where nodes share one or MASTER_ADDR is an address of another interface.
is_host=$([ "$NODE_RANK" = 0 ] && echo 1 || echo 0)
echo "torchrun_multinode: node $NODE_RANK of $NNODES on $(hostname): $NPROC_PER_NODE process(es)," \
     "rendezvous $MASTER_ADDR:$MASTER_PORT id $RDZV_ID, interface ${SOCKET_IFNAME:-(auto)}," \
     "OMP_NUM_THREADS=$OMP_NUM_THREADS"
exec "$PYTHON" -m torch.distributed.run \
    --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" \
    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$RDZV_ID" \
    --rdzv-conf="is_host=$is_host,join_timeout=$RDZV_TIMEOUT" \
    ${LOCAL_ADDR:+--local-addr="$LOCAL_ADDR"} \
    --max-restarts=0 \
    "$@"
