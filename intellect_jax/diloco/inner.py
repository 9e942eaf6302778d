"""The real inner trainer as the outer loop sees it (:class:`~.loop.Inner` over `Trainer`).

The pseudo-gradient is made on the host (fp32 pulled from the devices) or, with a
:class:`~.device_pg.DevicePseudoGradient`, on the devices and quantized there (GPU nodes); with
an ``encoder`` too (:class:`~.device_codec.DeviceEncoder`), it stays there and the outer loop
gets a :class:`~.device_codec.DeviceContribution` to encode where it lives."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from intellect_jax.diloco.device_codec import DeviceContribution, DeviceEncoder
from intellect_jax.diloco.device_pg import DevicePseudoGradient
from intellect_jax.diloco.state import DilocoState, MomentumState, host_copy, init_state, pseudo_gradient
from intellect_jax.trainer.loop import Trainer
from intellect_jax.trainer.optim import adam_envelope


class TrainerInner:
    def __init__(self, trainer: Trainer, device_pg: DevicePseudoGradient | None = None,
                 encoder: DeviceEncoder | None = None) -> None:
        if encoder is not None and device_pg is None:
            raise ValueError("encoding on the devices needs the device pseudo-gradient")
        self.t = trainer
        self.device_pg = device_pg
        self.encoder = encoder

    @property
    def step(self) -> int:
        return self.t.step

    def train(self, until: int, stop: Callable[[], bool] | None = None) -> dict[str, Any]:
        return self.t.train(until=until, stop=stop)

    def pseudo_gradient(self, outer_params: Any) -> Any:
        if self.device_pg is None:
            return pseudo_gradient(outer_params, self.t.state.params)
        if self.encoder is not None:
            return DeviceContribution(self.device_pg.diff(self.t.state.params), self.encoder, outer_params)
        return self.device_pg(self.t.state.params, outer_params)

    def _placed(self) -> None:
        """The outer params were just placed on the devices: the device path's anchor."""
        if self.device_pg is not None:
            self.device_pg.mark(self.t.state.params)

    def init_state(self, tx: Any) -> DilocoState:
        self._placed()
        return init_state(self.t.state.params, tx, None, self.t.step)

    def set_params(self, params: Any) -> None:
        self.t.set_params(params)
        self._placed()

    def snapshot(self) -> Any:
        return host_copy(self.t.state.opt_state)

    def live_opt_state(self) -> Any:
        return self.t.state.opt_state

    def data_state(self) -> dict | None:
        return self.t.data.get_state()

    def adopt(self, s: DilocoState) -> None:
        """Params := the outer params; the optimizer state, step and data position when given."""
        opt = s.inner_opt_state if s.inner_opt_state is not None else self.t.state.opt_state
        self.t.set_state(s.inner_step, s.outer_params, opt)
        self._placed()
        if s.data is not None:
            self.t.data.set_state(s.data)

    def template(self) -> DilocoState:
        """Shapes and dtypes of a transferred state (nothing allocated)."""
        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, np.float32), self.t.abstract_state.params)
        opt = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.t.abstract_state.opt_state)
        return DilocoState(params, MomentumState(params), opt, 0, 0)

    def vet_opt_state(self, opt: Any) -> str | None:
        """Why a donor's inner optimizer state must not be adopted (None: it could be an honest one)."""
        return adam_envelope(opt, self.t.cfg.optim)

    def evaluate(self, params: Any = None) -> float:
        return self.t.evaluate(params)

    # ---- overlapped rounds (the device path's anchor is the round's start) --------------------
    def _dpg(self) -> DevicePseudoGradient:
        if self.device_pg is None:
            raise RuntimeError("overlapped rounds need the device pseudo-gradient path")
        return self.device_pg

    def capture(self) -> Any:
        d = self._dpg().diff(self.t.state.params)
        self._placed()  # the next round's progress counts from here
        return d

    def pull(self, captured: Any, like: Any) -> Any:
        if self.encoder is not None:
            return DeviceContribution(captured, self.encoder, like)
        return self._dpg().pull(captured, like)

    def place(self, outer_params: Any) -> Any:
        return jax.device_put(outer_params, self.t.shardings.params)

    def stash(self) -> Any:
        return jax.tree.map(jnp.copy, self.t.state.opt_state)  # dispatched: the window does not wait for it

    def merge(self, placed: Any) -> None:
        dpg = self._dpg()
        self.t.set_params(dpg.merged(placed, self.t.state.params))
        dpg.mark(placed, copy=False)  # placed is the loop's own copy, never donated

    def lease(self, rnd: int, batches: list[tuple[int, int]]) -> None:
        self.t.data.lease(batches)

    def record(self, step: int, metrics: dict[str, Any]) -> None:
        if self.t.logger is not None:
            self.t.logger.log(step, metrics)
