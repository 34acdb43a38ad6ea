#!/usr/bin/env bash
# Two "nodes" on one Linux machine: two network namespaces joined by a veth pair whose link is
# rate-limited with tc tbf, so that multi-node launches (torchrun, SLURM) and the bytes that really
# cross the link can be tested without a second machine. Needs root and iproute2.
#
#   launch/netns/twonode.sh up [RATE]        create node 1 and node 2 (RATE: tc rate, default 100mbit)
#   launch/netns/twonode.sh node N CMD...    run CMD "on node N" (see below)
#   launch/netns/twonode.sh bytes N          "TX_BYTES RX_BYTES" of node N's end of the link
#   launch/netns/twonode.sh down             kill what still runs in the two namespaces (by PID), delete them
#
#   node N        network namespace  address       interface   hostname (under `node`)
#   1             ${PREFIX}1         10.77.0.1/24  so0         ${PREFIX}1
#   2             ${PREFIX}2         10.77.0.2/24  so0         ${PREFIX}2
#
# The addresses exist only inside the two namespaces; the host's own network is not touched.
# `node N CMD` enters node N's network namespace plus a private UTS and mount namespace in which
# the hostname is ${PREFIX}N and /etc/hosts (bind-mounted) maps both hostnames to their addresses:
# what a daemon such as slurmd needs (it cannot run under `ip netns exec`, which remounts /sys).
# For a plain command that shares the host's hostname, `ip netns exec ${PREFIX}N CMD` works too.
#
# Environment: NETNS_PREFIX (default "sonode"): names of the namespaces and hostnames; use a
# different one for each concurrent user. NETNS_STATE (default /run/shardopt-netns): where the
# hosts file lives.
set -euo pipefail

PREFIX="${NETNS_PREFIX:-sonode}"
STATE="${NETNS_STATE:-/run/shardopt-netns}/$PREFIX"
IFACE=so0
address() { echo "10.77.0.$1"; }

# tc rate (e.g. 10mbit, 1gbit, 500kbit) → the token bucket's size in bytes: max(rate × 4 ms, 16 KiB)
burst_bytes() {
    local number="${1%%[a-z]*}" unit="${1##*[0-9.]}" scale
    case "$unit" in
        kbit) scale=1000 ;; mbit) scale=1000000 ;; gbit) scale=1000000000 ;;
        *) echo "twonode: rate '$1': give a number and kbit, mbit or gbit (e.g. 100mbit)" >&2; exit 1 ;;
    esac
    awk -v n="$number" -v s="$scale" 'BEGIN { b = n * s / 8 * 0.004; printf "%d\n", (b > 16384 ? b : 16384) }'
}

up() {
    local rate="${1:-100mbit}" n
    for n in 1 2; do
        if ip netns list | grep -qw "$PREFIX$n"; then
            echo "twonode: namespace $PREFIX$n exists already; run '$0 down' (NETNS_PREFIX=$PREFIX) first" >&2
            exit 1
        fi
    done
    ip netns add "${PREFIX}1"
    ip netns add "${PREFIX}2"
    ip link add "$IFACE" netns "${PREFIX}1" type veth peer name "$IFACE" netns "${PREFIX}2"
    mkdir -p "$STATE"
    printf '127.0.0.1 localhost\n%s %s1\n%s %s2\n' "$(address 1)" "$PREFIX" "$(address 2)" "$PREFIX" > "$STATE/hosts"
    for n in 1 2; do
        ip -n "$PREFIX$n" link set lo up
        ip -n "$PREFIX$n" addr add "$(address "$n")/24" dev "$IFACE"
        ip -n "$PREFIX$n" link set "$IFACE" up
        # Token bucket: RATE sustained, a bucket of burst_bytes(RATE) = 4 ms of RATE (at least 16 KiB).
        # It must not be much larger: an idle link refills the bucket, and its bytes then leave at
        # memory speed, so a bucket of B bytes hides up to B bytes a step of a method that sends
        # little between its computations (a fixed 256 KiB did: at 10 Mbit/s that is 210 ms of line
        # time, all of a 1-bit vote's). Measured TCP payload of one transfer: 9.6 Mbit/s at
        # 10mbit (5 MB), 95.7 at 100mbit and 966 at 1gbit (50 MB).
        ip netns exec "$PREFIX$n" tc qdisc add dev "$IFACE" root tbf rate "$rate" burst "$(burst_bytes "$rate")" latency 50ms
    done
    echo "twonode: ${PREFIX}1 $(address 1) <-> ${PREFIX}2 $(address 2) over $IFACE at $rate"
}

node() {
    local n="$1"; shift
    [ -f "$STATE/hosts" ] || { echo "twonode: no $STATE/hosts; run '$0 up' first" >&2; exit 1; }
    # exec all the way down, so that the PID of this script is the PID of CMD
    # shellcheck disable=SC2016
    exec nsenter --net="/run/netns/$PREFIX$n" unshare --uts --mount --propagation private \
        bash -c 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"' \
        node "$PREFIX$n" "$STATE/hosts" "$@"
}

bytes() {
    # /proc/net/dev: "so0: rx_bytes rx_packets ... (8 rx fields) tx_bytes ..."
    # shellcheck disable=SC2016
    ip netns exec "$PREFIX$1" awk -v dev="$IFACE:" '$1 == dev { print $10, $2 }' /proc/net/dev
}

down() {
    local n pids
    for n in 1 2; do
        ip netns list | grep -qw "$PREFIX$n" || continue
        # every process in the namespace was started into it by us (it has no other way in)
        pids=$(ip netns pids "$PREFIX$n" || true)
        if [ -n "$pids" ]; then
            # shellcheck disable=SC2086
            kill -TERM $pids 2>/dev/null || true
            sleep 1
            pids=$(ip netns pids "$PREFIX$n" || true)
            # shellcheck disable=SC2086
            [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
        fi
        ip netns del "$PREFIX$n"   # deletes its end of the veth pair, and with it the other end
    done
    rm -rf "$STATE"
}

command="${1:-}"
shift || true
case "$command" in
    up|node|bytes|down) "$command" "$@" ;;
    *) sed -n '2,/^set -euo/p' "$0" | sed '$d' >&2; exit 2 ;;
esac
