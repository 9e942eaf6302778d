"""The run's durable record, kept by the coordinator: how far the run's one history has got.

`RunRecord` holds the high-water mark (the newest outer step whose state hash the coordinator
recorded, and that hash), the recorded hashes of recent outer steps, whether the run is
complete, its length in outer steps, its model fingerprint and the next epoch id, and for each
recent recorded step the members' signed votes (:func:`verify_votes` checks them against the run
authority's certificate, e.g. ``python -m intellect_jax.coordinator --verify-journal FILE``). The
coordinator writes it to a small JSON file after every change (:func:`~intellect_jax.files.atomic_write`:
a crash leaves the old or the new record, never half of one) and reloads it on
restart, so a restarted coordinator still knows which states are behind, and a finished run
stays finished. It also holds the run's data leases (:class:`~.leases.Ledger`, as ranges): which
units of the training stream are trained, in which recent step, and which are out.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from intellect_jax.coordinator.leases import Ledger
from intellect_jax.files import atomic_write

VERSION = 1


class JournalError(RuntimeError):
    pass


@dataclass
class RunRecord:
    run_id: str = ""
    fingerprint: str | None = None
    outer_steps: int | None = None  # the run's length
    hwm_step: int | None = None  # newest outer step with a recorded hash
    hwm_hash: str | None = None
    completed: bool = False
    next_epoch: int = 1
    hashes: dict[int, str] = field(default_factory=dict)  # outer step -> recorded hash (recent ones)
    rollbacks: list[dict[str, Any]] = field(default_factory=list)  # operator-requested rollbacks done
    # outer step -> {"members": how many members its barrier had when it was recorded, "signed":
    # {node: [signature (hex) of identity.vote(run, step, recorded hash), certificate key]}};
    # certs: certificate key (sha256 of the DER, 16 hex) -> certificate (DER, hex)
    votes: dict[int, dict[str, Any]] = field(default_factory=dict)
    certs: dict[str, str] = field(default_factory=dict)
    leases: Ledger | None = None  # the run's data leases (coordinator/leases.py), once a node asked for one
    data: str | None = None  # the run's data plan (protocol.DataPlan.mode), its first barrier's members'
    banned: dict[str, str] = field(default_factory=dict)  # node -> the fraud its own signatures showed
    rev: int = field(default=0, repr=False, compare=False)  # bumped by sign(): the journal saves then

    def record(self, step: int, state_hash: str, keep: int) -> None:
        """The run's hash of outer step ``step`` (the newest one becomes the high-water mark)."""
        self.hashes[step] = state_hash
        for k in sorted(self.hashes)[:-keep]:
            del self.hashes[k]
        if self.hwm_step is None or step >= self.hwm_step:
            self.hwm_step, self.hwm_hash = step, state_hash

    def sign(self, step: int, members: int, votes: dict[str, tuple[str, str]]) -> None:
        """Keep the signed votes (signature, certificate) that recorded ``step``'s hash (the
        steps kept are those of :attr:`hashes`)."""
        if not votes:
            return
        at = self.votes.setdefault(step, {"members": members, "signed": {}})
        new = {n: v for n, v in votes.items() if n not in at["signed"]}  # a step formed again adds, never replaces
        if not new:
            return
        for n, (sig, cert) in new.items():
            key = hashlib.sha256(bytes.fromhex(cert)).hexdigest()[:16]
            at["signed"][n] = [sig, key]
            self.certs[key] = cert
        at["signed"] = dict(sorted(at["signed"].items()))
        self.votes = {k: v for k, v in self.votes.items() if k in self.hashes}
        used = {key for v in self.votes.values() for _, key in v["signed"].values()}
        self.certs = {k: c for k, c in self.certs.items() if k in used}
        self.rev += 1

    def judge(self, step: int, state_hash: str | None, floor: int, epoch_id: int = 0) -> str:
        """Why a state of outer step ``step`` (last in epoch ``epoch_id``) cannot resume a rebuilt
        run whose lowest acceptable step is ``floor`` ('' if it can): behind; ahead of what this
        record knows (no honest state is past the step after its newest, nor of an epoch it never
        made: claims are unsigned); or other bytes than the recorded ones."""
        if step < floor:
            return f"behind: state from outer step {step}, the run has reached {floor}"
        if self.hwm_step is not None and step > self.hwm_step + 1:
            return f"ahead of the run's journal: state from outer step {step}, the run has recorded {self.hwm_step}"
        if self.hwm_step is not None and epoch_id > self.next_epoch:
            return f"ahead of the run's journal: epoch {epoch_id}, the run has made none after {self.next_epoch - 1}"
        recorded = self.hashes.get(step)
        if recorded and state_hash and state_hash != recorded:
            return f"diverged: state hash {state_hash[:16]} at outer step {step}, the run's is {recorded[:16]}"
        return ""

    def truncate(self, step: int) -> None:
        """Forget every outer step after ``step`` (an operator-requested rollback)."""
        self.hashes = {k: h for k, h in self.hashes.items() if k <= step}
        self.votes = {k: v for k, v in self.votes.items() if k <= step}
        self.hwm_step, self.hwm_hash = step, self.hashes.get(step)
        self.completed = False
        if self.leases is not None:  # the forgotten steps' units are trained again
            self.leases.rollback(step)

    def key(self) -> tuple[Any, ...]:
        """What tells whether the record changed since it was saved (cheap: the votes and the
        data leases, which grow with nodes x steps, by their revisions)."""
        return self.to_json(votes=False), self.rev, self.leases.rev if self.leases is not None else -1

    def to_json(self, votes: bool = True) -> dict[str, Any]:
        """The record as JSON; ``votes=False``: without the signed votes and the data leases
        (cheap to compare)."""
        d = {k: getattr(self, k) for k in ("run_id", "fingerprint", "outer_steps", "hwm_step", "hwm_hash",
                                           "completed", "next_epoch", "data")}
        d["banned"] = dict(self.banned)
        d["hashes"] = {str(k): h for k, h in self.hashes.items()}
        d["rollbacks"] = [dict(r) for r in self.rollbacks]
        if votes and self.leases is not None:
            d["leases"] = self.leases.to_json()
        if votes:
            d["votes"] = {str(k): v for k, v in self.votes.items()}
            d["certs"] = dict(self.certs)
        return {"version": VERSION, **d}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RunRecord:
        if d.get("version") != VERSION:
            raise JournalError(f"journal version {d.get('version')} is not {VERSION}")
        d = {k: v for k, v in d.items() if k not in ("version", "rev")}
        d["hashes"] = {int(k): h for k, h in d.get("hashes", {}).items()}
        d["votes"] = {int(k): v for k, v in d.get("votes", {}).items()}
        if not isinstance(d.get("certs", {}), dict):
            raise JournalError("certs is not an object")
        banned = d.get("banned", {})
        if not isinstance(banned, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in banned.items()):
            raise JournalError(f"banned is not a map of node ids to reasons: {str(banned)[:80]}")
        if not isinstance(d.get("data"), str | None):
            raise JournalError(f"data is not a data plan: {str(d.get('data'))[:80]}")
        if d.get("leases") is not None:
            try:
                d["leases"] = Ledger.from_json(d["leases"])
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise JournalError(f"leases: {e}") from None
        return cls(**d)


