"""Who gets into the run, and how a joiner gets the run's state.

A registration is refused outright for a wrong protocol, model or run length, a duplicate or
invalid id, a completed run, or another data plan than the run's (:func:`check_registration`).
Joiners wait (``PENDING``) for the next boundary; a barrier then gives each one a donor among
its members, round robin in ring order (:func:`admit`), and the donor streams it the state
after the next outer step. A joiner whose donor is gone, or whose transfer failed, is
re-queued (:func:`requeue`) for the next boundary. These are rules over the :mod:`.roster`
records; :class:`~.membership.Membership` applies them to its table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

from intellect_jax.coordinator.journal import RunRecord
from intellect_jax.coordinator.protocol import (PROTOCOL, Admission, DataPlan, Peer, RegistrationRefused,
                                                RunCompleted)
from intellect_jax.coordinator.roster import Node, Role


def check_registration(node_id: str, addr: str, protocol: int, fingerprint: str, outer_steps: int | None,
                       nodes: dict[str, Node], rec: RunRecord, data: DataPlan | None = None,
                       started: bool = False) -> None:
    """Raise :class:`RegistrationRefused` (or :class:`RunCompleted`) if this node may not register."""
    if protocol != PROTOCOL:
        raise RegistrationRefused(f"node {node_id}: protocol version {protocol} != coordinator's {PROTOCOL}",
                                  "protocol")
    if not node_id or len(node_id) > 128 or not addr or len(addr) > 256 or any(c.isspace() for c in addr):
        raise RegistrationRefused(f"invalid node id {node_id!r} or ring address {addr!r}", "invalid")
    if node_id in rec.banned:
        raise RegistrationRefused(f"node {node_id} is banned from this run: {rec.banned[node_id]}", "banned")
    if node_id in nodes:
        raise RegistrationRefused(f"node id {node_id!r} is already registered and alive "
                                  f"(ring address {nodes[node_id].addr})", "duplicate")
    if rec.fingerprint is not None and fingerprint != rec.fingerprint:
        raise RegistrationRefused(f"node {node_id}: model config fingerprint {fingerprint} != run's "
                                  f"{rec.fingerprint}", "fingerprint")
    if outer_steps is not None and rec.outer_steps is not None and outer_steps != rec.outer_steps:
        raise RegistrationRefused(f"node {node_id}: run length {outer_steps} outer steps != run's "
                                  f"{rec.outer_steps}", "outer_steps")
    if rec.completed:
        raise RunCompleted(f"the run is complete: all {rec.outer_steps} outer steps are done "
                           f"(final state hash {str(rec.hwm_hash)[:16]})")
    if data is not None:
        check_data(node_id, data, nodes, rec, started)


def data_plan(rec: RunRecord) -> str | None:
    """The run's data plan (:attr:`~.protocol.DataPlan.mode`): the one its first barrier formed
    with (journaled), or leases once the journal holds them; None: not settled yet."""
    return rec.data or ("leases" if rec.leases is not None else None)


def check_data(node_id: str, data: DataPlan, nodes: dict[str, Node], rec: RunRecord, started: bool = False) -> None:
    """A run reads its data one way: the plan its first barrier formed with; until then, that of
    the live nodes that said one (a refusal the node retries, reason ``plan``: a misconfigured
    node that dies or leaves settles nothing). Leases cannot start in a run ``started`` without
    them (past outer step 0, or history unknown); a fixed shard is read by one live node at a time."""
    mode = data_plan(rec)
    live = [n for n in nodes.values() if n.data is not None and n.node_id != node_id]
    other = live[0].data.mode if live else None  # type: ignore[union-attr]
    if mode is None and other is not None and data.mode != other:
        raise RegistrationRefused(f"node {node_id}: it reads its data by {data.mode}, live node {live[0].node_id} by "
                                  f"{other} (the run's first barrier settles the plan: one of them is misconfigured)",
                                  "plan")
    if mode is not None and data.mode != mode:
        fix = "--diloco.leases" if mode == "leases" else f"--diloco.data_rank I --diloco.data_ranks {mode.split()[0]}"
        raise RegistrationRefused(f"node {node_id}: it reads its data by {data.mode}, this run by {mode} "
                                  f"(start it with {fix})", "data")
    if data.leases and rec.leases is None and started:
        raise RegistrationRefused(f"node {node_id}: it leases its data, but this run is past outer step 0 without "
                                  "leases (they cannot start mid-run): start it with the run's data_rank/data_ranks",
                                  "data")
    if not data.leases:
        held = [n.node_id for n in live if n.data == data]
        if held:  # (retried by the node for a while: a dead holder is evicted within its heartbeat timeout)
            raise RegistrationRefused(f"node {node_id}: data shard {data.rank} of {data.ranks} is read by live node "
                                      f"{held[0]}: two nodes on one shard train its tokens twice", "shard")


def admit(pending: list[Node], members: list[Node], step: int, epoch_id: int, seq: int,
          say: Callable[[str], None]) -> int:
    """Barrier ``step`` formed with ``members`` (ring order): give each pending joiner a donor,
    round robin over every admission of the run (``seq``: its count so far), for the state of
    outer step ``step + 1``; joiners take ring places after the members in admission order
    (``seq`` also orders them; returns it advanced), skipping the members that were a joiner's
    donor before (until it has tried them all). So a joiner admitted again, after a transfer that
    failed or a first barrier it did not pass, gets another donor: one slow or lying donor cannot
    keep it out (nor stall every boundary by serving it)."""
    for j in pending:
        turn = [members[(seq + k) % len(members)] for k in range(len(members))]
        fresh = [m for m in turn if m.node_id not in j.donors]
        if not fresh:
            j.donors.clear()
        donor = (fresh or turn)[0]
        j.donors.add(donor.node_id)
        seq += 1
        j.role, j.order, j.received = Role.ADMITTED, (1, seq), False
        j.admission = Admission(donor.node_id, donor.addr, step, step + 1, epoch_id)
        say(f"admitted joiner {j.node_id} at boundary {step}: state of outer step {step + 1} "
            f"from donor {donor.node_id}")
    return seq


def served_by(nodes: Iterable[Node], donor_id: str) -> list[Node]:
    """The admitted joiners still waiting for ``donor_id``'s state."""
    return [j for j in nodes if j.role is Role.ADMITTED and not j.received
            and j.admission is not None and j.admission.donor_id == donor_id]


