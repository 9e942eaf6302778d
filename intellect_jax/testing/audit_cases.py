"""Audit cases made in one process, signed under the test authority: what a butterfly auditor
holds after a call (``net.audit.Case``), for the simulation's in-process exchange and for tests.

The case is built as the socket exchange builds it: each member's piece encoded in the run's
codec and signed to the owner and to the auditor, the owner's row list and its commitment to
the digest of every piece's aggregate, which a forging owner computes from ``forge`` instead of
the honest aggregate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from intellect_jax.net import quant, tree as treelib
from intellect_jax.net.audit import ENTRY, NO_SIG, Case, judge, to_wire
from intellect_jax.net.pairing import audited_by, draw, rotation
from intellect_jax.net.comm import RingConfig, bucket_call
from intellect_jax.net.evidence import digest
from intellect_jax.net.evidence import der_signature, piece_statement, raw_signature
from intellect_jax.net.identity import verify
from intellect_jax.net.plan import butterfly_plan
from intellect_jax.net.robust import aggregate_piece
from intellect_jax.testing.identities import credentials

Forge = Callable[[int, np.ndarray], np.ndarray]  # (piece, honest aggregate) -> what the owner sends instead


def sign(name: str, data: bytes) -> bytes:
    """``name``'s 64-byte signature of ``data`` (the test authority issues it on first use)."""
    return raw_signature(credentials(name).sign(data))


def signed_case(xs: Sequence[np.ndarray], ids: Sequence[str], *, owner: int, auditor: int, piece: int,
                run_id: str, step: int, epoch: int, call: int, mode: str, block: int, piece_numel: int, how: str,
                absent: Sequence[int] = (), forge: Forge | None = None, left: Mapping[int, int] | None = None) -> Case:
    """The case auditor ``auditor`` holds on piece ``piece`` of segment ``owner`` when the members
    (``ids``, rank order) contributed the flat vectors ``xs`` (``forge``: the owner's forgery;
    ``left``: per member the owner left out, the first piece it left its row out of)."""
    world, n = len(xs), xs[0].shape[0]
    p = butterfly_plan(n, world, block, piece_numel)
    lefts = tuple((left or {}).get(i, p.pieces) for i in range(world))

    def wires(j: int) -> tuple[int, int, list[bytes]]:
        a, b = p.piece(owner, j)
        return a, b, [quant.encode(np.ascontiguousarray(x[a:b], np.float32), mode, block).tobytes() for x in xs]

    rows, aggs = [], []
    for j in range(p.pieces):
        a, b, ws = wires(j)
        entries = []
        out = frozenset(i for i in range(world) if lefts[i] <= j)
        for i, w in enumerate(ws):
            d = digest(w)
            said = piece_statement(run_id, step, epoch, call, ids[i], ids[owner], owner, j, b - a, mode, block, d.hex())
            entries.append(bytes(ENTRY) if i in out else d + (NO_SIG if i == owner else sign(ids[i], said)))
        rows.append(b"".join(entries))
        decoded = [quant.decode(np.frombuffer(w, np.uint8), b - a, mode, block) for w in ws]
        wire = aggregate_piece(decoded, b - a, mode, block, how, absent=frozenset(absent) | out)
        if forge is not None:
            wire = quant.encode(forge(j, quant.decode(wire, b - a, mode, block)), mode, block)
        aggs.append(digest(wire))
    _, _, payloads = wires(piece)
    payloads = [b"" if lefts[i] <= piece else w for i, w in enumerate(payloads)]
    case = Case(run_id, step, epoch, call, tuple(ids), owner, auditor, piece, n, piece_numel, mode, block, how,
                tuple(sorted(absent)), lefts, tuple(aggs), tuple(digest(r) for r in rows), b"", rows[piece],
                tuple(payloads), (None,) * world)
    sigs = tuple(None if i == auditor or lefts[i] <= piece else sign(ids[i], case.said(i, auditor, digest(w)))
                 for i, w in enumerate(payloads))
    return dataclasses.replace(case, commit_sig=sign(ids[owner], case.committed()), audit_sigs=sigs)


def verifier(ids: Sequence[str]) -> Callable[[int, bytes, bytes], bool]:
    """``net.audit.Verify`` against the test authority's certificates of ``ids``."""
    return lambda rank, data, sig: verify(credentials(ids[rank]).cert_der, data, der_signature(sig))


# ---- the simulation's in-process exchange, with forging owners ---------------------------------------
def _bucket_flats(tree: Any, cfg: RingConfig) -> list[np.ndarray]:
    leaves = treelib.flatten(tree)[0]
    return [treelib.gather(leaves, idx) for idx in treelib.make_buckets([x.size for x in leaves], cfg.bucket_numel)]


def fake_audit(trees: Sequence[Any], ids: Sequence[str], rank: int, forged: set[int], *, run_id: str, step: int,
               epoch: int, cfg: RingConfig, absent: Sequence[int] = ()) -> tuple[int, str, dict[str, Any]] | None:
    """What rank ``rank``'s audits find in one all-reduce of the members' ``trees`` (rank order)
    whose owners ``forged`` negate their aggregates: (guilty, why, the case as reported) for the
    first bucket whose audited segment is forged, by the same judge and with the same signatures
    as over sockets (the drawn piece turns with the step: any piece of a forged segment shows;
    the pairing is drawn from the step and call here, as over sockets from the members' nonces:
    the same for every rank, a different one every call)."""
    flats = [_bucket_flats(t, cfg) for t in trees]
    for bi in range(len(flats[0])):
        call = bucket_call(0, bi)
        nonces = [digest(f"{run_id} {step} {epoch} {call} {i}".encode()) for i in ids]
        target = audited_by(rank, len(ids), rotation(draw(run_id, step, epoch, call, nonces), len(ids)))
        if target not in forged or not flats[0][bi].size:
            continue
        p = butterfly_plan(flats[0][bi].shape[0], len(ids), cfg.block_size, cfg.piece_numel)
        case = signed_case([f[bi] for f in flats], ids, owner=target, auditor=rank, piece=(step + rank) % p.pieces,
                           run_id=run_id, step=step, epoch=epoch, call=call, mode=cfg.mode, block=cfg.block_size,
                           piece_numel=cfg.piece_numel, how=cfg.robust, absent=absent, forge=lambda j, v: -v)
        guilty, why, _ = judge(case, verifier(ids))
        if guilty is not None:
            return guilty, why, to_wire(case)
    return None
