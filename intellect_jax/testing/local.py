"""A whole DiLoCo run in one process: N nodes as threads running the one outer loop
(:class:`~.loop.NodeLoop`) against an in-process coordinator, the in-process ring (the socket
ring's exact arithmetic, :class:`~intellect_jax.testing.local_ring.LocalGroup`) and an in-process state
transport. The sweep benchmark replays DiLoCo this way, on real trainers, without sockets.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from intellect_jax.coordinator.client import CoordinatorClient
from intellect_jax.coordinator.clock import REAL, Clock
from intellect_jax.diloco.loop import NodeLoop
from intellect_jax.diloco.parts import Inner, LoopConfig, NodeParts, Outcome, TransferFailed
from intellect_jax.coordinator.protocol import Admission, CoordinatorConfig, DataPlan, Epoch, RegisterReply, Resume
from intellect_jax.testing.local_coordinator import LocalCoordinator
from intellect_jax.diloco.state import DilocoState, MomentumState, init_state, pseudo_gradient
from intellect_jax.diloco.store import MemoryStore
from intellect_jax.net.comm import RingConfig
from intellect_jax.testing.local_ring import LocalCommunicator, LocalGroup


class NumpyInner:
    """A numpy stand-in for the trainer (tests, the simulation): each inner step pulls the
    weights toward this node's ``target`` with momentum and a little noise, deterministically per
    (node, data position); ``step_time`` seconds of the clock per step. ``evaluate`` is the
    expected squared error on held-out data: targets ``goal`` (e.g. the mean of every node's
    target) plus unit noise, i.e. 1 + the mean squared distance to ``goal``."""

    def __init__(self, target: np.ndarray, init: dict[str, np.ndarray], goal: np.ndarray, *,
                 step_time: float = 0.0, clock: Clock = REAL) -> None:
        self.target, self.goal, self.step_time, self.clock = target, goal, step_time, clock
        self.weights = copy.deepcopy(init)
        self.anchor = copy.deepcopy(init)  # the params the current round started from (overlapped rounds)
        self.opt = {"m": np.zeros_like(init["w"])}
        self.step = 0
        self.data = {"pos": 0}
        self.plan: tuple[int, list[int]] | None = None  # data leases: (first step, global batch per step)
        self.trained: dict[int, list[int]] = {}  # data leases: first step of a lease -> the batches trained on it
        self.records: list[tuple[int, dict[str, Any]]] = []

    def _pause(self, seconds: float, phase: str) -> None:
        """Compute time (a subclass puts fault points here)."""
        self.clock.sleep(seconds)

    def train(self, until: int, stop: Callable[[], bool] | None = None) -> dict[str, Any]:
        if stop is None:
            n = max(0, until - self.step)
            self._pause(n * self.step_time / 2, "before")
            self._pause(n * self.step_time / 2, "during")
            return self._steps(until)
        self._pause(0.0, "before")
        while self.step < until and not stop():
            self._pause(self.step_time, "during")
            self._steps(self.step + 1)
        return self._steps(self.step)

    def _steps(self, until: int) -> dict[str, Any]:
        w = self.weights
        for _ in range(self.step, until):
            pos = self.data["pos"]
            if self.plan is not None:  # leased data: the next batch of the lease, or nothing
                i = self.step - self.plan[0]
                if not 0 <= i < len(self.plan[1]):
                    raise RuntimeError(f"step {self.step} is outside the lease of steps {self.plan[0]}.."
                                       f"{self.plan[0] + len(self.plan[1])}")
                self.trained.setdefault(self.plan[0], []).append(self.plan[1][i])
                pos = 1 << 40 | self.plan[1][i]  # a leased batch of the global stream
            seed = [pos, int(abs(float(self.target[0])) * 1e6)]
            noise = np.random.default_rng(seed).standard_normal(w["w"].shape).astype(np.float32)
            g = w["w"] - self.target + np.float32(0.1) * noise
            self.opt["m"] = (np.float32(0.9) * self.opt["m"] + g).astype(np.float32)
            w["w"] = (w["w"] - np.float32(0.05) * self.opt["m"]).astype(np.float32)
            w["u"] = (w["u"] + np.float32(0.01)).astype(np.float32)
            self.data["pos"] += 1
            self.step += 1
        return {"loss": float(np.mean((w["w"] - self.target) ** 2))}

    def pseudo_gradient(self, outer_params: Any) -> Any:
        return pseudo_gradient(outer_params, self.weights)

    def init_state(self, tx: Any) -> DilocoState:
        return init_state(self.weights, tx, None, self.step)

    def set_params(self, params: Any) -> None:  # host or device arrays (local feedback's start)
        self.weights = jax.tree.map(lambda a: np.array(a, np.float32), params)
        self.anchor = copy.deepcopy(self.weights)

    def capture(self) -> Any:
        pg = pseudo_gradient(self.anchor, self.weights)
        self.anchor = copy.deepcopy(self.weights)
        return pg

    def pull(self, captured: Any, like: Any) -> Any:
        return captured

    def place(self, outer_params: Any) -> Any:
        return copy.deepcopy(outer_params)

    def merge(self, placed: Any) -> None:
        placed = jax.tree.map(lambda a: np.array(a, np.float32), placed)
        self.weights = {k: (placed[k] + (w - self.anchor[k])).astype(np.float32) for k, w in self.weights.items()}
        self.anchor = placed

    def snapshot(self) -> Any:
        return copy.deepcopy(self.opt)

    stash = snapshot  # numpy state is never donated: a copy is a copy

    def live_opt_state(self) -> Any:
        return copy.deepcopy(self.opt)

    def data_state(self) -> dict | None:
        return dict(self.data)

    def adopt(self, s: DilocoState) -> None:
        self.set_params(s.outer_params)
        if s.inner_opt_state is not None:
            self.opt = copy.deepcopy(s.inner_opt_state)
        if s.data is not None:
            self.data = dict(s.data)
        self.step = s.inner_step

    def template(self) -> DilocoState:
        return DilocoState(self.weights, MomentumState(self.weights), self.opt, 0, 0)

    def vet_opt_state(self, opt: Any) -> str | None:
        return None if all(np.isfinite(x).all() for x in opt.values()) else "a non-finite momentum"

    def evaluate(self, params: Any = None) -> float:
        w = (self.weights if params is None else params)["w"]
        return 1.0 + float(np.mean((w - self.goal) ** 2))

    def record(self, step: int, metrics: dict[str, Any]) -> None:
        self.records.append((step, dict(metrics)))

    def lease(self, rnd: int, batches: list[tuple[int, int]]) -> None:
        self.plan = (self.step, [b for a, z in batches for b in range(a, z)])
        self.trained[self.step] = []


class LocalRing:
    """Ring factory: one :class:`LocalGroup` per (epoch, boundary), shared by its ranks."""

    def __init__(self, config: RingConfig) -> None:
        self.config = config
        self._groups: dict[tuple[int, int], LocalGroup] = {}
        self._lock = threading.Lock()

    def __call__(self, ep: Epoch) -> LocalCommunicator:
        with self._lock:
            g = self._groups.setdefault((ep.epoch_id, ep.outer_step),
                                        LocalGroup(ep.world_size, self.config, epoch=ep.epoch_id,
                                                   step=ep.outer_step))
        return g.communicator(ep.rank)


class LocalTransport:
    """In-process state transfer: the donor hands a copy of its snapshot to the joiner."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._boxes: dict[tuple[str, int], tuple[dict, DilocoState]] = {}

    def endpoint(self, node_id: str) -> _Endpoint:
        return _Endpoint(self, node_id)


