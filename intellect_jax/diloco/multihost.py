"""A DiLoCo node made of several processes (``[dist]``: one JAX runtime over all their devices).

Process 0, the *lead*, speaks for the node: it runs the one outer loop (:class:`~.loop.NodeLoop`)
with the coordinator client, the ring, the state transport and the checkpoint store, like a
single-process node, and holds the node's host state (outer params, momentum). The other
processes, the *followers*, hold only their devices' shards. Whatever touches the devices is a
program every process must run, in the same order, so the lead's inner trainer
(:class:`LeadInner`) first sends each such operation to the followers, which do their part of
it (:class:`Follower`):

========  ===========================================================================
train     every process runs the inner steps up to ``until`` (SPMD); with ``asks``, the lead
          sends a ``go`` before each step with its own ``stop()``'s answer, which all obey
eval      every process evaluates; the lead keeps the value
pg        ``anchor − params`` per shard; followers send their int8 pieces (1 + 4/block
          bytes per value); the lead assembles the node's pseudo-gradient
init      every process marks its anchor; followers send their param shards (fp32)
gather    followers send their shards of the inner optimizer state (checkpoint, donor)
place     the lead sends each follower the slices of params (and optimizer state) its
          devices hold; every process builds the global arrays and marks its anchor
data      followers send their data-iterator positions (one per process, checkpointed)
lease     every process reads its rows of the round's leased batches (data leases)
stop      followers leave
========  ===========================================================================

Followers connect to the lead's listener (the node's ``NetNode``; every process of a node holds
the node's certificate, and the lead accepts this channel only from that identity) at the host
of ``dist.coordinator_address`` and the port the lead broadcasts through
the JAX runtime at start. Checkpoints are written by the lead alone, from host copies. A
follower that loses its lead exits; a lead that loses a follower fails its next device
program or send and leaves the run, which evicts the node like any crashed node. Every message
between them has a strict schema (:mod:`.multihost_wire`): one of the wrong form is a
``FrameError`` naming the field, and the process fails like one that lost its peer.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from intellect_jax.diloco.device_pg import (
    Bounds,
    DevicePseudoGradient,
    Piece,
    Slots,
    assemble,
    shard_bounds,
)
from intellect_jax.diloco.inner import TrainerInner
from intellect_jax.diloco.multihost_wire import (
    COMMAND,
    Data,
    DataState,
    Eval,
    Gather,
    Go,
    Hello,
    Init,
    Lease,
    Pg,
    Place,
    PartsHeader,
    Stop,
    Train,
)
from intellect_jax.diloco.state import DilocoState, to_host
from intellect_jax.net.arrays import recv_array_data, recv_array_head, send_arrays
from intellect_jax.net.comm import NetNode
from intellect_jax.net.errors import FrameError, NetError
from intellect_jax.net.schema import Wire, recv_model
from intellect_jax.net.transport import Connection, TransportConfig, connect, send_msg
from intellect_jax.trainer.loop import Trainer

Part = tuple[int, Bounds, list[np.ndarray]]  # leaf index, its (start, stop) per dimension, arrays
PART_DTYPES = {"float32", "bfloat16", "float16", "int8", "int32"}
IDLE = 7 * 24 * 3600.0  # a follower waits this long for the lead's next command (a dead lead closes the socket)


CHANNEL = "node-processes"


def share_port(port: int) -> int:
    """Process 0's listening port, to every process of the runtime (each must call this once, at
    the same point: it is a program on the devices)."""
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(port)))


# ---- parts of arrays on the wire ------------------------------------------------------------
def send_parts(conn: Connection, parts: Sequence[Part]) -> int:
    """Parts as one array list (:mod:`intellect_jax.net.arrays`) whose header says, per part, its
    leaf, bounds and how many of the arrays are its own."""
    layout = [[leaf, [list(b) for b in bounds], len(arrs)] for leaf, bounds, arrs in parts]
    return send_arrays(conn, [a for _, _, arrs in parts for a in arrs], {"parts": layout})


def recv_parts(conn: Connection, *, max_bytes: int, per_part: int | None = None) -> list[Part]:
    """Parts from a peer process (a :class:`~.multihost_wire.PartsHeader`); at most ``max_bytes``
    in all (the size of what is expected) and, if given, ``per_part`` arrays in each."""
    head, specs = recv_array_head(conn, PartsHeader, max_bytes=max_bytes, dtypes=PART_DTYPES, what="part list")
    for i, (_, _, n) in enumerate(head.parts):
        if per_part not in (None, n):
            raise FrameError(f"{conn.peer}: malformed part list: part {i} holds {n} arrays, not {per_part}")
    arrays = iter(recv_array_data(conn, specs))
    return [(leaf, tuple(bounds), [next(arrays) for _ in range(n)]) for leaf, bounds, n in head.parts]


# ---- shards -----------------------------------------------------------------------------------
def local_shards(tree: Any, dtype: Any = None) -> list[Part]:
    """This process's first-replica shards of a device tree, as host arrays."""
    out: list[Part] = []
    for i, x in enumerate(jax.tree.leaves(tree)):
        for sh in x.addressable_shards:
            if sh.replica_id == 0 and sh.data.size:
                out.append((i, shard_bounds(sh.index, x.shape), [np.asarray(sh.data, dtype)]))
    return out