class Journal:
    """A `RunRecord` persisted at ``path`` (JSON, atomic replace)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._saved: dict[str, Any] | None = None

    def load_any(self) -> RunRecord:
        """The record on disk, whichever run's it is."""
        try:
            return RunRecord.from_json(json.loads(self.path.read_text()))
        except (OSError, ValueError, TypeError, AttributeError, JournalError) as e:
            raise JournalError(f"journal {self.path}: unreadable ({e})") from None

    def load(self, run_id: str) -> RunRecord:
        """The record on disk, or a fresh one; refuses another run's journal."""
        if not self.path.exists():
            return RunRecord(run_id=run_id)
        rec = self.load_any()
        if rec.run_id != run_id:
            raise JournalError(f"journal {self.path} belongs to run {rec.run_id!r}, not {run_id!r}")
        self._saved = rec.key()
        return rec

    def save(self, rec: RunRecord) -> bool:
        """Write ``rec`` if it changed since the last save; True if written. (Called under the
        coordinator's lock after every request: the signed votes, which grow with nodes x
        steps, are compared by their revision, not by value.)"""
        key = rec.key()
        if key == self._saved:
            return False
        atomic_write(self.path, json.dumps(rec.to_json(), sort_keys=True))
        self._saved = key
        return True


class MemoryJournal(Journal):
    """The same contract in memory (tests and in-process runs): survives a coordinator restart
    within the process, never touches disk."""

    def __init__(self) -> None:  # noqa: D107 - no path
        self._saved = None
        self._stored: dict[str, Any] | None = None

    def load(self, run_id: str) -> RunRecord:
        rec = RunRecord.from_json(self._stored) if self._stored else RunRecord(run_id=run_id)
        self._saved = rec.key() if self._stored else None  # revisions restart with the loaded record
        return rec

    def save(self, rec: RunRecord) -> bool:
        key = rec.key()
        if key == self._saved:
            return False
        self._stored = json.loads(json.dumps(rec.to_json()))
        self._saved = key
        return True


def verify_votes(rec: RunRecord, ca_der: bytes) -> dict[int, str]:
    """Check every recorded step's signed votes: each signature by a certificate the run
    authority (``ca_der``) issued to that node, over that step's recorded hash, and a strict
    majority of the barrier's members among them. Returns {step: what is wrong} (empty: all
    good); a recorded step without votes (an in-process run, or a journal from before votes)
    is reported as unsigned."""
    from intellect_jax.net.identity import vote, vouched

    bad: dict[int, str] = {}
    for step, h in sorted(rec.hashes.items()):
        v = rec.votes.get(step)
        if v is None:
            bad[step] = "no signed votes"
            continue
        try:
            good = [n for n, (sig, key) in v["signed"].items()
                    if vouched(ca_der, rec.certs.get(key, ""), n, vote(rec.run_id, step, h), sig)]
            members = int(v["members"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            bad[step] = f"malformed votes ({type(e).__name__})"
            continue
        if 2 * len(good) <= members:
            bad[step] = f"{len(good)} valid signatures of {members} members ({', '.join(good) or 'none'})"
    return bad