class _Endpoint:
    def __init__(self, hub: LocalTransport, node_id: str) -> None:
        self.hub, self.node_id = hub, node_id

    def serve(self, joiner_id: str, joiner_addr: str, snapshot: DilocoState, meta: dict[str, Any],
              cancelled: Callable[[], bool]) -> Any:
        """``parts.Transport.serve``: the copy is handed over at once, unless the joiner is no
        longer admitted (``cancelled()``)."""
        done = threading.Event()
        if not cancelled():
            with self.hub._cond:
                self.hub._boxes[(joiner_id, meta["outer_step"])] = (dict(meta), copy.deepcopy(snapshot))
                self.hub._cond.notify_all()
        done.set()
        return done

    def receive(self, adm: Admission, template: DilocoState, cancelled: Callable[[], bool],
                timeout: float) -> tuple[dict[str, Any], DilocoState]:
        key = (self.node_id, adm.outer_step)
        with self.hub._cond:
            if not self.hub._cond.wait_for(lambda: key in self.hub._boxes or cancelled(), timeout):
                raise TransferFailed(f"no state from {adm.donor_id} within {timeout:.0f}s")
            if key not in self.hub._boxes:
                raise TransferFailed(f"admission from {adm.donor_id} revoked")
            return self.hub._boxes.pop(key)


