#!/usr/bin/env bash
# Fault-tolerant local-steps training on one machine (docs/design.md §13): a torchft lighthouse and REPLICA_GROUPS
# replica groups (each its own torchrun world running integrations/fsdp/train.py --fault-tolerant). One group
# is SIGKILLed at a random logged step and restarted; it heals from a live group and finishes the same
# --steps. Then the same job runs without a failure, and launch/torchft_table.py prints the table:
# replicas alive over time, rounds committed / discarded, wall time lost, bytes per sync at each replica
# count, final val loss with and without the failure.
#
#   bash launch/torchft_local.sh                          # 3 groups × 1 rank, 300 steps, sign_mean, H = 10
#   REPLICA_GROUPS=3 RANKS=2 STEPS=100 bash launch/torchft_local.sh --tokenizer bpe
#
# Environment: REPLICA_GROUPS (3), RANKS per group (1), STEPS (300), H (10), EXCHANGE (sign_mean), MIN_REPLICAS
# (REPLICA_GROUPS − 1), KILL_GROUP (1), OUT (runs/torchft_local), BASELINE (1: also run without the failure), SEED (random).
# Everything after the options goes to train.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -n "${VIRTUAL_ENV:-}" ] || source launch/env.sh
REPLICA_GROUPS=${REPLICA_GROUPS:-3} RANKS=${RANKS:-1} STEPS=${STEPS:-300} H=${H:-10} EXCHANGE=${EXCHANGE:-sign_mean}
MIN_REPLICAS=${MIN_REPLICAS:-$((REPLICA_GROUPS - 1))} KILL_GROUP=${KILL_GROUP:-1} OUT=${OUT:-runs/torchft_local}
BASELINE=${BASELINE:-1}
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
        --min-replicas "$MIN_REPLICAS" --replica-groups "$REPLICA_GROUPS" --local-steps "$H" --outer-exchange "$EXCHANGE" \
        --steps "$STEPS" --out-dir "$dir" --timeout 20 --quorum-timeout 120 "${EXTRA[@]}" >>"$dir/log.txt" 2>&1 &
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
        local at=$(( (RANDOM % (STEPS / 20 > 0 ? STEPS / 20 : 1) + 1) * 10 )) log="$OUT/$run/group$KILL_GROUP/log.txt"
        until grep -q "step $at/" "$log" 2>/dev/null; do
            kill -0 "${PIDS[$KILL_GROUP]}" 2>/dev/null || { echo "group $KILL_GROUP ended before step $at"; break; }
            sleep 0.2
        done
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

EXTRA=("$@")
run_job failure 1
[ "$BASELINE" = 1 ] && run_job baseline 0
python launch/torchft_table.py "$OUT" --groups "$REPLICA_GROUPS" --kill-group "$KILL_GROUP" | tee "$OUT/table.md"
