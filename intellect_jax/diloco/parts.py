"""What a node's outer loop (:class:`~.loop.NodeLoop`) is handed and how it ends: its settings
(:class:`LoopConfig`), its collaborators (:class:`NodeParts`, the protocols :class:`Inner`,
:class:`Transport`, :class:`Store`) and its :class:`Outcome`. The real node builds them from
the run config (:mod:`.node`); the in-process run and the fault simulation build fakes."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from intellect_jax.coordinator.client import CoordinatorClient
from intellect_jax.coordinator.clock import REAL, Clock
from intellect_jax.coordinator.claims import RecordBook
from intellect_jax.coordinator.protocol import Admission, Epoch
from intellect_jax.diloco.guard import GuardConfig
from intellect_jax.diloco.state import DilocoState
from intellect_jax.net.comm import Communicator
from intellect_jax.net.errors import NetError


class DilocoError(RuntimeError):
    """A node cannot go on (bad settings, not admitted in time)."""


class TransferFailed(NetError):
    """A joiner did not get a usable state from its donor (gone, stalled, revoked, bad hash)."""


class Inner(Protocol):
    """The node's inner trainer, as the outer loop sees it."""

    step: int

    def train(self, until: int, stop: Callable[[], bool] | None = None) -> dict[str, Any]: ...  # stop: checked per step

    # synchronous rounds: taken at the window, the trainer idle
    def pseudo_gradient(self, outer_params: Any) -> Any: ...  # outer - inner, a host fp32 tree

    def init_state(self, tx: Any) -> DilocoState: ...  # outer step 0 of a fresh run

    def set_params(self, params: Any) -> None: ...

    def snapshot(self) -> Any: ...  # a host copy of the inner optimizer state

    def live_opt_state(self) -> Any: ...  # the inner optimizer state as it is (a checkpoint takes it)

    def data_state(self) -> dict | None: ...

    def adopt(self, s: DilocoState) -> None: ...  # params := outer params; opt state, step, data if given

    def template(self) -> DilocoState: ...  # shapes and dtypes of a transferred state

    def vet_opt_state(self, opt: Any) -> str | None: ...  # why a donor's inner optimizer state is refused (None: ok)

    def evaluate(self, params: Any = None) -> float: ...  # the current params, or the given host params

    def record(self, step: int, metrics: dict[str, Any]) -> None: ...

    # data leases (LoopConfig.data_units): round ``rnd`` trains these [a, b) ranges of the global
    # batch stream, in order, one batch per inner step
    def lease(self, rnd: int, batches: list[tuple[int, int]]) -> None: ...

    # overlapped rounds (LoopConfig.overlap, .overlap): the params a round started from are its anchor
    def capture(self) -> Any: ...  # the round's pseudo-gradient (anchor - params), cheaply; anchor := params

    def pull(self, captured: Any, like: Any) -> Any: ...  # its host fp32 tree (may run while training)

    def place(self, outer_params: Any) -> Any: ...  # a device copy of host params (may run while training)

    def stash(self) -> Any: ...  # a copy of the inner optimizer state the next steps leave alone (no wait)

    def merge(self, placed: Any) -> None: ...  # params := placed + (params - anchor); anchor := placed


class Transport(Protocol):
    def serve(self, joiner_id: str, joiner_addr: str, snapshot: DilocoState, meta: dict[str, Any],
              cancelled: Callable[[], bool]) -> Any: ...  # an event, set once sent, failed or cancelled

    def receive(self, adm: Admission, template: DilocoState, cancelled: Callable[[], bool],
                timeout: float) -> tuple[Any, DilocoState]: ...  # (the donor's header: StateMeta or its dict, state)


class Store(Protocol):
    """The node's one checkpointing path."""

    def latest(self) -> DilocoState | None: ...  # newest readable checkpoint to start from (or None)

    def save(self, s: DilocoState, *, wait: bool = False) -> None: ...

    def load(self, inner_step: int) -> DilocoState: ...

    book: RecordBook  # the coordinator's barrier records, kept with the checkpoints (coordinator.claims)


class Outcome(str, enum.Enum):
    FINISHED = "finished"  # this node did the run's last outer step
    STOPPED = "stopped"  # the job ended at run.stop_at; resume later
    COMPLETED = "completed"  # the run was already complete (another node finished it)


@dataclass(frozen=True)
class LoopConfig:
    inner_steps: int
    outer_steps: int  # the run's length
    stop_at: int | None = None  # this job ends after this many outer steps
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    max_retries: int = 5
    transfer_timeout: float = 600.0
    admission_timeout: float = 3600.0
    watch_interval: float = 1.0  # how often an all-reduce or a transfer checks the coordinator's view
    ckpt_every: int = 0  # inner steps (checkpoints at outer boundaries that are multiples, and the last)
    eval_every: int = 0  # inner steps
    guard: GuardConfig = GuardConfig()
    overlap: bool = False  # train round k+1 while round k's all-reduce and outer step run (see .overlap)
    overlap_delay: int | None = None  # tau: inner steps from sending a pseudo-gradient to merging its average (None: when ready)
    # error feedback (gathered codecs only): each contribution is pg + feedback x the residual the
    # last one left, and what its encoding drops becomes the next residual (0: off)
    feedback: float = 0.0
    # local feedback (alpha): each round starts from ``outer - alpha x feedback x residual`` (that
    # share of the node's unsent progress kept in its own params) and its pseudo-gradient is
    # measured from there; the contribution is still pg + feedback x residual (0: off)
    feedback_local: float = 0.0
    # data leases (coordinator/leases.py): (inner steps per unit, tokens per unit, the data
    # stream's fingerprint); each round's data is leased from the coordinator and handed to the
    # trainer (None: the node's own shard)
    data_units: tuple[int, int, str] | None = None


@dataclass
class NodeParts:
    node_id: str
    inner: Inner
    client: CoordinatorClient
    ring: Callable[[Epoch], Communicator]
    transport: Transport
    store: Store
    clock: Clock = REAL
    log: Callable[[str], None] = print
    serving: list[Any] = field(default_factory=list)
