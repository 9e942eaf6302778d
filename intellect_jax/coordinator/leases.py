"""Data leases: which units of the training stream each member trains, and which made it.

The training stream (every source of the mixture, by weight: ``intellect_jax.data``) is cut into
*units* of ``unit_steps`` inner steps' worth of batches: unit ``u`` is the stream's global
batches ``[u * unit_steps, (u + 1) * unit_steps)``. Each round (``round_steps`` inner steps, H)
a member trains ``round_steps / unit_steps`` units that the coordinator leased to it. A unit is
*trained* only once the outer step that took that member's contribution is recorded; the units
of a contribution that did not make it (its node died before the barrier, sat the round out,
its ring was aborted, the average was skipped, a rollback forgot the step) go back to the pool
and are handed out again, lowest first. So every unit is, at any time, in exactly one of:

* ``free``: released, to be leased again (with the never-leased ``[next_unit, inf)``);
* ``out``: leased to a node for one round, being trained;
* ``pending``: in a contribution to an outer step whose barrier formed (in the ring);
* ``trained``: in a recorded outer step (``commits`` keeps, per recent step, whose).

:class:`Ledger` is pure bookkeeping, driven by the coordinator's membership (``lease``,
:meth:`Ledger.contributions` when a barrier forms, :meth:`Ledger.recorded` when the next
barrier records the step, :meth:`Ledger.rollback`, :meth:`Ledger.finish`). A lease of a node
that sat out, died or left is not taken back at once (its process may resume and contribute it
to a barrier formed again): once outer step k is recorded, every lease of a round before k
that is still out goes back;
it lives in the run's journal as ranges (``[[a, b), ...]``), so it survives coordinator
restarts and stays small. :meth:`Ledger.problems` checks the partition (the seeded simulation
calls it after every event).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

Ranges = list[list[int]]  # sorted, disjoint, non-adjacent half-open [a, b)


class LeaseError(ValueError):
    """A lease request the ledger cannot honour (its geometry differs from the run's)."""


class RangeSet:
    """A set of non-negative integers as sorted disjoint ``[a, b)`` ranges."""

    def __init__(self, ranges: Ranges | None = None) -> None:
        self._r: list[tuple[int, int]] = []
        for a, b in ranges or ():
            self.add(a, b)

    def __len__(self) -> int:
        return sum(b - a for a, b in self._r)

    def __bool__(self) -> bool:
        return bool(self._r)

    def ranges(self) -> Ranges:
        return [[a, b] for a, b in self._r]

    def add(self, a: int, b: int) -> int:
        """Add ``[a, b)``; returns how many of its values were already in (0 for a disjoint add)."""
        if not 0 <= a <= b:
            raise ValueError(f"bad range [{a}, {b})")
        if a == b:
            return 0
        dup = self.overlap(a, b)
        i = bisect.bisect_left(self._r, (a, a))
        if i and self._r[i - 1][1] >= a:  # merge with the range before
            i -= 1
            a = min(a, self._r[i][0])
        j = i
        while j < len(self._r) and self._r[j][0] <= b:  # ... and every range it touches
            b = max(b, self._r[j][1])
            j += 1
        self._r[i:j] = [(a, b)]
        return dup

    def add_all(self, ranges: Ranges) -> int:
        return sum(self.add(a, b) for a, b in ranges)

    def overlap(self, a: int, b: int) -> int:
        """How many of ``[a, b)`` are in the set."""
        i = max(0, bisect.bisect_right(self._r, (a, a)) - 1)
        n = 0
        while i < len(self._r) and self._r[i][0] < b:
            lo, hi = self._r[i]
            n += max(0, min(b, hi) - max(a, lo))
            i += 1
        return n

    def remove(self, a: int, b: int) -> None:
        """Remove ``[a, b)``, which must be in the set."""
        if not 0 <= a <= b or self.overlap(a, b) != b - a:
            raise ValueError(f"[{a}, {b}) is not in the set")
        if a == b:
            return
        out: list[tuple[int, int]] = []
        for lo, hi in self._r:
            if hi <= a or lo >= b:
                out.append((lo, hi))
                continue
            if lo < a:
                out.append((lo, a))
            if hi > b:
                out.append((b, hi))
        self._r = out

    def take(self, n: int) -> Ranges:
        """Remove and return the ``n`` lowest values (fewer if the set holds fewer)."""
        got: Ranges = []
        while n > 0 and self._r:
            a, b = self._r[0]
            k = min(n, b - a)
            got.append([a, a + k])
            n -= k
            if a + k == b:
                self._r.pop(0)
            else:
                self._r[0] = (a + k, b)
        return got


def count(ranges: Ranges) -> int:
    return sum(b - a for a, b in ranges)


@dataclass
class Ledger:
    """The run's data leases (see the module docstring). ``round_steps`` (H) and ``unit_steps``
    are fixed by the first lease request; ``unit_tokens``: tokens per unit (the accounting's)."""

    round_steps: int = 0
    unit_steps: int = 0
    unit_tokens: int = 0
    stream: str = ""  # the fingerprint of the data stream the units are cut from (every node's the same)
    next_unit: int = 0
    free: RangeSet = field(default_factory=RangeSet)
    out: dict[str, dict[int, Ranges]] = field(default_factory=dict)  # node -> round -> units
    pending: dict[int, dict[str, Ranges]] = field(default_factory=dict)  # outer step -> node -> units
    commits: dict[int, dict[str, Ranges]] = field(default_factory=dict)  # recent recorded step -> node -> units
    trained: RangeSet = field(default_factory=RangeSet)
    rev: int = field(default=0, compare=False)  # bumped by every change (the journal saves then)
    discarded: int = 0  # units trained (or being trained) whose contribution did not make it
    duplicates: int = 0  # units recorded a second time (never, if the bookkeeping holds)

    # ---- requests ----------------------------------------------------------------------------
    @property
    def per_round(self) -> int:
        return self.round_steps // self.unit_steps if self.unit_steps else 0

    def lease(self, node: str, rnd: int, round_steps: int, unit_steps: int, unit_tokens: int,
              stream: str = "") -> Ranges:
        """``node``'s units for round ``rnd`` (the same ones if asked again while they are out;
        new ones once its round was contributed: a node training a round again, after a
        rollback or behind the run, never holds units of the history it left)."""
        self._geometry(round_steps, unit_steps, unit_tokens, stream)
        held = self.out.get(node, {}).get(rnd)
        if held is not None:
            return held
        self.rev += 1
        units = self.free.take(self.per_round)
        short = self.per_round - count(units)
        if short:
            units.append([self.next_unit, self.next_unit + short])
            self.next_unit += short
            units = RangeSet(units).ranges()
        self.out.setdefault(node, {})[rnd] = units
        return units

    def _geometry(self, round_steps: int, unit_steps: int, unit_tokens: int, stream: str) -> None:
        if unit_steps < 1 or round_steps < 1 or round_steps % unit_steps or unit_tokens < 1:
            raise LeaseError(f"a round of {round_steps} inner steps is not whole units of {unit_steps} "
                             f"(of {unit_tokens} tokens each)")
        if not self.unit_steps:
            self.round_steps, self.unit_steps, self.unit_tokens = round_steps, unit_steps, unit_tokens
            self.stream = stream
            self.rev += 1
        elif not self.stream and stream:  # a ledger from before streams were named: the first names it
            self.stream = stream
            self.rev += 1
        elif stream != self.stream:
            raise LeaseError(f"its data stream {stream or '(none)'} is not this run's {self.stream or '(none)'} "
                             "(other sources, tokenizer, sequence length, batch size or data seed)")
        elif (round_steps, unit_steps, unit_tokens) != (self.round_steps, self.unit_steps, self.unit_tokens):
            raise LeaseError(f"this run's units are {self.unit_steps} inner steps of {self.unit_tokens} tokens, "
                             f"{self.per_round} per round of {self.round_steps}; asked for {unit_steps} of "
                             f"{unit_tokens}, rounds of {round_steps}")

    # ---- the membership's events -------------------------------------------------------------
    def contributions(self, step: int, contributors: list[str]) -> None:
        """Barrier ``step`` formed: the round-``step`` units of ``contributors`` go into outer step
        ``step + 1``. A barrier formed again (its ring failed) replaces the earlier epoch's; a
        node of that epoch left out of this one keeps its lease (its process may come back and
        contribute it to a later forming of the same barrier): only :meth:`recorded` ends a round."""
        self.rev += 1
        before = self.pending.pop(step + 1, {})
        now: dict[str, Ranges] = {}
        for n in contributors:
            units, old = self.out.get(n, {}).pop(step, None), before.pop(n, None)
            if units is None:
                units = old
            elif old is not None:  # it leased the round again (a restarted process): the old ones go
                self._release(old)
            if units:
                now[n] = units
        for n, units in before.items():
            held = self.out.setdefault(n, {})
            if step in held:
                self._release(units)
            else:
                held[step] = units
        self._tidy()
        if now:
            self.pending[step + 1] = now

    def recorded(self, step: int, skipped: bool, keep: int) -> None:
        """Outer step ``step``'s hash was recorded; ``skipped``: its average was not applied."""
        self.rev += 1
        got = self.pending.pop(step, {})
        if skipped:
            for units in got.values():
                self._release(units)
        else:
            for units in got.values():
                self.duplicates += self.trained.add_all(units)
            if got:
                self.commits[step] = got
            for k in sorted(self.commits)[:-keep]:
                del self.commits[k]
        for n in list(self.out):  # rounds before ``step`` are over: a sit-out's, a dead node's lease
            for rnd in [r for r in self.out[n] if r < step]:
                self._release(self.out[n].pop(rnd))
        self._tidy()

    def rollback(self, to: int) -> None:
        """The run went back to outer step ``to``: every later step's units are trained again.
        Leases out stay: the nodes that resume from ``to`` may hold them for the rounds they
        train again (a lease nobody contributes goes back once its round's outer step is recorded).
        Steps older than the ``commits`` kept (a rollback deeper than the history) stay trained."""
        self.rev += 1
        for s in [s for s in self.commits if s > to]:
            for units in self.commits.pop(s).values():
                back = [[a, b] for a, b in units if self.trained.overlap(a, b) == b - a]  # (all, unless damaged)
                for a, b in back:
                    self.trained.remove(a, b)
                self._release(back)
        for s in [s for s in self.pending if s > to]:
            for units in self.pending.pop(s).values():
                self._release(units)

    def finish(self) -> None:
        """The run is complete: nothing more is trained; whatever is out or pending goes back."""
        self.rev += 1
        for per in self.pending.values():
            for units in per.values():
                self._release(units)
        self.pending = {}
        for per in self.out.values():
            for units in per.values():
                self._release(units)
        self.out = {}

    def _release(self, units: Ranges) -> None:
        self.discarded += count(units)
        self.free.add_all(units)

    def _tidy(self) -> None:
        self.out = {n: r for n, r in self.out.items() if r}

    # ---- reports -----------------------------------------------------------------------------
    def outstanding(self) -> int:
        return sum(count(u) for r in self.out.values() for u in r.values()) + \
            sum(count(u) for p in self.pending.values() for u in p.values())

    def status(self) -> dict[str, Any]:
        """Tokens trained, computed and discarded, duplicates, goodput (trained / computed)."""
        t, d = len(self.trained), self.discarded
        tok = self.unit_tokens
        return {"unit_steps": self.unit_steps, "units_trained": t, "units_discarded": d,
                "units_outstanding": self.outstanding(), "units_free": len(self.free),
                "tokens_trained": t * tok, "tokens_discarded": d * tok, "duplicates": self.duplicates,
                "goodput": round(t / (t + d), 4) if t + d else None}

    def problems(self) -> list[str]:
        """What breaks the partition of ``[0, next_unit)`` into free, out, pending and trained
        (each unit in exactly one), or the per-step commits (disjoint, all trained); empty: none."""
        bad: list[str] = []
        seen = RangeSet()
        parts = [("free", self.free.ranges())]
        parts += [(f"out {n} round {r}", u) for n, rs in self.out.items() for r, u in rs.items()]
        parts += [(f"pending step {s} {n}", u) for s, p in self.pending.items() for n, u in p.items()]
        parts.append(("trained", self.trained.ranges()))
        for name, units in parts:
            dup = seen.add_all(units)
            if dup:
                bad.append(f"{dup} units of {name} are also elsewhere")
        if seen.ranges() != ([[0, self.next_unit]] if self.next_unit else []):
            bad.append(f"the units {seen.ranges()[:4]} are not [0, {self.next_unit}) (some lost)")
        done = RangeSet()
        for s, per in self.commits.items():
            for n, units in per.items():
                if done.add_all(units):
                    bad.append(f"units of {n} recorded in outer step {s} were recorded before")
                if sum(self.trained.overlap(a, b) for a, b in units) != count(units):
                    bad.append(f"units of {n} in outer step {s} are not counted as trained")
        if self.duplicates:
            bad.append(f"{self.duplicates} units trained twice")
        return bad

    # ---- journal -----------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"round_steps": self.round_steps, "unit_steps": self.unit_steps, "unit_tokens": self.unit_tokens,
                "stream": self.stream,
                "next_unit": self.next_unit, "free": self.free.ranges(),
                "out": {n: {str(r): u for r, u in rs.items()} for n, rs in self.out.items()},
                "pending": {str(s): p for s, p in self.pending.items()},
                "commits": {str(s): p for s, p in self.commits.items()},
                "trained": self.trained.ranges(), "discarded": self.discarded,
                "duplicates": self.duplicates}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Ledger:
        def ranges(x: Any) -> Ranges:
            if not (isinstance(x, list) and all(isinstance(r, list) and len(r) == 2 and
                                                all(type(v) is int and v >= 0 for v in r) and r[0] < r[1]
                                                for r in x)):
                raise ValueError(f"not a list of [a, b) ranges: {str(x)[:80]}")
            return [list(r) for r in x]

        return cls(round_steps=int(d["round_steps"]), unit_steps=int(d["unit_steps"]),
                   unit_tokens=int(d["unit_tokens"]), stream=str(d.get("stream", "")), next_unit=int(d["next_unit"]),
                   free=RangeSet(ranges(d["free"])),
                   out={str(n): {int(r): ranges(u) for r, u in rs.items()} for n, rs in d["out"].items()},
                   pending={int(s): {str(n): ranges(u) for n, u in p.items()} for s, p in d["pending"].items()},
                   commits={int(s): {str(n): ranges(u) for n, u in p.items()} for s, p in d["commits"].items()},
                   trained=RangeSet(ranges(d["trained"])), discarded=int(d["discarded"]),
                   duplicates=int(d["duplicates"]))
