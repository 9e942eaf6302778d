"""Live recovery: a donor streams its `DilocoState` to a joiner over the authenticated socket
layer, in the background, while it keeps training.

No disk and no orbax on the donor: the snapshot (host numpy, taken at the boundary) goes out
leaf by leaf in `DilocoState.arrays()` order as one array list (:mod:`intellect_jax.net.arrays`:
a header with the meta, every leaf's path, dtype and shape, then one blob per leaf, each frame
MAC-checked and each blob checked end to end),
so the donor's own periodic checkpoint (its one orbax path) can never collide with it. The
joiner parses the header (:class:`StateHeader`) and receives every leaf straight into its final
numpy buffer; the outer loop then checks what it got (:func:`vet_received`: the hash the run
recorded, finite outer state, inner moments an honest AdamW can hold), writes the state as the
joiner's own checkpoint and restores it from there with orbax (the same path a resume
takes). A joiner polls ``cancelled`` while it waits and while it receives, so a donor that died
or was evicted frees it within a heartbeat; a donor polls its own ``cancelled`` likewise (the
coordinator no longer admits that joiner: it left, was evicted, was re-queued to another donor,
or the run is complete), so it never keeps dialling a joiner that is gone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Any

import jax
import numpy as np
from pydantic import Field

from intellect_jax.coordinator.clock import REAL, Clock, abort_when
from intellect_jax.diloco.parts import TransferFailed
from intellect_jax.coordinator.protocol import Admission
from intellect_jax.diloco.state import DilocoState, state_hash
from intellect_jax.net.arrays import MAX_ARRAYS, ArrayHeader, recv_array_data, recv_array_head, send_arrays, spec
from intellect_jax.net.comm import NetNode
from intellect_jax.net.errors import ConfigMismatch, FrameError, PeerTimeout
from intellect_jax.net.schema import Finite, Nat, Wire, parse, recv_model
from intellect_jax.net.transport import send_msg

MAX_NORMS = 1024  # recent average norms in a state (GuardConfig.history, 8 by default)


class StateMeta(Wire):
    """The donor's word on the state it sends (what the hash covers besides the arrays, and the
    inner step); the joiner checks it against its admission and the hash the run recorded."""

    outer_step: Nat
    inner_step: Nat
    hash: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]  # state.state_hash: blake2b-128, hex
    norms: Annotated[list[Finite], Field(max_length=MAX_NORMS)] = []
    skipped: bool | None = None  # whether the state's last average was skipped (hashed, as the norms)

    @classmethod
    def of(cls, meta: StateMeta | dict[str, Any], who: str) -> StateMeta:
        """``meta`` from any transport, parsed unless it already was (:class:`FrameError` otherwise)."""
        return meta if isinstance(meta, StateMeta) else parse(cls, meta, who, "state header")


class StateHeader(StateMeta, ArrayHeader):
    """The array-list header of a transfer: the meta, then every leaf's path, dtype and shape."""

    paths: Annotated[list[Annotated[str, Field(max_length=1024)]], Field(max_length=MAX_ARRAYS)]


class Receipt(Wire):
    """The joiner's answer once every array arrived."""

    ok: bool


def channel(joiner_id: str, outer_step: int) -> str:
    return f"state/{joiner_id}/{outer_step}"


def leaf_paths(tree: Any) -> list[str]:
    """The leaves' paths, so that a state of another structure is refused even if its shapes match."""
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


