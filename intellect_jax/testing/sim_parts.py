"""The stand-ins a simulated node runs with (see :mod:`.sim`): a numpy trainer
(:class:`SimInner`), the ring (the int8 ring's exact arithmetic), the state transport, the disk,
and the wrappers that route a node's calls through its fault points. Each sees the simulation
only as its :class:`~.sim_world.World`."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np

from intellect_jax.coordinator.claims import RecordBook
from intellect_jax.coordinator.protocol import Admission, Epoch
from intellect_jax.diloco.parts import TransferFailed
from intellect_jax.diloco.state import DilocoState, state_hash
from intellect_jax.net.comm import CommStats, bucket_call
from intellect_jax.net.errors import AuditFailed, PeerClosed, PeerTimeout
from intellect_jax.net import quant
from intellect_jax.net.evidence import (OUTSIZE, SAT_OUT, evidence, outsize_evidence, outsized, raw_signature,
                                        row_norm, statement, unsigned_evidence)
from intellect_jax.testing.audit_cases import fake_audit
from intellect_jax.testing.identities import credentials
from intellect_jax.testing.local import NumpyInner
from intellect_jax.testing.local_ring import LocalGroup, owner_pieces, ring_view
from intellect_jax.testing.sim_plan import Fault, Script, SimParams
from intellect_jax.testing.sim_world import Group, Killed, Proc, World, corrupt

# re-exported: tests (test_overlap, test_security) import the schedule types from here
__all__ = ["Fault", "Killed", "Proc", "Script", "SimInner", "SimParams"]


class _StallWire:
    """The coordinator wire of one process: nothing gets through while the process is stopped,
    and a paused coordinator (:meth:`.Sim.pause_coordinator`) is seen as a real client sees a
    SIGSTOPped coordinator's sockets: a new connection's handshake (``open``, ``request``) gets
    no answer, so a pause that outlasts its timeout costs that timeout and a
    :class:`PeerTimeout`; a heartbeat on the open session waits up to ``patience`` for its reply
    (likewise); anything shorter just waits (blocks on the service's lock) for the pause to end.
    Closing the session never waits: the kernel closes a dead process's socket, the coordinator
    reads it when it runs again."""

    def __init__(self, wire: Any, proc: Proc, sim: World) -> None:
        self.w, self.proc, self.sim, self.clock, self.name = wire, proc, sim, sim.clock, wire.name

    def _pause(self) -> None:
        left = self.proc.stalled_until - self.clock.now()
        if left > 0:
            self.clock.sleep(left)
        if self.proc.dead:
            raise PeerClosed("process gone")

    def _unanswered(self, timeout: float, what: str) -> None:
        """Against a coordinator paused for longer than ``timeout``: wait it out and time out."""
        timeout = max(0.0, timeout)
        left = self.sim.paused_until - self.clock.now()
        if left > 0 and left > timeout:
            self.clock.sleep(timeout)
            self._pause()
            why = f"{what}: no answer from the coordinator within {timeout:.1f}s (it is paused)"
            self.sim.say(self.proc.name, why)
            raise PeerTimeout(why, idle=True)

    def open(self, msg: dict, timeout: float) -> Any:
        self._pause()
        self._unanswered(timeout, "handshake")
        return self.w.open(msg, timeout)

    def beat(self, handle: Any, msg: dict, patience: float) -> dict:
        self._pause()
        self._unanswered(patience, "heartbeat")
        return self.w.beat(handle, msg, patience)

    def close(self, handle: Any) -> None:
        if self.sim.coordinator_paused():
            self.clock.spawn(lambda: self.w.close(handle), name=f"close-{self.proc.name}")
        else:
            self.w.close(handle)

    def request(self, msg: dict, deadline: float | None, connect_timeout: float) -> dict:
        self._pause()
        left = connect_timeout if deadline is None else min(connect_timeout, deadline - self.clock.now())
        self._unanswered(left, str(msg.get("op")))
        return self.w.request(msg, deadline, connect_timeout)


class _Gated:
    """Calls of the named methods pass through a fault point before and after."""

    def __init__(self, target: Any, proc: Proc, sim: World, hooks: dict[str, str]) -> None:
        self._t, self._proc, self._sim, self._hooks = target, proc, sim, hooks

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._t, name)
        hook = self._hooks.get(name)
        if hook is None:
            if callable(attr) and not self._proc.dead:
                return attr
            if callable(attr):
                def dead(*a: Any, **kw: Any) -> Any:
                    raise Killed()
                return dead
            return attr

        def call(*a: Any, **kw: Any) -> Any:
            self._sim.gate(self._proc, hook, "before")
            result = attr(*a, **kw)
            self._sim.gate(self._proc, hook, "after")
            return result

        return call


class SimInner(NumpyInner):
    """The numpy trainer in virtual time, with fault points around its compute; its records go
    to the simulation's log of every row any node wrote."""

    def __init__(self, sim: World, proc: Proc, target: np.ndarray) -> None:
        super().__init__(target, sim.init, np.mean(sim.targets[: sim.p.nodes], axis=0), step_time=sim.p.step_time,
                         clock=sim.clock)
        self.sim, self.proc = sim, proc

    def _pause(self, seconds: float, phase: str) -> None:
        self.sim.gate(self.proc, "train", phase)
        self.clock.sleep(seconds)
        if self.proc.dead:
            raise Killed()

    def train(self, until: int, stop: Callable[[], bool] | None = None) -> dict[str, Any]:
        out = super().train(until, stop)
        self.sim.gate(self.proc, "train", "after")
        return out

    def record(self, step: int, metrics: dict[str, Any]) -> None:
        if self.proc.dead:
            raise Killed()
        self.sim.rows.append((self.proc.name, step, dict(metrics)))

    def pseudo_gradient(self, outer_params: Any) -> Any:
        """A broken host: this node's own pseudo-gradient comes out poisoned."""
        pg = super().pseudo_gradient(outer_params)
        return self.sim.poison(self.proc, "own", self.step // self.sim.p.inner_steps, pg)

    def capture(self) -> Any:
        return self.step, super().capture()

    def lease(self, rnd: int, batches: list[tuple[int, int]]) -> None:
        super().lease(rnd, batches)
        self.sim.leased[(self.proc.name, rnd)] = self.trained[self.step]  # filled as it trains them

    def pull(self, captured: Any, like: Any) -> Any:
        step, pg = captured  # the round that made it (the trainer has moved on by now)
        return self.sim.poison(self.proc, "own", step // self.sim.p.inner_steps, pg)


class _Comm:
    """One rank of an in-process ring for one epoch; results are the ring's (or the all-gather's)
    exact bits for the run's codec."""

    def __init__(self, sim: World, proc: Proc, ep: Epoch) -> None:
        self.sim, self.proc, self.rank, self.world_size, self.epoch = sim, proc, ep.rank, ep.world_size, ep.epoch_id
        self.step = ep.outer_step + 1
        self.group = sim.groups.setdefault((ep.epoch_id, ep.outer_step), Group(ep.world_size))
        self.group.sitting_out = tuple(ep.sitting_out)
        self.last_stats = CommStats(world_size=ep.world_size, mode=sim.ring_cfg.mode)
        self.inspect: Any = None  # as the socket ring's: shown the predecessor's own contribution
        self.suspect: tuple[int, str, dict[str, Any]] | None = None
        self.suspects: list[tuple[int, str, dict[str, Any]]] = []  # (the butterfly's: one per sender)
        self.audited: tuple[int, str, dict[str, Any] | None] | None = None  # as SocketCommunicator.audited
        self.missing: tuple[int, ...] = ()  # as SocketCommunicator.missing: the ranks that never came
        self.steered: list[tuple[int, dict[str, Any]]] = []  # as SocketCommunicator.steered
        self.absent: frozenset[int] = frozenset()  # set by the loop: the ranks that sit the round out
        self.node_ids = list(ep.node_ids)

    @property
    def over_present(self) -> bool:
        return self.sim.ring_cfg.exchange == "butterfly"

    def all_reduce_mean(self, tree: Any, dropped: Any = None) -> Any:
        sim, g, clock = self.sim, self.group, self.sim.clock
        f = sim.gate(self.proc, "allreduce", "before")
        tree = sim.poison(self.proc, "wire", self.step, tree)
        deadline = clock.now() + sim.p.ring_deadline
        if self.over_present and g.world >= 3 and sim.withholding(self.proc, self.step):
            self._withhold(deadline)
        with sim.cond:
            g.inputs[self.rank], g.members[self.rank], g.drops[self.rank] = tree, self.proc, dropped
            g.units[self.rank] = sim.leased.get((self.proc.name, self.step - 1))  # the round that made it
            if len(g.inputs) == g.world and g.results is None and g.error is None:
                ordered = [g.inputs[r] for r in range(g.world)]
                g.results = LocalGroup(g.world, sim.ring_cfg, epoch=self.epoch).all_reduce_mean_all(
                    ordered, [g.drops.get(r) for r in range(g.world)], self.absent)
                forging = {r for r, q in g.members.items()  # (a ring of one has nobody to audit it)
                           if self.over_present and g.world > 1 and sim.forging(q, self.step)}
                if forging:  # each auditor's verdict; a forged segment that is empty forges nothing
                    g.verdicts = {r: fake_audit(ordered, self.node_ids, r, forging, run_id=sim.run_id,
                                                step=self.step - 1, epoch=self.epoch, cfg=sim.ring_cfg,
                                                absent=sorted(self.absent)) for r in range(g.world)}
                    g.forged = forging if any(g.verdicts.values()) else set()
                if not g.forged:  # (a forged exchange fails: nobody applies it)
                    sim.exchanges.append((self.step, self.epoch, {g.members[r].node_id: _flat(g.inputs[r]) for r in
                                                                  range(g.world)},
                                          _flat(g.results[0]), {self.node_ids[r] for r in self.absent}))
                if any(sim.framing(q, self.step) for q in g.members.values()):  # a framer's poisoned partial
                    g.results = [corrupt(r, "nan") for r in g.results]  # sums: nobody can see whose they are
                if f is not None and f.kind.startswith("partial") and g.world > 2:
                    others = [r for r in range(g.world) if r != self.rank]
                    g.fail_ranks = set(others[: int(sim.rng.integers(1, len(others)))])
                    if f.kind == "partial-outage":  # the ranks that finished die soon after, too
                        finished = [g.members[r] for r in others if r not in g.fail_ranks]
                        delay = float(sim.rng.uniform(0.0, 2 * sim.p.inner_steps * sim.p.step_time))
                        sim.clock.spawn(lambda: (sim.clock.sleep(delay), [sim.kill_from_outside(q) for q in finished]),
                                        name="outage")
                sim.cond.notify_all()
            while g.results is None and g.error is None:
                if any(m.dead for m in g.members.values()):
                    g.error = "a peer closed the connection (it died)"
                    break
                left = deadline - clock.now()
                if left <= 0:
                    g.error = f"all-reduce deadline ({sim.p.ring_deadline:.0f}s) expired"
                    break
                sim.cond.wait(min(left, 1.0))
            sim.cond.notify_all()
        clock.sleep(sim.p.ring_time)
        if self.proc.dead:
            raise Killed()
        if f is not None and f.kind.startswith("partial"):
            sim.kill(self.proc)
        if g.forged and g.results is not None:  # the auditor of a forged segment fails the call for all
            self.audited = g.verdicts.get(self.rank)
            raise AuditFailed(f"sim ring epoch {self.epoch}: an audit shows {sorted(g.forged)} forging")
        if g.results is None and self.over_present and g.error != "aborted (a member was evicted)":
            self.missing = tuple(r for r in range(g.world) if r not in g.inputs)  # (their pieces never left)
        if g.results is None or self.rank in g.fail_ranks:
            raise PeerClosed(f"sim ring epoch {self.epoch}: {g.error or 'a peer died before passing it on'}")
        sim.gate(self.proc, "allreduce", "after")
        self.proc.ring = (self.epoch, self.step - 1)
        if self.inspect is not None and self.world_size > 1 and self.over_present:
            self.suspects = self._butterfly_suspects(g)
            self.suspect = self.suspects[0] if self.suspects else None
            self.steered = self._butterfly_steering(g)
        elif self.inspect is not None and self.world_size > 1:
            prev = (self.rank - 1) % self.world_size
            found = unsigned_evidence(ring_view(g.inputs[prev], self.world_size, prev, self.sim.ring_cfg), self.inspect,
                                      step=self.step - 1, epoch=self.epoch, piece_numel=self.sim.ring_cfg.piece_numel)
            self.suspect, self.suspects = (prev, *found) if found else None, []
            if sim.frames(self.proc, self.step):  # a malicious successor: the honest piece as its evidence
                self.suspect = (prev, "framed", unsigned_evidence(_flat(g.inputs[prev]), lambda _: "framed",
                                                                  step=self.step - 1, epoch=self.epoch,
                                                                  piece_numel=sim.ring_cfg.piece_numel)[1])
        return copy.deepcopy(g.results[self.rank])

    def _withhold(self, deadline: float) -> None:
        """A withholder's call: in the exchange, but none of its pieces go out; it fails at the
        deadline with everyone (a ring of two cannot tell which of them withholds: none here)."""
        sim, g = self.sim, self.group
        sim.injected["withhold"] += 1
        sim.say(self.proc.name, f"FAULT withholds its pieces in epoch {self.epoch}")
        with sim.cond:
            g.members[self.rank] = self.proc
            while g.error is None and sim.clock.now() < deadline:
                sim.cond.wait(min(deadline - sim.clock.now(), 1.0))
        sim.clock.sleep(sim.p.ring_time)
        raise PeerTimeout(f"sim ring epoch {self.epoch}: we withheld our pieces")

    def _butterfly_suspects(self, g: Group) -> list[tuple[int, str, dict[str, Any]]]:
        """As a butterfly owner sees them: every other member's own pieces, the first bad one of
        each sender (a sitter's that is not zeros, or one ``inspect`` rejects) as evidence signed
        by its sender under the run's test authority (the coordinator checks it as over sockets)."""
        cfg, n = self.sim.ring_cfg, self.world_size
        found: list[tuple[int, str, dict[str, Any]]] = []
        for sender in ((self.rank + 1 + k) % n for k in range(n - 1)):
            look = (lambda v: SAT_OUT if v.any() else None) if sender in self.absent else self.inspect
            for bi, j, values in owner_pieces(g.inputs[sender], n, self.rank, cfg):
                wire = quant.encode(np.ascontiguousarray(values), cfg.mode, cfg.block_size)
                numel = values.shape[0]
                why = look(quant.decode(wire, numel, cfg.mode, cfg.block_size))
                if not why:
                    continue
                who, me, call = self.node_ids[sender], self.node_ids[self.rank], bucket_call(0, bi)
                payload = wire.tobytes()
                said = statement(self.sim.run_id, self.step - 1, self.epoch, call, who, me, self.rank, j, numel,
                                 cfg.mode, cfg.block_size, payload)
                key = credentials(who)
                found.append((sender, why, evidence(
                    step=self.step - 1, epoch=self.epoch, call=call, segment=self.rank, piece=j, numel=numel,
                    mode=cfg.mode, block=cfg.block_size, payload=payload, signature=raw_signature(key.sign(said)),
                    cert=key.cert_der)))
                break
        return found

    def _butterfly_steering(self, g: Group) -> list[tuple[int, dict[str, Any]]]:
        """As a butterfly owner weighs them (``net.butterfly.Weighing``): the senders whose rows
        are outsized in most pieces of our segments over the call's buckets, each with its first
        such piece, every row we may show of it signed by its sender under the run's test
        authority."""
        cfg, n, me = self.sim.ring_cfg, self.world_size, self.rank
        shown = [r for r in range(n) if r != me and r not in self.absent]
        per = {r: list(owner_pieces(g.inputs[r], n, me, cfg)) for r in shown}
        first: dict[int, dict[str, Any]] = {}  # sender -> its first outsized piece
        counts: dict[int, int] = {}  # sender -> pieces outsized
        pieces = len(per[shown[0]]) if shown else 0
        for at, (bi, j, values) in enumerate(per[shown[0]] if shown else ()):
            wires = {r: quant.encode(np.ascontiguousarray(per[r][at][2]), cfg.mode, cfg.block_size) for r in shown}
            numel = values.shape[0]
            norms = {r: row_norm(quant.decode(w, numel, cfg.mode, cfg.block_size)) for r, w in wires.items()}
            for r in shown:
                ratio = outsized(norms, r, n)
                if ratio is None or not ratio > OUTSIZE:
                    continue
                counts[r] = counts.get(r, 0) + 1
                if r not in first:
                    call, mine = bucket_call(0, bi), self.node_ids[me]
                    sigs = {k: raw_signature(credentials(self.node_ids[k]).sign(statement(
                        self.sim.run_id, self.step - 1, self.epoch, call, self.node_ids[k], mine, me, j, numel,
                        cfg.mode, cfg.block_size, w.tobytes()))) for k, w in wires.items()}
                    first[r] = outsize_evidence(
                        step=self.step - 1, epoch=self.epoch, call=call, segment=me, piece=j, numel=numel,
                        mode=cfg.mode, block=cfg.block_size, ratio=ratio,
                        payloads=[wires[k].tobytes() if k in wires else None for k in range(n)],
                        signatures=[sigs.get(k) for k in range(n)])
        return [(r, ev) for r, ev in sorted(first.items()) if 2 * counts[r] > pieces]

    def abort(self) -> None:
        with self.sim.cond:
            if self.group.results is None and self.group.error is None:
                self.group.error = "aborted (a member was evicted)"
            self.sim.cond.notify_all()

    def close(self) -> None:
        pass


def _flat(tree: Any) -> np.ndarray:
    import jax

    return np.concatenate([np.asarray(x, np.float32).reshape(-1) for x in jax.tree.leaves(tree)])


class _Transport:
    """In-process state transfer: the donor's thread delivers a copy after ``transfer_time``."""

    def __init__(self, sim: World, proc: Proc) -> None:
        self.sim, self.proc = sim, proc

    def serve(self, joiner_id: str, joiner_addr: str, snapshot: DilocoState, meta: dict[str, Any],
              cancelled: Callable[[], bool]) -> Any:
        """Like the socket transport: dial the joiner (it answers once it waits in ``receive``
        for this outer step) until ``transfer_timeout``, send for ``transfer_time``, then deliver;
        ``cancelled()`` (the coordinator no longer admits the joiner) is checked while dialling
        and sending, every heartbeat interval, and before delivering: the donor lets go."""
        sim, proc, clock = self.sim, self.proc, self.sim.clock
        done, snap = clock.Event(), copy.deepcopy(snapshot)
        target = sim.by_addr.get(joiner_addr)
        step, every = meta["outer_step"], sim.p.heartbeat_interval

        def deliver(item: Any) -> None:
            if target is not None and not target.dead:
                with sim.cond:
                    target.mailbox[step] = item
                    sim.cond.notify_all()

        def stop(why: str) -> None:
            sim.say(proc.name, f"stopped serving {joiner_id}: {why}")
            sim.injected["donor let go"] += 1

        def dial() -> bool:
            deadline = clock.now() + sim.p.transfer_timeout
            while True:
                sim.wait_unstalled(proc)
                with sim.cond:
                    if target is not None and not target.dead and target.receiving == step \
                            and target.stalled_until <= clock.now():
                        return True
                    if cancelled():
                        stop("the coordinator no longer admits it")
                        return False
                    left = deadline - clock.now()
                    if left <= 0:
                        sim.say(proc.name, f"serving {joiner_id} failed: not reachable within "
                                           f"{sim.p.transfer_timeout:.0f}s")
                        return False
                    sim.cond.wait(min(left, every))

        def send(seconds: float) -> bool:
            end = clock.now() + seconds
            while clock.now() < end:
                if cancelled():
                    stop("the coordinator no longer admits it (while sending)")
                    return False
                clock.sleep(min(every, end - clock.now()))
                sim.wait_unstalled(proc)
            return True

        def run() -> None:
            try:
                sim.gate(proc, "serve", "before")
                if not dial() or not send(sim.p.transfer_time / 2):
                    return
                sim.gate(proc, "serve", "during")
                if not send(sim.p.transfer_time / 2):
                    return
                sim.wait_unstalled(proc)
                if cancelled():
                    stop("the coordinator no longer admits it (before delivering)")
                    return
                deliver((meta, snap))
                sim.gate(proc, "serve", "after")
            except Killed:
                deliver(PeerClosed("donor connection reset"))
            finally:
                done.set()

        clock.spawn(run, name=f"serve-{proc.name}-{joiner_id}")
        return done

    def receive(self, adm: Admission, template: DilocoState, cancelled: Callable[[], bool],
                timeout: float) -> tuple[dict[str, Any], DilocoState]:
        sim, proc, clock = self.sim, self.proc, self.sim.clock
        sim.gate(proc, "receive", "before")
        deadline = clock.now() + timeout
        with sim.cond:
            proc.receiving = adm.outer_step  # the donor can connect now
            sim.cond.notify_all()
            try:
                while adm.outer_step not in proc.mailbox:
                    if proc.dead:
                        raise Killed()
                    if cancelled():
                        raise TransferFailed(f"admission from {adm.donor_id} revoked")
                    left = deadline - clock.now()
                    if left <= 0:
                        raise PeerTimeout(f"no state from {adm.donor_id} within {timeout:.0f}s")
                    sim.cond.wait(min(left, sim.p.heartbeat_interval))
                item = proc.mailbox.pop(adm.outer_step)
            finally:
                proc.receiving = None
        sim.gate(proc, "receive", "during")
        if isinstance(item, Exception):
            raise item
        sim.gate(proc, "receive", "after")
        meta, snap = item
        proc.ring = None  # the state it holds now came out of no ring of its own
        return meta, copy.deepcopy(snap)


class _Disk:
    """A node's checkpoints: they outlive its processes (keep the newest 3)."""

    def __init__(self, sim: World, proc: Proc, held: DilocoState | None) -> None:
        self.sim, self.proc, self.held = sim, proc, held
        self.book = RecordBook()  # (the simulation's coordinator signs no records: it stays empty)

    def latest(self) -> DilocoState | None:
        return self.held

    def save(self, s: DilocoState, *, wait: bool = False) -> None:
        if self.proc.dead:
            raise Killed()
        self.proc.disk[s.inner_step] = copy.deepcopy(s)
        ring = self.proc.ring  # an applied average's units are its ring's (a skipped one's: none, whichever)
        if s.skipped or (s.skipped is False and ring is not None and ring[1] + 1 == s.outer_step):
            self.sim.verdicts.setdefault((s.outer_step, state_hash(s)), set()).add(
                (None if s.skipped else ring[0], s.skipped))
        for k in sorted(self.proc.disk)[:-3]:
            del self.proc.disk[k]

    def load(self, inner_step: int) -> DilocoState:
        return copy.deepcopy(self.proc.disk[inner_step])
