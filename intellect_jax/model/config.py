"""The one model config: frozen, validated, with parameter/FLOP counts and HF conversion.

Every preset lives in `PRESETS` at the bottom of this file.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, PositiveFloat, PositiveInt, model_validator

DType = Literal["float32", "bfloat16", "float16"]


class ConfigError(ValueError):
    """A config value is wrong; the message names the field."""


class RopeScaling(BaseModel):
    """Llama-3.1 RoPE frequency scaling (HF `rope_type: llama3`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    factor: PositiveFloat = 8.0
    low_freq_factor: PositiveFloat = 1.0
    high_freq_factor: PositiveFloat = 4.0
    original_max_position_embeddings: PositiveInt = 8192

    @model_validator(mode="after")
    def _check(self) -> RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("rope_scaling.high_freq_factor must be > low_freq_factor")
        return self


class ModelConfig(BaseModel):
    """Llama-3 architecture. Frozen and hashable, so it can be a static jit argument."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: PositiveInt
    hidden_size: PositiveInt
    num_layers: PositiveInt
    num_heads: PositiveInt
    num_kv_heads: PositiveInt
    ffn_size: PositiveInt
    head_dim: PositiveInt | None = None  # default: hidden_size // num_heads
    rope_theta: PositiveFloat = 500_000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: PositiveInt = 8192
    tie_embeddings: bool = False
    norm_eps: PositiveFloat = 1e-5
    init_std: PositiveFloat = 0.02
    param_dtype: DType = "float32"
    compute_dtype: DType = "bfloat16"
    remat: bool = False
    # layers per iteration of the scan over the blocks: 1 compiles one layer and keeps one
    # layer's temporaries (large models); a tiny model on CPU runs ~8% faster fully unrolled
    scan_unroll: PositiveInt = 1
    # "auto": cuDNN's fused (flash) attention on GPUs where it takes the shape, XLA's elsewhere;
    # resolved once per node by `on_platform`, before anything is traced
    attention_impl: Literal["auto", "xla", "cudnn"] = "auto"
    # logits per chunk of the fused output projection + loss (trainer.loss); None: resolved by
    # `on_platform` (HEAD_CHUNK_LOGITS: small on CPU, where cache matters; large on GPUs, where a
    # small chunk re-reads the whole [D, V] weight and its fp32 gradient per chunk)
    head_chunk_logits: PositiveInt | None = None

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads "
                f"({self.num_heads}), or set head_dim"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.dim_head % 2:
            raise ValueError(f"head_dim ({self.dim_head}) must be even for RoPE")
        return self

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def cudnn_attention_fits(self) -> str | None:
        """Why cuDNN's fused attention cannot take this model's attention (None: it can).
        Its conditions for a causal bf16/fp16 attention without bias (as jax checks them): the
        head dim a multiple of 8 and at most 128 (256 on Hopper; 128 is what every GPU takes)."""
        if self.compute_dtype not in ("bfloat16", "float16"):
            return f"compute_dtype {self.compute_dtype} (cuDNN's fused attention takes bfloat16 or float16)"
        if self.dim_head % 8 or self.dim_head > 128:
            return f"head_dim {self.dim_head} (cuDNN's fused attention takes multiples of 8 up to 128)"
        return None

    def on_platform(self, platform: str, capability: str | None = None) -> ModelConfig:
        """This config with its per-platform choices resolved for the devices, once per node
        before anything is traced. ``platform``: "cpu", "gpu" or "cuda" (a compile-only GPU);
        ``capability``: an NVIDIA GPU's compute capability ("9.0"; None elsewhere, ROCm too).
        ``attention_impl`` "auto" is "cudnn" on an NVIDIA GPU of compute capability 8.0 or more
        (cuDNN's flash attention needs Ampere) where :meth:`cudnn_attention_fits`, else "xla";
        an explicit "cudnn" that cannot run here is an error naming why. An unset
        ``head_chunk_logits`` takes the platform's :data:`HEAD_CHUNK_LOGITS`."""
        gpu = platform in ("gpu", "cuda")
        why = (f"the devices are {platform}" if not gpu else
               f"compute capability {capability or 'unknown'} (cuDNN's fused attention needs an NVIDIA GPU of 8.0 "
               "or more)" if _capability(capability) < (8, 0) else self.cudnn_attention_fits())
        impl = self.attention_impl
        if impl == "cudnn" and why:
            raise ConfigError(f"model.attention_impl = \"cudnn\" cannot run here: {why}")
        if impl == "auto":
            impl = "xla" if why else "cudnn"
        chunk = self.head_chunk_logits or HEAD_CHUNK_LOGITS["gpu" if gpu else "cpu"]
        return self.model_copy(update={"attention_impl": impl, "head_chunk_logits": chunk})

    @classmethod
    def create(cls, **kw: Any) -> ModelConfig:
        """Build and validate; raise `ConfigError` with a one-line message naming the field."""
        from pydantic import ValidationError

        try:
            return cls(**kw)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            raise ConfigError(f"model.{loc}: {msg}" if loc else f"model: {msg}") from None

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        if name not in PRESETS:
            raise ConfigError(f"model preset {name!r} unknown; choose from {sorted(PRESETS)}")
        return cls.create(**{**PRESETS[name], **overrides})

    # ---- counts -------------------------------------------------------------------------
    def num_params(self, *, embedding: bool = True) -> int:
        """Parameter count; `embedding=False` leaves out the input embedding table."""
        D, F, H = self.hidden_size, self.ffn_size, self.dim_head
        attn = D * self.num_heads * H * 2 + D * self.num_kv_heads * H * 2
        per_layer = attn + 3 * D * F + 2 * D
        emb = self.vocab_size * D
        head = 0 if self.tie_embeddings else self.vocab_size * D
        total = self.num_layers * per_layer + D + head + (emb if embedding else 0)
        if not embedding and self.tie_embeddings:
            total += emb  # the tied table is still used as the output projection
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), PaLM appendix B convention.

        6 x (matmul parameters) + 12 x layers x heads x head_dim x seq_len (attention scores,
        not halved for the causal mask).
        """
        n_matmul = self.num_params(embedding=False) - (2 * self.num_layers + 1) * self.hidden_size
        attn = 12 * self.num_layers * self.num_heads * self.dim_head * seq_len
        return 6.0 * n_matmul + attn

    def fingerprint(self) -> str:
        """Hash of the architecture (not of dtypes/remat), to refuse mismatched DiLoCo peers."""
        arch = self.model_dump(exclude={"param_dtype", "compute_dtype", "remat", "scan_unroll", "attention_impl",
                                        "head_chunk_logits"})
        return hashlib.blake2b(json.dumps(arch, sort_keys=True).encode(), digest_size=8).hexdigest()

    # ---- Hugging Face ---------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any], **overrides: Any) -> ModelConfig:
        """From a `LlamaForCausalLM` config.json dict."""
        if hf.get("model_type", "llama") != "llama":
            raise ConfigError(f"config.json model_type {hf.get('model_type')!r} is not 'llama'")
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        rs = hf.get("rope_scaling") or hf.get("rope_parameters") or None
        if rs is not None:
            kind = rs.get("rope_type", rs.get("type"))
            if kind == "default":
                rs = None
            elif kind != "llama3":
                raise ConfigError(f"config.json rope_scaling type {kind!r} is not supported")
            else:
                rs = {"original_max_position_embeddings": hf.get("max_position_embeddings", 8192), **rs}
                rs = {k: rs[k] for k in RopeScaling.model_fields if k in rs}
        theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 1e4)
        kw = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            ffn_size=hf["intermediate_size"],
            head_dim=None if head_dim * heads == hf["hidden_size"] else head_dim,
            rope_theta=theta,
            rope_scaling=rs,
            max_seq_len=hf.get("max_position_embeddings", 8192),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            norm_eps=hf.get("rms_norm_eps", 1e-5),
            init_std=hf.get("initializer_range", 0.02),
        )
        return cls.create(**{**kw, **overrides})

    def to_hf(self, *, bos_id: int | None = None, eos_id: int | None = None) -> dict[str, Any]:
        """A `LlamaForCausalLM` config.json dict (weights exported in float32)."""
        rs = None
        if self.rope_scaling is not None:
            rs = {"rope_type": "llama3", **self.rope_scaling.model_dump()}
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.ffn_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.dim_head,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_seq_len,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rs,
            "tie_word_embeddings": self.tie_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "initializer_range": self.init_std,
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
            "torch_dtype": "float32",
        }


def _capability(cc: str | None) -> tuple[int, int]:
    """"9.0" -> (9, 0); anything else (None, a ROCm "gfx90a") -> (0, 0)."""
    m = re.fullmatch(r"(\d+)\.(\d+)", cc or "")
    return (int(m[1]), int(m[2])) if m else (0, 0)


# logits per chunk of the fused head + loss. CPU: 2^20 (4 MiB of fp32), measured fastest there.
# GPU: 2^28 (1 GiB of fp32 over the node): every chunk reads the [D, V] head weight twice and
# reads and writes its fp32 gradient, so a chunk needs about 2,000 tokens before its matmuls,
# not that traffic, set its time on an H100; with 2^20 the 1b step ran at 7% MFU there.
HEAD_CHUNK_LOGITS = {"cpu": 1 << 20, "gpu": 1 << 28}

_LLAMA3 = dict(vocab_size=128_256, rope_theta=500_000.0, norm_eps=1e-5)

PRESETS: dict[str, dict[str, Any]] = {
    # ~1.8M params: trains on 2 CPU cores in minutes; vocab matches the bundled BPE tokenizer.
    "debug": dict(
        vocab_size=4096, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
        ffn_size=384, rope_theta=10_000.0, max_seq_len=1024,
    ),
    "150m": dict(
        **_LLAMA3, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4,
        ffn_size=2048, max_seq_len=2048, tie_embeddings=True,
    ),
    # Llama-3.2-1B shape.
    "1b": dict(
        **_LLAMA3, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
        ffn_size=8192, max_seq_len=8192, tie_embeddings=True,
    ),
    "llama3-8b": dict(
        **_LLAMA3, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        ffn_size=14336, max_seq_len=8192,
    ),
    # INTELLECT-1 exactly as trained: ~10.2B parameters.
    "intellect-1-10b": dict(
        **_LLAMA3, hidden_size=4096, num_layers=42, num_heads=32, num_kv_heads=8,
        ffn_size=14336, max_seq_len=8192, tie_embeddings=False,
    ),
}