class NetTransport:
    """State transfer between nodes' :class:`~intellect_jax.net.comm.NetNode` endpoints."""

    def __init__(self, net: NetNode, node_id: str, *, clock: Clock = REAL, log: Callable[[str], None] = print,
                 watch_interval: float = 1.0, chunk_bytes: int = 8 << 20, serve_timeout: float = 600.0) -> None:
        """``serve_timeout``: how long a donor's transfer may take (``diloco.transfer_timeout``)."""
        self.net, self.node_id, self.clock, self.log = net, node_id, clock, log
        self.watch_interval, self.chunk_bytes, self.serve_timeout = watch_interval, chunk_bytes, serve_timeout
        self.last: dict[str, Any] = {}  # stats of the last transfer (bytes, seconds)

    def serve(self, joiner_id: str, joiner_addr: str, snapshot: DilocoState, meta: dict[str, Any],
              cancelled: Callable[[], bool] = lambda: False, timeout: float | None = None) -> Any:
        """Stream ``snapshot`` to a joiner from a background thread; returns an event set when done
        (sent, failed, or ``cancelled()``); ``timeout``: the transport's ``serve_timeout`` unless given."""
        done = self.clock.Event()
        timeout = self.serve_timeout if timeout is None else timeout

        def run() -> None:
            t0, wall = time.monotonic(), time.time()
            try:
                n = self.send(joiner_addr, joiner_id, snapshot, meta, timeout, cancelled)
                dt = time.monotonic() - t0
                self.log(f"served {joiner_id}: {n / 2**20:.1f} MiB in {dt:.1f}s "
                         f"(wall {wall:.3f} -> {time.time():.3f})")
            except Exception as e:  # noqa: BLE001 - the joiner died or stalled: it gets re-queued
                if cancelled():
                    self.log(f"stopped serving {joiner_id} after {time.monotonic() - t0:.1f}s: the coordinator no "
                             f"longer admits it ({e})")
                else:
                    self.log(f"serving {joiner_id} failed: {e}")
            finally:
                done.set()

        self.clock.spawn(run, name=f"serve-{joiner_id}")
        return done

    def _dial(self, joiner_addr: str, joiner_id: str, outer_step: int, deadline: float,
              cancelled: Callable[[], bool]) -> Any:
        """Connect to the joiner, in slices of ``watch_interval``, until ``deadline`` or ``cancelled()``."""
        while True:
            if cancelled():
                raise TransferFailed(f"joiner {joiner_id} is no longer admitted")
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerTimeout(f"joiner {joiner_id} could not be reached before the transfer deadline")
            try:
                return self.net.connect(joiner_addr, channel(joiner_id, outer_step), expect=joiner_id,
                                        timeout=min(left, max(self.watch_interval, 0.05)), name=f"joiner {joiner_id}")
            except PeerTimeout:
                continue

    def send(self, joiner_addr: str, joiner_id: str, snapshot: DilocoState, meta: dict[str, Any],
             timeout: float, cancelled: Callable[[], bool] = lambda: False) -> int:
        arrays = snapshot.arrays()
        deadline = time.monotonic() + timeout
        cpu0 = time.thread_time()
        conn = self._dial(joiner_addr, joiner_id, meta["outer_step"], deadline, cancelled)
        with conn, abort_when(self.clock, cancelled, conn.abort, self.watch_interval):
            sent = send_arrays(conn, jax.tree.leaves(arrays), {**meta, "paths": leaf_paths(arrays)},
                               deadline=deadline, chunk_bytes=self.chunk_bytes)
            if not recv_model(conn, Receipt, "receipt", deadline, max_len=1 << 12).ok:
                raise FrameError(f"joiner {joiner_id} did not take the state")
        self.last = {"bytes": sent, "seconds": time.monotonic() - (deadline - timeout),
                     "cpu_s": time.thread_time() - cpu0}  # this thread's CPU time (hashing, syscalls)
        return sent

    def receive(self, adm: Admission, template: DilocoState, cancelled: Callable[[], bool],
                timeout: float) -> tuple[StateHeader, DilocoState]:
        """Wait for the donor (giving up when ``cancelled()``), receive and return (header, state).
        A header that does not parse, or is for another outer step, fails before any array is read."""
        clock = self.clock
        deadline = clock.now() + timeout
        while True:
            if cancelled():
                raise TransferFailed(f"admission of outer step {adm.outer_step} from {adm.donor_id} revoked "
                                     "(donor gone, or re-queued)")
            try:
                conn = self.net.accept(channel(self.node_id, adm.outer_step), peer=adm.donor_id,
                                       timeout=max(0.01, min(self.watch_interval, deadline - clock.now())),
                                       name=f"donor {adm.donor_id}")
                break
            except PeerTimeout:
                if clock.now() >= deadline:
                    raise TransferFailed(f"donor {adm.donor_id} did not connect within {timeout:.0f}s") from None
        t0 = time.monotonic()  # the transfer itself, from the donor's connection
        arrays = template.arrays()
        treedef = jax.tree.structure(arrays)
        like = [spec(x) for x in jax.tree.leaves(arrays)]
        with conn, abort_when(clock, cancelled, conn.abort, self.watch_interval):
            end = time.monotonic() + timeout
            try:
                head, specs = recv_array_head(conn, StateHeader, like=like, deadline=end, what="state header")
            except ConfigMismatch as e:
                raise TransferFailed(f"donor {adm.donor_id} sent a state of another shape ({e})") from None
            if head.paths != leaf_paths(arrays):
                raise TransferFailed(f"donor {adm.donor_id} sent a state of another shape (other leaf paths)")
            if head.outer_step != adm.outer_step:
                raise TransferFailed(f"donor {adm.donor_id} sent the state of outer step {head.outer_step}, "
                                     f"not {adm.outer_step}")
            bufs = recv_array_data(conn, specs, deadline=end)
            send_msg(conn, Receipt(ok=True).model_dump(), end)
        self.last = {"bytes": sum(b.nbytes for b in bufs), "seconds": time.monotonic() - t0}
        return head, template.with_arrays(jax.tree.unflatten(treedef, bufs))


