"""What the simulated processes of a fault simulation (:mod:`.sim`) share: virtual time and one
condition, the event log, the rows every node recorded, the rings being formed, and the fault
points through which a process dies (:meth:`World.kill`), stalls or is poisoned
(:meth:`World.gate`, :meth:`World.poison`).

:class:`World` is all the simulated parts (:mod:`.sim_parts`) see of the simulation; the driver
(:class:`~.sim_driver.Sim`) extends it with the coordinator and the schedule, so the parts never
import the driver.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from intellect_jax.coordinator.client import CoordinatorClient
from intellect_jax.diloco.parts import Outcome
from intellect_jax.diloco.state import DilocoState
from intellect_jax.net.comm import RingConfig
from intellect_jax.testing.identities import credentials
from intellect_jax.testing.clock import SimClock
from intellect_jax.testing.sim_plan import Fault, SimParams


class Killed(BaseException):
    """The simulated node process died (SIGKILL): nothing of it runs any more."""


@dataclass
class Proc:
    """One process of one node (a restart is a new Proc with the same node id and disk)."""

    node_id: str
    number: int
    faults: list[Fault]
    disk: dict[int, DilocoState]
    start_from: str  # "fresh" | "latest" | "stale" | "empty"
    started_at: float = 0.0
    dead: bool = False
    killed_at: float | None = None
    ended_at: float | None = None  # when its main thread ended (any way)
    restarted: bool = False
    stalled_until: float = 0.0
    stalls: list[tuple[float, float]] = field(default_factory=list)  # (from, until) of each SIGSTOP
    counts: Counter = field(default_factory=Counter)
    outcome: Outcome | None = None
    error: str | None = None
    exc: BaseException | None = None  # the unhandled exception behind ``error``
    client: CoordinatorClient | None = None
    mailbox: dict[int, Any] = field(default_factory=dict)
    receiving: int | None = None  # the outer step whose state it waits for (a donor can connect)
    ring: tuple[int, int] | None = None  # (epoch, boundary) of the last all-reduce it came out of

    @property
    def name(self) -> str:
        return f"{self.node_id}#{self.number}"

    @property
    def addr(self) -> str:
        return f"sim://{self.name}"


class Group:
    """The ranks of one all-reduce meeting in process (one per epoch and boundary)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.inputs: dict[int, Any] = {}
        self.drops: dict[int, Any] = {}  # error feedback buffers (gathered codecs)
        self.members: dict[int, Proc] = {}
        self.results: list[Any] | None = None
        self.error: str | None = None
        self.fail_ranks: set[int] = set()
        self.units: dict[int, Any] = {}  # the batch ranges each rank's contribution was trained on (data leases)
        self.sitting_out: tuple[str, ...] = ()  # the epoch's
        self.forged: set[int] = set()  # owners that forge their aggregates (World.forging) and are caught
        self.verdicts: dict[int, Any] = {}  # rank -> what its audit found (testing.audit_cases.fake_audit)


