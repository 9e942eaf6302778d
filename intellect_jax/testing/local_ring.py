"""In-process fake of the socket ring, for tests of the layers above.

``LocalGroup(world, config)`` hands out one :class:`LocalCommunicator` per rank. Each
rank calls ``all_reduce_mean`` from its own thread (calls block until every rank has
arrived, like the real ring); or one thread calls :meth:`LocalGroup.all_reduce_mean_all`
with every rank's tree. Results are computed by :func:`~intellect_jax.net.plan.simulate`,
the same per-piece arithmetic as the socket ring, so they are bit-identical to it for the
same config and epoch. :meth:`LocalGroup.fail_next` makes the next collective raise on
every rank (inputs unchanged), to test recovery paths.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any, TypeVar

import numpy as np

from intellect_jax.net import audit, butterfly, codecs, gather, pairing, plan, tree as treelib
from intellect_jax.net.comm import CommStats, RingConfig, bucket_call, check_dropped, leaves_like, unpack_encoded
from intellect_jax.net.errors import PeerClosed, PeerTimeout
from intellect_jax.net.evidence import SAT_OUT, SIG_BYTES, unsigned_evidence
from intellect_jax.net.frames import HEADER_LEN
from intellect_jax.net.quant import encoded_nbytes

T = TypeVar("T")


def ring_bytes(numel: int, world: int, rank: int, cfg: RingConfig) -> int:
    """Data-frame bytes (headers included) one rank sends in a socket ring all-reduce, the
    signature frame after each of its own pieces included (the all-gather's: after each piece
    it sends, and the digests of its last round; not its N - 1 certificates, about 0.5 KB each)."""
    if world == 1 or numel == 0:
        return 0
    if codecs.gathered(cfg.mode):  # N - 1 whole contributions, every piece signed by its origin
        p = gather.gather_plan(numel, cfg.block_size, cfg.piece_numel)
        one = sum(2 * HEADER_LEN + encoded_nbytes(b - a, cfg.mode, cfg.block_size) + SIG_BYTES
                  for a, b in (p.piece(0, j) for j in range(p.pieces)))
        return (world - 1) * (one + HEADER_LEN + audit.DIGEST + SIG_BYTES)
    p = (plan.butterfly_plan if cfg.exchange == "butterfly" else plan.make_plan)(numel, world, cfg.block_size,
                                                                                cfg.piece_numel)
    if cfg.exchange == "butterfly":  # our pieces of every other segment, signed; our aggregate to every other rank

        def seg(c: int) -> int:
            return sum(HEADER_LEN + encoded_nbytes(b - a, cfg.mode, cfg.block_size)
                       for a, b in (p.piece(c, j) for j in range(p.pieces)))

        others = [c for c in range(world) if c != rank]
        total = sum(seg(c) for c in others) + len(others) * (p.pieces * (HEADER_LEN + SIG_BYTES) + seg(rank))
        return total + (audit_bytes(p, rank, cfg) if cfg.audit else 0)
    total = 0
    for m in range(p.messages):
        s, j = divmod(m, p.pieces)
        a, b = p.piece(p.send_segment(rank, s), j)
        total += HEADER_LEN + encoded_nbytes(b - a, cfg.mode, cfg.block_size)
    return total + p.pieces * (HEADER_LEN + SIG_BYTES)


def audit_bytes(p: plan.RingPlan, rank: int, cfg: RingConfig) -> int:
    """What one rank sends for the butterfly's audits (net.audit), to within a block per peer:
    its commitment and its nonce to every other rank, those it forwards (each owner's commitment
    and nonce to each member it is a forwarder of), its row lists to its auditor, its
    challenge (the piece and the draw) to every other rank, two commitments of each auditor's
    target (the held one, and another it got or that one again), and its piece to each auditor (each answer counted at the size of its
    segment's first piece); then its signature that its own audit passed, DONE and END (net.relay);
    and the 8-byte mark that starts its gather on every link (net.butterfly.BUCKET_MARK)."""
    world, n = p.world, p.piece(rank, 0)[1] - p.piece(rank, 0)[0]
    head = HEADER_LEN + audit.head_nbytes(p.pieces, world) + HEADER_LEN + SIG_BYTES
    rows = p.pieces * (HEADER_LEN + world * audit.ENTRY)
    answers = (world - 1) * (HEADER_LEN + encoded_nbytes(n, cfg.mode, cfg.block_size))
    echoes = 2 * (world - 2) * head  # the target's commitments, to every auditor but the target's own
    # the last aggregate piece in two frames, then our signature that our audit passed; DONE and END
    tails = (world - 1) * (HEADER_LEN + HEADER_LEN + SIG_BYTES + 2 * (HEADER_LEN + 1))
    nonce, challenge, mark = HEADER_LEN + audit.DIGEST, HEADER_LEN + 4 + audit.DIGEST, HEADER_LEN + 8
    forwards = sum(rank in pairing.forwarders(t, m, world) for t in range(world) for m in range(world)
                   if rank not in (t, m) and t != m) * (head + nonce)
    return (world - 1) * (head + nonce + challenge + mark + HEADER_LEN + SIG_BYTES) + rows + answers + echoes + tails + \
        forwards


def ring_view(tree: Any, world: int, sender: int, cfg: RingConfig) -> np.ndarray:
    """What the ring shows of ``sender``'s contribution to its successor, unsummed: its own
    segment of every bucket (the first messages it sends), or all of it with a gathered codec
    (every piece of it travels whole). Flat float32."""
    leaves = treelib.flatten(tree)[0]
    sizes = [x.size for x in leaves]
    parts = []
    for idx in treelib.make_buckets(sizes, cfg.bucket_numel):
        flat = np.concatenate([np.asarray(leaves[i], np.float32).reshape(-1) for i in idx]) if idx else \
            np.empty(0, np.float32)
        if codecs.gathered(cfg.mode) or world == 1:
            parts.append(flat)
            continue
        b = plan.make_plan(flat.shape[0], world, cfg.block_size, cfg.piece_numel).seg_bounds
        parts.append(flat[b[sender]: b[sender + 1]])
    return np.concatenate(parts) if parts else np.empty(0, np.float32)


def owner_pieces(tree: Any, world: int, owner: int, cfg: RingConfig) -> Iterator[tuple[int, int, np.ndarray]]:
    """What a butterfly owner receives of a member's contribution: (bucket, piece, values) for
    each piece of segment ``owner`` of every bucket (flat float32 views)."""
    leaves = treelib.flatten(tree)[0]
    sizes = [x.size for x in leaves]
    for bi, idx in enumerate(treelib.make_buckets(sizes, cfg.bucket_numel)):
        flat = np.concatenate([np.asarray(leaves[i], np.float32).reshape(-1) for i in idx])
        p = plan.butterfly_plan(flat.shape[0], world, cfg.block_size, cfg.piece_numel)
        for j in range(p.pieces):
            a, b = p.piece(owner, j)
            if b > a:
                yield bi, j, flat[a:b]


class LocalGroup:
    """``world`` ranks in one process sharing the ring's arithmetic."""

    def __init__(self, world: int, config: RingConfig | None = None, *, epoch: int = 0, step: int = 0) -> None:
        if world < 1:
            raise ValueError("world must be >= 1")
        self.world, self.config, self.epoch, self.step = world, config or RingConfig(), epoch, step
        self._cond = threading.Condition()
        self._inputs: dict[int, Any] = {}
        self._results: list[Any] | None = None
        self._error: Exception | None = None
        self._generation = 0
        self._calls = 0
        self._fail: str | None = None
        self.last_inputs: list[Any] = []  # every rank's input of the last collective
        self.comms = [LocalCommunicator(self, r) for r in range(world)]

    def communicator(self, rank: int) -> LocalCommunicator:
        """The communicator of ``rank``."""
        return self.comms[rank]

    def fail_next(self, reason: str = "injected failure") -> None:
        """Make the next collective raise :class:`PeerClosed` on every rank."""
        self._fail = reason

    def all_reduce_mean_all(self, trees: list[T], dropped: list[T | None] | None = None,
                            absent: frozenset[int] = frozenset()) -> list[T]:
        """Every rank's result for every rank's input, computed in the calling thread
        (``dropped[r]``: rank r's error feedback, as ``Communicator.all_reduce_mean``'s;
        ``absent``: the ranks sitting the round out, which the butterfly and the gathered codecs
        leave out)."""
        if len(trees) != self.world:
            raise ValueError(f"expected {self.world} trees, got {len(trees)}")
        call = self._calls
        self._calls += 1
        if self._fail is not None:
            reason, self._fail = self._fail, None
            raise PeerClosed(f"local ring: {reason}")
        cfg, seed = self.config, self.config.rng_seed(self.epoch)
        encs = [unpack_encoded(t, cfg, None if dropped is None else dropped[r]) for r, t in enumerate(trees)]
        flat = [treelib.flatten(t) for t, _ in encs]
        if len({sig for _, _, sig in flat}) != 1:
            raise ValueError("ranks passed pytrees of different structure or shapes")
        leaves0 = flat[0][0]
        drops = [None if d is None else leaves_like("dropped", d, flat[0][2]) for d in (dropped or [None] * self.world)]
        out: list[np.ndarray] = []
        for bi, idx in enumerate(treelib.make_buckets([x.size for x in leaves0], cfg.bucket_numel)):
            n = sum(leaves0[i].size for i in idx)
            inputs = [treelib.gather(leaves, idx) if e is None else np.broadcast_to(np.float32(0), (n,))
                      for (leaves, _, _), (_, e) in zip(flat, encs)]
            own = [None if e is None else e.payloads[bi] for _, e in encs]
            if not inputs[0].size:
                res = np.empty(0, np.float32)
            elif codecs.gathered(cfg.mode) and (self.world > 1 or own[0] is not None):
                ds = [None if d is None else np.empty(inputs[0].size, np.float32) for d in drops]
                res = gather.simulate(inputs, cfg.mode, cfg.block_size, cfg.piece_numel, ds, own, absent)
                for d_leaves, d in zip(drops, ds):
                    if d_leaves is not None:
                        for o, v in zip((d_leaves[i] for i in idx), treelib.scatter(d, leaves0, idx)):
                            np.copyto(o, v)
            elif cfg.exchange == "butterfly" and self.world > 1:
                res = butterfly.simulate(inputs, cfg.mode, cfg.block_size, cfg.piece_numel, cfg.robust, absent)
            else:
                res = plan.simulate(inputs, cfg.mode, cfg.block_size, cfg.piece_numel, seed=seed,
                                    call=bucket_call(call, bi))
                for d_leaves in drops:  # a gathered codec's ring of one: nothing sent, nothing lost
                    for i in idx if d_leaves is not None else ():
                        d_leaves[i][...] = 0
            out.extend(treelib.scatter(res, leaves0, idx))
        result = flat[0][1](out)
        self.last_inputs = [t if e is None else _decoded(e, cfg) for t, e in encs]  # what inspect is shown
        return [result] + [_copy_tree(result) for _ in range(self.world - 1)]

    def _submit(self, rank: int, tree: Any, timeout: float, dropped: Any = None) -> Any:
        deadline = time.monotonic() + timeout
        with self._cond:
            gen = self._generation
            self._inputs[rank] = (tree, dropped)
            if len(self._inputs) == self.world:
                got, self._inputs = [self._inputs[r] for r in range(self.world)], {}
                inputs = [t for t, _ in got]
                try:
                    self._results, self._error = self.all_reduce_mean_all(
                        inputs, [d for _, d in got], self.comms[0].absent), None
                except Exception as e:  # noqa: BLE001 - re-raised on every rank
                    self._results, self._error = None, e
                self._generation += 1
                self._cond.notify_all()
            while self._generation == gen:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._inputs.pop(rank, None)
                    missing = self.world - len(self._inputs) - 1
                    raise PeerTimeout(f"local ring: {missing} rank(s) did not join within {timeout:.1f}s")
                self._cond.wait(left)
            if self._error is not None:
                raise type(self._error)(str(self._error))
            assert self._results is not None
            return self._results[rank]


class LocalCommunicator:
    """One rank of a :class:`LocalGroup`; same interface as the socket communicator."""

    def __init__(self, group: LocalGroup, rank: int) -> None:
        self.group, self.rank, self.world_size = group, rank, group.world
        self._stats = CommStats(world_size=group.world, mode=group.config.mode)
        self.inspect: Any = None  # as SocketCommunicator.inspect, shown the predecessor's whole input
        self.suspect: tuple[int, str, dict[str, Any]] | None = None  # as SocketCommunicator.suspect (unsigned)
        self.absent: frozenset[int] = frozenset()  # as SocketCommunicator.absent (every rank sets the same)

    @property
    def over_present(self) -> bool:
        """As the socket communicator's: the butterfly averages the ranks not ``absent``."""
        return self.group.config.exchange == "butterfly"

    @property
    def last_stats(self) -> CommStats:
        """Traffic the socket ring would have sent (data frames) and the time spent here."""
        return self._stats

    def all_reduce_mean(self, tree: T, *, out: T | None = None, dropped: T | None = None) -> T:
        """Blocks until every rank of the group has called, then returns the mean."""
        t0 = time.monotonic()
        cfg = self.group.config
        check_dropped(cfg, dropped)
        result = self.group._submit(self.rank, tree, cfg.deadline, dropped)
        self.suspect = None
        if self.inspect is not None and self.world_size > 1:
            # the predecessor's pieces only, as the ring's successor sees them (the butterfly's: those
            # of our segment): this fake signs nothing, and a coordinator with no authority to check
            # signatures takes accusations from a member's ring successor only
            n = self.world_size
            fly = cfg.exchange == "butterfly"
            for sender in [(self.rank - 1) % n]:
                theirs = np.concatenate([w for _, _, w in owner_pieces(self.group.last_inputs[sender], n, self.rank,
                                                                       cfg)] or [np.empty(0, np.float32)]) \
                    if fly else ring_view(self.group.last_inputs[sender], n, sender, cfg)
                look = (lambda v: SAT_OUT if v.any() else None) if sender in self.absent and \
                    (self.over_present or codecs.gathered(cfg.mode)) else self.inspect
                found = unsigned_evidence(theirs, look, step=self.group.step, epoch=self.group.epoch,
                                          piece_numel=cfg.piece_numel)
                if found:
                    self.suspect = (sender, *found)
                    break
        if out is not None:
            for o, r in zip(treelib.flatten(out)[0], treelib.flatten(result)[0]):
                np.copyto(o, r)
            result = out
        sizes = [leaf.size for leaf in treelib.flatten(unpack_encoded(tree, cfg, None)[0])[0]]
        numel = sum(sizes)
        sent = sum(ring_bytes(sum(sizes[i] for i in idx), self.world_size, self.rank, cfg)
                   for idx in treelib.make_buckets(sizes, cfg.bucket_numel))
        self._stats = CommStats(sent, sent, time.monotonic() - t0, numel, self.world_size, cfg.mode)
        return result

    def abort(self) -> None:
        """Fail the collective in progress on every rank."""
        with self.group._cond:
            if self.group._inputs:
                self.group._inputs, self.group._results = {}, None
                self.group._error = PeerClosed("local ring: aborted")
                self.group._generation += 1
                self.group._cond.notify_all()

    def close(self) -> None:
        """Nothing to release."""


def _decoded(enc: gather.Encoded, cfg: RingConfig) -> Any:
    """The tree an encoded contribution decodes to."""
    leaves, rebuild, _ = treelib.flatten(enc.like)
    out: list[np.ndarray] = []
    for bi, idx in enumerate(treelib.make_buckets([x.size for x in leaves], cfg.bucket_numel)):
        n = sum(leaves[i].size for i in idx)
        p = gather.gather_plan(n, cfg.block_size, cfg.piece_numel)
        res = gather.combine([enc.payloads[bi]], p, cfg.mode, cfg.block_size, np.empty(n, np.float32)) if n else \
            np.empty(0, np.float32)  # an empty bucket is never exchanged
        out.extend(treelib.scatter(res, leaves, idx))
    return rebuild(out)


def _copy_tree(tree: Any) -> Any:
    if isinstance(tree, np.ndarray):
        return tree.copy()
    from jax import tree_util

    return tree_util.tree_map(lambda a: np.array(a, copy=True), tree)
