"""Ring schedule and per-piece arithmetic, shared by the socket ring and the in-process fake.

A flat vector of ``numel`` float32 is cut into ``world`` segments on block boundaries and
every segment into ``pieces`` pipeline pieces (the same count for every segment). Over the
link ``r -> r+1`` rank ``r`` sends, at step ``s`` (``0 <= s < 2*world - 2``), segment
``(r - s) mod world``, piece by piece. Steps ``< world - 1`` are the reduce-scatter
(partial sums, re-encoded every hop), the rest the all-gather (the owner's encoded mean,
forwarded verbatim). Segment ``c`` is summed in the fixed order ``x_c, x_{c+1}, ...``
and owned (fully reduced) by rank ``c - 1``.

Both implementations call :func:`rs_hop` and :func:`finish` on the same slices, so they
produce bit-identical results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from intellect_jax.net import quant


@dataclass(frozen=True)
class RingPlan:
    """Where every piece of a ring all-reduce lives in the flat vector."""

    numel: int
    world: int
    block: int
    pieces: int
    seg_bounds: tuple[int, ...]  # world + 1 element offsets, block aligned

    @property
    def messages(self) -> int:
        """Messages each rank sends (and receives) per all-reduce."""
        return (2 * self.world - 2) * self.pieces

    def piece(self, seg: int, j: int) -> tuple[int, int]:
        """Element range ``[start, end)`` of piece ``j`` of segment ``seg``."""
        a, b = self.seg_bounds[seg], self.seg_bounds[seg + 1]
        nblk = -(-(b - a) // self.block)
        lo = a + (j * nblk // self.pieces) * self.block
        hi = a + ((j + 1) * nblk // self.pieces) * self.block
        return min(lo, b), min(hi, b)

    def send_segment(self, rank: int, step: int) -> int:
        """Segment that ``rank`` sends at ``step``."""
        return (rank - step) % self.world

    def max_piece(self) -> int:
        """Largest piece, in elements."""
        return max(
            (e - s for c in range(self.world) for j in range(self.pieces) for s, e in [self.piece(c, j)]),
            default=0,
        )


def make_plan(numel: int, world: int, block: int, piece_numel: int, min_pieces: int = 1,
              min_piece_numel: int = 1) -> RingPlan:
    """Balanced, block-aligned segments and pieces of at most ~``piece_numel`` elements; at
    least ``min_pieces`` pieces per segment as long as each keeps ``min_piece_numel`` elements."""
    if world < 1 or numel < 0 or block < 1 or piece_numel < 1 or min_pieces < 1 or min_piece_numel < 1:
        raise ValueError(f"bad ring plan arguments numel={numel} world={world} block={block}")
    nblk = -(-numel // block)
    bounds = tuple(min(numel, (c * nblk // world) * block) for c in range(world + 1))
    seg_blocks = -(-nblk // world)
    piece_blocks = max(1, piece_numel // block)
    whole = min((b - a) // block for a, b in zip(bounds, bounds[1:]))  # the smallest segment's whole blocks
    floor = min(min_pieces, whole // -(-min_piece_numel // block))
    pieces = max(1, -(-seg_blocks // piece_blocks), floor)
    return RingPlan(numel, world, block, pieces, bounds)


BUTTERFLY_PIECES = 16  # butterfly: pieces per segment at least (an audit costs ~1/(2P) of the exchange's bytes)
BUTTERFLY_MIN_PIECE = 1 << 12  # ... while each keeps this many values (robust aggregation is per piece)


def butterfly_plan(numel: int, world: int, block: int, piece_numel: int) -> RingPlan:
    """The butterfly exchange's plan: the ring's, with at least :data:`BUTTERFLY_PIECES` pieces
    per segment where they stay :data:`BUTTERFLY_MIN_PIECE` values or more. Every rank, the
    audits' judge and the in-process fake cut with it."""
    return make_plan(numel, world, block, piece_numel, BUTTERFLY_PIECES, BUTTERFLY_MIN_PIECE)


def piece_rng(seed: int | None, call: int, seg: int, j: int, step: int) -> np.random.Generator | None:
    """Deterministic RNG for stochastic rounding of one piece at one hop (None: nearest)."""
    if seed is None:
        return None
    return np.random.default_rng([seed, call, seg, j, step])


def rs_hop(
    recv: np.ndarray, x: np.ndarray, mode: str, block: int, scratch: np.ndarray
) -> np.ndarray:
    """Reduce-scatter accumulation in fp32: ``decode(recv) + x`` (into ``scratch``)."""
    acc = quant.decode(recv, x.shape[0], mode, block, out=scratch[: x.shape[0]])
    np.add(acc, x, out=acc)
    return acc


def finish(
    acc: np.ndarray,
    world: int,
    mode: str,
    block: int,
    out: np.ndarray,
    rng: np.random.Generator | None = None,
    wire_out: np.ndarray | None = None,
    scratch: np.ndarray | None = None,
) -> np.ndarray:
    """Owner step: encode the mean ``acc / world`` and adopt its decoded value in ``out``.

    Returns the wire bytes of the mean; everybody else decodes exactly these bytes.
    ``acc`` may be overwritten; ``scratch`` must not overlap it.
    """
    n = acc.shape[0]
    if mode == "int8":  # the division is folded into the block scales
        wire = quant.encode(acc, mode, block, wire_out, rng=rng, scratch=scratch, divisor=world)
    else:
        np.divide(acc, np.float32(world), out=acc)
        if mode == "fp32":
            np.copyto(out, acc)
            return out.view(np.uint8)
        wire = quant.encode(acc, mode, block, wire_out, scratch=scratch)
    quant.decode(wire, n, mode, block, out=out)
    return wire


def simulate(
    inputs: Sequence[np.ndarray],
    mode: str,
    block: int,
    piece_numel: int,
    *,
    seed: int | None = None,
    call: int = 0,
) -> np.ndarray:
    """What the socket ring returns on every rank, computed in one process.

    ``inputs[r]`` is rank r's flat float32 vector; a single rank gets an exact copy back.
    """
    world = len(inputs)
    numel = inputs[0].shape[0]
    if world == 1:
        return np.array(inputs[0], np.float32, copy=True)
    plan = make_plan(numel, world, block, piece_numel)
    out = np.empty(numel, np.float32)
    scratch = np.empty(plan.max_piece(), np.float32)
    for c in range(world):
        for j in range(plan.pieces):
            a, b = plan.piece(c, j)
            acc = None
            for k in range(world):
                x = inputs[(c + k) % world][a:b]
                if acc is None:
                    acc = x
                    continue
                wire = quant.encode(acc, mode, block, rng=piece_rng(seed, call, c, j, k - 1))
                acc = rs_hop(wire, x, mode, block, scratch)
            finish(acc, world, mode, block, out[a:b], rng=piece_rng(seed, call, c, j, world - 1))
    return out