class World:
    """The shared state and fault points of one seeded simulation (see the module docstring)."""

    def __init__(self, seed: int, params: SimParams | None = None) -> None:
        self.seed, self.p = seed, params or SimParams()
        self.rng = np.random.default_rng(seed)
        self.clock = SimClock()
        self.cond = self.clock.Condition()
        self.log: list[str] = []
        self.ring_cfg = RingConfig(mode=self.p.mode, block_size=32, piece_numel=64, deadline=self.p.ring_deadline,
                                   exchange=self.p.exchange, robust=self.p.robust)
        self.run_id = "sim"
        # the butterfly's evidence comes from any owner: it must be signed (net.evidence), and is,
        # under the test authority whose certificate the coordinator is given
        self.ca = credentials("sim-operator").ca_der if self.p.exchange == "butterfly" else None
        self.rows: list[tuple[str, int, dict[str, Any]]] = []  # (proc, inner step, row) as recorded
        self.groups: dict[tuple[int, int], Group] = {}  # (epoch, boundary): an epoch spans steps
        self.leased: dict[tuple[str, int], Any] = {}  # (process, round) -> the batch ranges it was leased
        # (outer step, state hash) -> {(epoch, skipped)}: whose ring made each saved state (None:
        # a skipped average's, whichever ring), and whether the average was skipped (a step whose
        # rows nobody lived to write)
        self.verdicts: dict[tuple[int, str], set[tuple[int | None, bool]]] = {}
        self.by_addr: dict[str, Proc] = {}
        self.injected: Counter = Counter()
        self.paused_until = 0.0  # the coordinator is SIGSTOPped until then
        self.held: dict[tuple[str, int], Any] = {}  # (process, step): a false sitter's honest contribution
        # every exchange's (outer step, epoch, {node: its input}, result, {nodes sitting out})
        self.exchanges: list[tuple[int, int, dict[str, np.ndarray], np.ndarray, set[str]]] = []
        self.pausing = False  # a pause is under way (its thread holds, or waits for, the service's lock)
        rs = np.random.default_rng(12345)  # the task itself is the same for every seed
        p = self.p
        self.targets = [rs.standard_normal(p.dim).astype(np.float32) for _ in range(p.nodes + p.late_joiners + 2)]
        self.init = {"w": rs.standard_normal(p.dim).astype(np.float32), "u": np.zeros((4, 8), np.float32)}

    def say(self, who: str, line: str) -> None:
        self.log.append(f"{self.clock.now():9.3f} [{who}] {line}")

    def coordinator_paused(self) -> bool:
        return self.pausing or self.paused_until > self.clock.now()

    # ---- fault points --------------------------------------------------------------------------
    def gate(self, proc: Proc, hook: str, when: str, during: Callable[[float], None] | None = None) -> Fault | None:
        """A fault point of ``proc``: dies, stalls, or returns a fault the caller acts on."""
        if proc.dead:
            raise Killed()
        self.wait_unstalled(proc)
        if when == "before":
            proc.counts[hook] += 1
        n = proc.counts[hook] - 1
        for f in proc.faults:
            if f.hook == hook and f.nth == n and f.when == when:
                proc.faults.remove(f)
                self.injected[f"{f.kind}@{hook}/{when}"] += 1
                self.say(proc.name, f"FAULT {f.kind} at {hook} #{n} ({when})")
                if f.kind == "kill":
                    self.kill(proc)
                if f.kind == "stall":
                    proc.stalled_until = self.clock.now() + f.seconds
                    proc.stalls.append((self.clock.now(), proc.stalled_until))
                    self.clock.sleep(f.seconds)
                    self.say(proc.name, f"resumes after a {f.seconds:.2f}s stall")
                return f
        return None

    def poison(self, proc: Proc, where: str, step: int, tree: Any) -> Any:
        """``tree`` as the node's pseudo-gradient of outer step ``step`` (``where``: "own" before its
        own check, "wire" on its way into the exchange), corrupted if a poison fault says so.

        Besides :func:`corrupt`'s values, a malicious member's ("wire"): "flip" sends ``-N`` x its
        honest contribution (N: the run's nodes), "push" ``7`` x its norm in one fixed direction,
        "ratchet" ``1.6^step`` x it, "sitout" declares that it sits the round out (its own
        check is made to fail) yet sends its honest contribution, and "owner" sends it as it is
        but forges its aggregate as a butterfly owner (:meth:`forging`)."""
        for f in proc.faults:
            if not (f.hook == "poison" and f.nth == step):
                continue
            if f.value == "sitout" and where == "own":  # its check must fail: the honest one waits
                self.held[(proc.name, step)] = tree
                return corrupt(tree, "nan")
            if f.when == where:
                self.injected[f"poison {f.value} ({where})"] += 1
                self.say(proc.name, f"FAULT poison ({f.value}, {where}) at outer step {step}")
                if f.value == "sitout":
                    return self.held.pop((proc.name, step), tree)
                if f.value == "owner":
                    return tree
                return attack(tree, f.value, self.p.nodes, step) if f.value in ATTACKS else corrupt(tree, f.value)
        return tree

    def forging(self, proc: Proc, step: int) -> bool:
        """Whether the node, as a butterfly owner, sends back its segment's aggregate negated in
        outer step ``step`` (the same bytes to every member: only an audit can tell)."""
        return any(f.hook == "poison" and f.value == "owner" and f.nth == step for f in proc.faults)

    def withholding(self, proc: Proc, step: int) -> bool:
        """Whether the node comes to outer step ``step``'s all-reduce but sends none of its pieces."""
        return any(f.hook == "withhold" and f.nth == step for f in proc.faults)

    def framing(self, proc: Proc, step: int) -> bool:
        """Whether the node frames its ring predecessor in outer step ``step``: it poisons the
        partial sums it forwards (the round fails for everyone, and nobody can see whose doing it
        is), then accuses the predecessor, showing its honest piece as evidence."""
        return any(f.hook == "frame" and f.nth == step for f in proc.faults)

    def frames(self, proc: Proc, step: int) -> bool:
        """:meth:`framing`, counted and logged (at the accusation)."""
        if not self.framing(proc, step):
            return False
        self.injected["frame (an honest piece as evidence)"] += 1
        self.say(proc.name, f"FAULT frame: poisoned sums in outer step {step}, accusing its predecessor")
        return True

    def wait_unstalled(self, proc: Proc) -> None:
        """A stopped process's thread resumes when the stop ends (or dies with it)."""
        left = proc.stalled_until - self.clock.now()
        if left > 0:
            self.clock.sleep(left)
        if proc.dead:
            raise Killed()

    def kill_from_outside(self, proc: Proc) -> None:
        """SIGKILL from another thread: the process's own threads die at their next step."""
        try:
            self.kill(proc)
        except Killed:
            pass

    def kill(self, proc: Proc) -> None:
        """SIGKILL: the process is gone (its session drops, its rings and transfers fail)."""
        if proc.dead:
            raise Killed()
        proc.dead, proc.killed_at = True, self.clock.now()
        self.say(proc.name, "SIGKILL")
        if proc.client is not None:
            proc.client.close()
        with self.cond:
            self.cond.notify_all()
        raise Killed()


