"""What a fault simulation (:mod:`.sim`) runs: its parameters (:class:`SimParams`), the faults of
a node process (:class:`Fault`, at the fault points named in :data:`HOOKS`), a hand-written
schedule (:class:`Script`), and the seeded draws of both (:func:`draw_faults`,
:func:`draw_schedule`): one seed, one schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

HOOKS = ("train", "sync", "allreduce", "serve", "receive", "admit", "register", "lease")


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
    # above the longest coordinator pause (as a deployment's 120 s is above ordinary 10-30 s stalls)
    reconnect_timeout: float = 60.0
    connect_timeout: float = 10.0  # a request's handshake (a paused coordinator longer than this: PeerTimeout)
    transfer_timeout: float = 20.0
    ring_deadline: float = 20.0
    max_time: float = 900.0  # virtual seconds before the run counts as not completing
    dim: int = 96
    fault_prob: float = 0.6  # chance that an incarnation gets a fault
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    coordinator_restarts: int = 2  # at most
    coordinator_pauses: int = 2  # at most (SIGSTOP of the coordinator for 0.05-30 s, log-uniform)
    max_pause: float = 30.0
    node_and_coordinator_prob: float = 0.15  # chance of one event that kills a node and the coordinator together
    late_coordinator_prob: float = 0.1  # chance that the coordinator starts after the founders
    start_in_window_prob: float = 0.4  # per coordinator crash/pause: a node killed as it starts (restarts inside it)
    outage_prob: float = 0.3  # chance of one event that kills several nodes at once
    all_but_one_prob: float = 0.3  # of those outages: every live node but one
    all_prob: float = 0.25  # of those outages: every live node
    auto_rollback_after: float | None = 20.0  # the coordinator's (None: the operator rolls back by hand)
    ckpt_every: int = 0  # outer steps between checkpoints (0: drawn, mostly 1, sometimes 2 or 3)
    end_bound: float = 5.0  # a process still running this long after the run completed (and it could act) hangs
    late_joiners: int = 1  # at most
    overlap: bool = False  # overlapped rounds (diloco/overlap.py)
    overlap_delay: int | None = 0  # their tau; 0: drawn from the seed (when ready, or 1..inner_steps)
    mode: str = "int8"  # the exchange's codec (blocks and top-k chunks of 32 values), e.g. "topk4"
    feedback: float = 1.0  # error feedback of a gathered codec (int2, int1, topk<K>, top1of<G>)
    feedback_local: float = 0.0  # the share of it kept in each node's own params (diloco.feedback_local)
    leases: bool = True  # each round's data leased from the coordinator (coordinator/leases.py), units of H/2 steps
    frame_prob: float = 0.15  # chance that an incarnation accuses its ring predecessor falsely (1-2 rounds)
    exchange: str = "ring"  # "butterfly": each segment's owner sees every piece (net/butterfly.py); signed evidence
    robust: str = "mean"  # the butterfly owners' aggregator (net/robust.py)
    forge_prob: float = 0.1  # butterfly: chance that an incarnation forges its aggregates as owner (net/audit.py)
    withhold_prob: float = 0.3  # butterfly: chance that a seed has a node that withholds its pieces (draw_withholder)
    steer_prob: float = 0.1  # butterfly: chance that an incarnation pushes 7x its norm as it sends (draw_steerers)



def unit_steps(inner_steps: int) -> int:
    """The simulation's data unit: half a round (two units per round) when H is even."""
    return inner_steps // 2 if inner_steps % 2 == 0 else inner_steps

@dataclass(frozen=True)
class Fault:
    hook: str  # one of HOOKS, "poison" (nth = the outer step's all-reduce to poison) or "frame" (nth =
    #            the outer step whose all-reduce it reports its honest predecessor for, showing its real piece)
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
    # more driver events: (t, "pause", "20") stops the coordinator for 20 s (SIGSTOP); (t,
    # "coordinator", "5") crashes it for 5 s (arg optional); (t, "kill+coordinator", "n1") SIGKILLs
    # n1 and crashes the coordinator at once; (t, "outage", "all-but-one") kills every live node
    # but one, (t, "outage", "all") every live node. Restart mode "none": the node stays dead.


def draw_faults(rng: np.random.Generator, p: SimParams, joining: bool) -> list[Fault]:
    """The seeded faults of one node process (most get none); ``joining``: it will be a joiner."""
    if rng.random() >= p.fault_prob:
        return []
    # a process that will join mostly faults where joiners are; founders also while donating
    weights = dict(zip(HOOKS, (1, 1, 1, 0, 3, 3, 2, 1) if joining else (2, 2, 2, 2, 0, 0, 1, 2)))
    hook = str(rng.choice(HOOKS, p=[weights[h] / sum(weights.values()) for h in HOOKS]))
    kind = str(rng.choice(["kill", "kill", "stall", "stall"]
                          + (["partial", "partial-outage"] if hook == "allreduce" else [])))
    when = str(rng.choice(["before", "during", "after"] if hook in ("train", "serve", "receive")
                          else ["before", "after"]))
    if kind.startswith("partial"):
        when = "before"
    long = rng.random() < 0.7  # long stalls (SIGSTOP 1.5-30 s) get the node evicted, short ones not
    seconds = float(rng.uniform(1.5, 30.0) if long else rng.uniform(0.05, 0.5))
    rare = hook in ("serve", "receive", "admit", "register")  # a process calls these once or twice
    return [Fault(hook, int(rng.integers(0, 2 if rare else 6)), kind, when, seconds)]


