"""Orbax checkpoints of a run: train state, data-iterator state, run config and tokenizer.

Orbax writes each step into a temporary directory and renames it when complete, so a process
killed during an (async) save leaves the last complete checkpoint intact and the partial one
is ignored and cleaned up on the next start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
    pass


class Checkpointer:
    """Save every `every` steps (and when forced), keep the last `keep`."""

    def __init__(self, directory: str | Path, *, every: int, keep: int, async_save: bool = True):
        self.directory = Path(directory).absolute()
        opts = ocp.CheckpointManagerOptions(
            save_interval_steps=max(every, 1) if every else 10**12,
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=opts)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, *, data: dict, meta: dict, tokenizer: dict | None = None,
             extra: dict[str, Any] | None = None, force: bool = False) -> bool:
        """`extra`: more array trees saved beside the train state (e.g. DiLoCo's outer state)."""
        items = dict(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data),
            meta=ocp.args.JsonSave(meta),
        )
        if tokenizer is not None:
            items["tokenizer"] = ocp.args.JsonSave(tokenizer)
        for name, tree in (extra or {}).items():
            items[name] = ocp.args.StandardSave(tree)
        return self.manager.save(step, args=ocp.args.Composite(**items), force=force)

    def restore_extra(self, name: str, abstract: Any, step: int) -> Any:
        """An `extra` tree saved with `save`."""
        out = self.manager.restore(step, args=ocp.args.Composite(**{name: ocp.args.StandardRestore(abstract)}))
        return out[name]

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict, dict]:
        """(state placed per `abstract_state`'s shardings, data-iterator state, meta)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        if step not in self.all_steps():
            raise CheckpointError(f"step {step} not in {self.directory} (have {self.all_steps()})")
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=ocp.args.JsonRestore(),
                meta=ocp.args.JsonRestore(),
            ),
        )
        return out.state, out.data, out.meta

    def restore_json(self, item: str, step: int | None = None) -> dict:
        """A JSON item (`meta`, `data`, `tokenizer`) alone, without touching the arrays."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        out = self.manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))
        return out[item]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
