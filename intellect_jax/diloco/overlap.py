"""Overlapped rounds (``diloco.overlap``): round r+1 trains while round r's pseudo-gradient is
all-reduced and applied, so the inner loop waits only when an all-reduce takes longer than a round.

The outer state applies each average one outer step late. Each round starts from an *anchor*
(the params at its start). At the boundary after round r (a *window*, the only time training
pauses):

1. ``pg_r = anchor − params`` is captured on the devices (no host copy yet);
2. the params move to where round r+1 starts, ``base + scale (params − anchor)``, and the
   anchor with them. θ_r, the newest outer params, is the average of round r−1 applied while
   round r trained; round r's average is not known yet. ``keep``: θ_r plus this node's whole
   progress of round r (base θ_r, scale 1; the default). ``eager``: the Nesterov step from θ_r
   (on a copy of the momentum) that round r's average would make if it were this node's own
   pseudo-gradient for its 1/n share and round r−1's average for the others' (base and scale
   from :func:`start_point`); the node's own progress reaches the outer params only through
   round r's real average;
3. round r+1 starts training in a thread; meanwhile this thread pulls ``pg_r`` to the host,
   runs the outer step ``θ_r → θ_{r+1}`` exactly as a synchronous node (own check, barrier,
   ring all-reduce with retries, check of the average, Nesterov), so the outer states, their
   hashes and every failure path are those of the synchronous loop, and places ``θ_{r+1}`` on
   the devices for the next merge;
4. it waits for round r+1 to end (the next window).

After the last round the last outer step is applied and the params become the outer params,
as in the synchronous loop. A checkpoint of ``θ_r`` holds the data position and optimizer state
of the window where round r began, and a joiner served ``θ_r`` trains round r: both resume the
run as a synchronous node would. Joiners, evaluation and checkpoint snapshots use the windows
(the trainer is busy otherwise). The averaged update of round r lands ``H`` inner steps after
the node sent its pseudo-gradient (``delay_steps``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from intellect_jax.diloco.state import DilocoState, state_hash

if TYPE_CHECKING:
    from intellect_jax.diloco.loop import (
        LoopConfig,
        NodeLoop,
        NodeParts,
        Outcome,
        OuterResult,
    )


class Round:
    """One round of inner steps on a thread of the node's clock."""

    def __init__(self, p: NodeParts, until: int) -> None:
        self.done = p.clock.Event()
        self.out: dict[str, Any] = {}
        self.err: BaseException | None = None
        self.t0, self.t1 = p.clock.now(), None

        def run() -> None:
            try:
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
        return (self.t1 or self.t0) - self.t0


def overlapped_rounds(loop: NodeLoop) -> Outcome:
    p, cfg, H = loop.p, loop.cfg, loop.cfg.inner_steps
    s = loop.state
    assert s is not None
    k, h = s.outer_step, state_hash(s)
    p.client.hold(k, h)
    report = None
    pending: Any = None  # the captured pseudo-gradient of the round before r, its outer step not applied
    prev: Round | None = None  # the round that ended at this window
    running: Round | None = None
    last: dict[str, Any] = {}
    r = k  # the round that starts at this window
    # the next round starts at placed + scale (params - anchor); after a (re)start, θ_k + own progress
    placed, scale = p.inner.place(s.outer_params), 1.0
    try:
        while True:
            # ---- the window before round r: training is paused ------------------------------
            keep = None  # a checkpoint of θ_r carries this window's data position and optimizer state
            if pending is not None and loop.due(cfg.ckpt_every, r):
                keep = (p.inner.snapshot(), p.inner.data_state())
            idle = p.clock.now() - prev.t1 if prev is not None and prev.t1 is not None else 0.0
            compute_s = prev.compute_s if prev is not None else 0.0
            running = Round(p, (r + 1) * H) if r < loop.stop_at else None
            loop.t_first = loop.t_first if loop.t_first is not None or running is None else running.t0
            applied = None
            if pending is not None:  # ---- round r-1's outer step, while round r trains ----------
                t1 = p.clock.now()
                o = loop.outer(s, p.inner.pull(pending, s.outer_params), report)
                s, report, pending = o.state, o.report, None
                loop.state, k, h = s, s.outer_step, state_hash(s)
                p.client.hold(k, h)
                sync_s = p.clock.now() - t1
                base, scale = start_point(cfg, s, o)
                placed = p.inner.place(base)  # host -> device off the training path
                if keep is not None:
                    p.store.save(s._replace(inner_opt_state=keep[0], data=keep[1]))
                applied = (o, {**o.row(h), "sync_s": sync_s, "compute_s": compute_s, "overlap_wait_s": idle,
                               "utilization": compute_s / max(compute_s + idle, 1e-9), "delay_steps": H,
                               "elapsed_s": loop.elapsed(),
                               "round_start_s": prev.t0 - loop.t_first if prev and loop.t_first is not None else 0.0},
                              sync_s)
            if running is None:  # the run's last outer step is applied: params := outer params
                p.inner.set_params(s.outer_params)
                if applied is not None:
                    _serve_and_report(loop, *applied, s, last, h)
                break
            last = running.join()  # ---- the next window ---------------------------------------
            prev, running = running, None
            if applied is not None:
                _serve_and_report(loop, *applied, s, last, h)
            pending = p.inner.capture()
            p.inner.merge(placed, scale)
            r += 1
    finally:
        if running is not None:  # evicted or failed mid-round: the trainer is left idle first
            running.done.wait()
    return loop._finish(k, h, report)


def start_point(cfg: LoopConfig, s: DilocoState, o: OuterResult) -> tuple[Any, float]:
    """Where the next round starts, as ``base + scale (params − anchor)`` (host base, scale).

    ``keep``: θ_r + the node's whole progress of round r. ``eager``: θ_r moved by the outer
    step (Nesterov, on a copy of the momentum) that an estimate of round r's average would make:
    this node's own pseudo-gradient for its 1/n share, the previous average for the others'.
    """
    if cfg.overlap_merge == "keep":
        return s.outer_params, 1.0
    n = max(1, o.ep.world_size - len(o.ep.sitting_out))
    lr, mu, c = np.float32(cfg.outer_lr), np.float32(cfg.outer_momentum), np.float32(1.0 - 1.0 / n)
    zero = np.float32(0.0)
    avg = o.avg if o.avg is not None else jax.tree.map(lambda t: zero, s.outer_params)
    base = jax.tree.map(lambda t, m, a: (t - lr * ((1 + mu) * c * a + mu * mu * m)).astype(np.float32),
                        s.outer_params, s.outer_opt_state.momentum, avg)
    return base, float(lr * (1 + mu) / n)


def _serve_and_report(loop: NodeLoop, o: Any, row: dict[str, Any], sync_s: float, s: DilocoState,
                      last: dict[str, Any], h: str) -> None:
    """At a window: serve the joiners of the epoch with the newest state, evaluate it if due, and
    queue its metrics row (written once the next barrier confirms it)."""
    k = s.outer_step
    loop._serve(o.ep, s)
    if loop.due(loop.cfg.eval_every, k):
        row["val_loss"] = loop.p.inner.evaluate(s.outer_params)
    loop._pending = row
    loop._say(k, o, last, sync_s, h)
