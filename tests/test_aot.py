"""Compiling for GPUs without one: target specs, HLO reading, the attention choice, the Triton
kernel for sm_90a, and (where the ``[aot]`` extra is installed: CI's own venv for it) the debug
model's train step compiled for an H100 with cuDNN's fused attention.

The real-GPU counterpart is ``benchmarks/gpu_check.py``; docs/results.md compares the two."""

import importlib.util
import subprocess
import sys

import pytest

from intellect_jax.aot import hlo, targets
from intellect_jax.model.config import HEAD_CHUNK_LOGITS, ConfigError, ModelConfig


def _has(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


AOT = targets.unavailable() is None  # the plugin, ptxas and cuDNN, as the tool checks them
needs_aot = pytest.mark.skipif(not AOT, reason="the [aot] extra is not installed (CI runs these in its own venv)")
DEBUG_BF16 = ["--config", "configs/debug.toml", "--model.compute_dtype", "bfloat16"]


# ---- everywhere ----------------------------------------------------------------------------
def test_every_target_renders_a_config_with_its_own_figures():
    for name, s in targets.TARGETS.items():
        text = targets.target_config(s, (12, 9, 0), (9, 28, 0))
        assert f"core_count: {s.cores}\n" in text and f"device_memory_size: {s.memory_bytes}\n" in text, name
        major, minor = s.compute_capability
        assert f"cuda_compute_capability {{ major: {major} minor: {minor} }}" in text
        assert "dnn_version_info { major: 9 minor: 28 patch: 0 }" in text and f'"{s.name}"' in text
    h100 = targets.spec("h100")
    assert (h100.cores, h100.memory_bytes, h100.compute_capability) == (132, 85017493504, (9, 0))
    with pytest.raises(ConfigError, match="--target v100: unknown GPU"):
        targets.spec("v100")


def test_attention_resolves_per_platform():
    m = ModelConfig.preset("debug", compute_dtype="bfloat16")
    assert m.on_platform("gpu", "9.0").attention_impl == "cudnn" and m.on_platform("cuda", "8.0").attention_impl == "cudnn"
    assert m.on_platform("cpu").attention_impl == "xla"
    # no flash attention before Ampere, none on ROCm (no NVIDIA compute capability): XLA's
    assert m.on_platform("gpu", "7.0").attention_impl == "xla" and m.on_platform("gpu", None).attention_impl == "xla"
    assert m.on_platform("gpu", "gfx90a").attention_impl == "xla"
    fp32 = ModelConfig.preset("debug", compute_dtype="float32")  # float32 compute: cuDNN's fused attention takes no fp32
    assert fp32.on_platform("gpu", "9.0").attention_impl == "xla" and "compute_dtype float32" in fp32.cudnn_attention_fits()
    wide = ModelConfig.preset("debug", compute_dtype="bfloat16", head_dim=192)
    assert wide.on_platform("gpu", "9.0").attention_impl == "xla" and "head_dim 192" in wide.cudnn_attention_fits()
    xla = ModelConfig.preset("debug", compute_dtype="bfloat16", attention_impl="xla")
    assert xla.on_platform("gpu", "9.0").attention_impl == "xla"
    cudnn = ModelConfig.preset("debug", attention_impl="cudnn", compute_dtype="bfloat16")
    assert cudnn.on_platform("gpu", "9.0").attention_impl == "cudnn"
    with pytest.raises(ConfigError, match="attention_impl = \"cudnn\" cannot run here: the devices are cpu"):
        cudnn.on_platform("cpu")
    with pytest.raises(ConfigError, match="cannot run here: compute capability 7.5 \\(cuDNN's fused attention needs"):
        cudnn.on_platform("gpu", "7.5")
    with pytest.raises(ConfigError, match="cannot run here: compute_dtype float32"):
        ModelConfig.preset("debug", attention_impl="cudnn", compute_dtype="float32").on_platform("gpu", "9.0")
    # the head's chunk: the platform's unless set; neither choice changes the architecture
    assert m.on_platform("gpu", "9.0").head_chunk_logits == HEAD_CHUNK_LOGITS["gpu"] > HEAD_CHUNK_LOGITS["cpu"]
    assert m.on_platform("cpu").head_chunk_logits == HEAD_CHUNK_LOGITS["cpu"]
    assert ModelConfig.preset("debug", head_chunk_logits=4096).on_platform("gpu", "9.0").head_chunk_logits == 4096
    assert m.on_platform("gpu", "9.0").fingerprint() == m.on_platform("cpu").fingerprint() == m.fingerprint()


def test_the_allocator_share_is_set_unless_the_operator_set_it(monkeypatch):
    from intellect_jax.trainer.distributed import MEM_FRACTION_ENV, set_mem_fraction

    monkeypatch.setenv(MEM_FRACTION_ENV, "0.5")  # recorded, so that the end of the test restores the original
    monkeypatch.delenv(MEM_FRACTION_ENV)
    assert set_mem_fraction(0.9) == 0.9 and __import__("os").environ[MEM_FRACTION_ENV] == "0.9"
    monkeypatch.setenv(MEM_FRACTION_ENV, ".8")
    assert set_mem_fraction(0.9) == 0.8  # the operator's value wins
    monkeypatch.setenv(MEM_FRACTION_ENV, "most")
    with pytest.raises(ConfigError, match="XLA_PYTHON_CLIENT_MEM_FRACTION='most' is not a number"):
        set_mem_fraction(0.9)
    monkeypatch.setenv(MEM_FRACTION_ENV, "0")
    with pytest.raises(ConfigError, match="XLA_PYTHON_CLIENT_MEM_FRACTION='0': a share above 0"):
        set_mem_fraction(0.9)
    monkeypatch.setenv(MEM_FRACTION_ENV, "4.0")  # unified memory: the operator's to choose
    assert set_mem_fraction(0.9) == 4.0


SCHEDULED = """\
HloModule jit_step, is_scheduled=true

%wrapped_rs (p: f32[64]) -> f32[8] {
  %p = f32[64]{0} parameter(0)
  ROOT %rs = f32[8]{0} reduce-scatter(%p), dimensions={0}, to_apply=%add
}

ENTRY %main (a: f32[8], b: f32[64]) -> f32[64] {
  %a = f32[8]{0} parameter(0)
  %b = f32[64]{0} parameter(1)
  %all-gather-start = (f32[8]{0}, f32[64]{0}) all-gather-start(%a), dimensions={0}
  %fusion.1 = f32[64]{0} fusion(%b), kind=kLoop, calls=%fused_computation
  %all-gather-done = f32[64]{0} all-gather-done(%all-gather-start)
  %all-reduce-start = f32[64]{0} all-reduce-start(%fusion.1), to_apply=%add
  %bitcast.2 = f32[64]{0} bitcast(%b)
  %all-reduce-done = f32[64]{0} all-reduce-done(%all-reduce-start)
  %async-start = ((f32[64]{0}), f32[8]{0}) async-start(%all-reduce-done), calls=%wrapped_rs
  %cudnn = (f32[64]{0}, u8[0]{0}) custom-call(%b), custom_call_target="__cudnn$fmhaSoftmax"
  %async-done = f32[8]{0} async-done(%async-start)
  %ar = f32[8]{0} all-reduce(%async-done), to_apply=%add
  %all-gather-start.2 = (f32[8]{0}, f32[64]{0}) all-gather-start(%ar), dimensions={0}
  %loop = (s32[], f32[64]{0}) while(%t), condition=%cond, body=%layers
  %all-gather-done.2 = f32[64]{0} all-gather-done(%all-gather-start.2)
  %all-gather-start.3 = (f32[8]{0}, f32[64]{0}) all-gather-start(%ar), dimensions={0}, backend_config={"is_sync":true}
  %fusion.3 = f32[64]{0} fusion(%b), kind=kLoop, calls=%fused_computation
  %all-gather-done.3 = f32[64]{0} all-gather-done(%all-gather-start.3)
  ROOT %out = f32[64]{0} add(%all-gather-done, %bitcast.2)
}

%layers (t: (s32[], f32[64])) -> (s32[], f32[64]) {
  %t = (s32[], f32[64]{0}) parameter(0)
  %gemm = (f32[64]{0}, s8[0]{0}) custom-call(%t), custom_call_target="__cublas$gemm"
  ROOT %r = (s32[], f32[64]{0}) tuple(%t)
}
"""


def test_hlo_collectives_and_their_overlap():
    c = hlo.collectives(SCHEDULED).summary()
    # the all-gather spans a fusion: overlapped; the all-reduce spans only a bitcast: not; the
    # wrapped reduce-scatter spans a custom call: overlapped; the plain all-reduce is synchronous
    # all-gather 2 spans the layer loop, whose body holds a matmul: overlapped; all-gather 3 is
    # synchronous (is_sync) though a fusion sits between its start and done
    assert c["all-gather"] == {"count": 3, "async": 2, "overlapped": 2}
    assert c["all-reduce"] == {"count": 2, "async": 1, "overlapped": 0}
    assert c["reduce-scatter"] == {"count": 1, "async": 1, "overlapped": 1}
    assert "all-to-all" not in c
    assert hlo.attention(SCHEDULED) == "cudnn" and hlo.cudnn_calls(SCHEDULED) == {"forward": 1, "backward": 0}
    assert hlo.attention(SCHEDULED.replace("__cudnn$fmhaSoftmax", "__cublas$gemm")) == "xla"


@pytest.mark.skipif(not _has("triton"), reason="triton is not installed")
def test_the_quantize_kernel_compiles_for_hopper_without_fused_multiply_adds():
    """Triton's compiler (not its interpreter) takes the kernel to PTX and ptxas to a cubin for
    sm_90a; the PTX holds the IEEE divisions the kernel's exactness needs and no FMA. With fp
    fusion allowed the same count finds FMAs: the check can fail."""
    from intellect_jax.kernels.quant_triton import report_in_subprocess

    k = report_in_subprocess(90, 64)
    assert k["target"] == "sm_90a" and k["cubin_bytes"] > 1000
    assert k["ieee_divisions"] > 0 and k["fused_multiply_adds"] == 0
    assert report_in_subprocess(90, 64, fp_fusion=True)["fused_multiply_adds"] > 0
    assert report_in_subprocess(80, 256)["target"] == "sm_80"


@pytest.mark.skipif(AOT, reason="the [aot] extra is installed here")
def test_without_the_extra_a_gpu_target_is_one_line_and_exit_2():
    p = subprocess.run([sys.executable, "-m", "intellect_jax.memory", *DEBUG_BF16, "--target", "h100", "--devices", "1"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 2 and p.stdout == "", p.stderr
    assert p.stderr.strip().splitlines() == [
        "error: compiling for a GPU needs the [aot] extra: pip install 'intellect-jax[aot]' "
        "(jax-cuda12-plugin is missing)"]


# ---- with the [aot] extra ------------------------------------------------------------------
@needs_aot
def test_every_target_gives_compile_only_devices():
    """Every shipped spec parses in the installed XLA:GPU: one host of up to 8 GPUs, or hosts of 8."""
    for name, s in targets.TARGETS.items():
        for n in (1, 16):
            devs = targets.devices(name, n)
            assert len(devs) == n and {d.device_kind for d in devs} == {s.name}, name
            assert devs[0].compute_capability == "{}.{}".format(*s.compute_capability)
    with pytest.raises(ConfigError, match="--devices 12: a node of more than 8 GPUs has hosts of 8"):
        targets.devices("h100", 12)


@needs_aot
def test_debug_train_step_compiled_for_one_h100_calls_cudnn_attention():
    from intellect_jax.memory import main

    r = main([*DEBUG_BF16, "--target", "h100", "--devices", "1"])
    assert r["platform"] == "gpu" and r["device_kind"] == "NVIDIA H100 80GB HBM3"
    assert r["attention_impl"] == "cudnn"
    tr, ev = r["train"], r["eval"]
    assert tr["attention"] == "cudnn" and tr["cudnn_calls"]["forward"] >= 1 and tr["cudnn_calls"]["backward"] >= 1
    assert ev["attention"] == "cudnn" and ev["cudnn_calls"] == {"forward": ev["cudnn_calls"]["forward"], "backward": 0}
    assert tr["peak_bytes"] > tr["temporaries_bytes"] > 0 and tr["aliased_bytes"] > 0
    assert tr["collectives"] == {}  # one device
    assert r["margin_bytes"] > 0 and r["usable_bytes"] < targets.spec("h100").memory_bytes
    if _has("triton"):
        assert r["kernel"]["target"] == "sm_90a" and r["kernel"]["fused_multiply_adds"] == 0


@needs_aot
def test_eight_h100s_beside_fake_cpu_devices_in_one_run():
    """One command, both targets: the GPU's step has asynchronous collectives the scheduler
    overlaps with compute and cuDNN attention; XLA's attention (forced) holds no cuDNN call."""
    from intellect_jax.memory import main

    both = main([*DEBUG_BF16, "--target", "h100,cpu", "--devices", "8"])["targets"]
    gpu, cpu = both
    assert (gpu["target"], cpu["target"], gpu["devices"], cpu["devices"]) == ("h100", "cpu", 8, 8)
    coll = gpu["train"]["collectives"]
    assert coll["all-gather"]["async"] >= 1 and coll["reduce-scatter"]["count"] >= 1
    assert sum(v["overlapped"] for v in coll.values()) >= 1
    assert cpu["train"]["attention"] == "xla" and gpu["train"]["attention"] == "cudnn"
    xla = main([*DEBUG_BF16, "--target", "h100", "--devices", "1", "--model.attention_impl", "xla"])
    assert xla["train"]["cudnn_calls"] == {"forward": 0, "backward": 0} and xla["train"]["attention"] == "xla"


@needs_aot
@pytest.mark.parametrize("mode", ["top1of4", "topk64", "int1"])
def test_the_device_encoder_compiles_for_eight_h100s_and_keeps_the_residual_sharded(mode):
    """A gathered codec's per-bucket program (diloco/device_codec.py) on 8 H100s, for leaves
    sharded as the model's are (rows; a later axis of a stacked weight; a vector): a leaf of its
    own bucket (every large leaf) is never gathered whole on a GPU (all-to-alls move it;
    temporaries stay a few shards); a bucket of several small leaves is gathered, so it costs at
    most its own size per GPU; the next residual stays sharded like its leaf; the codec's
    sections are a small fraction of the values."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from intellect_jax.diloco.device_codec import _encode_bucket

    mesh = Mesh(np.array(targets.devices("h100", 8)).reshape(8, 1), ("fsdp", "tp"))
    on = [NamedSharding(mesh, s) for s in (P("fsdp", None), P(None, "fsdp", None), P("fsdp"))]
    shapes = [(4096, 1024), (4, 1024, 1024), (8192,)]
    one = NamedSharding(mesh, P())
    scalar = [jax.ShapeDtypeStruct((), t, sharding=one) for t in (jnp.float32, jnp.bool_)]

    def compiled(idx):
        d = [jax.ShapeDtypeStruct(shapes[i], jnp.float32, sharding=on[i]) for i in idx]
        return _encode_bucket.lower(d, d, *scalar, mode=mode, chunk=4096, placed=tuple(on[i] for i in idx)).compile()

    for i in range(2):  # a bucket of its own
        c, n = compiled([i]), int(np.prod(shapes[i]))
        assert "all-gather" not in c.as_text()
        assert c.memory_analysis().temp_size_in_bytes < 4 * (4 * n / 8)
        assert c.output_shardings[1][0].is_equivalent_to(on[i], len(shapes[i]))
        sections = sum(int(np.prod(s.shape)) * s.dtype.itemsize for s in jax.tree.leaves(c.out_info[0]))
        assert sections < n * {"top1of4": 0.15, "int1": 0.13}.get(mode, 0.05)
    c, n = compiled([0, 1, 2]), sum(int(np.prod(s)) for s in shapes)
    assert [r.is_equivalent_to(o, len(s)) for r, o, s in zip(c.output_shardings[1], on, shapes)] == [True] * 3
    assert c.memory_analysis().temp_size_in_bytes < 1.5 * 4 * n  # about the bucket, gathered once
