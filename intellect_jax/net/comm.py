"""The one interface the DiLoCo layer uses: ``Communicator.all_reduce_mean(tree) -> tree``.

* :class:`NetNode`: a process's long-lived endpoint (transport config + listener).
* :class:`SocketCommunicator`: the ring over one ordered peer list for one epoch; its
  connections open on the first call and are reused until :meth:`close` or a failure
  (then build a new one, typically for a new epoch: it costs only new connections).
* :class:`~intellect_jax.testing.local_ring.LocalCommunicator`: the in-process fake, bit-identical.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import socket
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from typing import Annotated, Any, Callable, Iterable, Protocol, Sequence, TypeVar, runtime_checkable

import numpy as np
from pydantic import Field

from intellect_jax.net import audit, codecs, evidence, mesh, pairing, quant, robust, tree as treelib
from intellect_jax.net.audit import Auditing, Case
from intellect_jax.net.butterfly import RING_MODES, MeshSeal, Weighing, butterfly_all_reduce, peer_of
from intellect_jax.net.errors import AuditFailed, ConfigMismatch, NetError, PeerTimeout, RingClosed
from intellect_jax.net.identity import issued, verify
from intellect_jax.net.schema import Nat, Wire, recv_model
from intellect_jax.net.gather import (Encoded, Holding, OriginSeal, Vouch, check_own, combine, gather_plan,
                                     ring_all_gather_mean)
from intellect_jax.net.ring import Finding, Links, Seal, Workspace, ring_all_reduce
from intellect_jax.net.listener import Listener
from intellect_jax.net.transport import (
    Address,
    Connection,
    TransportConfig,
    connect,
    parse_address,
    shut,
    send_msg,
)

T = TypeVar("T")


@dataclass(frozen=True)
class RingConfig:
    """How the ring all-reduce runs. Every rank of a ring must use the same values."""

    mode: str = "int8"  # "fp32" | "bf16" | "int8" | "int4" (ring) | "int2" | "int1" | "topk<K>" | "top1of<G>" (gathered)
    block_size: int = 64  # int8, int4, int2, int1: elements per float32 scale; topk<K>, top1of<G>: values per chunk
    streams: int = 1  # parallel TCP connections per ring link
    piece_numel: int = 1 << 18  # pipeline piece (elements)
    bucket_numel: int = 1 << 26  # pytree leaves are reduced in buckets of this many elements
    deadline: float = 300.0  # seconds for one all_reduce_mean call, connecting included
    stochastic_rounding: bool = False
    seed: int = 0
    exchange: str = "ring"  # "ring" | "butterfly": each segment's owner sees every contribution whole (.butterfly)
    robust: str = "mean"  # the butterfly owners' aggregator (.robust: mean, clip, trim<k>, cclip)
    audit: bool = True  # butterfly: owners commit to their aggregates and every rank audits one (.audit)

    def __post_init__(self) -> None:
        quant.check_mode(self.mode, self.block_size)
        if self.exchange not in ("ring", "butterfly"):
            raise ValueError(f"exchange must be ring or butterfly, not {self.exchange!r}")
        robust.check_mode(self.robust)
        if self.exchange == "butterfly" and (self.mode not in RING_MODES or self.stochastic_rounding
                                             or self.streams != 1):
            raise ValueError(f"the butterfly exchange takes {', '.join(RING_MODES)}, one stream per peer and no "
                             f"stochastic rounding, not {self.mode} with {self.streams} streams")
        if self.exchange == "ring" and self.robust != "mean":
            raise ValueError(f"a robust aggregator ({self.robust}) needs the butterfly exchange")
        if self.streams < 1 or self.piece_numel < 1 or self.bucket_numel < 1 or self.deadline <= 0:
            raise ValueError(f"invalid ring config {self}")
        if self.stochastic_rounding and self.mode != "int8":
            raise ValueError(f"stochastic rounding is for int8, not {self.mode}")
        piece = max(1, self.piece_numel // self.block_size) * self.block_size  # pieces are whole blocks
        if self.exchange == "butterfly" and self.audit and 4 * piece > evidence.MAX_EVIDENCE_BYTES:
            raise ValueError(f"an audited butterfly piece of up to {piece} values is {4 * piece} bytes as an owner's "
                             f"float32 row, above {evidence.MAX_EVIDENCE_BYTES}, the most a case can show of one "
                             "member; lower piece_numel")
        if self.block_size > 1 << 16 or quant.encoded_nbytes(piece, self.mode, self.block_size) > \
                evidence.MAX_EVIDENCE_BYTES:
            raise ValueError(f"a ring piece of up to {piece} values in {self.mode} (blocks of {self.block_size}) is "
                             f"larger than {evidence.MAX_EVIDENCE_BYTES} bytes, the most a bad piece can be shown "
                             "as evidence; lower piece_numel (and block_size to at most 65536)")

    def rng_seed(self, epoch: int) -> int | None:
        """Seed for stochastic rounding (None: round to nearest)."""
        return (self.seed << 20) + epoch if self.stochastic_rounding else None


@dataclass(frozen=True)
class CommStats:
    """What the last ``all_reduce_mean`` cost on this rank."""

    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    numel: int = 0
    world_size: int = 1
    mode: str = ""


@runtime_checkable
class Communicator(Protocol):
    """Averages pytrees of float32 numpy arrays across the ranks of a ring."""

    rank: int
    world_size: int
    # ranks sitting the round out (set before a call): the butterfly and the gathered codecs leave
    # their contributions out (they must be zeros); ``over_present`` says whether results average
    # the others only
    absent: frozenset[int]

    def all_reduce_mean(self, tree: T, *, out: T | None = None, dropped: T | None = None) -> T:
        """Elementwise mean over ranks, bit-identical on every rank; the input is never modified.

        Returns new arrays, or writes into ``out`` (same structure) and returns it. With a
        gathered codec (``int2``, ``int1``, ``topk<K>``, ``top1of<G>``: every rank's contribution reaches every rank as
        this rank encoded it) ``dropped`` (same structure, writable) receives what the encoding
        of this rank's contribution lost, ``tree - decode(encode(tree))``: error feedback. Raises
        a :class:`~intellect_jax.net.errors.NetError` subclass if the collective fails.

        ``tree`` may be a contribution encoded already (:class:`~intellect_jax.net.gather.Encoded`,
        a gathered codec's payloads made on the accelerator for this ring's settings): it is sent
        as it is, and no ``dropped`` is asked for (its encoder computed that).
        """
        ...

    @property
    def last_stats(self) -> CommStats: ...

    @property
    def over_present(self) -> bool: ...

    def abort(self) -> None:
        """Make a call in progress (in another thread) fail soon with a ``NetError``."""
        ...

    def close(self) -> None: ...


def bucket_call(call: int, bucket: int) -> int:
    """Per-bucket call id (seeds stochastic rounding identically in the fake and the ring)."""
    return call * 4096 + bucket


Reduce = Callable[[np.ndarray, int, "np.ndarray | None", "np.ndarray | None"], np.ndarray]


def leaves_like(what: str, tree: Any, sig: str) -> list[np.ndarray]:
    leaves, _, osig = treelib.flatten(tree)
    if osig != sig or not all(o.flags.c_contiguous and o.flags.writeable for o in leaves):
        raise ValueError(f"{what} must match the input's structure and shapes, with writable C-contiguous leaves")
    return leaves


def check_dropped(cfg: RingConfig, dropped: Any) -> None:
    """``dropped`` is for the gathered codecs only (a ring's re-encoded sums lose what no rank owns)."""
    if dropped is not None and not codecs.gathered(cfg.mode):
        raise ValueError(f"dropped (error feedback) needs a gathered codec (int2, int1, topk<K>, top1of<G>), not {cfg.mode}")


def unpack_encoded(tree: Any, cfg: RingConfig, dropped: Any) -> tuple[Any, Encoded | None]:
    """(the tree to reduce, its encoding): an :class:`Encoded` contribution is checked against
    the ring's settings and stands for its placeholders' tree."""
    if not isinstance(tree, Encoded):
        return tree, None
    if not codecs.gathered(cfg.mode):
        raise ValueError(f"an encoded contribution needs a gathered codec, not {cfg.mode}")
    tree.check(cfg.mode, cfg.block_size, cfg.bucket_numel, cfg.piece_numel)
    if dropped is not None:
        raise ValueError("dropped is computed where an encoded contribution was encoded, not asked of the ring")
    return tree.like, tree


ReduceAll = Callable[[list[Any], list[int], list[Any]], list[Any]]


def reduce_tree(tree: T, cfg: RingConfig, reduce_flat: Reduce | None,
                before: Callable[[dict[str, Any]], None] | None = None, out: T | None = None, dropped: T | None = None,
                encoded: bool = False, reduce_all: ReduceAll | None = None) -> tuple[T, int]:
    """Flatten, bucket, reduce every bucket with ``reduce_flat(flat, bucket, out_flat, dropped_flat)``,
    rebuild.

    With ``out`` (same structure, C-contiguous float32 leaves) results are written there; with
    ``dropped`` (the same), what ``reduce_flat`` writes to ``dropped_flat`` lands there.
    ``encoded``: the leaves are placeholders (:class:`Encoded`); ``flat`` is one too.
    ``reduce_all(flats, buckets, out_flats)`` instead reduces every bucket that is not empty in
    one call (the butterfly's: every bucket's step 1 before any bucket's step 3); its flats are
    views of the leaves (:func:`~.tree.view`: an array or a :class:`~.tree.Flat`), and so are the
    ``out`` ones, written in place (without ``out``: None, the results returned).
    """
    leaves, rebuild, sig = treelib.flatten(tree)
    outs = None if out is None else leaves_like("out", out, sig)
    drops = None if dropped is None else leaves_like("dropped", dropped, sig)
    sizes = [leaf.size for leaf in leaves]
    buckets = treelib.make_buckets(sizes, cfg.bucket_numel)
    if before is not None:
        before({"sig": sig, "buckets": [sum(sizes[i] for i in b) for b in buckets]})
    directs = [outs[idx[0]].reshape(-1) if outs is not None and len(idx) == 1 else None for idx in buckets]
    results: dict[int, np.ndarray] = {}
    if reduce_all is not None:  # every bucket at once, as views of the leaves (no bucket is copied)
        full = [bi for bi, idx in enumerate(buckets) if sum(sizes[i] for i in idx)]
        got = reduce_all([treelib.view(leaves, buckets[bi]) for bi in full], full,
                         [None if outs is None else treelib.view(outs, buckets[bi]) for bi in full])
        results = dict(zip(full, got))
        if outs is not None:  # (written in place)
            return rebuild(outs), sum(sizes)
    result: list[np.ndarray] = []
    for bi, idx in enumerate(buckets):
        n, direct = sum(sizes[i] for i in idx), directs[bi]
        if reduce_all is not None:
            res = results.get(bi, np.empty(0, np.float32))
        else:
            flat = np.broadcast_to(np.float32(0), (n,)) if encoded else treelib.gather(leaves, idx)
            d = None if drops is None else (drops[idx[0]].reshape(-1) if len(idx) == 1 else np.empty(n, np.float32))
            res = reduce_flat(flat, bi, direct, d) if n else np.empty(0, np.float32)  # type: ignore[misc]
            if drops is not None and n and len(idx) > 1:
                for o, r in zip((drops[i] for i in idx), treelib.scatter(d, leaves, idx)):
                    np.copyto(o, r)
        if outs is None:
            result.extend(treelib.scatter(res, leaves, idx))
            continue
        if direct is None:
            for o, r in zip((outs[i] for i in idx), treelib.scatter(res, leaves, idx)):
                np.copyto(o, r)
        result.extend(outs[i] for i in idx)
    return rebuild(result), sum(sizes)


def _or_close(conn: Connection, step: Callable[[], None]) -> Connection:
    """``conn`` once ``step()`` passed; closed if it raised."""
    try:
        step()
    except BaseException:
        conn.close()
        raise
    return conn


def _alone(flat: np.ndarray, _: int, out: np.ndarray | None, dropped: np.ndarray | None) -> np.ndarray:
    """A ring of one: an exact copy (nothing is sent, so nothing is dropped)."""
    if dropped is not None:
        dropped[...] = 0
    if out is None:
        return np.array(flat, np.float32, copy=True)
    np.copyto(out, flat)
    return out


def decoded(cfg: RingConfig, enc: Encoded) -> Reduce:
    """A ring of one with an encoded contribution: what its payloads decode to (a host tree alone
    is applied exactly; an encoded one was encoded before the ring was known, and its encoder
    counted what it dropped, which feedback sends with the next round)."""

    def reduce(flat: np.ndarray, bi: int, out: np.ndarray | None, _: np.ndarray | None) -> np.ndarray:
        p = gather_plan(flat.shape[0], cfg.block_size, cfg.piece_numel)
        check_own(enc.payloads[bi], p, cfg.mode, cfg.block_size)
        return combine([enc.payloads[bi]], p, cfg.mode, cfg.block_size,
                       np.empty(flat.shape[0], np.float32) if out is None else out)

    return reduce


class NetNode:
    """A node's endpoint: a listener that stays up, plus outgoing connections on demand."""

    def __init__(self, cfg: TransportConfig, host: str = "127.0.0.1", port: int = 0) -> None:
        self.cfg = cfg
        self.listener = Listener(cfg, host, port)
        # identities on probation with us as a butterfly owner: their own pieces of our segment did
        # not all reach us in a failed call while their link stood open and still, and no call has
        # succeeded with them all since (SocketCommunicator._on_probation). Our own observation,
        # kept across epochs.
        self.probation: set[str] = set()

    @property
    def address(self) -> Address:
        """Where peers reach this node."""
        return self.listener.address

    @property
    def name(self) -> str:
        """This node's identity."""
        return self.cfg.name

    def connect(self, address: Address | str, channel: str, *, expect: str | None, timeout: float | None = None,
                name: str | None = None, dialing: Callable[[socket.socket], None] | None = None) -> Connection:
        """Connection on ``channel`` to the peer at ``address``, which must hold identity
        ``expect`` (None: any identity of the run); ``dialing``: see :func:`~.transport.connect`."""
        return connect(self.cfg, parse_address(address), channel, expect=expect, timeout=timeout, name=name,
                       dialing=dialing)

    def accept(self, channel: str, *, peer: str | None, timeout: float, name: str | None = None) -> Connection:
        """Next connection on ``channel`` from identity ``peer`` (None: any identity of the run)."""
        return self.listener.accept(channel, timeout=timeout, peer=peer, name=name)

    def ring(self, members: Sequence[tuple[str, Address | str]], rank: int, *, epoch: int = 0, step: int = 0,
             config: RingConfig | None = None) -> SocketCommunicator:
        """A communicator over ``members``, (identity, address) in ring order; ``members[rank]``
        is this node; ``step``: the outer step its all-reduces belong to (in every signature)."""
        return SocketCommunicator(self, members, rank, epoch=epoch, step=step, config=config)

    def close(self) -> None:
        """Stop listening."""
        self.listener.close()

    def __enter__(self) -> NetNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
Short = Annotated[str, Field(max_length=64)]


class RingMeta(Wire):
    """What ring neighbours compare before every all-reduce call (``_check_meta``): the call,
    the ring, the :class:`RingConfig` (less its deadline), the ranks sitting the round out and the
    tree's signature and buckets."""

    v: Annotated[int, Field(ge=0, le=1 << 16)]
    call: Nat
    step: Int64
    epoch: Int64
    world: Annotated[int, Field(ge=1, le=1 << 20)]
    peers: Short
    mode: Annotated[str, Field(max_length=16)]
    block_size: Nat
    streams: Nat
    piece_numel: Nat
    bucket_numel: Nat
    stochastic_rounding: bool
    seed: Int64
    exchange: Annotated[str, Field(max_length=16)]
    robust: Annotated[str, Field(max_length=16)]
    audit: bool
    absent: Annotated[list[Nat], Field(max_length=1 << 20)]  # the ranks sitting the round out
    sig: Short
    buckets: Annotated[list[Nat], Field(max_length=1 << 16)]
    nonce: Annotated[str, Field(pattern=r"^([0-9a-f]{64})?$")]  # audits: the head of its nonce chain (not compared)


class SocketCommunicator:
    """Ring all-reduce over TCP for one ordered peer list and one epoch.

    One call at a time per communicator; every rank must make the same sequence of calls
    with the same tree structure (checked on every call).
    """

    def __init__(self, node: NetNode, members: Sequence[tuple[str, Address | str]], rank: int, *, epoch: int = 0,
                 step: int = 0, config: RingConfig | None = None) -> None:
        self.node, self.rank, self.epoch, self.step = node, rank, epoch, step
        try:  # the member list comes from the coordinator, the addresses from each member
            if not all(isinstance(m, (tuple, list)) and len(m) == 2 and isinstance(m[0], str) for m in members):
                raise ValueError(f"not a list of (identity, address): {str(members)[:120]}")
            self.ids = [m[0] for m in members]
            self.peers = [parse_address(m[1]) for m in members]
        except ValueError as e:
            raise ConfigMismatch(f"ring of epoch {epoch}: {e}") from None
        self.world_size = len(self.peers)
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a ring of {self.world_size}")
        self.config = config or RingConfig()
        piece_bytes = quant.encoded_nbytes(self.config.piece_numel, self.config.mode, self.config.block_size)
        if piece_bytes > node.cfg.max_frame_bytes:
            raise ValueError(f"a ring piece of {self.config.piece_numel} values is {piece_bytes} bytes, above "
                             f"max_frame_bytes={node.cfg.max_frame_bytes}; lower piece_numel")
        self._aborted = False
        self.inspect: Any = None  # theirs -> reason | None, shown the predecessor's own pieces
        self.absent: frozenset[int] = frozenset()  # ranks sitting the round out (the butterfly leaves them out)
        # after a call: (predecessor rank, reason, evidence: its signed piece, see net.evidence)
        self.suspect: tuple[int, str, dict[str, Any]] | None = None
        # the same for every member whose bad piece we hold, one each (a butterfly owner sees all
        # members' pieces of its segment; the ring's successor only its predecessor's): suspect first
        self.suspects: list[tuple[int, str, dict[str, Any]]] = []
        # after a butterfly call that our audit failed (AuditFailed): (rank at fault, why, the audited
        # piece as evidence, net.audit.to_wire; None when too large to report)
        self.audited: tuple[int, str, dict[str, Any] | None] | None = None
        # after a butterfly call that failed (not aborted from outside): the ranks whose own pieces of
        # our segment, in any bucket, did not all reach us, link or header failures included (net.mesh)
        self.missing: tuple[int, ...] = ()
        # after an all-gather call that failed once our signed digests went out: our holding of each
        # origin (net.evidence.holding_evidence), for the coordinator to compare with the others' (an
        # origin that signed two versions of a piece), and our signed digest list and every rank's we
        # got (net.evidence.vouch_evidence: a rank whose list gives it away)
        self.held: list[dict[str, Any]] = []
        self.vouched: list[dict[str, Any]] = []
        # after a butterfly call that succeeded: (rank, evidence) for each member whose rows were
        # outsized in most pieces of our segment (net.evidence.outsize_evidence, its first such piece)
        self.steered: list[tuple[int, dict[str, Any]]] = []
        self._dead: dict[int, NetError] = {}  # rank -> why its link to or from us failed (butterfly)
        self._heads: dict[int, bytes] = {}  # rank -> the head of its nonce chain in this call's header (audits)
        self._opening: list[Connection] = []  # the mesh's links opened so far, while _mesh runs
        self._dials: weakref.WeakSet[socket.socket] = weakref.WeakSet()  # sockets of dials under way (_dial)
        self._dials_lock = threading.Lock()
        self._links: Links | None = None
        self._workspace = Workspace()
        self._closed = False
        self._calls = 0
        self._stats = CommStats(world_size=self.world_size, mode=self.config.mode)
        self._peers_hash = hashlib.sha256(json.dumps([self.ids, self.peers]).encode()).hexdigest()[:16]

    @property
    def last_stats(self) -> CommStats:
        """Traffic and time of the last call."""
        return self._stats

    @property
    def over_present(self) -> bool:
        """Whether results average only the ranks not in ``absent`` (the butterfly); the ring
        averages every rank, zeros included."""
        return self.config.exchange == "butterfly"

    def _name(self, r: int) -> str:
        return f"rank {r} ({self.ids[r]} at {self.peers[r][0]}:{self.peers[r][1]})"

    def _channel(self, src: int, dst: int, k: int) -> str:
        return f"ring/{self.epoch}/{src}>{dst}/{k}"

    def _until(self, fn: Callable[[float], Connection], deadline: float, what: str) -> Connection:
        """``fn(timeout)`` in short slices until it succeeds, the deadline passes or :meth:`abort`."""
        while True:
            if self._aborted:
                raise RingClosed(f"ring epoch {self.epoch} aborted while {what}")
            left = deadline - time.monotonic()
            try:
                return fn(max(0.0, min(left, 0.5)))
            except PeerTimeout as e:
                if time.monotonic() >= deadline:
                    raise PeerTimeout(f"{what}: nothing in time (last try: {e})") from None

    def _open(self, deadline: float) -> Links:
        """The ring's links: ``streams`` to the successor and as many from the predecessor (the
        butterfly's mesh opens with its header: :meth:`_mesh`)."""
        if self._links is not None:
            return self._links
        n, me = self.world_size, self.rank
        outs = [((me + 1) % n, k) for k in range(self.config.streams)]
        inns = [((me - 1) % n, k) for k in range(self.config.streams)]
        links = Links([], [])
        try:
            for to, k in outs:
                ch = self._channel(me, to, k)
                links.out.append(self._until(lambda t: self._dial(to, ch, t), deadline,
                                             f"connecting to {self._name(to)}"))
            for frm, k in inns:
                ch = self._channel(frm, me, k)
                links.inn.append(self._until(lambda t: self.node.accept(ch, peer=self.ids[frm], timeout=t,
                                                                        name=self._name(frm)),
                                             deadline, f"waiting for {self._name(frm)} on channel {ch!r}"))
        except BaseException:
            links.close()
            raise
        self._links = links
        if self._aborted:
            links.abort()
        return links

    def _mesh(self, meta: dict[str, Any], deadline: float) -> Links:
        """The butterfly's :meth:`_open` and :meth:`_check_meta` in one, link by link
        (:mod:`.mesh`): each link is a :class:`~.mesh.Pending` whose own thread opens it if it
        is not open yet, then sends our header on it or reads and compares the peer's; the call
        starts at once, and each of its threads waits only for its own link. A link that fails
        before ``deadline`` (it does not open, its header does not come, parse or match ours)
        becomes a :class:`~.mesh.DeadLink`, its rank noted in ``_dead``; the others stand."""
        n, me, last = self.world_size, self.rank, self._links  # (the last call's links, reused; not the new ones)
        ranks = [peer_of(me, n, k) for k in range(n - 1)]
        ours = RingMeta.model_validate(meta).model_dump()  # ours must parse too: a new field goes in RingMeta
        self._opening, self._heads = [], {}

        def out(k: int) -> Callable[[], Connection]:
            to, ch = ranks[k], self._channel(me, ranks[k], 0)

            def go() -> Connection:
                conn = last.out[k].get() if last else self._opened(self._until(
                    lambda t: self._dial(to, ch, t), deadline, f"connecting to {self._name(to)}"))
                def start() -> None:
                    if not last:  # (a new link: its peer reads it all along, see Connection.bound_unsent)
                        conn.bound_unsent(self.node.cfg.notsent_lowat)
                    send_msg(conn, meta, deadline)
                return _or_close(conn, start)
            return go

        def inn(k: int) -> Callable[[], Connection]:
            frm, ch = ranks[k], self._channel(ranks[k], me, 0)

            def check(conn: Connection) -> None:
                theirs = recv_model(conn, RingMeta, "all-reduce header", deadline, max_len=1 << 16).model_dump()
                self._heads[frm] = bytes.fromhex(theirs["nonce"])
                diff = [key for key in ours if key != "nonce" and ours[key] != theirs[key]]
                if diff:
                    detail = ", ".join(f"{key}: theirs={repr(theirs[key])[:40]} ours={repr(ours[key])[:40]}"
                                       for key in diff)
                    raise ConfigMismatch(f"{self._name(frm)} disagrees on this all-reduce: {detail}")

            def go() -> Connection:
                conn = last.inn[k].get() if last else self._opened(self._until(
                    lambda t: self.node.accept(ch, peer=self.ids[frm], timeout=t, name=self._name(frm)),
                    deadline, f"waiting for {self._name(frm)} on channel {ch!r}"))
                return _or_close(conn, lambda: check(conn))
            return go

        def pending(rank: int, opener: Callable[[], Connection]) -> mesh.Pending:
            return mesh.Pending(self._name(rank), opener, deadline, lambda e: self._dead.setdefault(rank, e))

        self._links = links = Links([pending(ranks[k], out(k)) for k in range(n - 1)],  # type: ignore[misc]
                                    [pending(ranks[k], inn(k)) for k in range(n - 1)])
        if self._aborted:
            links.abort()
            raise RingClosed(f"ring epoch {self.epoch} aborted while opening its links")
        return links

    def _dial(self, to: int, ch: str, timeout: float) -> Connection:
        """A connection to rank ``to`` on channel ``ch``, each try's socket where :meth:`abort`
        finds it (a dial waits for a peer's answer past its timeout: ``transport.connect``)."""
        def dialing(sock: socket.socket) -> None:
            with self._dials_lock:
                self._dials.add(sock)
            if self._aborted:
                shut(sock)
        return self.node.connect(self.peers[to], ch, expect=self.ids[to], timeout=timeout, name=self._name(to),
                                 dialing=dialing)

    def _opened(self, conn: Connection) -> Connection:
        """``conn``, just opened by :meth:`_mesh`, where :meth:`abort` finds it meanwhile."""
        self._opening.append(conn)
        if self._aborted:
            conn.abort()
        return conn

    def _check_meta(self, links: Links, meta: dict[str, Any], deadline: float) -> None:
        """Send our parameters to every rank we send to; every rank we receive from must send
        the same, parsed as a :class:`RingMeta` (:class:`FrameError` if they do not parse,
        :class:`ConfigMismatch` if they differ)."""
        ours = RingMeta.model_validate(meta).model_dump()  # ours must parse too: a new field goes in RingMeta
        send_msg(links.out[0], meta, deadline)
        theirs = recv_model(links.inn[0], RingMeta, "all-reduce header", deadline, max_len=1 << 16).model_dump()
        diff = [key for key in ours if ours[key] != theirs[key]]
        if diff:
            detail = ", ".join(f"{key}: theirs={repr(theirs[key])[:40]} ours={repr(ours[key])[:40]}" for key in diff)
            raise ConfigMismatch(f"{self._name((self.rank - 1) % self.world_size)} disagrees on this all-reduce: "
                                 f"{detail}")

    def all_reduce_mean(self, tree: T, *, out: T | None = None, dropped: T | None = None) -> T:
        """Mean over the ring, bit-identical on every rank, as new arrays (or written to ``out``);
        ``dropped``: see :meth:`Communicator.all_reduce_mean` (gathered codecs,
        :mod:`.gather`).

        On failure every rank raises within ``config.deadline``, the connections are closed
        (this communicator is then unusable: build a new ring) and ``tree`` is untouched.
        """
        if self._closed:
            raise RingClosed(f"ring epoch {self.epoch} is closed (after a failure or close()); build a new one")
        cfg, t0 = self.config, time.monotonic()
        check_dropped(cfg, dropped)
        tree, enc = unpack_encoded(tree, cfg, dropped)
        deadline = t0 + cfg.deadline
        call, seed = self._calls, cfg.rng_seed(self.epoch)
        if self.world_size == 1:
            result, numel = reduce_tree(tree, cfg, _alone if enc is None else decoded(cfg, enc), out=out,
                                        dropped=dropped, encoded=enc is not None)
            self._stats = CommStats(0, 0, time.monotonic() - t0, numel, 1, cfg.mode)
            self._calls += 1
            return result
        verdicts: list[tuple[int, str, Case]] = []  # (rank, why, case) from our audits
        # after a failed butterfly call: whose own pieces of our segment, in any bucket, did not all
        # reach us (every bucket's step 1 comes before any bucket's step 3: net.butterfly)
        gaps: list[int] = []
        shut: list[int] = []  # after a butterfly call that succeeded: the ranks whose links it shut (net.relay)
        left: list[int] = []  # after a butterfly call that succeeded: the ranks whose rows of our segment it left out
        quiet: list[int] = []  # after one that failed: the gaps whose links stood still (MeshCall.quiet)
        held: list[tuple[int, Holding]] = []  # (call, our holding of an origin) from an all-gather that failed
        vouched: list[tuple[int, Vouch]] = []  # (call, our signed digest list or a rank's we got) from it
        meshed = cfg.exchange == "butterfly"  # (its links open with the call's header, link by link: _mesh)
        probation = frozenset(r for r, i in enumerate(self.ids) if i in self.node.probation and r != self.rank) \
            if meshed and cfg.audit else frozenset()
        opening = t0 + mesh.OPENING * cfg.deadline if meshed else deadline
        self.missing = ()
        try:
            links = self._links if meshed else self._open(opening)
            sent0, recv0 = links.traffic() if links else (0, 0)

            def before(info: dict[str, Any]) -> None:
                nonlocal links
                meta = {"v": 8, "call": call, "step": self.step, "epoch": self.epoch, "world": self.world_size,
                        "peers": self._peers_hash, **asdict(cfg), "absent": sorted(self.absent), **info, "nonce": ""}
                meta.pop("deadline")
                if meshed and cfg.audit:  # a nonce per bucket for the audits' pairing, bound here (pairing.draw)
                    head, chain[:] = pairing.nonce_chain(secrets.token_bytes(32), len(info["buckets"]))
                    meta["nonce"] = head.hex()
                if meshed:
                    links = self._mesh(meta, opening)
                else:
                    self._check_meta(links, meta, opening)

            findings: list[tuple[int, int, Finding]] = []  # (call, sender rank, its bad piece)
            weighing = Weighing()  # the owners' weighing of the rows of our segment, every bucket's
            bucket_calls: list[int] = []  # the call id of each bucket the butterfly reduced, in its order
            prv = (self.rank - 1) % self.world_size
            chain: list[bytes] = []  # our nonce of each bucket (audits)
            last: dict[int, tuple[int, bytes]] = {}  # rank -> (bucket, its nonce there): the latest revealed

            def flat_reduce(flat: np.ndarray, bi: int, o: np.ndarray | None, d: np.ndarray | None) -> np.ndarray:
                found: list[Finding] = []
                disputed: list[Holding] = []
                lists: list[Vouch] = []
                c = bucket_call(call, bi)
                try:
                    if codecs.gathered(cfg.mode):
                        return ring_all_gather_mean(links, flat, self.rank, self.world_size, mode=cfg.mode,
                                                    block=cfg.block_size, piece_numel=cfg.piece_numel,
                                                    deadline=deadline, out=o, dropped=d, inspect=self.inspect,
                                                    findings=found, seal=self._origin_seal(c),
                                                    own=None if enc is None else enc.payloads[bi],
                                                    absent=self.absent, disputed=disputed, vouches=lists)
                    return ring_all_reduce(links, flat, self.rank, self.world_size, mode=cfg.mode,
                                           block=cfg.block_size, piece_numel=cfg.piece_numel, seed=seed,
                                           call=c, deadline=deadline, out=o, workspace=self._workspace,
                                           inspect=self.inspect, findings=found, seal=self._seal(c, links))
                finally:
                    findings.extend((c, prv, f) for f in found)
                    held.extend((c, h) for h in disputed)
                    vouched.extend((c, v) for v in lists)

            def mesh_reduce(flats: list[Any], bis: list[int], outs: list[Any]) -> list[Any]:
                calls, by = [bucket_call(call, bi) for bi in bis], []  # (by: (bucket, sender rank, its bad piece))
                try:
                    return butterfly_all_reduce(links, flats, self.rank, self.world_size, mode=cfg.mode,
                                                block=cfg.block_size, piece_numel=cfg.piece_numel, deadline=deadline,
                                                how=cfg.robust, outs=outs, inspect=self.inspect, findings=by,
                                                seals=[self._mesh_seal(c, links) for c in calls],
                                                workspace=self._workspace, absent=self.absent,
                                                auditings=[self._auditing(c, links, chain[bi], bi, last)
                                                           for c, bi in zip(calls, bis)] if cfg.audit else None,
                                                verdicts=verdicts, gaps=gaps, weighing=weighing, shut=shut,
                                                probation=probation, left=left, quiet=quiet)
                finally:
                    findings.extend((calls[i], r, f) for i, r, f in by)
                    bucket_calls[:] = calls

            self.suspect, self.suspects, self.audited, self.steered = None, [], None, []
            self.held, self.vouched = [], []
            result, numel = reduce_tree(tree, cfg, None if meshed else flat_reduce, before, out=out, dropped=dropped,
                                        encoded=enc is not None, reduce_all=mesh_reduce if meshed else None)
            for c, r, f in findings:
                if any(r == s[0] for s in self.suspects):  # (the first bad piece of each sender)
                    continue
                k = (r - self.rank - 1) % self.world_size if cfg.exchange == "butterfly" else 0
                self.suspects.append((r, f.why, evidence.evidence(
                    step=self.step, epoch=self.epoch, call=c, segment=f.segment, piece=f.piece, numel=f.numel,
                    mode=cfg.mode, block=cfg.block_size, payload=f.payload, signature=f.signature,
                    cert=links.inn[k].cert)))
            self.suspect = self.suspects[0] if self.suspects else None
            self.steered = [(r, evidence.outsize_evidence(
                step=self.step, epoch=self.epoch, call=bucket_calls[i], segment=self.rank, piece=ev.piece, numel=ev.numel,
                mode=cfg.mode, block=cfg.block_size, ratio=ev.ratio, payloads=ev.payloads, signatures=ev.signatures))
                for r, i, ev in weighing.steering()]
        except BaseException as e:
            if verdicts:  # our audit failed the call: the case goes with our next sync
                r, why, case = verdicts[0]
                self.audited = (r, why, audit.to_wire(case) if audit.reportable(case) else None)
            if self.world_size > audit.MAX_CASE_RANKS:  # (larger rings' lists are too large to report)
                vouched = []
            size = sum(evidence.vouch_size(len(v.entries), len(v.cert)) for _, v in vouched)
            self.vouched = [evidence.vouch_evidence(
                step=self.step, epoch=self.epoch, call=c, holder=self.ids[v.holder], entries=v.entries,
                signature=v.signature, cert=v.cert) for c, v in vouched]
            for c, h in held:  # ours, for the coordinator to compare: a prefix that fits (coordinator.holdings)
                size += evidence.holding_size(len(h.numels), len(h.cert))
                if size > audit.MAX_CASE_BYTES or len(self.held) >= audit.MAX_CASE_RANKS:
                    break
                self.held.append(evidence.holding_evidence(
                    step=self.step, epoch=self.epoch, call=c, origin=self.ids[h.origin], mode=cfg.mode,
                    block=cfg.block_size, cert=h.cert, numels=h.numels, digests=h.digests, signatures=h.signatures))
            if not self._aborted:  # (aborted from outside: the call was cut short, its gaps say nothing)
                self.missing = tuple(sorted(set(gaps)))
                if meshed and cfg.audit:
                    self._on_probation(probation | set(quiet))
            self._teardown()  # neighbours see the connections close and fail fast too
            if self._dead and isinstance(e, NetError) and not isinstance(e, AuditFailed):
                first = self._dead[min(self._dead)]  # the root cause, not its echo in the exchange
                raise type(first)(str(first)) from e
            raise
        if meshed and cfg.audit:
            self._on_probation(probation & set(left))
        sent, recv = links.traffic()
        self._stats = CommStats(sent - sent0, recv - recv0, time.monotonic() - t0, numel, self.world_size, cfg.mode)
        self._calls += 1
        if shut:  # (those links may hold half a frame: another call on them would read it as its own)
            self._teardown()
        return result

    def _on_probation(self, ranks: Iterable[int]) -> None:
        """After an audited butterfly call: the members of this ring on probation with us are
        ``ranks`` (the others' standing is kept). A member goes on it when its own pieces of our
        segment did not all reach us in a call that failed, its link to us bringing no whole piece
        for half the call and for a quarter of it after the latest time its sender's step 1 can
        have been paced, up to the end or to a close (``MeshCall.quiet``): every link carries its
        step 1 to its end whatever fails elsewhere, unpaced after half the call from its sender's
        start (:mod:`.mesh_call`), so no third rank can cause that to an honest member on a sound
        link (a rank aborted from outside shuts its links at once: an early close makes nobody
        quiet). It stays on through
        failed calls and calls that succeed leaving its rows out, and is off after one that
        succeeds with them all. In a later call we give its missing rows the shortest grace and,
        once we have left it out and its link brings nothing, do without its audit frames
        (:mod:`.audit_frames`): a member that goes quiet to us after its first pieces then fails
        one call, not all."""
        mine = set(self.ids) - {self.ids[self.rank]}
        self.node.probation = (self.node.probation - mine) | {self.ids[r] for r in ranks}

    def _seal(self, call: int, links: Links) -> Seal:
        """Signatures of call ``call``: ours over our own pieces, the predecessor's checked with
        the certificate its connection presented."""
        cfg, run_id, me = self.config, self.node.cfg.run_id, self.ids[self.rank]
        nxt, prv = self.ids[(self.rank + 1) % self.world_size], self.ids[(self.rank - 1) % self.world_size]
        cert = links.inn[0].cert

        def said(sender: str, receiver: str, seg: int, j: int, n: int, payload: Any) -> bytes:
            return evidence.statement(run_id, self.step, self.epoch, call, sender, receiver, seg, j, n, cfg.mode,
                                      cfg.block_size, payload)

        def sign(seg: int, j: int, n: int, payload: Any) -> bytes:
            return evidence.raw_signature(self.node.cfg.identity.sign(said(me, nxt, seg, j, n, payload)))

        def check(seg: int, j: int, n: int, payload: bytes, sig: bytes) -> bool:
            return verify(cert, said(prv, me, seg, j, n, payload), evidence.der_signature(sig))

        return Seal(sign, check)

    def _origin_seal(self, call: int) -> OriginSeal:
        """Signatures of call ``call`` in the all-gather (:mod:`.gather`): ours over our own
        pieces, naming no receiver; any rank's checked with its certificate, which a forwarded
        one must show the run authority issued to it (and did not revoke)."""
        cfg, run_id, ids, ident = self.config, self.node.cfg.run_id, self.ids, self.node.cfg.identity

        def said(origin: int, j: int, numel: int, d: bytes) -> bytes:
            return evidence.piece_statement(run_id, self.step, self.epoch, call, ids[origin], evidence.EVERYONE, 0, j,
                                            numel, cfg.mode, cfg.block_size, d.hex())

        def sign(j: int, numel: int, d: bytes) -> bytes:
            return evidence.raw_signature(ident.sign(said(self.rank, j, numel, d)))

        def check(origin: int, cert: bytes, j: int, numel: int, d: bytes, sig: bytes) -> bool:
            return verify(cert, said(origin, j, numel, d), evidence.der_signature(sig))

        def admit(origin: int, cert: bytes) -> str | None:
            serial = issued(ident.ca_der, cert, ids[origin])
            if serial is None:
                return "not issued to it by the run authority"
            return "revoked" if ident.revocations.revoked(serial) else None

        def holding(rank: int, d: bytes) -> bytes:
            return evidence.holding_statement(run_id, self.step, self.epoch, call, ids[rank], d.hex())

        def vouch(d: bytes) -> bytes:
            return evidence.raw_signature(ident.sign(holding(self.rank, d)))

        def vouched(rank: int, cert: bytes, d: bytes, sig: bytes) -> bool:
            return verify(cert, holding(rank, d), evidence.der_signature(sig))

        return OriginSeal(sign, check, admit, ident.cert_der, vouch, vouched)

    def _mesh_seal(self, call: int, links: Links) -> MeshSeal:
        """Signatures of call ``call`` in the butterfly: ours over our own pieces, to each
        segment's owner; a sender's checked with the certificate its connection presented."""
        cfg, run_id, ids = self.config, self.node.cfg.run_id, self.ids

        def said(sender: int, owner: int, seg: int, j: int, numel: int, payload: Any) -> bytes:
            return evidence.statement(run_id, self.step, self.epoch, call, ids[sender], ids[owner], seg, j, numel,
                                      cfg.mode, cfg.block_size, payload)

        def sign(owner: int, seg: int, j: int, numel: int, payload: Any) -> bytes:
            return evidence.raw_signature(self.node.cfg.identity.sign(said(self.rank, owner, seg, j, numel, payload)))

        def check(sender: int, seg: int, j: int, numel: int, payload: bytes, sig: bytes) -> bool:
            cert = self._cert(links, sender)
            return cert is not None and verify(cert, said(sender, self.rank, seg, j, numel, payload),
                                               evidence.der_signature(sig))

        return MeshSeal(sign, check)

    def _auditing(self, call: int, links: Links, nonce: bytes, bucket: int,
                  last: dict[int, tuple[int, bytes]]) -> Auditing:
        """Audits of call ``call``, bucket ``bucket`` (:mod:`.audit`): statements signed with our
        key, a peer's checked with the certificate its connection presented; our ``nonce`` of
        the bucket, and a peer's accepted if it hashes to the latest one it revealed (``last``,
        updated here once all of the bucket's nonces are in) or to its header's chain head."""
        def check(rank: int, data: bytes, sig: bytes) -> bool:
            cert = self._cert(links, rank)
            return cert is not None and verify(cert, data, evidence.der_signature(sig))

        def accepts(rank: int, x: bytes) -> bool:
            k, want = last.get(rank, (-1, self._heads.get(rank)))
            for _ in range(bucket - k):
                x = evidence.digest(x)
            return want is not None and x == want

        def revealed(nonces: dict[int, bytes]) -> None:
            last.update((r, (bucket, x)) for r, x in nonces.items())

        return Auditing(self.node.cfg.run_id, self.step, self.epoch, call, tuple(self.ids),
                        lambda data: evidence.raw_signature(self.node.cfg.identity.sign(data)), check,
                        secrets.randbelow, nonce, accepts, revealed)

    def _cert(self, links: Links, rank: int) -> bytes | None:
        """``rank``'s certificate (DER): ours, or the one its connection to us presented (asked
        when needed: a mesh link may still be opening, :mod:`.mesh`)."""
        if rank == self.rank:
            return self.node.cfg.identity.cert_der
        return links.inn[(rank - self.rank - 1) % self.world_size].cert

    def abort(self) -> None:
        """From another thread: fail the all-reduce in progress now (every socket of the ring is
        shut down, so this rank raises and its neighbours notice at once)."""
        self._aborted = True
        links = self._links
        if links is not None:
            links.abort()
        for conn in list(self._opening):  # (a mesh still opening: its header reads wake up too)
            conn.abort()
        with self._dials_lock:  # (and dials still waiting for their peer's answer)
            dials = list(self._dials)
        for sock in dials:
            shut(sock)

    def _teardown(self) -> None:
        self._closed = True
        if self._links is not None:
            self._links.close()
            self._links = None
        self.node.listener.discard(f"ring/{self.epoch}/")

    def close(self) -> None:
        """Close the ring's connections (the node stays up for the next ring)."""
        self._teardown()

    def __enter__(self) -> SocketCommunicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
