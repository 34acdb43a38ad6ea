#!/usr/bin/env bash
# Fault-tolerant local-steps training on one machine (docs/design.md §13): a torchft lighthouse and REPLICA_GROUPS
# replica groups (each its own torchrun world running integrations/fsdp/train.py --fault-tolerant). One group
# is SIGKILLed at a random logged step and restarted; it heals from a live group and finishes the same
# --steps. Then the same job runs without a failure, and launch/torchft_table.py prints the table:
# replicas alive over time, rounds committed / discarded, wall time lost, bytes per sync at each replica
# count, final val loss with and without the failure. TODAY=1 adds today's figure: the same job as one plain
# torchrun world (REPLICA_GROUPS replicas, no torchft, --checkpoint-every 50) with the same kill: the job ends;
# the table states when, and the steps lost since its last checkpoint. H=0 runs the per-step optimizers (a round
# per step: --optimizer dion or signmuon).
#
#   bash launch/torchft_local.sh                          # 3 groups × 1 rank, 300 steps, sign_mean, H = 10
#   REPLICA_GROUPS=3 RANKS=2 STEPS=100 bash launch/torchft_local.sh --tokenizer bpe
#   H=0 TODAY=1 CSV=results/torchft_perstep.csv bash launch/torchft_local.sh --tokenizer bpe \
#       --optimizer signmuon --nonmatrix-algorithm lion
#
# Environment: REPLICA_GROUPS (3), RANKS per group (1), STEPS (300), H (10; 0: per-step), EXCHANGE (sign_mean),
# MIN_REPLICAS (REPLICA_GROUPS − 1), KILL_GROUP (1), OUT (runs/torchft_local), BASELINE (1: also run without the
# failure), TODAY (0), CHECKPOINT_EVERY (50, the today run's), CSV (write the table's numbers to this CSV too),
# AT (the kill's step; default a random multiple of 10 from SEED), FAILURE (1; 0: only the other runs), SEED (random). Everything after the options goes to train.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -n "${VIRTUAL_ENV:-}" ] || source launch/env.sh
REPLICA_GROUPS=${REPLICA_GROUPS:-3} RANKS=${RANKS:-1} STEPS=${STEPS:-300} H=${H:-10} EXCHANGE=${EXCHANGE:-sign_mean}
MIN_REPLICAS=${MIN_REPLICAS:-$((REPLICA_GROUPS - 1))} KILL_GROUP=${KILL_GROUP:-1} OUT=${OUT:-runs/torchft_local}
BASELINE=${BASELINE:-1} FAILURE=${FAILURE:-1} TODAY=${TODAY:-0} CHECKPOINT_EVERY=${CHECKPOINT_EVERY:-50} CSV=${CSV:-}
RANDOM=${SEED:-$$}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1
LIGHTHOUSE_PORT=$((29500 + RANDOM % 400))
PIDS=()

tree() { local pid=$1 child; echo "$pid"; for child in $(pgrep -P "$pid"); do tree "$child"; done; }
kill_group() {   # SIGKILL a group: its torchrun and every process under it (workers run in sessions of their own)
    local pids; pids=$(tree "$1"); kill -STOP $pids 2>/dev/null || true; kill -9 $pids 2>/dev/null || true
}
cleanup() { for pid in "${PIDS[@]}"; do kill_group "$pid"; done; }
trap cleanup EXIT

start_group() {   # start_group RUN INDEX: one torchrun world in its own process group
    local run=$1 i=$2 dir="$OUT/$1/group$2"
    mkdir -p "$dir"
    torchrun --nnodes 1 --nproc_per_node "$RANKS" --master_port $((LIGHTHOUSE_PORT + 500 + 10 * i + ${3:-0})) \
        integrations/fsdp/train.py --fault-tolerant --replica-id "$i" --lighthouse "http://localhost:$LIGHTHOUSE_PORT" \
        --min-replicas "$MIN_REPLICAS" --replica-groups "$REPLICA_GROUPS" --shard "$RANKS" --local-steps "$H" \
        --outer-exchange "$EXCHANGE" --steps "$STEPS" --out-dir "$dir" --timeout 20 --quorum-timeout 120 "${EXTRA[@]}" >>"$dir/log.txt" 2>&1 &
    PIDS[$i]=$!
}

