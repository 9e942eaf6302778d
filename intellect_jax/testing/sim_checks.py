"""The invariants a fault simulation (:mod:`.sim`) checks, as functions of what it recorded:
never two hashes for one outer step (:func:`forks`), every process ends cleanly (:func:`ends`),
no eviction that only the coordinator's own stall explains (:func:`stall_evictions`), nobody
evicted as a poisoner on a false accusation (:func:`framed`), no process that lingers long
after the run completed (:func:`late_ends`), and every unit of data trained exactly once
(:func:`leases`). Each returns the
violations as lines; :meth:`.Sim.check` gathers them."""

from __future__ import annotations

import re
from typing import Any

from intellect_jax.coordinator.journal import RunRecord
from intellect_jax.coordinator.protocol import CoordinatorConfig, CoordinatorUnavailable
from intellect_jax.net.errors import NetError
from intellect_jax.testing.sim_plan import SimParams
from intellect_jax.testing.sim_world import Proc

TRANSIENT_ENDS = (CoordinatorUnavailable, NetError, OSError, TimeoutError)  # no process may end of these

Window = tuple[float, float]  # (from, until)


def forks(rows: list[tuple[str, int, dict[str, Any]]], rec: RunRecord) -> list[str]:
    """Outer steps with two hashes among the rows nodes logged, or one other than the recorded."""
    by_step: dict[int, set[str]] = {}
    for _, _, row in rows:
        by_step.setdefault(row["outer_step"], set()).add(row["outer_hash"])
    out = []
    for k, hs in sorted(by_step.items()):
        if len(hs) > 1:
            out.append(f"FORK: outer step {k} has {len(hs)} hashes: {sorted(h[:12] for h in hs)}")
        elif k in rec.hashes and rec.hashes[k] not in hs:
            out.append(f"FORK: outer step {k} recorded {rec.hashes[k][:12]}, nodes logged {list(hs)[0][:12]}")
    return out