class _Together:
    """The nodes of one :func:`run_local` call, each once: registered, or ended without."""

    def __init__(self, n: int) -> None:
        self._n, self._in, self._cond = n, set[str](), threading.Condition()

    def arrive(self, name: str) -> None:
        with self._cond:
            self._in.add(name)
            self._cond.notify_all()

    def wait(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: len(self._in) >= self._n)


class _TogetherClient(CoordinatorClient):
    """A node's coordinator client whose first registration returns once every node of the
    run has registered (or ended): the threads start together, as :func:`run_local` means."""

    def __init__(self, *args: Any, together: _Together, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.together: _Together | None = together

    def register(self, claim: Resume | None = None) -> RegisterReply:
        try:
            return super().register(claim)
        finally:
            together, self.together = self.together, None
            if together is not None:
                together.arrive(self.node_id)
                together.wait()


def run_local(loop_cfg: LoopConfig, inners: list[Inner], ring: RingConfig, *,
              coordinator: CoordinatorConfig | None = None, log: Callable[[str], None] | None = None,
              heartbeat_interval: float = 1.0, stores: list[MemoryStore] | None = None,
              ring_hook: Callable[[str, Any], Any] | None = None,
              on_coordinator: Callable[[LocalCoordinator], None] | None = None) -> list[Outcome]:
    """Run every node to the end in threads; returns their outcomes (raises a node's error).
    ``stores``: each node's checkpoint store (default: a fresh :class:`MemoryStore` each);
    ``ring_hook(node, communicator)``: what node ``node`` gets instead of each communicator (an
    attacker's, in a benchmark); ``on_coordinator``: called with the in-process coordinator once it
    runs (a benchmark's stand-in for evidence it does not produce). The nodes start together:
    none goes past its first registration before every node has registered (nodes resuming from
    their ``stores`` are members of a run being rebuilt, and the first barrier, join window 0,
    would close with whichever were there)."""
    stores = stores or [MemoryStore() for _ in inners]
    together = _Together(len(inners))
    coord = LocalCoordinator(coordinator or CoordinatorConfig(min_nodes=len(inners), join_window=0.0,
                                                              outer_steps=loop_cfg.outer_steps))
    if on_coordinator is not None:
        on_coordinator(coord)
    rings, transport = LocalRing(ring), LocalTransport()
    outcomes: list[Any] = [None] * len(inners)

    def node(i: int) -> None:
        name = f"node{i}"
        client = _TogetherClient(None, None, name, f"local://{name}", wire=coord.wire(name),
                                 heartbeat_interval=heartbeat_interval, outer_steps=loop_cfg.outer_steps,
                                 data=DataPlan(True) if loop_cfg.data_units else None, together=together)
        ring_of = rings if ring_hook is None else (lambda ep: ring_hook(name, rings(ep)))
        parts = NodeParts(name, inners[i], client, ring_of, transport.endpoint(name), stores[i],
                          log=(lambda line: log(f"[{name}] {line}")) if log else (lambda line: None))
        try:
            outcomes[i] = NodeLoop(loop_cfg, parts).run()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            outcomes[i] = e
        finally:
            together.arrive(name)  # (ended before registering: the others go on)
            client.close()

    threads = [threading.Thread(target=node, args=(i,), name=f"node{i}") for i in range(len(inners))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    coord.crash()
    for o in outcomes:
        if isinstance(o, BaseException):
            raise o
    return outcomes
