"""Run ring ranks as separate processes with fault injection (for tests and demos).

``run_ring_processes(world, fault=...)`` spawns ``world`` processes on 127.0.0.1 (OS
assigned ports), each all-reducing its own deterministic vector, and returns one report
per rank. A fault makes one rank SIGKILL itself, SIGSTOP itself, or write garbage into
its outgoing connection after it has received ``after`` data frames, i.e. mid-reduction.
With ``retry=True`` the survivors then build a new ring (epoch 1) without the victim.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Fault:
    """What the victim does after receiving ``after`` data frames."""

    rank: int
    kind: str  # "kill" | "stop" | "garbage"
    after: int = 20


def rank_data(rank: int, numel: int) -> np.ndarray:
    """Deterministic input of one rank."""
    return np.random.default_rng(100 + rank).standard_normal(numel).astype(np.float32)


def _install_fault(fault: Fault) -> None:
    from intellect_jax.net import NetError, transport
    from intellect_jax.net.frames import MsgType

    orig_recv = transport.Connection.recv_payload_into
    seen = [0]

    def recv_payload_into(self, hdr, out, *, deadline=None):  # noqa: ANN001, ANN202
        orig_recv(self, hdr, out, deadline=deadline)
        if hdr.mtype == MsgType.DATA:
            seen[0] += 1
            if seen[0] == fault.after:
                if fault.kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif fault.kind == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)

    orig_send = transport.Connection.send

    def send(self, mtype, payload=b"", *, deadline=None, ptag=None):  # noqa: ANN001, ANN202
        if fault.kind == "garbage" and mtype == MsgType.DATA and seen[0] >= fault.after:
            garbage = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
            try:  # (through the connection's own send loop: its TLS socket does not block)
                self._send_views([memoryview(garbage)], time.monotonic() + 5.0, "sending garbage")
            except (OSError, NetError):  # the successor hung up mid-garbage (it saw enough): the same fault
                pass
            time.sleep(1.0)  # let the successor read the garbage before our sockets close
            raise RuntimeError("fault injection: wrote garbage instead of a frame")
        return orig_send(self, mtype, payload, deadline=deadline, ptag=ptag)

    transport.Connection.recv_payload_into = recv_payload_into  # type: ignore[method-assign]
    transport.Connection.send = send  # type: ignore[method-assign]


def _rank_main(rank: int, world: int, numel: int, ring_kw: dict[str, Any], io_timeout: float,
               fault: Fault | None, ports_q: Any, peers_rx: Any, results_q: Any) -> None:
    from intellect_jax.net import NetError, NetNode, RingConfig
    from intellect_jax.testing.identities import transport_config

    cfg = transport_config(f"rank{rank}", io_timeout=io_timeout, connect_timeout=10)
    node = NetNode(cfg, "127.0.0.1", 0)
    ports_q.put((rank, node.address[1]))
    x = rank_data(rank, numel)
    before = x.copy()
    if fault is not None and fault.rank == rank:
        _install_fault(fault)
    epoch = 0
    while True:
        msg = peers_rx.recv()
        if msg is None:
            break
        ports, my_rank = msg
        ring = node.ring([(f"rank{r}", ("127.0.0.1", p)) for r, p in ports], my_rank, epoch=epoch,
                         config=RingConfig(**ring_kw))
        t0 = time.monotonic()
        report: dict[str, Any] = {"rank": rank, "epoch": epoch}
        try:
            y = ring.all_reduce_mean(x)
            report.update(status="ok", digest=hashlib.sha256(y.tobytes()).hexdigest())
        except (NetError, RuntimeError) as e:
            report.update(status="error", error=type(e).__name__, message=str(e))
        report.update(elapsed=time.monotonic() - t0, input_unchanged=bool(np.array_equal(x, before)))
        ring.close()
        results_q.put(report)
        epoch += 1
    node.close()


def run_ring_processes(world: int, *, numel: int = 1 << 21, fault: Fault | None = None, retry: bool = False,
                       io_timeout: float = 3.0, timeout: float = 60.0, **ring_kw: Any) -> list[dict[str, Any]]:
    """Spawn ``world`` ranks, run one all-reduce (and a retry without the victim); return reports."""
    from intellect_jax.testing.identities import credentials

    for r in range(world):  # issued here, once: the children (spawned) find them in $INTELLECT_TEST_KEYS
        credentials(f"rank{r}")
    ctx = mp.get_context("spawn")
    ports_q, results_q = ctx.Queue(), ctx.Queue()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    ring_kw.setdefault("piece_numel", 1 << 14)
    ring_kw.setdefault("deadline", 10.0)
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, world, numel, ring_kw, io_timeout, fault, ports_q, pipes[r][0], results_q))
             for r in range(world)]
    for p in procs:
        p.start()
    reports: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    try:
        ports = dict(ports_q.get(timeout=timeout) for _ in range(world))
        order = [(r, ports[r]) for r in range(world)]
        for r in range(world):
            pipes[r][1].send((order, r))
        survivors = [r for r in range(world) if fault is None or fault.kind == "garbage" or r != fault.rank]
        expected = len(survivors) if fault is not None and fault.kind != "garbage" else world
        while len(reports) < expected and time.monotonic() < deadline:
            try:
                reports.append(results_q.get(timeout=max(0.1, deadline - time.monotonic())))
            except Exception:  # noqa: BLE001 - queue.Empty: give up waiting
                break
        if fault is not None and fault.kind in ("kill", "stop"):
            procs[fault.rank].kill()  # a stopped victim would otherwise linger
        if retry and fault is not None:
            alive = [r for r in range(world) if r != fault.rank]
            if fault.kind == "garbage":  # the victim also reported; it sits out the retry
                pipes[fault.rank][1].send(None)
            for i, r in enumerate(alive):
                pipes[r][1].send(([(a, ports[a]) for a in alive], i))
            for _ in alive:
                reports.append(results_q.get(timeout=max(0.1, deadline - time.monotonic())))
        for r in range(world):
            try:
                pipes[r][1].send(None)
            except (BrokenPipeError, OSError):
                pass
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return reports
