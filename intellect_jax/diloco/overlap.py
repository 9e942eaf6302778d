"""Rounds of inner steps, and how an outer step lands in one (``diloco.overlap``).

The node's one round loop (:meth:`~.loop.NodeLoop._rounds`) pauses training at *windows*, the
boundaries between rounds. At the window after round r it applies round r's outer step
``θ_r → θ_{r+1}`` exactly as every node does (own check, barrier, ring all-reduce with retries,
check of the average, Nesterov), so the outer states, their hashes and every failure path are
the same in both kinds of round:

* **synchronous**: no thread; the outer step runs at the window, the trainer's params become
  ``θ_{r+1}`` (a merge at the round's first step, with no progress to keep), then round r+1
  trains on the loop's thread;
* **overlapped**: round r+1 trains on a :class:`Round` thread while the outer step runs, and the
  average lands ``tau`` inner steps into it: by default at the first inner step after it is
  ready, or after a fixed ``diloco.overlap_delay`` steps (reproducible runs; Streaming DiLoCo's
  overlapped communication). The inner loop waits only when an all-reduce takes longer than a
  whole round (or than a fixed ``tau``).

An overlapped node keeps an *anchor* on its devices; its pseudo-gradient is ``anchor − params``.
At the window after round r:

1. ``pg_r = anchor − params`` is captured on the devices (no host copy yet), and the anchor
   moves to the params: round r+1 goes on from where round r ended;
2. round r+1 starts training on a thread; meanwhile the loop's thread pulls ``pg_r`` to the
   host, runs the outer step and places ``θ_{r+1}`` on the devices, opening the round's
   :class:`Gate`;
3. ``tau`` inner steps into round r+1 the training thread *merges*: params :=
   ``θ_{r+1} + (params − anchor)``, i.e. the new outer params plus the progress made since the
   window, and the anchor := ``θ_{r+1}``. So ``pg_{r+1}`` is the node's whole progress of round
   r+1, as in the synchronous loop, and the only staleness is the first ``tau`` steps, computed
   from a point that did not yet include round r's average (``tau = H`` applies each average
   one outer step late: PCCL's asynchronous DiLoCo);
4. the loop's thread waits for round r+1 to end (the next window).

After the last round the last outer step is applied with no round beside it and the params
become the outer params, as in the synchronous loop. A checkpoint of ``θ_r`` holds the data
position and optimizer state of the window where round r began, and a joiner served ``θ_r``
trains round r: both resume the run as a synchronous node would. A checkpoint's optimizer state
is copied on the devices at the window and pulled to the host by the loop's thread; serving a
joiner (a host snapshot) and evaluation use the windows (the trainer is busy otherwise). Each
outer step's metrics row has its ``delay_steps`` = ``tau`` (0 for the last, applied when
training is over).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from intellect_jax.coordinator.clock import Clock


class Trains(Protocol):
    """What a round needs of the inner trainer (a part of :class:`~.loop.Inner`)."""

    step: int

    def train(self, until: int, stop: Callable[[], bool] | None = None) -> dict[str, Any]: ...

    def merge(self, placed: Any) -> None: ...  # params := placed + (params - anchor); anchor := placed


class Gate:
    """The outer params a round merges at its delay point: opened with them on the devices, or
    shut (the outer step failed: the round stops there)."""

    def __init__(self, clock: Clock) -> None:
        self.ready = clock.Event()
        self.placed: Any = None

    def open(self, placed: Any) -> None:
        self.placed = placed
        self.ready.set()

    def shut(self) -> None:
        self.open(None)


class Round:
    """One round of inner steps: train to ``merge_at`` (or, when None, until the gate opens),
    merge what the gate brings (when there is a gate), train to ``until``. On a thread of the
    clock (``thread``: an overlapped round) or at once on the caller's (a synchronous round, which
    has no gate: its outer params were set before it began)."""

    def __init__(self, inner: Trains, clock: Clock, until: int, *, merge_at: int | None = None,
                 gate: Gate | None = None, thread: bool = True) -> None:
        self.inner, self.clock, self.until, self.merge_at, self.gate = inner, clock, until, merge_at, gate
        self.done = clock.Event()
        self.out: dict[str, Any] = {}
        self.err: BaseException | None = None
        self.t0: float = clock.now()
        self.t1: float | None = None
        self.wait_s = 0.0  # time spent at the merge point, waiting for the outer step
        self.delay = 0  # inner steps between the round's start (the send) and the merge
        self.start = inner.step
        if thread:
            clock.spawn(self._run, name=f"train-{until}")
        else:
            self._run()

    def _run(self) -> None:
        inner, gate = self.inner, self.gate
        try:
            if gate is not None:
                if self.merge_at is None:
                    self.out = inner.train(until=self.until, stop=gate.ready.is_set)
                elif self.merge_at > inner.step:
                    self.out = inner.train(until=self.merge_at)
                t = self.clock.now()
                gate.ready.wait()
                self.wait_s = self.clock.now() - t
                if gate.placed is None:
                    return
                inner.merge(gate.placed)
                self.delay = inner.step - self.start
            if self.until > inner.step:
                self.out = inner.train(until=self.until)
        except BaseException as e:  # noqa: BLE001 - re-raised by join() on the loop's thread
            self.err = e
        finally:
            self.t1 = self.clock.now()
            self.done.set()

    def join(self) -> dict[str, Any]:
        """The training metrics of the round's last steps, once it ended (its error, if it failed)."""
        self.done.wait()
        if self.err is not None:
            raise self.err
        return self.out

    @property
    def compute_s(self) -> float:
        return (self.t1 or self.t0) - self.t0 - self.wait_s
