"""GPU targets to compile for without the GPU, and the compile-only devices of one.

XLA:GPU compiles for a device it cannot see from a description of it (a ``GpuTargetConfig``
text proto): core count, shared memory and registers per core, caches, clocks, memory size and
the cuDNN version its fusions may use. :data:`TARGETS` holds each GPU's figures as this project
read or looked them up (``source`` says which); :func:`target_config` writes the proto that
the installed jaxlib takes, and :func:`devices` gives the topology's devices to build meshes on.

Needs the ``[aot]`` extra: ``jax-cuda12-plugin`` (XLA:GPU itself), ``nvidia-cuda-nvcc-cu12``
(ptxas and libdevice) and ``nvidia-cudnn-cu12`` (JAX checks the local cuDNN version when it
traces cuDNN attention), with ``JAX_PLATFORMS=cpu`` set before jax starts: the plugin's own
device search would otherwise fail on a machine without a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

GiB = 2**30


class AotUnavailable(RuntimeError):
    """The ``[aot]`` extra (or one of its parts) is missing: a one-line reason."""


@dataclass(frozen=True)
class GpuSpec:
    name: str  # CUDA's device name, as a node's `device_kind` shows it
    source: str  # where these figures come from
    compute_capability: tuple[int, int]
    cores: int  # streaming multiprocessors
    fpus_per_core: int  # fp32 lanes per SM
    threads_per_core: int
    shared_per_block: int  # bytes, default and opt-in
    shared_per_block_optin: int
    shared_per_core: int
    registers_per_core: int
    registers_per_block: int
    l2_bytes: int
    clock_ghz: float
    memory_bytes: int  # what CUDA reports as total global memory
    bandwidth: int  # bytes/s: 2 x memory clock x bus width


TARGETS: dict[str, GpuSpec] = {
    "h100": GpuSpec(
        "NVIDIA H100 80GB HBM3", "cudaGetDeviceProperties on an H100 SXM, driver 580.159.04 (2026-11-24)",
        (9, 0), cores=132, fpus_per_core=128, threads_per_core=2048, shared_per_block=49152,
        shared_per_block_optin=232448, shared_per_core=233472, registers_per_core=65536, registers_per_block=65536,
        l2_bytes=52428800, clock_ghz=1.98, memory_bytes=85017493504, bandwidth=2 * 2_619_000_000 * 5120 // 8),
    "h200": GpuSpec(
        "NVIDIA H200", "the H100's SM figures (same GH100 die); memory 143771 MiB as nvidia-smi shows an H200 "
        "here, 4.8 TB/s (NVIDIA's datasheet)",
        (9, 0), cores=132, fpus_per_core=128, threads_per_core=2048, shared_per_block=49152,
        shared_per_block_optin=232448, shared_per_core=233472, registers_per_core=65536, registers_per_block=65536,
        l2_bytes=52428800, clock_ghz=1.98, memory_bytes=143771 * 2**20, bandwidth=4_800_000_000_000),
    "a100": GpuSpec(
        "NVIDIA A100-SXM4-80GB", "NVIDIA's A100 datasheet and CUDA's sm_80 limits; memory nominal (80 GiB)",
        (8, 0), cores=108, fpus_per_core=64, threads_per_core=2048, shared_per_block=49152,
        shared_per_block_optin=166912, shared_per_core=167936, registers_per_core=65536, registers_per_block=65536,
        l2_bytes=41943040, clock_ghz=1.41, memory_bytes=80 * GiB, bandwidth=2_039_000_000_000),
}


def spec(target: str) -> GpuSpec:
    if target not in TARGETS:
        from intellect_jax.model.config import ConfigError

        raise ConfigError(f"--target {target}: unknown GPU; choose from {sorted(TARGETS)} (or cpu)")
    return TARGETS[target]


def _versions() -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(CUDA runtime the plugin was built for, local cuDNN): what the compiled program assumes."""
    import importlib.util

    def found(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # no jax_plugins package at all
            return False

    if not any(found(f"jax_plugins.xla_cuda{v}") for v in (12, 13)):
        raise AotUnavailable("compiling for a GPU needs the [aot] extra: pip install 'intellect-jax[aot]' "
                             "(jax-cuda12-plugin is missing)")
    import shutil

    # where jax looks for ptxas: the CUDA wheels (12's nvcc wheel, 13's), else CUDA on the PATH
    if not (found("nvidia.cuda_nvcc") or found("nvidia.cu13") or shutil.which("ptxas")):
        raise AotUnavailable("compiling for a GPU needs ptxas: pip install 'intellect-jax[aot]' "
                             "(nvidia-cuda-nvcc-cu12 is missing)")
    from jax._src.lib import cuda_versions
    if cuda_versions is None:
        raise AotUnavailable("jax-cuda12-plugin is installed but its CUDA version helpers did not load")
    try:
        dnn = cuda_versions.cudnn_get_version()  # e.g. 92800
    except Exception:  # noqa: BLE001 - the library failed to load: the wheel is missing
        raise AotUnavailable("compiling cuDNN attention needs the cuDNN library: pip install "
                             "'intellect-jax[aot]' (nvidia-cudnn-cu12 is missing)") from None
    rt = cuda_versions.cuda_runtime_build_version()  # e.g. 12090
    return (rt // 1000, rt % 1000 // 10, 0), (dnn // 10000, dnn % 10000 // 100, dnn % 100)


def unavailable() -> str | None:
    """Why this environment cannot compile for a GPU (None: it can)."""
    try:
        _versions()
    except AotUnavailable as e:
        return str(e)
    return None


def target_config(s: GpuSpec, runtime: tuple[int, int, int], dnn: tuple[int, int, int]) -> str:
    """The ``GpuTargetConfig`` text proto of ``s`` for the installed jaxlib."""
    info = {
        "threads_per_block_limit": 1024, "threads_per_warp": 32,
        "shared_memory_per_block": s.shared_per_block, "shared_memory_per_core": s.shared_per_core,
        "threads_per_core_limit": s.threads_per_core, "core_count": s.cores, "fpus_per_core": s.fpus_per_core,
        "block_dim_limit_x": 2**31 - 1, "block_dim_limit_y": 65535, "block_dim_limit_z": 65535,
        "memory_bandwidth": s.bandwidth, "l2_cache_size": s.l2_bytes, "clock_rate_ghz": s.clock_ghz,
        "device_memory_size": s.memory_bytes, "shared_memory_per_block_optin": s.shared_per_block_optin,
        "registers_per_core_limit": s.registers_per_core, "registers_per_block_limit": s.registers_per_block,
    }
    major, minor = s.compute_capability

    def version(name: str, v: tuple[int, int, int]) -> str:
        return f"{name} {{ major: {v[0]} minor: {v[1]} patch: {v[2]} }}"

    return "\n".join([
        "gpu_device_info {", *(f"  {k}: {v}" for k, v in info.items()),
        f"  cuda_compute_capability {{ major: {major} minor: {minor} }}", "}",
        'platform_name: "CUDA"', version("dnn_version_info", dnn), version("runtime_version", runtime),
        f'device_description_str: "{s.name}"', ""])


def devices(target: str, n: int) -> list[Any]:
    """``n`` compile-only devices of ``target`` (one host of up to 8 GPUs, else hosts of 8): build
    meshes on these, then ``jit(...).lower(...).compile()`` runs XLA:GPU's whole pipeline."""
    s = spec(target)
    if os.environ.get("JAX_PLATFORMS", "") != "cpu":
        raise AotUnavailable("compiling for a GPU without one needs JAX_PLATFORMS=cpu set before jax starts")
    if n > 8 and n % 8:
        from intellect_jax.model.config import ConfigError

        raise ConfigError(f"--devices {n}: a node of more than 8 GPUs has hosts of 8")
    runtime, dnn = _versions()
    from jax.experimental import topologies

    hosts, per_host = (n // 8, 8) if n > 8 else (1, n)
    try:
        topo = topologies.get_topology_desc(platform="cuda", topology=f"1x{hosts}x{per_host}",
                                            target_config=target_config(s, runtime, dnn))
    except Exception as e:  # noqa: BLE001 - XLA's errors are runtime errors of many kinds
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise AotUnavailable(f"XLA refused the {target} topology 1x{hosts}x{per_host}: {first}") from None
    return list(topo.devices)[:n]