def vet_received(adm: Admission, meta: StateMeta | dict[str, Any], got: DilocoState, inner_steps: int,
                 vet_opt_state: Callable[[Any], str | None]) -> tuple[DilocoState, str]:
    """``got`` with the donor's counters, norms and verdict, and its hash, if it is the state ``adm`` admits:
    a header that parses, for the outer step admitted and its inner step (``inner_steps`` per
    outer step), the hash the run recorded for that step (the header's own only while the run has
    none: then the joiner's first barrier checks it), finite outer params and momentum, and an
    inner optimizer state (which no hash covers) that ``vet_opt_state`` accepts: the trainer's
    own check (:func:`~intellect_jax.trainer.optim.adam_envelope`). Else :class:`TransferFailed`
    naming the donor (the joiner asks again)."""
    donor, k = f"donor {adm.donor_id}", adm.outer_step
    try:
        meta = StateMeta.of(meta, donor)
    except FrameError as e:
        raise TransferFailed(str(e)) from None
    if meta.outer_step != k or meta.inner_step != k * inner_steps:
        raise TransferFailed(f"{donor} sent outer step {meta.outer_step} at inner step {meta.inner_step}; "
                             f"admitted for outer step {k}, i.e. inner step {k * inner_steps}")
    got = got._replace(outer_step=k, inner_step=meta.inner_step, data=None, norms=tuple(meta.norms), residual=None,
                       skipped=meta.skipped)
    h, want = state_hash(got), adm.state_hash or meta.hash
    if h != want:
        whose = "the run recorded" if adm.state_hash else "its header says"
        raise TransferFailed(f"{donor} sent a state of outer step {k} that hashes to {h[:12]}; {whose} {want[:12]}")
    bad = [name for name, tree in (("outer params", got.outer_params), ("outer momentum", got.outer_opt_state))
           if not all(np.isfinite(x).all() for x in jax.tree.leaves(tree))]
    why = f"non-finite {bad[0]}" if bad else vet_opt_state(got.inner_opt_state)
    if why:
        raise TransferFailed(f"{donor} sent the state of outer step {k} with {why}")
    return got, h
