"""The run's one history: hash agreement at barriers, rollbacks, and the wait for lost state.

:class:`History` holds the journal's :class:`~.journal.RunRecord` (the hash recorded for every
recent outer step, the newest one as the high-water mark) and the rules that keep it single: a
barrier records its step's hash (the recorded one, else the one a strict majority of its
members reports; without such a quorum it waits) and never goes back behind the high-water
mark unless a rollback was allowed, by the operator (``allow_rollback_to``) or by the
coordinator itself once nobody has brought the newest state for ``auto_rollback_after``. A
coordinator that lost its journal does not know the history: it waits for most members of the
newest epoch the nodes report before rebuilding the run.

It decides; :class:`~.membership.Membership` acts (evicts, promotes, moves its floor), so this
module needs only the node records of :mod:`.roster`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from intellect_jax.coordinator.journal import RunRecord
from intellect_jax.coordinator.protocol import CoordinatorConfig, Peer, Resume
from intellect_jax.coordinator.roster import Node, Role


class History:
    """The run record and the rules over it (see the module docstring); ``say`` logs an event."""

    def __init__(self, record: RunRecord, config: CoordinatorConfig, say: Callable[[str], None]) -> None:
        self.record, self.config, self._say = record, config, say
        self.rollback = config.allow_rollback_to  # a barrier this far back may rewrite the history (once)
        self.rollback_by = f"operator: allow_rollback_to={self.rollback}"  # who allowed it (journaled)
        self.hashes: dict[int, dict[str, Any]] = {}  # recent steps: every member's hash, any mismatch
        self.waiting_since: float | None = None  # not started with history: since when (auto rollback)
        self.unknown = False  # nodes bring history that the record lacks (a coordinator without its journal)
        self._quorum_said = False
        self.waiting: str | None = None  # why the barrier that everyone reached cannot complete

    def lowest_resumable(self) -> int:
        """The oldest outer step a resumed node may bring (the high-water mark, unless a rollback
        was allowed)."""
        hwm = self.record.hwm_step or 0
        return min(hwm, self.rollback) if self.rollback is not None else hwm

    def note_unknown(self, node_id: str, step: int) -> None:
        """A node brings state but the record has no history (the journal was lost)."""
        if not self.unknown:
            self.unknown = True
            self._say(f"WARNING {node_id} brings the state of outer step {step} but this coordinator "
                      "has no record of the run (started without its journal?): the run's history is unknown; "
                      "it is rebuilt only once most members of the newest epoch the nodes report are back")

    def mismatch(self, step: int) -> tuple[Peer, ...]:
        """(node, hash) of every member at barrier ``step`` if they disagreed, else ()."""
        return tuple(tuple(p) for p in self.hashes.get(step, {}).get("mismatch", ()))  # type: ignore[misc]

    # ---- barriers ------------------------------------------------------------------------
    def agree(self, step: int, members: list[Node]) -> tuple[list[Node], list[tuple[Node, str]], str | None] | None:
        """The run's hash of outer step ``step`` from the members' (in ring order): the one already
        recorded, else the one a quorum (a strict majority of the members) reports, recorded now
        (a rollback first, if one is allowed down to ``step``). Returns (members kept, (member,
        why) to evict: those whose state differs, or all if they are behind the history; that
        hash or None if nobody sent one), or None: no quorum, the barrier waits (see
        :attr:`waiting`). A joiner at its first barrier holds a state it received, not one it
        made: its hash is checked against the members' quorum but is no vote (else a donor that
        served a bogus state would win a majority with its joiner's voice)."""
        hashes = {n.node_id: n.arrival.state_hash for n in members if n.arrival.state_hash}  # type: ignore[union-attr]
        voters = [n for n in members if n.role is not Role.ADMITTED] or members
        ballots = {n.node_id: hashes[n.node_id] for n in voters if n.node_id in hashes}
        rec = self.record
        if rec.hwm_step is not None and step < rec.hwm_step and (self.rollback is None or step < self.rollback):
            # (unreachable: arrivals below the floor are expelled) never rewrite history
            return [], [(n, f"behind: at outer step {step}, the run has reached {rec.hwm_step}") for n in members], None
        recorded = rec.hashes.get(step) or _quorum(ballots, len(voters))
        if recorded is None and ballots:
            votes = ", ".join(f"hash {h[:16]}.. by [{', '.join(n for n in ballots if ballots[n] == h)}]"
                              for h in dict.fromkeys(ballots.values()))
            self._wait(f"no quorum for outer step {step}: {votes} of {len(voters)} members; waiting for a member "
                       "to arrive or leave, or for the operator")
            return None
        self.waiting = None
        mismatch = tuple(sorted(hashes.items())) if len(set(hashes.values()) | {recorded} - {None}) > 1 else ()
        at = self.hashes.setdefault(step, {"hashes": {}, "mismatch": []})
        at["hashes"].update(hashes)
        for k in sorted(self.hashes)[: -self.config.history]:
            del self.hashes[k]
        if mismatch:
            at["mismatch"] = [list(p) for p in mismatch]
            self._say("WARNING state hash mismatch at outer step "
                      f"{step}: " + ", ".join(f"{n}={h[:16]}" for n, h in mismatch)
                      + f"; the run's is {str(recorded)[:16]}")
        if recorded is None:
            return members, [], None
        if rec.hwm_step is not None and step < rec.hwm_step:  # allow_rollback_to, an operator's or automatic
            rec.rollbacks.append({"from": rec.hwm_step, "to": step, "by": self.rollback_by})
            self._say(f"WARNING rolled the run back from outer step {rec.hwm_step} to {step} ({self.rollback_by})")
            rec.truncate(step)
            self.rollback = None
        rec.record(step, recorded, self.config.history)
        rec.sign(step, len(voters), {n.node_id: n.arrival.vote for n in voters  # type: ignore[union-attr]
                                     if n.arrival.vote and n.arrival.state_hash == recorded})  # type: ignore[union-attr]
        keep: list[Node] = []
        evict: list[tuple[Node, str]] = []
        for n in members:
            h = n.arrival.state_hash  # type: ignore[union-attr]
            if h and h != recorded:
                evict.append((n, f"diverged: state hash {h[:16]} at outer step {step}, the run's is {recorded[:16]}"))
            else:
                keep.append(n)
        return keep, evict, recorded

    def _wait(self, why: str) -> None:
        """A barrier cannot record its step: say why (once for each reason)."""
        if why != self.waiting:
            self.waiting = why
            self._say(f"WARNING {why}")

    def complete(self, step: int, recorded: str) -> None:
        """Barrier ``step`` kept members with hash ``recorded``: the run is complete if it was the last
        (after the evictions :meth:`agree` asked for: they happen in a run not yet complete)."""
        rec = self.record
        if rec.outer_steps is not None and step >= rec.outer_steps:
            rec.completed = True
            self._say(f"run complete: outer step {step} of {rec.outer_steps}, state hash {recorded[:16]}")

    def formed(self) -> None:
        """A barrier formed: the history is known again and nobody waits for lost state."""
        self.unknown, self.waiting_since = False, None

    def claimed_ring(self, claim: Resume | None, nodes: dict[str, Node], since: float | None,
                     now: float) -> tuple[int, bool] | None:
        """Not started (restarted, or rebuilding): the epoch a node claims, and whether that ring
        is broken: a member's process of that epoch has not come back within a heartbeat timeout
        of ``since`` (the first registration; a restarted process claims no epoch, or an older
        one). None: the node claims no epoch."""
        if claim is None or not claim.members or since is None:
            return None
        back = all(m in nodes and (c := nodes[m].claim) is not None and c.epoch_id >= claim.epoch_id
                   for m in claim.members)
        return claim.epoch_id, now - since > self.config.heartbeat_timeout and not back

    # ---- waiting for the state -----------------------------------------------------------
    def overdue(self, now: float, resuming: bool) -> bool:
        """``resuming`` (not started, with history) for longer than ``auto_rollback_after``."""
        if not resuming or self.record.completed:
            self.waiting_since = None
            return False
        self.waiting_since = now if self.waiting_since is None else self.waiting_since
        after = self.config.auto_rollback_after
        return after is not None and now - self.waiting_since >= after

    def extend(self, gap: float) -> None:
        """The coordinator stalled ``gap`` seconds: the wait did not run meanwhile."""
        if self.waiting_since is not None:
            self.waiting_since += gap

    def auto_rollback(self, claims: list[Resume], floor: int, now: float, resuming: bool) -> int | None:
        """Nobody has brought the state of boundary ``floor`` for ``auto_rollback_after``: allow a
        rollback to the newest state that registered nodes hold (their ``claims``), exactly as
        an operator's ``allow_rollback_to`` would (the barrier that forms journals it). Returns
        that step (the new floor), or None."""
        if not self.overdue(now, resuming) or self.unknown:
            return None
        rec = self.record
        held = [c.outer_step for c in claims if not rec.judge(c.outer_step, c.state_hash, 0, c.epoch_id)]
        if not held or max(held) >= floor:
            return None  # nothing to roll back to yet, or the state the run waits for is here
        to = max(held)
        self.rollback, self.rollback_by = to, f"automatic: no live node held it for {now - self.waiting_since:.0f}s"  # type: ignore[operator]
        self._say(f"WARNING no live node has held the run's newest state (outer step {rec.hwm_step}) for "
                  f"{now - self.waiting_since:.0f}s: rolling back to outer step {to}, the newest state that "  # type: ignore[operator]
                  "registered nodes hold (auto_rollback_after)")
        self.waiting_since = None
        return to

    def quorum(self, nodes: dict[str, Node], now: float, resuming: bool) -> bool:
        """History unknown: whether most members of the newest epoch that the registered nodes
        report are back (or the wait has lasted ``auto_rollback_after``)."""
        claims = [n.claim for n in nodes.values() if n.claim is not None and n.claim.outer_step > 0]
        if not claims:
            return True
        newest = max(claims, key=lambda c: (c.epoch_id, c.outer_step))
        last = set(newest.members)
        back = {node_id for node_id, n in nodes.items() if node_id in last and n.claim is not None
                and n.claim.outer_step > 0}  # (back with state: one that lost its disk does not count)
        if not last or 2 * len(back) > len(last):  # (a claim without its epoch's members says nothing)
            return True
        if self.overdue(now, resuming):
            self._say(f"WARNING the run's history is unknown and only {len(back)} of epoch {newest.epoch_id}'s "
                      f"{len(last)} members came back in {now - self.waiting_since:.0f}s: rebuilding the run "  # type: ignore[operator]
                      "from the newest state here")
            self.unknown = False
            return True
        if not self._quorum_said:
            self._quorum_said = True
            self._say(f"the run's history is unknown: waiting for most of epoch {newest.epoch_id}'s members "
                      f"({', '.join(sorted(last))}) before rebuilding it (have {', '.join(sorted(back)) or 'none'})")
        return False


def _quorum(hashes: dict[str, str], members: int) -> str | None:
    """The hash that a strict majority of ``members`` (distinct node ids) reported, if any."""
    counts = Counter(hashes.values())
    best = max(counts, key=counts.__getitem__, default=None)
    return best if best is not None and 2 * counts[best] > members else None