ATTACKS = ("flip", "push", "ratchet")


def attack(tree: Any, value: str, nodes: int, step: int) -> Any:
    """A malicious member's contribution made from its honest ``tree`` (:meth:`World.poison`)."""
    import jax

    leaves, treedef = jax.tree.flatten(tree)
    xs = [np.asarray(x, np.float32) for x in leaves]
    if value == "flip":
        out = [x * np.float32(-nodes) for x in xs]
    elif value == "ratchet":
        out = [x * np.float32(1.6 ** step) for x in xs]
    else:  # push: one direction, the same every round (seeded apart from the run)
        rng = np.random.default_rng(20_22)
        ds = [rng.standard_normal(x.shape).astype(np.float32) for x in xs]
        norm = np.sqrt(sum(float(np.sum(np.square(x, dtype=np.float64))) for x in xs))
        dn = np.sqrt(sum(float(np.sum(np.square(d, dtype=np.float64))) for d in ds))
        out = [d * np.float32(7 * norm / dn) for d in ds]
    return jax.tree.unflatten(treedef, out)


def corrupt(tree: Any, value: str) -> Any:
    """A copy of a pseudo-gradient tree with NaN or Inf in the first 1% of every leaf, NaN in the
    very last value only ("late-nan": where a ring successor never looks), or every value x1000."""
    import jax

    last = jax.tree.leaves(tree)[-1] if jax.tree.leaves(tree) else None

    def bad(x: np.ndarray) -> np.ndarray:
        y = np.array(x, np.float32, copy=True)
        if value == "x1000":
            return y * np.float32(1000)
        if value == "late-nan":
            if x is last:
                y.reshape(-1)[-1] = np.nan
            return y
        y.reshape(-1)[: max(1, y.size // 100)] = np.nan if value == "nan" else np.inf
        return y

    return jax.tree.map(bad, tree)
