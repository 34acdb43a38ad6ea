"""Bytes this node has sent on its network links so far, read from the kernel's interface counters.

    link_tx_bytes() = Σ tx_bytes over the interfaces of /proc/net/dev except loopback

/proc/net/dev belongs to the reading process's network namespace, so inside one of the emulated nodes
of launch/netns/twonode.sh it is that node's end of the rate-limited link (every rank of the node
together); on a real node it is every link of the machine, whatever sends on it. The training scripts
log it with each metrics row (column `link_tx_bytes`), so that a benchmark can take the wire bytes of
the steady training steps and leave out the start-up (model broadcast, rendezvous).
"""

from __future__ import annotations

from pathlib import Path

PROC_NET_DEV = Path("/proc/net/dev")


def interface_tx_bytes(proc_net_dev: Path = PROC_NET_DEV) -> dict[str, int] | None:
    """{interface: tx_bytes} of this network namespace; None where the file does not exist (not Linux)."""
    if not proc_net_dev.exists():
        return None
    counters = {}
    for line in proc_net_dev.read_text().splitlines()[2:]:     # two header lines
        name, _, fields = line.partition(":")
        counters[name.strip()] = int(fields.split()[8])        # 8 receive fields, then tx_bytes
    return counters


def link_tx_bytes(proc_net_dev: Path = PROC_NET_DEV) -> int | None:
    """Σ tx_bytes over the non-loopback interfaces; None where the file does not exist (not Linux)."""
    counters = interface_tx_bytes(proc_net_dev)
    return None if counters is None else sum(sent for name, sent in counters.items() if name != "lo")
