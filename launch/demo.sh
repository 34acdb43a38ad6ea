#!/usr/bin/env bash
# The README's first command: shardopt's optimizers on a 4-process CPU job, about 6 minutes on 2 cores.
#
#   bash launch/demo.sh
#
# Sets up the environment (launch/env.sh), prepares the Shakespeare bytes (once), then trains the
# same small GPT (4 layers, width 128, context 64) with AdamW, Dion (rank 1/4) and Sign-Muon on a
# mesh of 2 replicas × 2 FSDP2 shards: FSDP2 inside a replica, the optimizer's own compressed
# exchange between replicas. Prints a table (final val loss, replicate-axis bytes per step, wall
# time) and writes it to runs/demo/summary.csv; the runs' metrics, plots and logs go to runs/demo/, with
# runs/demo/compare.png overlaying all optimizers (val loss vs step and vs replicate-axis bytes).
# The checkout's committed files are left as they are: the README's table stays the one drawn from
# the committed results/demo.csv (this machine's losses differ in the third digit from another CPU's).
#
# Settings (environment variables):
#   STEPS=100 REPLICATE=4 SHARD=1   the size (defaults 300, 2, 2)
#   OUT_DIR=somewhere               where the runs and the table go (default runs/demo)
#   UPDATE_RESULTS=1                also copy the table to results/demo.csv and redraw the README's table and
#                                   docs/results.md from it (launch/results_table.py --readme README.md):
#                                   what a maintainer does to commit new numbers
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$SHARDOPT_ROOT"

REPLICATE=${REPLICATE:-2}
SHARD=${SHARD:-2}
STEPS=${STEPS:-300}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

python integrations/data.py

runs=${OUT_DIR:-runs/demo}
rm -rf "$runs/adamw" "$runs/dion" "$runs/signmuon" "$runs/summary.csv" "$runs/compare.png"   # the last demo's
mkdir -p "$runs"
for optimizer in adamw dion signmuon; do
    echo "== $optimizer: $STEPS steps on $REPLICATE replicas × $SHARD shards"
    torchrun --standalone --nproc_per_node $((REPLICATE * SHARD)) integrations/fsdp/train.py \
        --replicate "$REPLICATE" --shard "$SHARD" --optimizer "$optimizer" --rank-fraction 0.25 \
        --steps "$STEPS" --out-dir "$runs/$optimizer" --summary-csv "$runs/summary.csv"
done

python integrations/plot.py "$runs/adamw" "$runs/dion" "$runs/signmuon" --out "$runs/compare.png" \
    --title "$STEPS steps, $REPLICATE replicas × $SHARD shards"
echo
python launch/results_table.py "$runs/summary.csv"
if [ "${UPDATE_RESULTS:-0}" = 1 ]; then
    cp "$runs/summary.csv" results/demo.csv
    python launch/results_table.py --readme README.md
fi
