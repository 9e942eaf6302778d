"""Node-local sharding: the one table mapping logical axis names onto the (fsdp, tp) mesh.

Layers name their axes logically (`embed`, `mlp`, `heads`, ...); only this file knows mesh axes.
A mesh axis is dropped for a dimension it does not divide evenly (that dimension is replicated).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("fsdp", "tp")

# logical axis -> mesh axes (None = replicated). Parameters are FSDP-sharded on `embed`
# and tensor-parallel on heads / mlp / vocab; activations keep `batch` on fsdp.
RULES: dict[str, tuple[str, ...] | None] = {
    "layers": None,  # the stacked blocks' leading axis (scanned)
    "batch": ("fsdp",),
    "seq": None,
    "embed": ("fsdp",),
    "act_embed": None,
    "mlp": ("tp",),
    "heads": ("tp",),
    "kv_heads": ("tp",),
    "head_dim": None,
    "vocab": ("tp",),
    "norm": None,
}

LogicalAxes = tuple[str | None, ...]


def make_mesh(fsdp: int = -1, tp: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A (fsdp, tp) mesh over this node's devices (all processes of the node); -1 = the rest."""
    devs = list(jax.devices() if devices is None else devices)
    n = len(devs)
    for name, size in (("fsdp", fsdp), ("tp", tp)):
        if size == 0 or size < -1:
            raise ValueError(f"mesh.{name} must be a positive size or -1, got {size}")
    if fsdp == -1 and tp == -1:
        raise ValueError("mesh: at most one of fsdp, tp may be -1")
    if fsdp == -1:
        fsdp = n // tp if n % tp == 0 else 0
    if tp == -1:
        tp = n // fsdp if n % fsdp == 0 else 0
    if fsdp * tp != n:
        raise ValueError(f"mesh fsdp x tp = {fsdp} x {tp} does not match {n} devices")
    grid = np.asarray(devs, dtype=object).reshape(fsdp, tp)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 2)


def platform(mesh: Mesh) -> tuple[str, str | None]:
    """(platform, compute capability) of a mesh's devices: ("cpu", None), ("gpu", "9.0") for an
    H100, real or compile-only; the capability is None where the device has none (ROCm's)."""
    d = mesh.devices.flat[0]
    cc = getattr(d, "compute_capability", None) if d.platform in ("gpu", "cuda") else None
    return d.platform, cc if isinstance(cc, str) else None


def logical_to_spec(
    axes: LogicalAxes, shape: Sequence[int], mesh_shape: Mapping[str, int]
) -> PartitionSpec:
    """PartitionSpec for `axes` via RULES, skipping mesh axes of size 1, already used, or
    not dividing the dimension."""
    used: set[str] = set()
    out: list[Any] = []
    for name, dim in zip(axes, shape, strict=True):
        picked: list[str] = []
        size = 1
        for ax in (RULES.get(name) or ()) if name else ():
            n = mesh_shape.get(ax, 1)
            if n > 1 and ax not in used and dim % (size * n) == 0:
                picked.append(ax)
                size *= n
        used.update(picked)
        out.append(None if not picked else picked[0] if len(picked) == 1 else tuple(picked))
    return PartitionSpec(*out)


def constrain(x: jax.Array, axes: LogicalAxes) -> jax.Array:
    """Sharding constraint on an activation under the mesh set by `jax.set_mesh` (no-op without)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes, x.shape, dict(mesh.shape)))


def _param_axes(v: nnx.Variable) -> LogicalAxes:
    axes = v.get_metadata().get("axes")
    if axes is None:
        raise ValueError(f"parameter of shape {v.shape} carries no logical axes")
    return axes


def state_specs(abs_state: Any, mesh_shape: Mapping[str, int]) -> Any:
    """PartitionSpecs for an (abstract) nnx.State of parameters."""
    return jax.tree.map(
        lambda v: v.replace(logical_to_spec(_param_axes(v), v.shape, mesh_shape)),
        abs_state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def state_shardings(abs_state: Any, mesh: Mesh) -> Any:
    specs = state_specs(abs_state, dict(mesh.shape))
    return jax.tree.map(lambda p: NamedSharding(mesh, p), specs)


def abstract(make_model: Any) -> tuple[nnx.GraphDef, Any]:
    """(graphdef, abstract nnx.State) of `make_model()`: shapes, dtypes and axes, nothing allocated."""
    return nnx.split(nnx.eval_shape(make_model))


def init_sharded(make_model: Any, mesh: Mesh) -> nnx.Module:
    """Create `make_model()` with every parameter born sharded (eval_shape -> specs -> jit):
    the one way parameters are initialized (training, tests, tools)."""
    graphdef, abs_state = abstract(make_model)
    shardings = state_shardings(abs_state, mesh)

    @jax.jit(out_shardings=shardings)
    def init() -> Any:
        return nnx.state(make_model())

    with jax.set_mesh(mesh):
        state = init()
    return nnx.merge(graphdef, state)


def memory_report(
    make_model: Any, mesh_shape: Mapping[str, int], *, opt_states: int = 2
) -> dict[str, float]:
    """Parameter count and worst-device bytes for params + `opt_states` fp32 moments (AdamW: 2),
    computed from abstract shapes only: nothing is allocated."""
    _, abs_state = abstract(make_model)
    specs = state_specs(abs_state, mesh_shape)
    n_params = 0
    param_bytes = 0.0
    opt_bytes = 0.0
    for v, spec in zip(
        jax.tree.leaves(abs_state), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec)),
        strict=True,
    ):
        shard = list(v.shape)
        for i, ax in enumerate(spec):
            for a in (ax,) if isinstance(ax, str) else (ax or ()):
                shard[i] = math.ceil(shard[i] / mesh_shape[a])
        n_shard = math.prod(shard)
        n_params += math.prod(v.shape)
        param_bytes += n_shard * np.dtype(v.dtype).itemsize
        opt_bytes += n_shard * 4 * opt_states
    return {
        "num_params": n_params,
        "devices": math.prod(mesh_shape.values()),
        "param_bytes_per_device": param_bytes,
        "opt_bytes_per_device": opt_bytes,
        "total_bytes_per_device": param_bytes + opt_bytes,
    }
