"""Overlapped rounds (``diloco.overlap``): round r+1 trains while round r's pseudo-gradient is
all-reduced and applied, and the average lands ``tau`` inner steps into round r+1: by default at
the first inner step after it is ready, or after a fixed ``diloco.overlap_delay`` steps
(reproducible runs; Streaming DiLoCo's overlapped communication). The inner loop waits only
when an all-reduce takes longer than a whole round (or than a fixed ``tau``).

Each node keeps an *anchor* on its devices; its pseudo-gradient is ``anchor − params``. At the
boundary after round r (a *window*, where training pauses for a few device ops):

1. ``pg_r = anchor − params`` is captured on the devices (no host copy yet), and the anchor
   moves to the params: round r+1 goes on from where round r ended;
2. round r+1 starts training in a thread; meanwhile this thread pulls ``pg_r`` to the host,
   runs the outer step ``θ_r → θ_{r+1}`` exactly as a synchronous node (own check, barrier,
   ring all-reduce with retries, check of the average, Nesterov), so the outer states, their
   hashes and every failure path are those of the synchronous loop, and places ``θ_{r+1}`` on
   the devices;
3. ``tau`` inner steps into round r+1 the training thread *merges*: params :=
   ``θ_{r+1} + (params − anchor)``, i.e. the new outer params plus the progress made since the
   window, and the anchor := ``θ_{r+1}``. So ``pg_{r+1}`` is the node's whole progress of round
   r+1, as in the synchronous loop, and the only staleness is the first ``tau`` steps, computed
   from a point that did not yet include round r's average (``tau = H`` applies each average
   one outer step late: PCCL's asynchronous DiLoCo);
4. this thread waits for round r+1 to end (the next window).

After the last round the last outer step is applied and the params become the outer params,
as in the synchronous loop. A checkpoint of ``θ_r`` holds the data position and optimizer state
of the window where round r began, and a joiner served ``θ_r`` trains round r: both resume the
run as a synchronous node would. A checkpoint's optimizer state is copied on the devices at the
window and pulled to the host by this thread; serving a joiner (a host snapshot) and evaluation
use the windows (the trainer is busy otherwise). Each outer step's metrics row has its
``delay_steps`` = ``tau`` (0 for the last, applied when training is over).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from intellect_jax.diloco.state import host_copy, state_hash

if TYPE_CHECKING:
    from intellect_jax.coordinator.clock import Clock
    from intellect_jax.diloco.loop import NodeLoop, NodeParts, Outcome


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
    """One round of inner steps on a thread of the node's clock: train to ``merge_at`` (or, when
    None, until the gate opens), merge what the gate brings (when there is a gate), train to
    ``until``."""

    def __init__(self, p: NodeParts, merge_at: int | None, until: int, gate: Gate | None) -> None:
        self.done = p.clock.Event()
        self.out: dict[str, Any] = {}
        self.err: BaseException | None = None
        self.t0, self.t1 = p.clock.now(), None
        self.wait_s = 0.0  # time spent at the merge point, waiting for the outer step
        self.delay = 0  # inner steps between the round's start (the send) and the merge
        start = p.inner.step

        def run() -> None:
            try:
                if gate is not None:
                    if merge_at is None:
                        self.out = p.inner.train(until=until, stop=gate.ready.is_set)
                    elif merge_at > p.inner.step:
                        self.out = p.inner.train(until=merge_at)
                    t = p.clock.now()
                    gate.ready.wait()
                    self.wait_s = p.clock.now() - t
                    if gate.placed is None:
                        return
                    p.inner.merge(gate.placed)
                    self.delay = p.inner.step - start
                if until > p.inner.step:
                    self.out = p.inner.train(until=until)
            except BaseException as e:  # noqa: BLE001 - re-raised by join() on the loop's thread
                self.err = e
            finally:
                self.t1 = p.clock.now()
                self.done.set()

        p.clock.spawn(run, name=f"train-{until}")

    def join(self) -> dict[str, Any]:
        self.done.wait()
        if self.err is not None:
            raise self.err
        return self.out

    @property
    def compute_s(self) -> float:
        return (self.t1 or self.t0) - self.t0 - self.wait_s


def overlapped_rounds(loop: NodeLoop) -> Outcome:
    p, cfg, H = loop.p, loop.cfg, loop.cfg.inner_steps
    tau = cfg.overlap_delay  # None: merge at the first inner step after the average is ready
    s = loop.state
    assert s is not None
    k, h = s.outer_step, state_hash(s)
    p.client.hold(k, h)
    report = None
    pending: Any = None  # the captured pseudo-gradient of the round before r, its outer step not applied
    prev: Round | None = None  # the round that ended at this window
    running: Round | None = None
    gate: Gate | None = None
    last: dict[str, Any] = {}
    r = k  # the round that starts at this window
    try:
        while True:
            # ---- the window before round r: training is paused ------------------------------
            keep = None  # a checkpoint of θ_r carries this window's data position and optimizer state
            if pending is not None and loop.due(cfg.ckpt_every, r):
                keep = (p.inner.stash(), p.inner.data_state())  # a device copy; to the host below
            idle = p.clock.now() - prev.t1 if prev is not None and prev.t1 is not None else 0.0
            gate = Gate(p.clock) if pending is not None else None
            running = Round(p, None if tau is None else r * H + tau, (r + 1) * H, gate) if r < loop.stop_at else None
            loop.t_first = loop.t_first if loop.t_first is not None or running is None else running.t0
            applied = None
            if pending is not None:  # ---- round r-1's outer step, while round r trains ----------
                t1 = p.clock.now()
                o = loop.outer(s, p.inner.pull(pending, s.outer_params), report)
                s, report, pending = o.state, o.report, None
                loop.state, k, h = s, s.outer_step, state_hash(s)
                p.client.hold(k, h)
                sync_s = p.clock.now() - t1
                if gate is not None and running is not None:
                    gate.open(p.inner.place(s.outer_params))  # host -> device off the training path
                if keep is not None:  # to the host here: off the training thread, after the gate opened
                    p.store.save(s._replace(inner_opt_state=host_copy(keep[0]), data=keep[1]))
                assert prev is not None
                wait_s = prev.wait_s + idle
                applied = (o, {**o.row(h), "sync_s": sync_s, "compute_s": prev.compute_s, "overlap_wait_s": wait_s,
                               "utilization": prev.compute_s / max(prev.compute_s + wait_s, 1e-9),
                               "delay_steps": 0, "elapsed_s": loop.elapsed(),
                               "round_start_s": prev.t0 - loop.t_first if loop.t_first is not None else 0.0},
                           sync_s)
            if running is None:  # the run's last outer step is applied: params := outer params
                p.inner.set_params(s.outer_params)
                if applied is not None:
                    _serve_and_report(loop, *applied, s, last, h)
                break
            last = running.join()  # ---- the next window ---------------------------------------
            prev, running = running, None
            if applied is not None:
                applied[1]["delay_steps"] = prev.delay  # the round that merged this average
                _serve_and_report(loop, *applied, s, last, h)
            pending = p.inner.capture()
            r += 1
    finally:
        if running is not None:  # evicted or failed mid-round: the trainer is left idle first
            if gate is not None:
                gate.shut()
            running.done.wait()
    return loop._finish(k, h, report)


def _serve_and_report(loop: NodeLoop, o: Any, row: dict[str, Any], sync_s: float, s: Any,
                      last: dict[str, Any], h: str) -> None:
    """At a window: serve the joiners of the epoch with the newest state, evaluate it if due, and
    queue its metrics row (written once the next barrier confirms it)."""
    k = s.outer_step
    loop._serve(o.ep, s)
    if loop.due(loop.cfg.eval_every, k):
        row["val_loss"] = loop.p.inner.evaluate(s.outer_params)
    loop._pending = row
    loop._say(k, o, last, sync_s, h)