def units_of(batches: list[int], u: int) -> list[list[int]] | str:
    """The units (``[a, b)`` ranges, merged) that a round's trained batches cover, each whole and
    in order; else what is wrong with them."""
    from intellect_jax.coordinator.leases import RangeSet

    units = [batches[i] // u for i in range(0, len(batches), u)]
    if len(batches) % u or any(batches[i:i + u] != list(range(k * u, k * u + u))
                               for i, k in zip(range(0, len(batches), u), units)):
        return f"batches {batches[:8]} are not whole units of {u}"
    return RangeSet([[k, k + 1] for k in units]).ranges()


def leases(rows: list[tuple[str, int, dict[str, Any]]], rec: RunRecord, groups: dict[tuple[int, int], Any],
           final: bool, verdicts: dict[tuple[int, str], set[tuple[int | None, bool]]] | None = None) -> list[str]:
    """Data leases (coordinator/leases.py): every unit in exactly one place, none trained twice;
    each recorded outer step's trained units are exactly those its contributors trained (what
    the ring itself saw: who sent in the epoch the nodes' rows name, not sitting out, on which
    batches it trained), none for a skipped average; at the run's end (``final``) nothing is out.
    A recorded step no node lived to log (rows are written once the next barrier records it) is
    judged by the states saved of it (``verdicts``: (step, hash) -> {(epoch, skipped)})."""
    led = rec.leases
    if led is None:
        return []
    out = [f"LEASES: {p}" for p in led.problems()]
    epochs: dict[int, set[tuple[int | None, bool]]] = {}
    for _, _, row in rows:  # the rows of the history the run kept (its recorded hashes)
        if rec.hashes.get(row["outer_step"]) == row["outer_hash"]:
            epochs.setdefault(row["outer_step"], set()).add((row["epoch"], bool(row.get("skipped"))))
    for (s, h), seen in (verdicts or {}).items():
        if s not in epochs and rec.hashes.get(s) == h:
            epochs[s] = set(seen)
    u, compared = led.unit_steps, 0
    for s, seen in sorted(epochs.items()):
        want: dict[str, Any] = {}  # a skipped average trains nothing, whichever ring made it
        if not all(skipped for _, skipped in seen):
            if len(seen) != 1:
                out.append(f"LEASES: outer step {s} was logged from several epochs or skip verdicts: "
                           f"{sorted(seen, key=str)}")
                continue
            (epoch, _), = seen
            g = groups.get((epoch, s - 1))
            if g is None:
                out.append(f"LEASES: outer step {s} was logged from epoch {epoch}, whose ring was never seen")
                continue
            want = {q.node_id: units_of(g.units[r], u) for r, q in g.members.items()
                    if q.node_id not in g.sitting_out and g.units.get(r)}
        compared += 1
        got = led.commits.get(s, {})
        if got != want:
            out.append(f"LEASES: outer step {s} recorded the units {got} as trained, its ring carried {want}")
    if final and led.outstanding():
        out.append(f"LEASES: {led.outstanding()} units still out or pending after the run completed")
    if final and not compared:
        out.append("LEASES: no recorded outer step could be compared with its ring")
    return out


def ends(procs: list[Proc]) -> list[str]:
    """Processes still alive that never finished, or ended of an exception (a transient
    coordinator fault above all: the client must wait those out) other than a proven forger's
    refusal to come back."""
    out = []
    forgers = _forgers(procs)
    for q in procs:
        if not q.dead and q.outcome is None and q.error is None:
            out.append(f"{q.name} never finished")
        elif q.error and getattr(q.exc, "reason", None) == "banned" and q.node_id in forgers:
            continue  # a forger (any incarnation), proven by its own signatures, may not come back
        elif q.error and isinstance(q.exc, TRANSIENT_ENDS):
            out.append(f"{q.name} ended because of a transient coordinator fault: {q.error}")
        elif q.error:
            out.append(f"{q.name}: unhandled {q.error}")
    return out


def _forgers(procs: list[Proc]) -> set[str]:
    return {q.node_id for q in procs for f in q.faults if f.hook == "poison" and f.value == "owner"}


def banned(coord_events: list[tuple[float, str]], procs: list[Proc]) -> list[str]:
    """Evictions or bans on an audit of a node none of whose processes forged an aggregate."""
    forgers, out = _forgers(procs), []
    for t, line in coord_events:
        m = re.match(r"evicted (\S+): (shown at fault by an audit|banned)", line)
        if m and m.group(1) not in forgers:
            out.append(f"{m.group(1)} evicted at {t:.1f}s on an audit, but it never forged an aggregate")
    return out


def framed(coord_events: list[tuple[float, str]], procs: list[Proc]) -> list[str]:
    """Evictions for poisoned contributions of a node none of whose processes sent poison: a
    false accusation (``frame`` faults show honest pieces as evidence) got it evicted."""
    poisoners = {q.node_id for q in procs for f in q.faults if f.hook == "poison" and f.when == "wire"}
    out = []
    for t, line in coord_events:
        m = re.match(r"evicted (\S+): poisoned contributions", line)
        if m and m.group(1) not in poisoners:
            out.append(f"{m.group(1)} evicted at {t:.1f}s as a poisoner, but it never sent poison (framed)")
    return out


def stall_evictions(coord_events: list[tuple[float, str]], procs: list[Proc], pauses: list[Window],
                    downtimes: list[Window], p: SimParams, cfg: CoordinatorConfig) -> list[str]:
    """Evictions that no fault of the node explains: caused by the coordinator's own stall.

    Which evictions: for silence ("no heartbeat for Xs", "missed boundary ...") and for a
    session its client dropped ("connection lost": a client that gives its session up while
    the coordinator is paused). Such an eviction of node N at time t is explained if in the
    window it was judged on some process of N was SIGKILLed, was SIGSTOPped, or (for a
    dropped session) ended (up to ``end_bound`` after t) or the coordinator crashed and restarted. The window ends at t
    and reaches back ``X + slack`` (heartbeat), ``boundary_timeout + slack`` (boundary) or
    ``reconnect_timeout + slack`` (dropped session: as long as a client may take to give
    up) seconds as the coordinator counts them: net of its own pauses (the stalls it
    excuses) and, to be safe, of its crashes, so the window reaches back over every pause
    or crash inside it (``X`` as the line says; ``slack``: two heartbeat intervals and two
    ticks). E.g. a node stopped 2.1-8.4 s, then a coordinator pause 3.8-22.5 s: the node is
    evicted at 22.5 s for the 1 s of silence it had before the pause: explained. Anything
    else (a stall the coordinator failed to excuse, a heartbeat or session lost in a stalled
    wire) is reported."""
    out = []
    slack = 2 * p.heartbeat_interval + 2 * cfg.tick_interval
    outside = sorted(pauses + downtimes, key=lambda w: -w[1])
    for t, line in coord_events:
        m = re.match(r"evicted (\S+): (no heartbeat for ([\d.]+)s|missed boundary|connection lost)", line)
        if not m:
            continue
        node, why = m.group(1), m.group(2)
        dropped = why == "connection lost"
        need = slack + (float(m.group(3)) if m.group(3) else p.reconnect_timeout if dropped
                        else cfg.boundary_timeout)
        start = t  # walk back from t over `need` seconds the coordinator counted (it skips its pauses)
        for a, b in outside:
            if a >= start:
                continue
            if b < start:
                if start - b >= need:
                    break
                need -= start - b
            start = a
        start -= need
        mine = [q for q in procs if q.node_id == node]
        explained = any((q.killed_at is not None and start <= q.killed_at <= t)
                        or any(a <= t and b >= start for a, b in q.stalls) for q in mine)
        if dropped and not explained:  # (a client drops its session as its process ends: a joiner told
            # the run is complete may still let go of the joiner it served for a moment after)
            explained = (any(q.ended_at is not None and start <= q.ended_at <= t + p.end_bound for q in mine)
                         or any(a <= t and b >= start for a, b in downtimes))
        if not explained:
            out.append(f"{node} evicted at {t:.1f}s ({why}) with no kill or stall of it since "
                       f"{start:.1f}s: the coordinator's own stall got it evicted")
    return out


def withheld(coord_events: list[tuple[float, str]], procs: list[Proc], window: float) -> list[str]:
    """Members evicted for stalling the all-reduce (most others said its pieces never reached
    them) that never withheld its pieces and had no kill or stall of any of its processes in the
    ``window`` seconds before: an honest member's pieces always arrive, so each such eviction
    must rest on a real stall."""
    out = []
    for t, line in coord_events:
        m = re.match(r"evicted (\S+): stalled the all-reduce", line)
        if not m:
            continue
        mine = [q for q in procs if q.node_id == m.group(1)]
        if any(f.hook == "withhold" for q in mine for f in q.faults):
            continue
        if not any((q.killed_at is not None and t - window <= q.killed_at <= t)
                   or any(a <= t and b >= t - window for a, b in q.stalls) for q in mine):
            out.append(f"{m.group(1)} evicted at {t:.1f}s for stalling the all-reduce, with no kill or stall of it "
                       f"in the {window:.0f}s before")
    return out


def steered(coord_events: list[tuple[float, str]], procs: list[Proc]) -> list[str]:
    """Members evicted for steering the average (most others showed their rows outsized) that
    never sent a corrupted contribution: an honest member's rows are never outsized against the
    others' (``net.evidence.outsized``)."""
    out = []
    for t, line in coord_events:
        m = re.match(r"evicted (\S+): steered the average", line)
        if m and not any(f.hook == "poison" and f.when == "wire" and f.value not in ("owner", "sitout")
                         for q in procs if q.node_id == m.group(1) for f in q.faults):
            out.append(f"{m.group(1)} evicted at {t:.1f}s for steering the average, though it never sent a "
                       "corrupted contribution")
    return out


def late_ends(procs: list[Proc], completed_at: float | None, outside: list[Window], end_bound: float,
              log: list[str]) -> list[str]:
    """Processes that ended more than ``end_bound`` after the run completed and they could act
    again: after the completion, the process's start, its own last stall, and the end of
    the coordinator's last pause or crash (``outside``; a donor that never lets go of a joiner
    shows here, as a node waiting on a transfer)."""
    if completed_at is None:
        return []
    out = []
    coord = max([b for _, b in outside], default=0.0)
    for q in procs:
        if q.dead or q.ended_at is None:
            continue
        settle = max([completed_at, q.started_at, coord] + [b for _, b in q.stalls])
        if q.ended_at - settle > end_bound:
            out.append(f"{q.name} ended {q.ended_at - settle:.1f}s after the run completed (bound "
                       f"{end_bound:.0f}s){why_late(q, log)}")
    return out


def evictions(log: list[str]) -> dict[str, int]:
    """node -> the boundary of the first epoch formed without it because it was evicted (from
    the coordinator's ``epoch N: members [...] at boundary K (evicted X: ...; ...)`` lines)."""
    out: dict[str, int] = {}
    for line in log:
        m = re.search(r"\[coord\] epoch \d+: members \[.*\] at boundary (\d+)(?: retry)? \((.*)\)$", line)
        for who in re.findall(r"evicted (\S+):", m.group(2)) if m else ():
            out.setdefault(who, int(m.group(1)))
    return out


def why_late(q: Proc, log: list[str]) -> str:
    """A diagnosis of a late end, where the log shows one (product bugs known to cause it)."""
    mine = [line.split("] ", 1)[1] for line in log if f" [{q.name}] " in line]
    told = next((i for i, line in enumerate(mine) if line.startswith("nothing to do: the run is complete")), None)
    if told is not None and any(re.match(r"serving \S+ failed: not reachable", line) for line in mine[told:]):
        return (": DONOR NEVER LET GO: its registration again was told the run is complete, yet its "
                "transfers waited out transfer_timeout (CoordinatorClient.serving_revoked stays False: "
                "register() cleared _fatal and a refused registration sets no view)")
    return ""
