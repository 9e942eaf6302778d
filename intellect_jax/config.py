"""The training run's typed config: TOML file + `--section.key value` overrides (tyro).

Every section is a frozen pydantic model with `extra="forbid"`: an unknown key or a wrong type
fails with one line naming it.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, NonNegativeInt, PositiveFloat, PositiveInt, ValidationError

from intellect_jax.data.config import DataConfig
from intellect_jax.diloco.config import DilocoConfig
from intellect_jax.model.config import ConfigError, DType, ModelConfig
from intellect_jax.trainer.optim import OptimConfig

_FROZEN = ConfigDict(extra="forbid", frozen=True)


class RunConfig(BaseModel):
    model_config = _FROZEN

    name: str = "debug"
    out_dir: str = "runs"
    seed: int = 0
    steps: PositiveInt = 200
    stop_at: PositiveInt | None = None  # end this job early at this step (resume later)
    micro_batch_size: PositiveInt | None = None  # sequences per micro-batch over the node
    log_every: PositiveInt = 1
    eval_every: NonNegativeInt = 0  # 0: evaluate only at the end
    eval_batches: PositiveInt = 4
    progress: bool = True
    peak_tflops: PositiveFloat | None = None  # per device, for MFU; None: known GPUs only
    compile_cache: str | None = "~/.cache/intellect_jax/xla"  # persistent XLA cache (restarts)


class ModelSection(BaseModel):
    """A preset plus optional overrides of any architecture / dtype field."""

    model_config = _FROZEN

    preset: str = "debug"
    init_from: str | None = None  # a Hugging Face Llama dir: architecture + weights to start from
    vocab_size: PositiveInt | None = None
    hidden_size: PositiveInt | None = None
    num_layers: PositiveInt | None = None
    num_heads: PositiveInt | None = None
    num_kv_heads: PositiveInt | None = None
    ffn_size: PositiveInt | None = None
    max_seq_len: PositiveInt | None = None
    rope_theta: PositiveFloat | None = None
    tie_embeddings: bool | None = None
    param_dtype: DType | None = None
    compute_dtype: DType | None = None
    remat: bool | None = None
    scan_unroll: PositiveInt | None = None
    attention_impl: Literal["auto", "xla", "cudnn"] | None = None

    def build(self) -> ModelConfig:
        over = {k: v for k, v in self.model_dump(exclude={"preset", "init_from"}).items() if v is not None}
        if self.init_from:
            from intellect_jax.model.hf import read_hf_config

            return read_hf_config(self.init_from, **over)
        return ModelConfig.preset(self.preset, **over)


class MeshConfig(BaseModel):
    model_config = _FROZEN

    fsdp: int = -1  # -1: all devices not used by tp
    tp: int = 1


class CkptConfig(BaseModel):
    model_config = _FROZEN

    every: NonNegativeInt = 0  # 0: only at the end of the job
    keep: PositiveInt = 3
    async_save: bool = True
    resume: bool = False  # continue from the latest checkpoint in runs/<name>/ckpt


class DistConfig(BaseModel):
    """A node spanning several hosts (jax.distributed); leave empty for one process."""

    model_config = _FROZEN

    coordinator_address: str | None = None  # host:port of process 0
    num_processes: PositiveInt = 1
    process_id: NonNegativeInt = 0
    # a process whose heartbeats stop for this long ends the node's other processes too (JAX's
    # coordination service), so a node that lost a process leaves the DiLoCo run instead of hanging
    heartbeat_timeout: PositiveInt = 100


class TrainConfig(BaseModel):
    model_config = _FROZEN

    run: RunConfig = RunConfig()
    model: ModelSection = ModelSection()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    mesh: MeshConfig = MeshConfig()
    ckpt: CkptConfig = CkptConfig()
    dist: DistConfig = DistConfig()
    diloco: DilocoConfig = DilocoConfig()

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir).expanduser() / self.run.name


def _one_line(e: ValidationError, where: str) -> str:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    return f"{where}: {loc}: {msg}" if loc else f"{where}: {msg}"


def load_toml(path: str | Path) -> TrainConfig:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} not found")
    try:
        raw = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: invalid TOML: {e}") from None
    return validate(raw, where=str(p))


def validate(raw: dict[str, Any], where: str = "config") -> TrainConfig:
    try:
        cfg = TrainConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_one_line(e, where)) from None
    cfg.model.build()  # architecture checks (ConfigError names the field)
    return cfg


def parse_args(argv: list[str] | None = None, description: str = "") -> TrainConfig:
    """`--config FILE` (TOML) then `--section.key value` overrides; `--help` lists them all."""
    import tyro

    argv = list(sys.argv[1:] if argv is None else argv)
    base = TrainConfig()
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise ConfigError("--config needs a TOML file path")
        base = load_toml(argv[i + 1])
        del argv[i : i + 2]
    try:
        cfg, unknown = tyro.cli(TrainConfig, default=base, args=argv, description=description,
                                use_underscores=True, return_unknown_args=True)
    except ValidationError as e:
        raise ConfigError(_one_line(e, "command line")) from None
    if unknown:
        bad = next((a for a in unknown if a.startswith("-")), unknown[0])
        raise ConfigError(f"unknown option {bad} (see --help for the list)")
    cfg.model.build()
    return cfg
