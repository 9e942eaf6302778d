"""The training run's typed config: TOML file + `--section.key value` overrides (tyro).

Every section is a frozen pydantic model with `extra="forbid"`: an unknown key or a wrong type
fails with one line naming it.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    TypeAdapter,
    ValidationError,
    create_model,
)

from intellect_jax.data.config import DataConfig
from intellect_jax.diloco.config import DilocoConfig
from intellect_jax.model.config import ConfigError, ModelConfig
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
    # share of each GPU's memory JAX's allocator may take (XLA_PYTHON_CLIENT_MEM_FRACTION, when
    # that is not set already); JAX's own default is 0.75. `python -m intellect_jax.memory`
    # checks the compiled steps against this share less a reserve.
    gpu_mem_fraction: float = Field(default=0.90, gt=0.0, le=1.0)


class _ModelSection(BaseModel):
    """A preset (or a Hugging Face dir) plus optional overrides of any architecture / dtype field."""

    model_config = _FROZEN

    preset: str = "debug"
    init_from: str | None = None  # a Hugging Face Llama dir: architecture + weights to start from

    def build(self) -> ModelConfig:
        over = {k: v for k in ModelConfig.model_fields if (v := getattr(self, k)) is not None}
        if self.init_from:
            from intellect_jax.model.hf import read_hf_config

            return read_hf_config(self.init_from, **over)
        return ModelConfig.preset(self.preset, **over)


def _model_section() -> type[_ModelSection]:
    """`[model]` adds to its own keys an optional override of every `ModelConfig` field, with
    that field's type and constraints (None: the preset's value). Derived, not copied, so that
    a field added to `ModelConfig` can be set in TOML and on the command line at once."""
    fields: dict[str, Any] = {}
    for name, f in ModelConfig.model_fields.items():
        assert name not in _ModelSection.model_fields, f"ModelConfig.{name} clashes with a [model] key"
        typ = Annotated[(f.annotation, *f.metadata)] if f.metadata else f.annotation
        fields[name] = (Optional[typ], Field(None, description=f.description))
    return create_model("ModelSection", __base__=_ModelSection, __module__=__name__,
                        __doc__=_ModelSection.__doc__, **fields)


ModelSection = _model_section()


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


_TRUE, _FALSE = "true", "false"


def _bool_options(model: type[BaseModel], path: tuple[str, ...] = ()) -> dict[tuple[str, ...], bool]:
    """Every boolean option under ``model`` by its key path (``*``: any list index), mapped to
    whether it is optional (``bool | None``: tyro takes a value) or plain (tyro: a flag)."""
    out: dict[tuple[str, ...], bool] = {}
    for name, f in model.model_fields.items():
        t, key = f.annotation, (*path, name)
        args = get_args(t)
        if t is bool or set(args) == {bool, type(None)}:
            out[key] = t is not bool
        elif isinstance(t, type) and issubclass(t, BaseModel):
            out |= _bool_options(t, key)
        elif get_origin(t) in (list, tuple) and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            out |= _bool_options(args[0], (*key, "*"))
    return out


def _bool_values(argv: list[str]) -> list[str]:
    """Boolean options take ``true``/``false`` (any case, as in TOML) on the command line too:
    ``--ckpt.resume true``, ``--diloco.overlap=false``, ``--run.no_progress false``. Rewritten
    into tyro's forms (a flag for a plain bool, ``True``/``False``/``None`` for an optional one);
    a bare flag still works. Any other value is refused in one line naming the option."""
    bools = _bool_options(TrainConfig)
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        flag, eq, value = arg.partition("=")
        *head, last = flag.removeprefix("--").split(".")
        neg = last.startswith(("no_", "no-"))
        key = tuple("*" if p.isdigit() else p for p in head)
        optional = bools.get((*key, last))
        if not arg.startswith("--") or (optional is None and not (neg and bools.get((*key, last[3:])) is False)):
            out.append(arg)
            continue
        if not eq:
            if i == len(argv) or argv[i].startswith("-"):
                out.append(arg)  # a bare flag (an optional bool without a value: tyro says so)
                continue
            value, i = argv[i], i + 1
        v = value.lower()
        if v not in (_TRUE, _FALSE) and not (optional and v == "none"):
            raise ConfigError(f"{flag}: expected true or false, got {value!r}")
        if optional:
            out += [flag, v.capitalize()]
        else:
            on = (v == _TRUE) != neg
            name = last[3:] if neg else last
            out.append("--" + ".".join([*head, name if on else f"no_{name}"]))
    return out


def _scalar_options(model: type[BaseModel], path: str = "") -> dict[str, tuple[TypeAdapter, bool]]:
    """Every non-boolean scalar option (number, string, choice) by its flag, with a validator of
    its type and constraints and whether it may be None."""
    out: dict[str, tuple[TypeAdapter, bool]] = {}
    for name, f in model.model_fields.items():
        t, flag = f.annotation, f"{path}.{name}" if path else f"--{name}"
        args = get_args(t)
        optional = type(None) in args
        inner = [a for a in args if a is not type(None)] if optional else [t]
        base = get_args(inner[0])[0] if get_origin(inner[0]) is Annotated else inner[0]
        if isinstance(base, type) and issubclass(base, BaseModel):
            out |= _scalar_options(base, flag)
        elif len(inner) == 1 and base is not bool and (base in (int, float, str) or get_origin(base) is Literal):
            out[flag] = TypeAdapter(Annotated[inner[0], *f.metadata] if f.metadata else inner[0]), optional
    return out


def _check_values(argv: list[str]) -> None:
    """A scalar option's value is checked against its field before tyro sees it, so that a wrong
    type or a value out of range is one line naming the option (tyro would print a box)."""
    scalars = _scalar_options(TrainConfig)
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag not in scalars or (not eq and i + 1 == len(argv)):
            continue
        value = value if eq else argv[i + 1]
        check, optional = scalars[flag]
        if optional and value == "None":
            continue
        try:
            check.validate_python(value)
        except ValidationError as e:
            raise ConfigError(f"{flag}: {e.errors()[0]['msg'].removeprefix('Value error, ')}, got {value!r}") from None


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
    argv = _bool_values(argv)
    _check_values(argv)
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