def fill(parts: Sequence[Part], like: Any) -> Any:
    """The host tree (structure, shapes and dtypes of ``like``) the parts cover exactly once."""
    slots = Slots(like, "shard")
    for leaf, bounds, (a,) in parts:
        view = slots.slot(leaf, bounds)
        if view.shape != a.shape:
            raise ValueError(f"shard of leaf {leaf} at {bounds}: shape {a.shape}, the slot is {view.shape}")
        view[...] = a
    return slots.done()


def slices_for(process: int, host: Any, shardings: Any, abstract: Any) -> list[Part]:
    """The slices of a host tree that ``process``'s devices hold (once each), in the dtypes of ``abstract``."""
    out: list[Part] = []
    for i, (x, s, a) in enumerate(zip(jax.tree.leaves(host), jax.tree.leaves(shardings),
                                      jax.tree.leaves(abstract), strict=True)):
        seen: set[Bounds] = set()
        for dev, idx in s.devices_indices_map(a.shape).items():
            b = shard_bounds(idx, a.shape)
            if dev.process_index == process and b not in seen:
                seen.add(b)
                out.append((i, b, [np.asarray(x[idx], a.dtype)]))
    return out


def build(parts: Sequence[Part], shardings: Any, abstract: Any) -> Any:
    """Global arrays from this process's slices (every process calls it with its own)."""
    have: dict[tuple[int, Bounds], np.ndarray] = {(leaf, b): arrs[0] for leaf, b, arrs in parts}
    leaves, treedef = jax.tree.flatten(abstract)

    def one(i: int, a: Any, s: Any) -> jax.Array:
        def cb(idx: tuple[slice, ...]) -> np.ndarray:
            key = (i, shard_bounds(idx, a.shape))
            if key not in have:
                raise ValueError(f"no slice {key[1]} of leaf {i} was received for this process")
            return have[key]

        return jax.make_array_from_callback(a.shape, s, cb)

    return jax.tree.unflatten(treedef, [one(i, a, s) for i, (a, s) in
                                        enumerate(zip(leaves, jax.tree.leaves(shardings), strict=True))])


def _pieces_to_parts(pieces: Sequence[Piece]) -> list[Part]:
    return [(p.leaf, p.index, [p.scale, p.codes]) for p in pieces]


def _parts_to_pieces(parts: Sequence[Part]) -> list[Piece]:
    return [Piece(leaf, b, arrs[0], arrs[1]) for leaf, b, arrs in parts]


def _nbytes(tree: Any) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


# ---- what every process does with placed arrays -------------------------------------------------
def _apply(t: Trainer, dpg: DevicePseudoGradient, params: Any, opt: Any, step: int | None) -> None:
    if step is None:
        t.set_params(params)
    else:
        t.set_state(step, params, opt if opt is not None else t.state.opt_state)
    dpg.mark(t.state.params)


