"""Barrier records signed by the coordinator, and the registration claims they prove.

A coordinator with the run's history (its journal) judges a registering node's claim (outer
step, state hash, last epoch and its members) against that history. One without it (a lost
journal, or a first start that a member says is not one) had only the claim's word: a single
member could claim a later step and an epoch of its own and become the run's history, and the
members without state would then join from it.

So a coordinator that signs (the socket coordinator, with its identity) signs each barrier's
:class:`~.protocol.Record` (:func:`~intellect_jax.net.identity.record`: the hash it recorded for
the step, the epoch it formed, that epoch's members) into every member's reply; each member
keeps the newest ones with its checkpoints (:class:`RecordBook`). Without history such a
coordinator takes a claim only with a record signed by a certificate the run authority issued
to ``coordinator`` (this instance or an earlier one, not revoked) for an epoch the claimant was a
member of: of the claimed step with the claimed hash, or of the step before (the state a member
holds after an all-reduce whose barrier never completed). A claimed epoch must be the record's,
and a proven claim takes the record's epoch and members (:func:`proven`). A claim without such a
record counts as none: the node joins. Not covered: a claim of the step past its record has a
hash nobody signed, and is taken as a journal takes the step after its newest, from a single
member (docs/security.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path

from intellect_jax.coordinator.protocol import Record, Resume
from intellect_jax.coordinator.schema import RecordMsg
from intellect_jax.files import atomic_write
from intellect_jax.net.identity import COORDINATOR, record, vouched

KEEP = 128  # records a node keeps (its newest checkpoint may be older than its newest record)


class Notary:
    """Signs barrier records for ``run_id`` (``sign``: the coordinator's key, ``cert``: its
    certificate, DER) and checks claims against records of the authority ``ca`` (DER) by a
    certificate not ``revoked`` (its serial)."""

    def __init__(self, run_id: str, sign: Callable[[bytes], bytes], cert: bytes, ca: bytes,
                 revoked: Callable[[int], bool] | None = None) -> None:
        self.run_id, self._sign, self.cert, self.ca, self.revoked = run_id, sign, cert, ca, revoked

    def sign(self, outer_step: int, state_hash: str, epoch_id: int, members: Sequence[str]) -> Record:
        said = record(self.run_id, outer_step, state_hash, epoch_id, members)
        return Record(outer_step, state_hash, epoch_id, tuple(members), self._sign(said).hex(), self.cert.hex())

    def unproven(self, claim: Resume, node_id: str) -> str:
        """Why ``node_id``'s ``claim`` is not proven by its record ('' if it is: the claim's epoch
        and members are then the record's, see :func:`proven`)."""
        r = claim.record
        if r is None:
            return "it carries no record signed by the run's coordinator"
        if node_id not in r.members:
            return f"its record is of epoch {r.epoch_id}, of which it was no member"
        if not (r.outer_step == claim.outer_step and r.state_hash == claim.state_hash
                or r.outer_step + 1 == claim.outer_step):
            return (f"its record is of outer step {r.outer_step} (hash {r.state_hash[:16]}), not of its state of "
                    f"step {claim.outer_step} (hash {str(claim.state_hash)[:16]}) or the step before")
        if (claim.epoch_id or claim.members) and (claim.epoch_id, tuple(claim.members)) != (r.epoch_id, r.members):
            return f"it claims epoch {claim.epoch_id} of [{', '.join(claim.members)}], its record epoch {r.epoch_id}"
        if not vouched(self.ca, r.cert, COORDINATOR, record(self.run_id, r.outer_step, r.state_hash, r.epoch_id,
                                                            r.members), r.signature, self.revoked):
            return "its record does not carry the signature of a coordinator of this run"
        return ""


def proven(claim: Resume, node_id: str) -> Resume:
    """A proven claim with its record's epoch and members (and ``node_id``'s rank there): a claim
    that names none (a restarted process) counts toward its epoch's quorum, and none can name
    an epoch of its own."""
    r = claim.record
    assert r is not None
    return replace(claim, epoch_id=r.epoch_id, members=r.members, rank=r.members.index(node_id))


def best(records: Sequence[Record], outer_step: int, state_hash: str | None) -> Record | None:
    """The record that proves a state of ``outer_step`` hashing to ``state_hash``: of that step
    and hash, else the newest of the step before (None: none)."""
    same = [r for r in records if r.outer_step == outer_step and r.state_hash == state_hash]
    before = [r for r in records if r.outer_step + 1 == outer_step]
    return (same or before or [None])[-1]


class RecordBook:
    """A node's newest barrier records, in ``path`` (JSON, written whole: temp file, then rename)
    when given, else in memory only."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = None if path is None else Path(path)
        self.records: list[Record] = []
        if self.path is not None and self.path.exists():
            try:  # (parsed like a peer's message: a damaged file must not stop the node later)
                raw = json.loads(self.path.read_text())
                self.records = [RecordMsg.model_validate(r).parsed() for r in raw][-KEEP:]
            except (ValueError, TypeError, OSError):  # unreadable: start afresh (a record only helps)
                self.records = []

    def keep(self, r: Record) -> None:
        if r in self.records:
            return
        self.records = [x for x in self.records if x.outer_step < r.outer_step][-(KEEP - 1):] + [r]
        if self.path is not None:
            atomic_write(self.path, json.dumps([asdict(x) for x in self.records]))
