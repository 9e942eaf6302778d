"""A throwaway shaped network for benchmarks: N namespaces on a bridge, tbf on every link.

Topology: namespace ``<prefix>hub`` holds bridge ``br0``; node ``i`` lives in namespace
``<prefix><i>`` with interface ``ijn`` = ``10.77.0.<i+1>/24``, a veth whose other end is
a bridge port in the hub. Both ends get ``tc qdisc tbf rate <mbit>`` so each node has
``mbit`` up and ``mbit`` down, like a real NIC. Needs root; only touches namespaces and
addresses it creates, and :meth:`ShapedNet.close` deletes them all (also used on Ctrl-C).
"""

from __future__ import annotations

import os
import shutil
import subprocess

IFNAME = "ijn"
SUBNET = "10.77.0"


def require_root() -> str | None:
    """None if shaping is possible here, else the reason it is not."""
    if os.geteuid() != 0:
        return "--shape-mbit needs root (network namespaces, veth, tc); run as root or drop --shape-mbit"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"--shape-mbit needs the '{tool}' tool (iproute2)"
    return None


def _run(*cmd: str) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip()}")


class ShapedNet:
    """Create with :meth:`up`; always :meth:`close` (use as a context manager)."""

    def __init__(self, nodes: int, mbit: float, prefix: str | None = None) -> None:
        self.nodes, self.mbit = nodes, mbit
        self.prefix = prefix or f"ijb{os.getpid() % 100000}_"
        self.created: list[str] = []

    def ns(self, i: int) -> str:
        """Namespace of node ``i``."""
        return f"{self.prefix}{i}"

    def addr(self, i: int) -> str:
        """IP address of node ``i``."""
        return f"{SUBNET}.{i + 1}"

    def exec_prefix(self, i: int) -> list[str]:
        """Command prefix that runs a program inside node ``i``'s namespace."""
        return ["ip", "netns", "exec", self.ns(i)]

    def up(self) -> ShapedNet:
        """Build the topology (rolls back on error)."""
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        hub = f"{self.prefix}hub"
        rate = f"{self.mbit}mbit"
        # 4 ms of line rate (>= 256 KiB): a smaller bucket starves on coarse VM timers
        burst = str(max(256 * 1024, int(self.mbit * 1e6 / 8 * 0.004)))
        _run("ip", "netns", "add", hub)
        self.created.append(hub)
        _run("ip", "-n", hub, "link", "set", "lo", "up")
        _run("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", hub, "link", "set", "br0", "up")
        for i in range(self.nodes):
            ns, port = self.ns(i), f"p{i}"
            _run("ip", "netns", "add", ns)
            self.created.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "link", "add", IFNAME, "type", "veth", "peer", "name", port, "netns", hub)
            _run("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", IFNAME)
            _run("ip", "-n", ns, "link", "set", IFNAME, "up")
            _run("ip", "-n", hub, "link", "set", port, "master", "br0")
            _run("ip", "-n", hub, "link", "set", port, "up")
            for where, dev in ((ns, IFNAME), (hub, port)):
                _run("tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                     "burst", burst, "latency", "50ms")

    def steer_receive(self, i: int, peer: int, cpu: int) -> None:
        """Process the packets that ``peer`` sends to node ``i`` on CPU ``cpu`` (RPS on the
        bridge port where they enter and on node ``i``'s interface), as if node ``i`` were its
        own machine: otherwise the sender's core runs the receiver's stack in its softirq."""
        mask = format(1 << cpu, "x")
        hub = f"{self.prefix}hub"
        for ns, dev in ((hub, f"p{peer}"), (self.ns(i), IFNAME)):
            _run("ip", "netns", "exec", ns, "sh", "-c", f"echo {mask} > /sys/class/net/{dev}/queues/rx-0/rps_cpus")

    def close(self) -> None:
        """Delete every namespace this object created (their veths and bridge go with them)."""
        while self.created:
            ns = self.created.pop()
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def __enter__(self) -> ShapedNet:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.close()
