#!/usr/bin/env bash
# The GPU smoke check, ≤ 10 minutes on one GPU (a two-GPU section runs where there are two): tests/test_cuda.py,
# the fake-group step audit on CUDA (launch/bench/step_ops.py, where it exists), FSDP2 with overlap_backward
# off/on bitwise under TORCH_CUDA_SANITIZER=1, DeepSpeed bf16 memory per parameter, the NCCL multi-rank tests.
# Each section detects what it needs and prints "skipped: <reason>" without it; a summary table at the end;
# exit 1 if a section that ran failed. Sections and options: launch/gpu_smoke.py (--list, --only, --cpu).
#
#   bash launch/gpu_smoke.sh            # on the GPU machine
#   bash launch/gpu_smoke.sh --cpu      # dry run on the CPU (GPUs hidden): the CPU parts run, exit 0
#
# Uses the active Python (PYTHON=... to choose); this checkout's shardopt comes first on PYTHONPATH, so
# nothing needs to be installed but torch (and pytest; deepspeed for its section).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" launch/gpu_smoke.py "$@"