def serving(nodes: Iterable[Node], step: int) -> dict[str, tuple[Peer, ...]]:
    """donor -> the joiners (in the given order) it streams the state of outer step ``step`` to."""
    serve: dict[str, list[Peer]] = {}
    for j in nodes:
        if j.role is Role.ADMITTED and not j.received and j.admission and j.admission.outer_step == step:
            serve.setdefault(j.admission.donor_id, []).append((j.node_id, j.addr))
    return {d: tuple(s) for d, s in serve.items()}


def requeue(joiner: Node, why: str, say: Callable[[str], None]) -> None:
    """Back to waiting for the next boundary (and a new donor)."""
    joiner.role, joiner.received = Role.PENDING, False
    say(f"joiner {joiner.node_id} re-queued: {why}")


def admission_of(node: Node, outer_step: int, epoch_id: int, rec: RunRecord) -> Admission | None:
    """A joiner's admission, if it has one, with the hash the run recorded for the state it
    receives (None while that step is not recorded). A joiner promoted to member with the
    state it brought (a rebuild) gets itself as donor: no transfer."""
    if node.role is Role.MEMBER:
        step = node.claim.outer_step if node.claim else outer_step
        return Admission(node.node_id, node.addr, -1, step, epoch_id, rec.hashes.get(step))
    if node.role is Role.PENDING and rec.completed:
        raise RunCompleted(f"the run completed all {rec.outer_steps} outer steps while {node.node_id} waited "
                           "for admission")
    adm = node.admission if node.role is Role.ADMITTED else None
    return adm and replace(adm, state_hash=rec.hashes.get(adm.outer_step))


def received(node: Node, step: int, run_step: int | None, say: Callable[[str], None]) -> bool:
    """The joiner holds the state after outer step ``step`` (``run_step``: the boundary a started
    run heads for, else None); False: re-queued, it waits for a new admission."""
    adm = node.admission
    if adm is None or adm.outer_step != step or (run_step is not None and run_step != step):
        return False
    if node.role is Role.PENDING:  # re-queued (donor gone) after the transfer had in fact finished
        node.role = Role.ADMITTED
    node.received = True
    say(f"joiner {node.node_id} received the state of outer step {step} from {adm.donor_id}")
    return node.role is Role.ADMITTED
