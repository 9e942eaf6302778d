"""The run config: every model field from TOML and the command line, booleans as true/false."""

import pytest

from intellect_jax import config as C
from intellect_jax.model.config import PRESETS, ConfigError, ModelConfig

# A value for every ModelConfig field, each unlike the debug preset's. Adding a field to
# ModelConfig fails `test_every_model_field_has_a_value_here` until it is added (and checked) here.
MODEL = {
    "vocab_size": 2048, "hidden_size": 96, "num_layers": 3, "num_heads": 8, "num_kv_heads": 4,
    "ffn_size": 200, "head_dim": 32, "rope_theta": 1e5, "rope_scaling": {"factor": 4.0},
    "max_seq_len": 512, "tie_embeddings": True, "norm_eps": 1e-6, "init_std": 0.01,
    "param_dtype": "bfloat16", "compute_dtype": "float32", "remat": True, "scan_unroll": 2,
    "attention_impl": "xla", "head_chunk_logits": 65536,
}


def _argv(values: dict) -> list[str]:
    out: list[str] = []
    for k, v in sorted(values.items(), key=lambda kv: isinstance(kv[1], dict)):
        if isinstance(v, dict):  # a model that may be None: tyro's subcommand then its keys (last)
            out.append(f"model.{k}:{k}")
            out += [a for kk, vv in v.items() for a in (f"--model.{k}.{kk}", str(vv))]
        else:
            out += [f"--model.{k}", str(v).lower() if isinstance(v, bool) else str(v)]
    return out


def _check(m: ModelConfig) -> None:
    debug = ModelConfig.preset("debug")
    for k, v in MODEL.items():
        got = getattr(m, k)
        got = got.model_dump(include=set(v)) if isinstance(v, dict) else got
        assert got == v and got != getattr(debug, k), k


def test_every_model_field_has_a_value_here():
    assert set(MODEL) == set(ModelConfig.model_fields)
    assert set(ModelConfig.model_fields) | {"preset", "init_from"} == set(C.ModelSection.model_fields)


def test_every_model_field_set_from_toml(tmp_path):
    toml = "[model]\npreset = \"debug\"\n" + "".join(
        f"{k} = {str(v).lower() if isinstance(v, bool) else repr(v)}\n" for k, v in MODEL.items() if not isinstance(v, dict)
    ) + "[model.rope_scaling]\nfactor = 4.0\n"
    p = tmp_path / "m.toml"
    p.write_text(toml)
    _check(C.load_toml(p).model.build())


def test_every_model_field_set_from_the_command_line(tmp_path):
    _check(C.parse_args(_argv(MODEL)).model.build())
    # on top of a TOML file: the file's values stay unless overridden
    p = tmp_path / "m.toml"
    p.write_text("[model]\nhead_dim = 64\nnorm_eps = 1e-4\n[model.rope_scaling]\nfactor = 2.0\n")
    m = C.parse_args(["--config", str(p), "--model.head_dim", "32"]).model.build()
    assert (m.head_dim, m.norm_eps, m.rope_scaling.factor, m.num_layers) == (32, 1e-4, 2.0, PRESETS["debug"]["num_layers"])


@pytest.mark.parametrize("key,value,msg", [
    ("num_heads", 0, "greater than 0"), ("num_heads", "four", "valid integer"), ("head_dim", 2.5, "valid integer"),
    ("norm_eps", -1.0, "greater than 0"), ("attention_impl", "flash", "'auto', 'xla' or 'cudnn'"),
    ("rope_scaling", {"factor": 0}, "greater than 0"),
])
def test_bad_model_value_from_toml_names_the_field(key, value, msg):
    with pytest.raises(ConfigError, match=f"^config: model\\.{key}.*: .*{msg}") as e:
        C.validate({"model": {key: value}})
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="^model: head_dim .31. must be even"):  # the architecture check
        C.validate({"model": {"head_dim": 31}})


def test_bad_model_value_on_the_command_line_names_the_field():
    with pytest.raises(ConfigError, match="^--model.num_heads: Input should be greater than 0, got '0'$"):
        C.parse_args(["--model.num_heads", "0"])
    with pytest.raises(ConfigError, match="num_heads .3."):  # the architecture check: one line
        C.parse_args(["--model.num_heads", "3"])


@pytest.mark.parametrize("argv,flag", [
    (["--run.steps", "x"], "--run.steps"), (["--run.steps=-1"], "--run.steps"),
    (["--optim.lr", "abc"], "--optim.lr"), (["--diloco.mode", "int3"], "--diloco.mode"),
    (["--model.rope_theta", "0"], "--model.rope_theta"), (["--data.seq_len", "1.5"], "--data.seq_len"),
])
def test_a_wrong_type_or_range_on_the_command_line_is_one_line_naming_the_flag(argv, flag, capsys):
    from intellect_jax.cli import run_main

    assert run_main(lambda: C.parse_args(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {flag}: "), err


def test_good_values_pass_the_check_unchanged():
    cfg = C.parse_args(["--run.steps=7", "--model.head_dim", "None", "--model.rope_theta", "1e4",
                        "--run.name", "12", "--diloco.mode", "fp32"])
    assert (cfg.run.steps, cfg.model.head_dim, cfg.model.rope_theta, cfg.run.name, cfg.diloco.mode) == (
        7, None, 1e4, "12", "fp32")


# ---- booleans -----------------------------------------------------------------------------------
def test_plain_and_optional_booleans_take_true_and_false():
    for words, want in ((["true"], True), (["TRUE"], True), (["false"], False), (["False"], False), ([], True)):
        assert C.parse_args(["--ckpt.resume", *words]).ckpt.resume is want, words
    assert C.parse_args(["--ckpt.resume=true"]).ckpt.resume is True
    assert C.parse_args(["--ckpt.async_save", "false"]).ckpt.async_save is False
    assert C.parse_args(["--run.no_progress", "false"]).run.progress is True  # the negated flag, negated
    assert C.parse_args(["--run.no-progress"]).run.progress is False
    for word, want in (("true", True), ("false", False), ("True", True), ("None", None)):
        assert C.parse_args(["--diloco.overlap", word]).diloco.overlap is want, word
    assert C.parse_args(["--diloco.overlap=false", "--run.steps", "7"]).diloco.overlap is False


def test_every_boolean_option_takes_true_and_false():
    bools = C._bool_options(C.TrainConfig)
    assert {("ckpt", "resume"), ("diloco", "overlap"), ("model", "remat")} <= set(bools)
    for path in bools:
        flag = "--" + ".".join("0" if p == "*" else p for p in path)
        for word, want in (("true", True), ("false", False)):
            cfg = C.parse_args([flag, word])
            got = cfg
            for p in path:
                got = got[0] if p == "*" else getattr(got, p)
            assert got is want, (flag, word)


@pytest.mark.parametrize("argv,flag", [(["--diloco.overlap", "maybe"], "--diloco.overlap"),
                                       (["--ckpt.resume", "yes"], "--ckpt.resume"),
                                       (["--model.remat=1"], "--model.remat")])
def test_a_bad_boolean_fails_in_one_line_naming_the_flag(argv, flag):
    with pytest.raises(ConfigError) as e:
        C.parse_args(argv)
    msg = str(e.value)
    assert msg.startswith(f"{flag}: expected true or false") and "\n" not in msg, msg
