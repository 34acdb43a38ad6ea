#!/usr/bin/env bash
# The step-time and memory table of launch/bench/step_time.py on a CUDA GPU, rows tagged with the device's
# name, into results/step_time_gpu.csv. Without a CUDA device it says so and exits 0 without a file
# (no GPU row exists then). This checkout's shardopt comes first on PYTHONPATH: nothing needs installing.
#
#   bash launch/bench/step_time_gpu.sh [ROUNDS]        # default 30 rounds
#   bash launch/bench/step_time_gpu.sh --dry-run       # any machine, seconds: one CPU round of one matrix into
#                                                      # a temporary CSV (the script and its imports work)
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python=${PYTHON:-python}
if [ "${1:-}" = "--dry-run" ]; then
    csv=$(mktemp --suffix .csv)
    trap 'rm -f "$csv"' EXIT
    "$python" launch/bench/step_time.py --device cpu --rounds 1 --matrices attn.proj --csv "$csv"
    echo "step_time_gpu: dry run on the CPU passed (1 round of attn.proj; no GPU rows written)"
    exit 0
fi
if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "step_time_gpu: skipped: torch.cuda.is_available() is False on $(hostname) (no CUDA device or a CPU build of torch); no GPU rows written"
    exit 0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec "$python" launch/bench/step_time.py --device cuda --rounds "${1:-30}" --csv results/step_time_gpu.csv
