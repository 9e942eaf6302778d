"""Node-side client of the coordinator (see ``docs/coordinator.md``).

Typical outer loop (``k`` = completed outer steps)::

    client = CoordinatorClient(addr, transport_cfg, "node-a", "10.0.0.5:7000", devices=8, fingerprint=fp)
    reply = client.register(claim)            # claim: the state this node holds (Resume), if any
    if not reply.member:                      # joiner: wait for a boundary, fetch the state
        adm = client.wait_admission()         # donor + outer step of the state to fetch
        ...receive the state from adm.donor_addr...; client.state_received(adm.outer_step)
    while training:
        ...H inner steps...
        epoch = client.sync(k, state_hash=h)  # barrier; the ring for outer step k+1
        ...all-reduce over epoch.members (on NetError: epoch = client.sync(k, h, retry_of=epoch.epoch_id))...
        ...outer step; client.hold(k + 1, new_hash); stream the state to each joiner in epoch.serve...
    client.leave()

A background thread heartbeats over the session connection; each reply carries the node's
``view`` (its role, its admission, whether the newest epoch's ring is still whole). If the
coordinator goes away, the client reconnects with backoff for up to ``reconnect_timeout`` and
registers again with the state it holds; an in-flight request is then re-issued transparently.
How requests travel is the ``wire``'s business: :class:`SocketWire` (authenticated TCP) or the
in-process :class:`~.service.LocalWire`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any, Self

from intellect_jax.coordinator.clock import REAL, Clock
from intellect_jax.coordinator.protocol import (PROTOCOL, Admission, CoordinatorError, CoordinatorUnavailable,
                                                DataPlan, Epoch, Evicted, ProtocolError, Record, RegisterReply,
                                                RegistrationRefused, Resume, RunCompleted, StaleSession)
from intellect_jax.coordinator.schema import (AdmissionOk, EpochOk, LeaseOk, Ok, ReceivedOk, RegisterOk, StatusOk,
                                              ViewOk, parse_reply)
from intellect_jax.coordinator.wire import TRANSIENT, SocketWire, Wire, coordinator_status, reply_error
from intellect_jax.net import Address, AuthError, PeerTimeout, TransportConfig
from intellect_jax.net.identity import IdentityError, vote

__all__ = ["Admission", "CoordinatorClient", "CoordinatorError", "CoordinatorUnavailable", "Epoch", "Evicted",
           "ProtocolError", "RegisterReply", "RegistrationRefused", "RunCompleted", "SocketWire",
           "coordinator_status"]

log = logging.getLogger("intellect_jax.coordinator.client")


class CoordinatorClient:
    """One node's membership in the run: register, heartbeat, sync at boundaries, leave."""

    def __init__(self, address: Address | str | None, transport_cfg: TransportConfig | None, node_id: str,
                 ring_addr: str, devices: int = 1, fingerprint: str = "", protocol: int = PROTOCOL, *,
                 heartbeat_interval: float = 1.0, reconnect_timeout: float = 60.0,
                 connect_timeout: float = 10.0, io_timeout: float = 10.0, outer_steps: int | None = None,
                 register_timeout: float = 600.0, wire: Wire | None = None, clock: Clock = REAL,
                 say: Callable[[str], None] | None = None, data: DataPlan | None = None) -> None:
        if wire is None:
            assert address is not None and transport_cfg is not None
            # coordinator replies (and its keepalives) come within ~1 s: a silent peer is a dead one
            wire = SocketWire(address, replace(transport_cfg, io_timeout=min(transport_cfg.io_timeout, io_timeout)))
        self.wire, self.clock = wire, clock
        self._signer = transport_cfg  # signs the state hash of each sync (None: an in-process wire)
        self.node_id, self.ring_addr, self.devices = node_id, ring_addr, devices
        self.fingerprint, self.protocol, self.outer_steps = fingerprint, protocol, outer_steps
        self.data = data  # how the node reads its data (the coordinator checks it against the run's)
        self.heartbeat_interval, self.reconnect_timeout = heartbeat_interval, reconnect_timeout
        self.connect_timeout, self.register_timeout = connect_timeout, register_timeout
        self._say = say or log.warning
        self._name = wire.name
        self._lock = clock.Lock()  # client state below
        self._io_lock = clock.Lock()  # session connection I/O
        self._recover_lock = clock.Lock()
        self._conn: Any = None
        self._session: str | None = None
        self._gen = 0  # session generation (bumped by every registration)
        self._fatal: CoordinatorError | None = None
        self._seen_run = False  # this node has seen the run started (so it never founds it)
        self._has_state = False  # a member (holds the run's state)
        self._claim: Resume | None = None  # the state this node holds, claimed on re-registration
        self._record: Record | None = None  # the newest barrier record the coordinator signed for us (.claims)
        self._reply: RegisterReply | None = None
        self._view: dict[str, Any] = {}
        self._view_seq = 0  # heartbeat replies received
        self._members: tuple[str, ...] = ()  # of the newest epoch this node was in
        self._epoch = self._rank = 0
        self._closed = False
        self._stop = clock.Event()
        self._hb: Any = None

    # ---- state ---------------------------------------------------------------------------
    @property
    def registered(self) -> bool:
        return self._session is not None and self._fatal is None

    @property
    def member(self) -> bool:
        """Holds the run's state (founding/resumed member, or a joiner past ``state_received``)."""
        return self._has_state

    @property
    def outer_step(self) -> int:
        return self._claim.outer_step if self._claim else 0

    @property
    def epoch_id(self) -> int:
        return self._epoch

    @property
    def view(self) -> dict[str, Any]:
        """The node as the coordinator saw it at the last heartbeat (role, admission, epoch)."""
        return self._view

    def epoch_broken(self, epoch_id: int) -> bool:
        """The coordinator says the ring of ``epoch_id`` lost a member (or a newer epoch formed
        without us): abort it. Also True once the session is gone for good."""
        v = self._view
        if self._fatal is not None:
            return True
        return bool(v) and (v.get("epoch_id", 0) > epoch_id or (v.get("epoch_id") == epoch_id
                                                                and v.get("epoch_broken", False)))

    def admission_revoked(self, adm: Admission) -> bool:
        """The coordinator no longer expects this joiner to receive ``adm`` (donor gone, re-queued,
        evicted): stop waiting for that transfer."""
        v = self._view
        if self._fatal is not None:
            return True
        return bool(v) and not (v.get("role") == "admitted" and v.get("admission") == adm.outer_step
                                and v.get("donor") == adm.donor_id)

    @property
    def view_seq(self) -> int:
        """How many heartbeat replies this client has received (see :meth:`serving_revoked`)."""
        return self._view_seq

    def serving_revoked(self, joiner_id: str, since: int) -> bool:
        """Stop streaming the state to ``joiner_id``: the coordinator no longer expects this node
        to serve it (the joiner left, was evicted, re-queued to another donor or already holds
        the state; the run is complete), or this node's session is gone for good. Only views
        asked for after ``since`` (the :attr:`view_seq` when serving began) count: the second
        reply after it answers a heartbeat sent after it."""
        if self._fatal is not None:
            return True
        if self._view_seq < since + 2:
            return False
        v = self._view
        serving = v.get("serving")
        return v.get("completed") is True or (isinstance(serving, list) and joiner_id not in serving)

    def hold(self, outer_step: int, state_hash: str | None) -> None:
        """This node now holds the state after ``outer_step`` outer steps (claimed if it has to
        register again, e.g. with a restarted coordinator)."""
        with self._lock:
            self._claim = Resume(outer_step, self._epoch, self._rank, state_hash, self._members, self._record)

    @property
    def record(self) -> Record | None:
        """The newest barrier record the coordinator signed for a state of ours (None: none yet,
        or a coordinator that signs none)."""
        return self._record

    # ---- requests ------------------------------------------------------------------------
    def register(self, claim: Resume | None = None) -> RegisterReply:
        """Join the run: as a founding member of a fresh run, as a member with the state ``claim``
        describes (only while the coordinator rebuilds the run), else as a joiner (``reply.member``
        False, ``reply.note`` says why a claim was not taken). If the client is registered and
        healthy (e.g. it re-registered by itself after losing the coordinator), that registration
        is returned. Raises :class:`RegistrationRefused` (certificate refused, model fingerprint, run
        length, data plan, protocol, a live node with this id past its grace) and :class:`RunCompleted`.

        Transient failures (no answer, connection refused or reset, a coordinator restarting or
        stalled) are retried with backoff for up to ``register_timeout`` seconds, the first
        registration of a process included (a node started before its coordinator waits for
        it); one line says when the wait starts and one when it ends. Past the limit:
        :class:`CoordinatorUnavailable`, naming the coordinator and the last cause.
        """
        with self._recover_lock:  # never two registrations at once (the heartbeat thread recovers too)
            with self._lock:
                if self._session is not None and self._fatal is None and self._reply is not None:
                    return self._reply
                self._fatal, self._has_state = None, False
                self._claim = claim if claim is not None else self._claim
                if claim is not None and claim.record is not None:  # (kept in the claims that follow: hold)
                    self._record = claim.record
            try:
                return self._register_waiting()
            except CoordinatorError as e:  # no session follows (complete, refused, unreachable): say so
                if isinstance(e, RegistrationRefused) and self._name not in str(e):
                    e = RegistrationRefused(f"{self._name} refused {e}", e.reason)  # the one line names both
                with self._lock:
                    self._fatal = e
                raise e from None

    def _register_waiting(self) -> RegisterReply:
        """Register, retrying transient failures until ``register_timeout`` (see :meth:`register`)."""
        clock = self.clock
        t0 = clock.now()
        deadline = t0 + self.register_timeout
        grace = t0 + min(self.reconnect_timeout, self.register_timeout)  # for "duplicate": our old session
        delay, waiting, said, said_at = 0.05, False, "", t0
        while True:
            try:
                r = self._register(min(self.connect_timeout, max(0.1, deadline - clock.now())))
                if waiting:
                    self._say(f"node {self.node_id}: registered with {self._name} after waiting "
                              f"{clock.now() - t0:.1f}s")
                return r
            except RegistrationRefused as e:  # our own previous session (or a shard's holder), not yet seen gone;
                # or a run whose data plan its first barrier has not settled yet
                if not ((e.reason in ("duplicate", "shard") and clock.now() < grace) or
                        (e.reason == "plan" and clock.now() < deadline)):
                    raise
                cause: Exception = e
            except TRANSIENT as e:
                cause = e
            kind = re.sub(r"\d+(\.\d+)?", "#", f"{type(cause).__name__}: {cause}")  # (times and ports aside)
            if not waiting:
                waiting, said, said_at = True, kind, clock.now()
                self._say(f"node {self.node_id}: waiting for {self._name} ({cause}); retrying for up to "
                          f"{self.register_timeout:.0f}s")
            elif kind != said and clock.now() - said_at >= 5.0:  # another cause: say it, once in a while
                said, said_at = kind, clock.now()
                self._say(f"node {self.node_id}: still waiting for {self._name} after {clock.now() - t0:.0f}s "
                          f"({cause})")
            if clock.now() >= deadline:
                raise CoordinatorUnavailable(f"{self._name} did not answer node {self.node_id}'s registration for "
                                             f"{self.register_timeout:.0f}s ({cause})") from cause
            clock.sleep(min(delay, max(0.0, deadline - clock.now())))
            delay = min(2 * delay, 1.0)

    def sync(self, k: int, state_hash: str | None = None, retry_of: int | None = None,
             timeout: float | None = None, sits_out: str | None = None, report: dict | None = None) -> Epoch:
        """Barrier at boundary ``k`` (``k`` completed outer steps); returns the epoch of step ``k+1``.

        ``retry_of``: the epoch whose all-reduce just failed. ``sits_out``: why this node will
        contribute zeros. ``report``: on the all-reduce before (``{"avg_failed": bool,
        "accused": [node, why] | None}``). Raises :class:`Evicted` if the node was dropped
        (register again), :class:`CoordinatorUnavailable`.
        """
        self.hold(k, state_hash)
        sig = None
        if self._signer is not None and state_hash is not None:
            sig = self._signer.identity.sign(vote(self._signer.run_id, k, state_hash)).hex()
        reply = self._call("sync", {"step": k, "state_hash": state_hash, "retry_of": retry_of, "sits_out": sits_out,
                                    "report": report, "vote": sig}, timeout)
        ep = parse_reply(EpochOk, reply, "sync", self._name).epoch.parsed()
        r = ep.record
        with self._lock:
            self._epoch, self._rank, self._has_state, self._seen_run = ep.epoch_id, ep.rank, True, True
            self._members = tuple(ep.node_ids)
            if r is not None and (r.outer_step, r.state_hash, r.epoch_id, r.members) == \
                    (k, state_hash, ep.epoch_id, self._members):
                self._record = r
            self._claim = Resume(k, ep.epoch_id, ep.rank, state_hash, self._members, self._record)
        if ep.hash_mismatch:
            log.warning("node %s: state hashes disagree at outer step %d: %s", self.node_id, k,
                        ", ".join(f"{n}={h[:16]}" for n, h in ep.hash_mismatch))
        return ep

    def wait_admission(self, requeue: bool = False, timeout: float | None = None) -> Admission:
        """Joiner: block until a boundary admits us; ``requeue=True`` after a failed state transfer.
        An admission whose donor is this node itself means: resume with the state you claimed."""
        reply = self._call("admit", {"requeue": requeue}, timeout, reissue={"requeue": False})
        adm = parse_reply(AdmissionOk, reply, "admit", self._name).admission.parsed()
        with self._lock:
            self._epoch = adm.epoch_id
            if adm.donor_id == self.node_id:
                self._has_state = True
            else:  # until the next heartbeat says otherwise
                self._view = {**self._view, "role": "admitted", "admission": adm.outer_step, "donor": adm.donor_id}
        return adm

    def lease(self, rnd: int, round_steps: int, unit_steps: int, unit_tokens: int,
              stream: str = "") -> list[tuple[int, int]]:
        """The units of the training stream (``[a, b)`` ranges) this node trains in round ``rnd``,
        leased by the coordinator (the same ones if asked again; coordinator/leases.py);
        ``stream``: the fingerprint of the data stream (the run's first lease fixes it)."""
        reply = self._call("lease", {"round": rnd, "round_steps": round_steps, "unit_steps": unit_steps,
                                     "unit_tokens": unit_tokens, "stream": stream})
        return [(a, b) for a, b in parse_reply(LeaseOk, reply, "lease", self._name).units]

    def state_received(self, k: int) -> bool:
        """Joiner: we hold the state after outer step ``k``; False means re-queued (wait_admission again)."""
        accepted = parse_reply(ReceivedOk, self._call("received", {"step": k}), "received", self._name).accepted
        if accepted:
            with self._lock:
                self._has_state = True
                self._claim = Resume(k, self._epoch, self._rank, self._claim.state_hash if self._claim else None,
                                     self._members)
        return accepted

    def leave(self) -> None:
        """Leave gracefully (removed at once; the next barrier forms a new epoch without us).
        Best effort: a coordinator that cannot be told (stalled, restarting, gone) sees the
        session close instead, which removes the node as well."""
        try:
            parse_reply(Ok, self._call("leave", {}, recover=False), "leave", self._name)
        except (CoordinatorError, *TRANSIENT) as e:
            self._say(f"node {self.node_id}: could not tell {self._name} that it leaves ({e}); closing its session")
        finally:
            with self._lock:  # (a heartbeat already under way on this session then fails on its closed
                self._gen += 1  # connection: it must not take that for a lost coordinator and register us again)
            self._drop_session()

    def status(self) -> dict[str, Any]:
        reply = self.wire.request({"op": "status"}, self.clock.now() + self.connect_timeout, self.connect_timeout)
        if reply.get("ok") is not True:
            raise reply_error(reply, self._name)
        return parse_reply(StatusOk, reply, "status", self._name).status

    def close(self) -> None:
        """Stop heartbeating and close the session (the coordinator evicts us unless we left)."""
        self._closed = True
        self._stop.set()
        self._drop_session()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals -----------------------------------------------------------------------
    def _register(self, timeout: float) -> RegisterReply:
        with self._lock:
            claim = self._claim
            msg = {"op": "register", "node": self.node_id, "addr": self.ring_addr, "devices": self.devices,
                   "protocol": self.protocol, "fingerprint": self.fingerprint, "founder": not self._seen_run,
                   "outer_steps": self.outer_steps, "resume": asdict(claim) if claim else None,
                   **({"data": asdict(self.data)} if self.data is not None else {})}
        try:
            conn, reply = self.wire.open(msg, timeout)
        except AuthError as e:
            raise RegistrationRefused(f"no authenticated connection between {self._name} and node {self.node_id}: "
                                      f"{e}", "auth") from e
        if reply.get("ok") is not True:
            raise reply_error(reply, self._name)
        r = parse_reply(RegisterOk, reply, "register", self._name).parsed()
        with self._lock:
            self._conn, self._session, self._gen, self._fatal, self._reply = conn, r.session, self._gen + 1, None, r
            self._seen_run = self._seen_run or not r.member or r.epoch_id > 0
            self._has_state, self._view = r.member, {}
            if self._hb is None:
                self._hb = self.clock.spawn(self._heartbeat_loop, name=f"coordinator-hb-{self.node_id}")
        log.info("node %s registered with %s as %s (outer step %d, epoch %d)%s", self.node_id, self._name,
                 "member" if r.member else "joiner", r.outer_step, r.epoch_id, f": {r.note}" if r.note else "")
        return r

    def _beat(self, conn: Any) -> None:
        with self._io_lock:  # a coordinator that is alive but stalled is waited for, session kept
            revocations = self._signer.identity.revocations if self._signer is not None else None
            held = revocations.current() if revocations is not None else None
            reply = self.wire.beat(conn, {"op": "hb", "crl": held[0] if held else None}, self.reconnect_timeout)
        if reply.get("ok") is not True:
            raise reply_error(reply, self._name)
        ok = parse_reply(ViewOk, reply, "hb", self._name)
        if ok.crl is not None and revocations is not None:
            try:  # the authority's signature decides, not the coordinator's word
                revocations.install(ok.crl.encode(), f"the coordinator {self._name}")
            except IdentityError as e:  # (never fatal: the node goes on with the list it holds)
                log.warning("node %s: %s; ignored", self.node_id, e)
        self._view = ok.view.model_dump()
        self._view_seq += 1

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_interval):
            with self._lock:
                conn, gen = self._conn, self._gen
            if conn is None:
                continue
            try:
                self._beat(conn)
            except CoordinatorError as e:
                self._fail(e, gen)
            except TRANSIENT:
                if self._stop.is_set():
                    return
                try:
                    self._recover(gen)
                except CoordinatorError:
                    pass  # recorded by _fail; the next request raises it

    def _fail(self, e: CoordinatorError, gen: int | None = None) -> None:
        """Record a fatal error (eviction, refusal, coordinator gone) and drop the session; with
        ``gen``, only if the session that failed is still the current one (a heartbeat that was
        stuck while the node registered again reports on the old session)."""
        with self._lock:
            if gen is not None and gen != self._gen:
                return
            self._fatal = e
            if isinstance(e, Evicted):
                self._has_state = False
        log.warning("node %s: %s", self.node_id, e)
        self._drop_session(keep_thread=True)

    def _drop_session(self, keep_thread: bool = False) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
            if not keep_thread:
                self._session = None
        if conn is not None:
            self.wire.close(conn)

    def _recover(self, gen: int) -> None:
        """The coordinator is unreachable: reconnect with backoff and register again with the
        state this node holds (once per generation)."""
        with self._recover_lock:
            with self._lock:
                if self._fatal is not None:
                    raise self._fatal
                if self._closed:
                    raise CoordinatorUnavailable(f"node {self.node_id}: client closed")
                if self._gen != gen:
                    return  # another thread already re-registered
            self._drop_session(keep_thread=True)
            log.warning("node %s lost %s; reconnecting for up to %.0fs", self.node_id, self._name,
                        self.reconnect_timeout)
            clock = self.clock
            deadline, delay = clock.now() + self.reconnect_timeout, 0.05
            last: Exception | None = None
            while not self._closed:
                try:
                    was_member = self._has_state
                    r = self._register(max(0.1, deadline - clock.now()))
                    if was_member and not r.member:  # our state no longer resumes the run
                        self._fail(Evicted(f"node {self.node_id}: {r.note or 'the run went on without us'}",
                                           "behind"))
                    return
                except RegistrationRefused as e:  # duplicate: our old session is not yet seen dead
                    if e.reason != "duplicate" or clock.now() >= deadline:
                        self._fail(e)
                        raise
                    last = e
                except CoordinatorError as e:
                    self._fail(e)
                    raise
                except TRANSIENT as e:
                    last = e
                if clock.now() >= deadline:
                    break
                clock.sleep(min(delay, max(0.0, deadline - clock.now())))
                delay = min(2 * delay, 1.0)
            err = CoordinatorUnavailable(f"node {self.node_id}: client closed" if self._closed else
                                         f"node {self.node_id}: {self._name} unreachable for "
                                         f"{self.reconnect_timeout:.0f}s ({last})")
            self._fail(err)
            raise err

    def _call(self, op: str, args: dict[str, Any], timeout: float | None = None,
              reissue: dict[str, Any] | None = None, recover: bool = True) -> dict[str, Any]:
        """A request on its own connection; survives coordinator restarts by re-registering and
        re-issuing (``recover=False``: fail at once with :class:`CoordinatorUnavailable`)."""
        clock = self.clock
        deadline = None if timeout is None else clock.now() + timeout
        failing_since: float | None = None
        while True:
            with self._lock:
                if self._fatal is not None:
                    raise self._fatal
                if self._session is None:
                    raise ProtocolError(f"node {self.node_id} is not registered; call register()")
                gen, msg = self._gen, {"op": op, "node": self.node_id, "session": self._session, **args}
            try:
                reply = self.wire.request(msg, deadline, self.connect_timeout)
            except AuthError:
                raise
            except TRANSIENT as e:
                if not recover:
                    raise CoordinatorUnavailable(f"node {self.node_id}: {op} to {self._name} failed ({e})") from e
                if deadline is not None and clock.now() >= deadline:
                    raise PeerTimeout(f"node {self.node_id}: {op} not answered within {timeout:.1f}s") from e
                now = clock.now()
                failing_since = failing_since or now
                if now - failing_since > self.reconnect_timeout:
                    raise CoordinatorUnavailable(f"node {self.node_id}: {op} to {self._name} failing for "
                                                 f"{now - failing_since:.0f}s ({e})") from e
                self._check_session(gen)
                args = {**args, **(reissue or {})}
                continue
            if reply.get("ok") is True:
                return reply
            err = reply_error(reply, self._name)
            if isinstance(err, StaleSession):
                self._recover(gen)
                continue
            if isinstance(err, (Evicted, RunCompleted)):
                self._fail(err)
            raise err

    def _check_session(self, gen: int) -> None:
        """After a failed request: if the session still answers, retry; otherwise recover it."""
        with self._lock:
            conn = self._conn if self._gen == gen else None
        if conn is None:
            with self._recover_lock:  # wait for a recovery in progress
                pass
            self.clock.sleep(0.05)
            return
        try:
            self._beat(conn)
            self.clock.sleep(0.1)
        except CoordinatorError as e:
            self._fail(e, gen)
            raise
        except TRANSIENT:
            self._recover(gen)
