"""Policing at a barrier: which members have to go for what they contributed.

Two rules, counted per member across barriers on its :class:`~.roster.Node`: a member whose own
pseudo-gradient checks failed (it sat out, contributing zeros) at ``sit_out_limit`` barriers in
a row is broken; a member its ring successor blamed in ``strikes`` rounds whose average most
members found bad poisons the run. One blame alone evicts nobody: the successor may be the liar,
and a round only counts when most members saw the damage.
"""

from __future__ import annotations

from intellect_jax.coordinator.protocol import CoordinatorConfig
from intellect_jax.coordinator.roster import Node


def police(members: list[Node], config: CoordinatorConfig) -> tuple[list[Node], list[tuple[Node, str]]]:
    """Count this barrier's sit-outs and blames; returns (members kept, (member, why) to evict),
    in ring order. Every member has arrived (its ``arrival`` carries its report)."""
    reports = [n.arrival.report or {} for n in members]  # type: ignore[union-attr]
    failed = sum(1 for r in reports if r.get("avg_failed")) * 2 > len(members)
    blamed = {r["accused"][0]: r["accused"][1] for r in reports if r.get("accused")}
    keep: list[Node] = []
    evict: list[tuple[Node, str]] = []
    for n in members:
        n.sit_outs = n.sit_outs + 1 if n.arrival.sits_out else 0  # type: ignore[union-attr]
        n.strikes += int(failed and n.node_id in blamed)
        if n.sit_outs >= config.sit_out_limit:
            evict.append((n, f"its own pseudo-gradient checks failed at {n.sit_outs} barriers in a row "
                             f"({n.arrival.sits_out})"))  # type: ignore[union-attr]
        elif n.strikes >= config.strikes:
            evict.append((n, f"poisoned contributions: blamed by its ring successor in {n.strikes} "
                             f"rounds whose average failed ({blamed.get(n.node_id)})"))
        else:
            keep.append(n)
    return keep, evict