run_job() {   # run_job NAME KILL(0/1)
    local run=$1 kill=$2 started
    rm -rf "${OUT:?}/$run"; mkdir -p "$OUT/$run"
    torchft_lighthouse --min_replicas "$MIN_REPLICAS" --join_timeout_ms 5000 --bind "[::]:$LIGHTHOUSE_PORT" \
        >"$OUT/$run/lighthouse.txt" 2>&1 &
    local lighthouse=$!
    started=$(date +%s.%N)
    for ((i = 0; i < REPLICA_GROUPS; i++)); do start_group "$run" "$i"; done
    if [ "$kill" = 1 ]; then
        wait_for_step "$OUT/$run/group$KILL_GROUP/log.txt" "${PIDS[$KILL_GROUP]}"
        kill_group "${PIDS[$KILL_GROUP]}"
        echo "{\"killed_at_step\": $at, \"killed_at\": $(date +%s.%N), \"started\": $started}" >"$OUT/$run/kill.json"
        echo "killed group $KILL_GROUP at step $at; restarting it"
        sleep 2
        echo "{\"restarted_at\": $(date +%s.%N)}" >>"$OUT/$run/kill.json"
        start_group "$run" "$KILL_GROUP" 1
    fi
    for ((i = 0; i < REPLICA_GROUPS; i++)); do   # the others first: a restarted group that finds them done waits no more than 60 s
        [ "$i" = "$KILL_GROUP" ] || wait "${PIDS[$i]}" || echo "group $i exited with $?"
    done
    for ((t = 0; t < 300; t++)); do kill -0 "${PIDS[$KILL_GROUP]}" 2>/dev/null || break; sleep 0.2; done
    kill -0 "${PIDS[$KILL_GROUP]}" 2>/dev/null && kill_group "${PIDS[$KILL_GROUP]}" && echo "group $KILL_GROUP stopped: the others had finished" || true
    kill "$lighthouse" 2>/dev/null || true
}

wait_for_step() {   # wait_for_step LOG PID: until LOG shows step $at (or PID has ended)
    until grep -q "step $at/" "$1" 2>/dev/null; do
        kill -0 "$2" 2>/dev/null || { echo "ended before step $at"; break; }
        sleep 0.2
    done
}

run_today() {   # today's figure: one torchrun world of REPLICA_GROUPS replicas, the same kill at step $at
    local dir="$OUT/today" pid worker killed code=0
    rm -rf "$dir"; mkdir -p "$dir"
    torchrun --nnodes 1 --nproc_per_node $((REPLICA_GROUPS * RANKS)) --master_port $((LIGHTHOUSE_PORT + 490)) \
        integrations/fsdp/train.py --replicate "$REPLICA_GROUPS" --shard "$RANKS" --local-steps "$H" \
        --outer-exchange "$EXCHANGE" --steps "$STEPS" --out-dir "$dir" --timeout 20 \
        --checkpoint-every "$CHECKPOINT_EVERY" "${EXTRA[@]}" >"$dir/log.txt" 2>&1 &
    pid=$!
    wait_for_step "$dir/log.txt" "$pid"
    worker=$(pgrep -P "$pid" | sort -n | sed -n "$((KILL_GROUP * RANKS + 1))p")
    kill -9 "$worker"; killed=$(date +%s.%N)
    wait "$pid" || code=$?
    echo "{\"killed_at_step\": $at, \"job_exit_code\": $code, \"job_ended_after_s\": $(python -c "print(round($(date +%s.%N) - $killed, 1))"), \
\"last_checkpoint_step\": $(ls "$dir/checkpoints" 2>/dev/null | sed -n 's/^step_0*\([0-9]\+\)$/\1/p' | sort -n | tail -1 | grep . || echo 0), \
\"checkpoint_every\": $CHECKPOINT_EVERY}" >"$dir/today.json"
    echo "today: killed replica $KILL_GROUP's worker at step $at; the job ended with exit code $code"
}

EXTRA=("$@")
at=$(( (RANDOM % (STEPS / 20 > 0 ? STEPS / 20 : 1) + 1) * 10 )); at=${AT:-$at}
[ "$FAILURE" = 1 ] && run_job failure 1
[ "$BASELINE" = 1 ] && run_job baseline 0
[ "$TODAY" = 1 ] && run_today
[ -d "$OUT/failure" ] && python launch/torchft_table.py "$OUT" --groups "$REPLICA_GROUPS" --kill-group "$KILL_GROUP" ${CSV:+--csv "$CSV"} | tee "$OUT/table.md"
