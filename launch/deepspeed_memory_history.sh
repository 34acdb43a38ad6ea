#!/usr/bin/env bash
# Every row of results/deepspeed_zero_memory.csv in one run: the DeepSpeed plugin's bf16 ZeRO 2 memory per rank
# at three earlier commits and at this checkout, each beside DeepSpeed's own ZeRO 2 measured in the same launch,
# all by this checkout's launch/bench/deepspeed_zero_memory.py (the earlier code comes first on PYTHONPATH):
#   before          3ff95c7  the stage-0 wrapper's fp32 masters of every param, its zero-filled fp32 gradients
#   owned-masters   b72af4c  fp32 masters only for the slots a rank owns (masters.py), a bf16 .grad beside the
#                            wrapper's fp32 copy of it
#   node-mean       160f850  the fp32 node mean is the owned master's gradient itself
#   after           (this checkout)  bf16: the owned masters packed between steps (low 16 bits and a rounding bit
#                            beside the bf16 weight), rebuilt per bucket for the step (masters.py, packing.py)
# shardopt's bucket_bytes 1 MiB: small beside this 12.7M-param model (51 MB in fp32), as the 16 MiB default is beside
# a 1B-param one, so that step_peak shows what grows with the model, not one bucket's working copies.
# 4 CPU ranks (gloo), ~5 minutes on 2 busy cores. Run from a git checkout:  bash launch/deepspeed_memory_history.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# (a fixed mmap threshold: freed buffers leave the RSS, whose high-water mark is the CPU's step_peak)
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MALLOC_MMAP_THRESHOLD_=65536
out=results/deepspeed_zero_memory.csv
bench=(torchrun --standalone --nproc_per_node 4 launch/bench/deepspeed_zero_memory.py --out "$out" --bucket-bytes 1048576)
rm -f "$out"   # every label is measured anew, in this run
for label_commit in before:3ff95c7 owned-masters:b72af4c node-mean:160f850; do
    label=${label_commit%%:*} commit=${label_commit#*:}
    code=$(mktemp -d)
    git archive "$commit" shardopt integrations | tar -x -C "$code"
    PYTHONPATH="$code" "${bench[@]}" --label "$label" --meshes 2x2
    rm -rf "$code"
done
"${bench[@]}" --label after
python launch/results_table.py --readme README.md   # docs/results.md redrawn from the CSV
