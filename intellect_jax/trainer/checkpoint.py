"""Orbax checkpoints of a run: array trees (the train state, or a DiLoCo state) and JSON items
(data-iterator position, run metadata, tokenizer), with per-array checksums.

Orbax writes each step into a temporary directory and renames it when complete, so a process
killed during an (async) save leaves the last complete checkpoint intact and the partial one
is ignored and cleaned up on the next start. Orbax does not notice flipped bytes in an array
file (it restores them as they are), so every save also stores two 32-bit sums of each array's
bits (computed where the array lives, order-independent, so sharding does not matter);
`restore` recomputes them and a damaged checkpoint raises :class:`CheckpointDamaged` naming the
array. `restore_newest` falls back to the newest checkpoint that restores and verifies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

log = logging.getLogger("intellect_jax.checkpoint")
CHECKSUMS = "checksums"


class CheckpointError(RuntimeError):
    pass


class CheckpointDamaged(CheckpointError):
    pass


def _sums_np(x: np.ndarray) -> list[int]:
    u = np.ascontiguousarray(x).reshape(-1)
    u = u.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[u.dtype.itemsize]).astype(np.uint32)
    w = (np.arange(u.size, dtype=np.uint32) & np.uint32(0xFFFF)) + np.uint32(1)
    return [int(u.sum(dtype=np.uint32)), int((u * w).sum(dtype=np.uint32))]


def _sums_jax(x: jax.Array) -> jax.Array:
    bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    u = jax.lax.bitcast_convert_type(x, bits).astype(jnp.uint32).reshape(-1)
    w = (jnp.arange(u.size, dtype=jnp.uint32) & jnp.uint32(0xFFFF)) + jnp.uint32(1)
    return jnp.stack([jnp.sum(u, dtype=jnp.uint32), jnp.sum(u * w, dtype=jnp.uint32)])


_sums_all = jax.jit(lambda xs: [_sums_jax(x) for x in xs])  # one program for all of a tree's arrays


def checksums(tree: Any) -> list[list[Any]]:
    """[leaf path, sum of its bits as uint32 words, position-weighted sum] per leaf in tree order,
    sums mod 2**32: the same for a device array and its host copy, however it is sharded."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    idx = [i for i, (_, x) in enumerate(leaves) if isinstance(x, jax.Array)]
    # the sums come back replicated: read this process's copy (an array spanning processes
    # cannot be fetched whole)
    dev = {i: np.asarray(r.addressable_data(0)) for i, r in zip(idx, _sums_all([leaves[i][1] for i in idx]))}
    return [[jax.tree_util.keystr(p), *([int(v) for v in dev[i]] if i in dev else _sums_np(np.asarray(x)))]
            for i, (p, x) in enumerate(leaves)]


class Checkpointer:
    """Save every `every` steps (and when forced), keep the last `keep`."""

    def __init__(self, directory: str | Path, *, every: int, keep: int, async_save: bool = True,
                 lead_only: bool = False):
        """``lead_only``: in a runtime of several processes, process 0 alone saves and restores
        (host numpy trees; a multi-process DiLoCo node's lead). The others must not build one."""
        self.directory = Path(directory).absolute()
        self.lead_only = lead_only and jax.process_count() > 1
        more = {}
        if self.lead_only:
            if jax.process_index() != 0:
                raise CheckpointError("a lead-only checkpointer belongs to process 0")
            more["multiprocessing_options"] = ocp.options.MultiprocessingOptions(primary_host=0, active_processes={0})
            self.directory.mkdir(parents=True, exist_ok=True)  # orbax cannot create it for a subset of processes
        opts = ocp.CheckpointManagerOptions(
            save_interval_steps=max(every, 1) if every else 10**12,
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=not self.lead_only,
            cleanup_tmp_directories=True,  # a save cut short by a crash is removed on the next start
            **more,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=opts)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, arrays: dict[str, Any], json: dict[str, dict], *, force: bool = False) -> bool:
        """Array trees (orbax standard items) and JSON items, plus the arrays' checksums."""
        items = {name: ocp.args.StandardSave(tree) for name, tree in arrays.items()}
        items.update({name: ocp.args.JsonSave(d) for name, d in json.items()})
        items[CHECKSUMS] = ocp.args.JsonSave({name: checksums(tree) for name, tree in arrays.items()})
        return self.manager.save(step, args=ocp.args.Composite(**items), force=force)

    def restore(self, step: int, arrays: dict[str, Any], json: tuple[str, ...] = (),
                optional: tuple[str, ...] = ()) -> dict[str, Any]:
        """The named items of ``step``: array trees placed per the abstract trees' shardings (host
        numpy where the abstract leaves are numpy), verified against their checksums. An array
        item named in ``optional`` that this checkpoint lacks is left out of the result."""
        if step not in self.all_steps():
            raise CheckpointError(f"step {step} not in {self.directory} (have {self.all_steps()})")
        if optional:
            have = self.item_names(step)
            arrays = {k: v for k, v in arrays.items() if k not in optional or k in have}
        items = {name: ocp.args.StandardRestore(tree) for name, tree in arrays.items()}
        items.update({name: ocp.args.JsonRestore() for name in (*json, CHECKSUMS)})
        out = self.manager.restore(step, args=ocp.args.Composite(**items))
        want = out[CHECKSUMS]
        for name in arrays:  # compared in leaf order (a dict restored for a NamedTuple keeps it)
            got, saved = checksums(out[name]), want.get(name, [])
            bad = [w[0] for w, g in zip(saved, got) if w[1:] != g[1:]] + [w[0] for w in saved[len(got):]]
            if bad:
                raise CheckpointDamaged(f"{self.directory / str(step) / name}: array {bad[0]} does not match its "
                                        f"checksum" + (f" ({len(bad)} arrays damaged)" if len(bad) > 1 else ""))
        return {name: out[name] for name in (*arrays, *json)}

    def restore_newest(self, arrays: dict[str, Any], json: tuple[str, ...] = (),
                       verify: Callable[[dict[str, Any]], str | None] | None = None,
                       warn: Callable[[str], None] = log.warning,
                       optional: tuple[str, ...] = ()) -> tuple[int, dict[str, Any]]:
        """The newest checkpoint that restores and passes ``verify`` (which returns a reason to
        reject, or None); each damaged one is skipped with one warning line."""
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        for step in reversed(steps):
            try:
                out = self.restore(step, arrays, json, optional)
                why = verify(out) if verify else None
            except CheckpointDamaged as e:
                why = str(e)
            except Exception as e:  # noqa: BLE001 - orbax/tensorstore errors on damaged files vary
                why = f"{self.directory / str(step)}: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
            if why is None:
                return step, out
            older = [s for s in steps if s < step]
            warn(f"WARNING checkpoint {step} is damaged ({why}); "
                 + (f"falling back to checkpoint {older[-1]}" if older else "no older checkpoint"))
        raise CheckpointError(f"no readable checkpoint in {self.directory} (all of {steps} are damaged)")

    def restore_json(self, item: str, step: int | None = None) -> dict:
        """A JSON item (`meta`, `data`, `tokenizer`) alone, without touching the arrays."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        out = self.manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))
        return out[item]

    def item_names(self, step: int) -> set[str]:
        return {p.name for p in (self.directory / str(step)).iterdir() if p.is_dir()}

    def delete(self, step: int) -> None:
        self.manager.wait_until_finished()
        self.manager.delete(step)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
