#!/usr/bin/env bash
# The step-time and memory table of launch/bench/step_time.py on a CUDA GPU, rows tagged with the device's
# name, into results/step_time_gpu.csv. Without a CUDA device it says so and exits 0 without a file
# (no GPU row exists then).
#
#   bash launch/bench/step_time_gpu.sh [ROUNDS]        # default 30 rounds
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${PYTHON:-python}
if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "step_time_gpu: skipped: torch.cuda.is_available() is False on $(hostname) (no CUDA device or a CPU build of torch); no GPU rows written"
    exit 0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec "$python" launch/bench/step_time.py --device cuda --rounds "${1:-30}" --csv results/step_time_gpu.csv