def draw_frames(rng: np.random.Generator, p: SimParams) -> list[Fault]:
    """A malicious successor's false accusations (drawn from their own stream, so the other
    draws of a seed stay as they were): the predecessor's honest piece shown as evidence."""
    if rng.random() >= p.frame_prob:
        return []
    steps = rng.choice(np.arange(1, p.outer_steps + 1), size=int(rng.integers(1, 3)), replace=False)
    return [Fault("frame", int(s), "frame") for s in sorted(steps)]


def draw_forgers(rng: np.random.Generator, p: SimParams) -> list[Fault]:
    """A butterfly owner that forges its aggregates from some outer step on (its own stream, so
    the other draws of a seed stay as they were); its auditor's case gets it banned."""
    if p.exchange != "butterfly" or rng.random() >= p.forge_prob:
        return []
    first = int(rng.integers(1, p.outer_steps + 1))
    return [Fault("poison", s, "poison", "wire", value="owner") for s in range(first, p.outer_steps + 1)]


def draw_steerers(rng: np.random.Generator, p: SimParams) -> list[Fault]:
    """A member that from some outer step on sends 7x its norm in one fixed direction ("push":
    :meth:`~.sim_world.World.poison`; its own stream, so the other draws of a seed stay as they
    were); the owners that see its rows outsized show them, and the coordinator evicts it."""
    if p.exchange != "butterfly" or rng.random() >= p.steer_prob:
        return []
    first = int(rng.integers(1, p.outer_steps + 1))
    return [Fault("poison", s, "poison", "wire", value="push") for s in range(first, p.outer_steps + 1)]


def attacker(value: str, steps: int) -> list[Fault]:
    """A malicious member's faults from outer step 1 to ``steps``: ``"stall"`` comes to every
    all-reduce and withholds its pieces (:meth:`~.sim_world.World.withholding`), any other
    ``value`` corrupts what it sends (:meth:`~.sim_world.World.poison`)."""
    if value == "stall":
        return [Fault("withhold", s, "withhold") for s in range(1, steps + 1)]
    return [Fault("poison", s, "poison", "wire", value=value) for s in range(1, steps + 1)]


def draw_withholder(rng: np.random.Generator, p: SimParams) -> tuple[str, int] | None:
    """(node, first step): the one node of a seed that, from that outer step on, in every
    incarnation, comes to each butterfly all-reduce of three or more and sends none of its
    pieces while its heartbeats go on (its own stream, so the other draws of a seed stay as they
    were); only the others' reports can get it evicted. One at most: a stall needs most of the
    others to witness it, and two withholders in a ring of four are half of it."""
    if p.exchange != "butterfly" or rng.random() >= p.withhold_prob:
        return None
    return f"n{int(rng.integers(p.nodes))}", int(rng.integers(1, p.outer_steps + 1))


def draw_schedule(rng: np.random.Generator, p: SimParams) -> list[tuple[float, str, str]]:
    """The seeded driver events (see :class:`Script` for what each does)."""
    events: list[tuple[float, str, str]] = []

    def also_start() -> str:  # a node killed as the window opens restarts inside it
        return ",start" if rng.random() < p.start_in_window_prob else ""

    for _ in range(int(rng.integers(0, p.coordinator_restarts + 1))):
        events.append((float(rng.uniform(0.2, 4.0)), "coordinator", f"{rng.uniform(0.2, 3.0):.3f}{also_start()}"))
    for j in range(int(rng.integers(0, p.late_joiners + 1))):
        events.append((float(rng.uniform(0.1, 3.0)), "join", f"n{p.nodes + j}"))
    if rng.random() < p.outage_prob:  # several nodes die at once (a site outage), all but one, or all
        u = rng.random()  # (the correlated ones mostly once the run is under way: from 2 s, the join window)
        kind = "all-but-one" if u < p.all_but_one_prob else "all" if u < p.all_but_one_prob + p.all_prob else ""
        events.append((float(rng.uniform(1.5, 3.0) if kind else rng.uniform(0.05, 2.0)), "outage", kind))
    for _ in range(int(rng.integers(0, p.coordinator_pauses + 1))):  # log-uniform 0.05 s .. max_pause
        seconds = math.exp(rng.uniform(math.log(0.05), math.log(p.max_pause)))
        events.append((float(rng.uniform(0.05, 4.0)), "pause", f"{seconds:.3f}{also_start()}"))
    if rng.random() < p.node_and_coordinator_prob:
        events.append((float(rng.uniform(0.2, 4.0)), "kill+coordinator", ""))
    if rng.random() < p.late_coordinator_prob:  # the founders start before their coordinator
        events.append((0.0, "coordinator", f"{rng.uniform(0.5, 5.0):.3f}"))
    return events

