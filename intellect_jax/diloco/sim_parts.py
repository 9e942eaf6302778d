"""The stand-ins and fault points of the DiLoCo fault simulation (see :mod:`.sim`): the fault
and schedule types, a node process's record, and the in-process parts a simulated node runs
with: a numpy trainer, the ring (the int8 ring's exact arithmetic), the state transport, the
disk, and the wrappers that route a node's calls through its fault points."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from intellect_jax.diloco.client import CoordinatorClient
from intellect_jax.diloco.clock import SimClock
from intellect_jax.diloco.local import NumpyInner
from intellect_jax.diloco.loop import Outcome, TransferFailed
from intellect_jax.diloco.protocol import Admission, Epoch
from intellect_jax.diloco.state import DilocoState
from intellect_jax.net.comm import CommStats
from intellect_jax.net.errors import PeerClosed, PeerTimeout
from intellect_jax.net.local import LocalGroup

if TYPE_CHECKING:
    from intellect_jax.diloco.sim import Sim

HOOKS = ("train", "sync", "allreduce", "serve", "receive", "admit")


class Killed(BaseException):
    """The simulated node process died (SIGKILL): nothing of it runs any more."""


@dataclass(frozen=True)
class SimParams:
    nodes: int = 4
    outer_steps: int = 10
    inner_steps: int = 4
    step_time: float = 0.01
    ring_time: float = 0.01
    transfer_time: float = 0.2
    heartbeat_interval: float = 0.2
    heartbeat_timeout: float = 1.0
    join_window: float = 2.0  # above the clients' longest reconnect backoff (1 s)
    reconnect_timeout: float = 30.0
    transfer_timeout: float = 20.0
    ring_deadline: float = 20.0
    max_time: float = 900.0  # virtual seconds before the run counts as not completing
    dim: int = 96
    fault_prob: float = 0.6  # chance that an incarnation gets a fault
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    coordinator_restarts: int = 2  # at most
    outage_prob: float = 0.3  # chance of one event that kills several nodes at once
    late_joiners: int = 1  # at most
    overlap: bool = False  # overlapped rounds (diloco/overlap.py)
    overlap_delay: int | None = 0  # their tau; 0: drawn from the seed (when ready, or 1..inner_steps)


@dataclass(frozen=True)
class Fault:
    hook: str  # one of HOOKS, or "poison" (nth = the outer step's all-reduce to poison)
    nth: int  # on this node process's nth call of that hook
    kind: str  # "kill" | "stall" | "partial" (allreduce: some ranks finish, the victim dies) | "poison"
    when: str = "before"  # "before" | "during" | "after"; poison: "own" (a broken host: its own
    #                       pseudo-gradient is bad) | "wire" (malicious: it sends bad values anyway)
    seconds: float = 0.0  # stall length
    value: str = ""  # poison: "nan" | "inf" | "x1000"


@dataclass
class Script:
    """A hand-written schedule instead of the seeded one (tests of one recovery path): faults per
    node process (``"n1#0"``: node n1's first process), driver events ``(time, "coordinator" |
    "join" | "outage", arg)`` (an outage's arg: comma-separated node ids) and how each node
    restarts after a kill (``"latest"``, ``"stale"``, ``"empty"``; default latest)."""

    faults: dict[str, list[Fault]] = field(default_factory=dict)
    events: list[tuple[float, str, str]] = field(default_factory=list)
    restarts: dict[str, str] = field(default_factory=dict)


@dataclass
class Proc:
    """One process of one node (a restart is a new Proc with the same node id and disk)."""

    node_id: str
    number: int
    faults: list[Fault]
    disk: dict[int, DilocoState]
    start_from: str  # "fresh" | "latest" | "stale" | "empty"
    dead: bool = False
    restarted: bool = False
    stalled_until: float = 0.0
    counts: Counter = field(default_factory=Counter)
    outcome: Outcome | None = None
    error: str | None = None
    client: CoordinatorClient | None = None
    mailbox: dict[int, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.node_id}#{self.number}"

    @property
    def addr(self) -> str:
        return f"sim://{self.name}"


class _StallWire:
    """The coordinator wire of one process: nothing gets through while the process is stopped."""

    def __init__(self, wire: Any, proc: Proc, clock: SimClock) -> None:
        self.w, self.proc, self.clock, self.name = wire, proc, clock, wire.name

    def _pause(self) -> None:
        left = self.proc.stalled_until - self.clock.now()
        if left > 0:
            self.clock.sleep(left)
        if self.proc.dead:
            raise PeerClosed("process gone")

    def open(self, msg: dict, timeout: float) -> Any:
        self._pause()
        return self.w.open(msg, timeout)

    def beat(self, handle: Any, msg: dict, patience: float) -> dict:
        self._pause()
        return self.w.beat(handle, msg, patience)

    def close(self, handle: Any) -> None:
        self.w.close(handle)

    def request(self, msg: dict, deadline: float | None, connect_timeout: float) -> dict:
        self._pause()
        return self.w.request(msg, deadline, connect_timeout)


class _Gated:
    """Calls of the named methods pass through a fault point before and after."""

    def __init__(self, target: Any, proc: Proc, sim: Sim, hooks: dict[str, str]) -> None:
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

    def __init__(self, sim: Sim, proc: Proc, target: np.ndarray) -> None:
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

    def pull(self, captured: Any, like: Any) -> Any:
        step, pg = captured  # the round that made it (the trainer has moved on by now)
        return self.sim.poison(self.proc, "own", step // self.sim.p.inner_steps, pg)


class _Group:
    def __init__(self, world: int) -> None:
        self.world = world
        self.inputs: dict[int, Any] = {}
        self.members: dict[int, Proc] = {}
        self.results: list[Any] | None = None
        self.error: str | None = None
        self.fail_ranks: set[int] = set()


class _Comm:
    """One rank of an in-process ring for one epoch; results are the int8 ring's exact bits."""

    def __init__(self, sim: Sim, proc: Proc, ep: Epoch) -> None:
        self.sim, self.proc, self.rank, self.world_size, self.epoch = sim, proc, ep.rank, ep.world_size, ep.epoch_id
        self.step = ep.outer_step + 1
        self.group = sim.groups.setdefault((ep.epoch_id, ep.outer_step), _Group(ep.world_size))
        self.last_stats = CommStats(world_size=ep.world_size, mode="int8")
        self.inspect: Any = None  # as the socket ring's: shown the predecessor's own contribution
        self.suspect: tuple[int, str] | None = None

    def all_reduce_mean(self, tree: Any) -> Any:
        sim, g, clock = self.sim, self.group, self.sim.clock
        f = sim.gate(self.proc, "allreduce", "before")
        tree = sim.poison(self.proc, "wire", self.step, tree)
        deadline = clock.now() + sim.p.ring_deadline
        with sim.cond:
            g.inputs[self.rank], g.members[self.rank] = tree, self.proc
            if len(g.inputs) == g.world and g.results is None and g.error is None:
                ordered = [g.inputs[r] for r in range(g.world)]
                g.results = LocalGroup(g.world, sim.ring_cfg, epoch=self.epoch).all_reduce_mean_all(ordered)
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
        if g.results is None or self.rank in g.fail_ranks:
            raise PeerClosed(f"sim ring epoch {self.epoch}: {g.error or 'a peer died before passing it on'}")
        sim.gate(self.proc, "allreduce", "after")
        if self.inspect is not None and self.world_size > 1:
            prev = (self.rank - 1) % self.world_size
            why = self.inspect(_flat(g.inputs[prev]), _flat(tree))
            self.suspect = (prev, why) if why else None
        return copy.deepcopy(g.results[self.rank])

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


def corrupt(tree: Any, value: str) -> Any:
    """A copy of a pseudo-gradient tree with NaN, Inf, or every value x1000."""
    import jax

    def bad(x: np.ndarray) -> np.ndarray:
        y = np.array(x, np.float32, copy=True)
        if value == "x1000":
            return y * np.float32(1000)
        y.reshape(-1)[: max(1, y.size // 100)] = np.nan if value == "nan" else np.inf
        return y

    return jax.tree.map(bad, tree)


class _Transport:
    """In-process state transfer: the donor's thread delivers a copy after ``transfer_time``."""

    def __init__(self, sim: Sim, proc: Proc) -> None:
        self.sim, self.proc = sim, proc

    def serve(self, joiner_id: str, joiner_addr: str, snapshot: DilocoState, meta: dict[str, Any],
              cancelled: Callable[[], bool]) -> Any:
        sim, proc, clock = self.sim, self.proc, self.sim.clock
        done, snap = clock.Event(), copy.deepcopy(snapshot)
        target = sim.by_addr.get(joiner_addr)

        def deliver(item: Any) -> None:
            if target is not None and not target.dead:
                with sim.cond:
                    target.mailbox[meta["outer_step"]] = item
                    sim.cond.notify_all()

        def run() -> None:
            try:
                sim.gate(proc, "serve", "before")
                clock.sleep(sim.p.transfer_time / 2)
                sim.gate(proc, "serve", "during")
                clock.sleep(sim.p.transfer_time / 2)
                sim._wait_unstalled(proc)
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
        sim.gate(proc, "receive", "during")
        if isinstance(item, Exception):
            raise item
        sim.gate(proc, "receive", "after")
        meta, snap = item
        return meta, copy.deepcopy(snap)


class _Disk:
    """A node's checkpoints: they outlive its processes (keep the newest 3)."""

    def __init__(self, sim: Sim, proc: Proc, held: DilocoState | None) -> None:
        self.sim, self.proc, self.held = sim, proc, held

    def latest(self) -> DilocoState | None:
        return self.held

    def save(self, s: DilocoState, *, wait: bool = False) -> None:
        if self.proc.dead:
            raise Killed()
        self.proc.disk[s.inner_step] = copy.deepcopy(s)
        for k in sorted(self.proc.disk)[:-3]:
            del self.proc.disk[k]

    def load(self, inner_step: int) -> DilocoState:
        return copy.deepcopy(self.proc.disk[inner_step])
