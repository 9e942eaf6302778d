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
to ``coordinator`` (this instance or an earlier one): of the claimed step with the claimed
hash, or of the step before (the state a member holds after an all-reduce whose barrier never
completed, as a journal takes the step after its newest; that step's hash is then settled by the
members' quorum at the barrier, as with a journal), and with the claimed epoch and members, if it
claims any, being the record's. A claim without one counts as none: the node joins.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from intellect_jax.coordinator.protocol import Record, Resume
from intellect_jax.files import atomic_write
from intellect_jax.net.identity import COORDINATOR, record, vouched

KEEP = 128  # records a node keeps (its newest checkpoint may be older than its newest record)


class Notary:
    """Signs barrier records for ``run_id`` (``sign``: the coordinator's key, ``cert``: its
    certificate, DER) and checks claims against records of the authority ``ca`` (DER)."""

    def __init__(self, run_id: str, sign: Callable[[bytes], bytes], cert: bytes, ca: bytes) -> None:
        self.run_id, self._sign, self.cert, self.ca = run_id, sign, cert, ca

    def sign(self, outer_step: int, state_hash: str, epoch_id: int, members: Sequence[str]) -> Record:
        said = record(self.run_id, outer_step, state_hash, epoch_id, members)
        return Record(outer_step, state_hash, epoch_id, tuple(members), self._sign(said).hex(), self.cert.hex())

    def unproven(self, claim: Resume) -> str:
        """Why ``claim`` is not proven by its record ('' if it is)."""
        r = claim.record
        if r is None:
            return "it carries no record signed by the run's coordinator"
        if not (r.outer_step == claim.outer_step and r.state_hash == claim.state_hash
                or r.outer_step + 1 == claim.outer_step):
            return (f"its record is of outer step {r.outer_step} (hash {r.state_hash[:16]}), not of its state of "
                    f"step {claim.outer_step} (hash {str(claim.state_hash)[:16]}) or the step before")
        if claim.members and (claim.epoch_id, tuple(claim.members)) != (r.epoch_id, r.members):
            return f"it claims epoch {claim.epoch_id} of [{', '.join(claim.members)}], its record epoch {r.epoch_id}"
        if not vouched(self.ca, r.cert, COORDINATOR,
                       record(self.run_id, r.outer_step, r.state_hash, r.epoch_id, r.members), r.signature):
            return "its record does not carry the signature of a coordinator of this run"
        return ""


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
            try:
                raw = json.loads(self.path.read_text())
                self.records = [Record(**{**r, "members": tuple(r["members"])}) for r in raw][-KEEP:]
            except (ValueError, TypeError, KeyError, OSError):  # unreadable: start afresh (a record only helps)
                self.records = []

    def keep(self, r: Record) -> None:
        if r in self.records:
            return
        self.records = [x for x in self.records if x.outer_step < r.outer_step][-(KEEP - 1):] + [r]
        if self.path is not None:
            atomic_write(self.path, json.dumps([asdict(x) for x in self.records]))
