"""Where a DiLoCo node's states go: the node's one orbax checkpointing path.

:class:`CheckpointStore` keeps `DilocoState`s in the trainer's `Checkpointer` (array item
``diloco``: outer params, outer momentum, inner optimizer state; ``feedback``, the node's
error-feedback residual, where it has one; JSON items ``data``,
``meta`` with the counters and the state hash, ``tokenizer``). Periodic checkpoints, the
state a joiner received from its donor, and a resume all go through it, one operation at a
time. A restored state must hash to what its ``meta`` says, else the checkpoint counts as
damaged and the next older one is tried. :class:`MemoryStore` keeps states in memory (runs
without a disk: the sweep benchmark, the simulation).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from intellect_jax.coordinator.claims import RecordBook
from intellect_jax.diloco.state import DilocoState, MomentumState, state_hash, to_host
from intellect_jax.trainer.checkpoint import Checkpointer, CheckpointError
from intellect_jax.trainer.loop import Trainer, warn

ITEM = "diloco"
RECORDS = "records.json"  # in the run directory, beside ckpt/
FEEDBACK = "feedback"  # the node's error-feedback residual, when it has one (an optional item)


class CheckpointStore:
    """DiLoCo states in ``trainer.ckpt``; ``latest()`` reads the node's own checkpoints when
    ``resume``, or another node's run directory ``init_from`` (e.g. on shared storage)."""

    def __init__(self, trainer: Trainer, *, resume: bool = False, init_from: str | None = None,
                 meta: dict[str, Any] | None = None, warn: Callable[[str], None] = warn) -> None:
        self.t, self.resume, self.init_from, self.warn = trainer, resume, init_from, warn
        self.meta = meta or {}
        self.book = RecordBook(trainer.run_dir / RECORDS)  # the coordinator's barrier records (coordinator.claims)

    def _abstract(self, feedback: bool = True) -> dict[str, Any]:
        """Restore targets: placed like the train state, or host numpy for a lead-only
        checkpointer (the lead of a multi-process node places the state itself); the residual
        (``feedback``: asked for) always to host numpy, where the outer loop keeps it."""
        a, sh = self.t.abstract_state, self.t.shardings
        if self.t.ckpt.lead_only:
            fp32 = jax.tree.map(lambda x: np.empty(x.shape, np.float32), a.params)
            opt = jax.tree.map(lambda x: np.empty(x.shape, x.dtype), a.opt_state)
        else:
            fp32 = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, "float32", sharding=s), a.params, sh.params)
            opt = a.opt_state
        out = {ITEM: {"outer_params": fp32, "outer_opt_state": MomentumState(fp32), "inner_opt_state": opt}}
        if feedback:
            out[FEEDBACK] = jax.tree.map(lambda x: np.empty(x.shape, np.float32), a.params)
        return out

    def _state(self, out: dict[str, Any]) -> DilocoState:
        arrays, meta = out[ITEM], out["meta"]
        outer = to_host(arrays["outer_params"])
        momentum = MomentumState(to_host(arrays["outer_opt_state"]["momentum"]
                                         if isinstance(arrays["outer_opt_state"], dict)
                                         else arrays["outer_opt_state"].momentum))
        data = out.get("data") or None  # {}: no position recorded (start of this node's shard)
        residual = out.get(FEEDBACK)  # host float32 numpy already (see _abstract)
        return DilocoState(outer, momentum, arrays["inner_opt_state"], int(meta["outer_step"]),
                           int(meta["inner_step"]), data, tuple(meta.get("norms", ())), residual,
                           meta["skipped"] if isinstance(meta.get("skipped"), bool) else None)

    def _verify(self, out: dict[str, Any]) -> str | None:
        got, want = state_hash(self._state(out)), out["meta"].get("outer_hash")
        return None if got == want else f"its outer state hashes to {got[:12]}, its metadata says {str(want)[:12]}"

    def latest(self) -> DilocoState | None:
        if self.init_from:
            d = Path(self.init_from)
            ck = Checkpointer(d / "ckpt" if (d / "ckpt").is_dir() else d, every=0, keep=10**6, async_save=False,
                              lead_only=self.t.ckpt.lead_only)
            try:
                _, out = ck.restore_newest(self._abstract(feedback=False), ("meta",), self._verify, self.warn)
            except CheckpointError as e:
                raise CheckpointError(f"diloco.init_from {self.init_from}: {e}") from None
            finally:
                ck.close()
            return self._state(out)._replace(data=None)  # another node's data shard (its feedback: not read)
        if not self.resume or not self.t.ckpt.all_steps():
            return None
        _, out = self.t.ckpt.restore_newest(self._abstract(), ("meta", "data"), self._verify, self.warn, (FEEDBACK,))
        return self._state(out)

    def save(self, s: DilocoState, *, wait: bool = False) -> None:
        ck, step, h = self.t.ckpt, s.inner_step, state_hash(s)
        if step in ck.all_steps():
            if ck.restore_json("meta", step).get("outer_hash") == h:
                return
            ck.delete(step)  # a state the run's history did not keep (e.g. a failed round's)
        meta = {**self.meta, "step": step, "outer_step": s.outer_step, "inner_step": step, "outer_hash": h,
                "norms": list(s.norms), **({"skipped": s.skipped} if s.skipped is not None else {}),
                "config": self.t.cfg.model_dump(mode="json")}
        json = {"meta": meta, "tokenizer": self.t.tok.state(), "data": s.data if s.data is not None else {}}
        ck.save(step, {ITEM: s.arrays(), **({FEEDBACK: s.residual} if s.residual is not None else {})}, json,
                force=True)
        if wait:
            ck.wait()

    def load(self, inner_step: int) -> DilocoState:
        out = self.t.ckpt.restore(inner_step, self._abstract(), ("meta", "data"), (FEEDBACK,))
        why = self._verify(out)
        if why:
            raise CheckpointError(f"checkpoint {inner_step}: {why}")
        return self._state(out)


class MemoryStore:
    """States kept in memory, keyed by inner step (``latest`` starts from ``initial``)."""

    def __init__(self, initial: DilocoState | None = None) -> None:
        self.states: dict[int, DilocoState] = {}
        self.initial = initial
        self.book = RecordBook()

    def latest(self) -> DilocoState | None:
        return self.initial

    def save(self, s: DilocoState, *, wait: bool = False) -> None:
        self.states[s.inner_step] = copy.deepcopy(s)

    def load(self, inner_step: int) -> DilocoState:
        return copy.deepcopy(self.states[inner_step])