def _receive_placed(t: Trainer, conn: Connection, with_opt: bool) -> tuple[Any, Any]:
    a, sh = t.abstract_state, t.shardings
    like = (a.params, a.opt_state) if with_opt else a.params
    parts = recv_parts(conn, max_bytes=_nbytes(like), per_part=1)
    if not with_opt:
        return build(parts, sh.params, a.params), None
    n = len(jax.tree.leaves(a.params))
    params = build([p for p in parts if p[0] < n], sh.params, a.params)
    opt = build([(leaf - n, b, arrs) for leaf, b, arrs in parts if leaf >= n], sh.opt_state, a.opt_state)
    return params, opt


# ---- the lead -----------------------------------------------------------------------------------
class Followers:
    """The lead's connections to the node's other processes."""

    def __init__(self, net: NetNode, processes: int, *, timeout: float) -> None:
        self.conns: dict[int, Connection] = {}
        try:
            for _ in range(processes - 1):
                conn = net.accept(CHANNEL, peer=net.name, timeout=timeout, name="follower")  # its own processes
                i = recv_model(conn, Hello, "greeting").process
                if not i < processes or i in self.conns:
                    raise FrameError(f"a follower announced itself as process {i} (of {processes}, or twice)")
                self.conns[i] = conn
        except BaseException:
            self.close()
            raise

    def command(self, cmd: Wire) -> None:
        """Send every follower ``cmd`` (a :data:`~.multihost_wire.COMMAND`, or :class:`Go`)."""
        msg = cmd.model_dump()
        for conn in self.conns.values():
            send_msg(conn, msg)

    def collect(self, max_bytes: int, per_part: int = 1) -> list[Part]:
        return [p for conn in self.conns.values() for p in recv_parts(conn, max_bytes=max_bytes, per_part=per_part)]

    def close(self) -> None:
        for conn in self.conns.values():
            with contextlib.suppress(NetError, OSError):  # a follower already gone
                send_msg(conn, Stop().model_dump())
            conn.close()
        self.conns.clear()


