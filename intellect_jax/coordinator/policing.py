"""Policing at a barrier: which members have to go for what they contributed.

Three rules, counted per member across barriers on its :class:`~.roster.Node`: a member whose own
pseudo-gradient checks failed (it sat out, contributing zeros) at ``sit_out_limit`` barriers in
a row is broken; a member its ring successor blamed in ``strikes`` rounds whose average most
members found bad poisons the run. One blame alone evicts nobody: the successor may be the liar,
and a round only counts when most members saw the damage. Only the accused's ring successor in
the epoch whose all-reduce is reported can have seen its contribution: an accusation by anyone
else is false, counted against the accuser, who is evicted at ``strikes`` false accusations.
"""

from __future__ import annotations

from collections.abc import Callable

from intellect_jax.coordinator.protocol import CoordinatorConfig
from intellect_jax.coordinator.roster import Node


def follows(ring: tuple[str, ...], accuser: str, accused: str) -> bool:
    """Whether ``accuser`` is ``accused``'s successor in ``ring`` (the node that receives its chunks)."""
    return accused in ring and accuser in ring and ring.index(accuser) == (ring.index(accused) + 1) % len(ring)


class Police:
    """The rules above; ``say`` logs an event. It knows the ring of the newest epoch formed at
    each of the last two barriers: a report at barrier k is on the all-reduce of barrier k-1's
    epoch (after a coordinator restart that ring is unknown, and accusations are ignored)."""

    def __init__(self, config: CoordinatorConfig, say: Callable[[str], None]) -> None:
        self.config, self._say = config, say
        self._rings: dict[int, tuple[int, tuple[str, ...]]] = {}  # barrier step -> (epoch id, ring order)

    def formed(self, step: int, epoch_id: int, ring: tuple[str, ...]) -> None:
        """Barrier ``step`` formed epoch ``epoch_id`` (a retry replaces the failed epoch)."""
        self._rings = {k: v for k, v in self._rings.items() if k == step - 1} | {step: (epoch_id, ring)}

    def judge(self, step: int, members: list[Node]) -> tuple[list[Node], list[tuple[Node, str]]]:
        """Count barrier ``step``'s sit-outs, blames and false accusations; returns (members kept,
        (member, why) to evict), in ring order. Every member has arrived (with its report)."""
        reports = [(n, n.arrival.report) for n in members if n.arrival.report]  # type: ignore[union-attr]
        failed = sum(1 for _, r in reports if r.avg_failed) * 2 > len(members)
        epoch_id, ring = self._rings.get(step - 1, (0, None))
        blamed: dict[str, str] = {}
        for n, r in reports:
            if r.accused is None or ring is None:
                continue
            accused, why = r.accused
            if follows(ring, n.node_id, accused):
                blamed[accused] = why
                continue
            n.false_accusations += 1
            self._say(f"WARNING false accusation: {n.node_id} accused {accused} of a bad contribution ({why}) to "
                      f"epoch {epoch_id} but is not its ring successor there ([{', '.join(ring)}]); "
                      f"{n.false_accusations} by {n.node_id} so far")
        keep: list[Node] = []
        evict: list[tuple[Node, str]] = []
        for n in members:
            n.sit_outs = n.sit_outs + 1 if n.arrival.sits_out else 0  # type: ignore[union-attr]
            n.strikes += int(failed and n.node_id in blamed)
            if n.sit_outs >= self.config.sit_out_limit:
                evict.append((n, f"its own pseudo-gradient checks failed at {n.sit_outs} barriers in a row "
                                 f"({n.arrival.sits_out})"))  # type: ignore[union-attr]
            elif n.strikes >= self.config.strikes:
                evict.append((n, f"poisoned contributions: blamed by its ring successor in {n.strikes} "
                                 f"rounds whose average failed ({blamed.get(n.node_id)})"))
            elif n.false_accusations >= self.config.strikes:
                evict.append((n, f"false accusations: it accused nodes it does not follow in the ring "
                                 f"{n.false_accusations} times"))
            else:
                keep.append(n)
        return keep, evict