class LeadInner(TrainerInner):
    """The inner trainer of a multi-process node's lead: every device operation is mirrored by
    the followers, and host copies are assembled from every process's shards."""

    def __init__(self, trainer: Trainer, device_pg: DevicePseudoGradient, followers: Followers) -> None:
        super().__init__(trainer, device_pg)
        self.dpg, self.f = device_pg, followers

    def train(self, until: int, stop: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Every process runs the same steps (each is a program they all run): with ``stop``,
        the lead asks it before each step and sends the followers its answer."""
        self.f.command(Train(until=until, asks=stop is not None))
        if stop is None:
            return self.t.train(until=until)

        def ask() -> bool:
            done = bool(stop())
            self.f.command(Go(stop=done))
            return done

        return self.t.train(until=until, stop=ask)

    def evaluate(self, params: Any = None) -> float:
        if params is not None:
            raise NotImplementedError("a multi-process node evaluates its own params (no overlapped rounds)")
        self.f.command(Eval())
        return self.t.evaluate()

    def pseudo_gradient(self, outer_params: Any) -> Any:
        self.f.command(Pg())
        mine = self.dpg.pieces(self.t.state.params)
        theirs = _parts_to_pieces(self.f.collect(max_bytes=2 * _nbytes(outer_params), per_part=2))
        return assemble(mine + theirs, outer_params, self.dpg.block)

    def _gather(self, op: str, tree: Any, dtype: Any = None) -> Any:
        self.f.command(Init() if op == "init" else Gather())
        if op == "init":
            self.dpg.mark(tree)
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype), tree)
        return fill(local_shards(tree, dtype) + self.f.collect(max_bytes=_nbytes(like)), like)

    def init_state(self, tx: Any) -> DilocoState:
        p = to_host(self._gather("init", self.t.state.params, np.float32))
        return DilocoState(p, tx.init(p), None, 0, self.t.step)

    def snapshot(self) -> Any:
        return self._gather("gather", self.t.state.opt_state)

    def live_opt_state(self) -> Any:  # the lead checkpoints alone, from host copies
        return self.snapshot()

    def data_state(self) -> dict | None:
        self.f.command(Data())
        theirs = {i: recv_model(c, DataState, "data position").model_dump(exclude_none=True)
                  for i, c in self.f.conns.items()}
        return {"processes": [self.t.data.get_state(), *(theirs[i] for i in sorted(theirs))]}

    def lease(self, rnd: int, batches: list[tuple[int, int]]) -> None:
        """Every process reads its rows of the leased global batches (the stream's batches do not
        depend on the node's process layout)."""
        self.f.command(Lease(ranges=[(int(a), int(b)) for a, b in batches]))
        super().lease(rnd, batches)

    def set_params(self, params: Any) -> None:
        self._place(params, None, None, None)

    def adopt(self, s: DilocoState) -> None:
        self._place(s.outer_params, s.inner_opt_state, s.inner_step, s.data)

    def _place(self, params: Any, opt: Any, step: int | None, data: dict | None) -> None:
        n = 1 + len(self.f.conns)
        per = None
        if data is not None:
            per = data.get("processes")
            if not isinstance(per, list) or len(per) != n:
                raise ValueError(f"the state's data position is for {len(per) if isinstance(per, list) else 1} "
                                 f"process(es); this node has {n}")
        a, sh = self.t.abstract_state, self.t.shardings
        tree, shard, abstract = ((params, opt), (sh.params, sh.opt_state), (a.params, a.opt_state)) \
            if opt is not None else (params, sh.params, a.params)
        for i, conn in self.f.conns.items():
            send_msg(conn, Place(opt=opt is not None, step=step, data=per[i] if per is not None else None).model_dump())
            send_parts(conn, slices_for(i, tree, shard, abstract))
        placed = build(slices_for(jax.process_index(), tree, shard, abstract), shard, abstract)
        p, o = placed if opt is not None else (placed, None)
        _apply(self.t, self.dpg, p, o, step)
        if per is not None:
            self.t.data.set_state(per[0])


# ---- a follower ---------------------------------------------------------------------------------
class Follower:
    """A non-lead process of a node: does its part of each of the lead's commands until ``stop``."""

    def __init__(self, trainer: Trainer, device_pg: DevicePseudoGradient, conn: Connection) -> None:
        self.t, self.dpg, self.conn = trainer, device_pg, conn

    @classmethod
    def connect(cls, trainer: Trainer, device_pg: DevicePseudoGradient, cfg: TransportConfig,
                lead: tuple[str, int], *, timeout: float) -> Follower:
        conn = connect(dataclasses.replace(cfg, io_timeout=IDLE), lead, CHANNEL, expect=cfg.name, timeout=timeout,
                       name="the node's lead process")
        send_msg(conn, Hello(process=jax.process_index()).model_dump())
        return cls(trainer, device_pg, conn)

    def run(self) -> int:
        """Serve commands until ``stop``; returns how many were served."""
        t, c, n = self.t, self.conn, 0
        while True:
            match recv_model(c, COMMAND, "command", max_len=1 << 16):
                case Stop():
                    return n
                case Train(until=until, asks=asks):
                    t.train(until=until, stop=self._lead_stops if asks else None)
                case Eval():
                    t.evaluate()
                case Pg():
                    send_parts(c, _pieces_to_parts(self.dpg.pieces(t.state.params)))
                case Init():
                    self.dpg.mark(t.state.params)
                    send_parts(c, local_shards(t.state.params, np.float32))
                case Gather():
                    send_parts(c, local_shards(t.state.opt_state))
                case Data():
                    send_msg(c, t.data.get_state())
                case Lease(ranges=ranges):
                    t.data.lease([list(r) for r in ranges])
                case Place(opt=with_opt, step=step, data=data):
                    params, opt = _receive_placed(t, c, with_opt)
                    _apply(t, self.dpg, params, opt, step)
                    if data is not None:
                        t.data.set_state(data.model_dump())
            n += 1

    def _lead_stops(self) -> bool:
        """Before a step of a train with ``stop``: the lead's answer (it asks at the same steps)."""
        return recv_model(self.conn, Go, "answer within a train", max_len=1 << 16).stop

    def close(self) -> None:
        self.conn.close()
