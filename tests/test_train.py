"""Inner training: exact resume, schedules, z-loss, grad accumulation, CLI and bad input."""

import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from intellect_jax import config as C
from intellect_jax.model.config import ConfigError
from intellect_jax.trainer.loss import chunk_len, head_loss, row_nll
from intellect_jax.trainer.optim import OptimConfig, make_schedule

from helpers import ref_loss, rows as read_rows, tiny_cfg

def _losses(run_dir):
    return {r["step"]: r["loss"] for r in read_rows(run_dir) if "loss" in r}


@pytest.mark.slow
def test_resume_gives_identical_loss(tmp_path, cache_dir):
    from intellect_jax.trainer.loop import Trainer

    full = Trainer(tiny_cfg(tmp_path / "a", cache_dir))
    full.train()
    full.close()
    ref = _losses(full.run_dir)

    first = Trainer(tiny_cfg(tmp_path / "b", cache_dir, run={"stop_at": 6}))
    first.train()
    assert first.step == 6
    first.close()  # saves step 6 (a forced save at the job's end)
    assert first.ckpt.all_steps() == [6]
    second = Trainer(tiny_cfg(tmp_path / "b", cache_dir, ckpt={"resume": True}))
    assert second.step == 6
    second.train()
    second.close()
    got = _losses(second.run_dir)
    assert sorted(got) == list(range(1, 13))
    for s in range(7, 13):
        assert got[s] == ref[s], (s, got[s], ref[s])  # bit-identical, not approximately
    assert ref[12] < ref[1]


@pytest.mark.slow
def test_train_with_stop_keeps_at_most_one_step_queued(tmp_path, cache_dir):
    """`train(stop=...)` (an overlapped DiLoCo round merging when ready) checks stop() before each
    step with at most one step in flight, even when metrics are rarely logged: otherwise the
    host queues the whole round in a few milliseconds and stop() comes too late to matter. The
    ten calls around steps 2-12 span about a third of a 30-step train (without the bound: 3%)."""
    import time

    from intellect_jax.trainer.loop import Role, Trainer

    t = Trainer(tiny_cfg(tmp_path, cache_dir, run={"steps": 60, "log_every": 1000}), role=Role.INNER)
    t.train(until=2)  # compiled
    calls: list[float] = []
    t0 = time.perf_counter()
    t.train(until=32, stop=lambda: calls.append(time.perf_counter()) or len(calls) > 40)
    wall = time.perf_counter() - t0
    assert t.step == 32 and len(calls) == 30
    assert (calls[12] - calls[2]) / wall > 0.15, (calls[12] - calls[2], wall)
    t.train(until=60, stop=lambda: t.step >= 40)
    assert t.step == 40
    t.close(save=False)


@pytest.mark.slow
def test_throughput_excludes_eval_and_checkpoint_time(tmp_path, cache_dir, monkeypatch):
    """Step time and tokens/s cover the training steps only: evaluations and checkpoints (made
    slow here) never inflate a step's time, and no step right after one reads as a spike."""
    import statistics
    import time

    from intellect_jax.trainer.loop import Trainer

    slow = 0.4
    evaluate, save = Trainer.evaluate, Trainer.save
    monkeypatch.setattr(Trainer, "evaluate", lambda self: (time.sleep(slow), evaluate(self))[1])
    monkeypatch.setattr(Trainer, "save", lambda self, **kw: (time.sleep(slow), save(self, **kw))[1])
    t = Trainer(tiny_cfg(tmp_path, cache_dir, run={"steps": 24, "log_every": 4, "eval_every": 8},
                         ckpt={"every": 8}))
    t0 = time.perf_counter()
    t.train()
    wall = time.perf_counter() - t0
    t.close(save=False)
    rows = read_rows(t.run_dir)
    assert [r["step"] for r in rows] == [1, 4, 8, 12, 16, 20, 24]
    assert [r["step"] for r in rows if "val_loss" in r] == [8, 16, 24]
    assert rows[0]["compile_s"] > 0 and all("compile_s" not in r for r in rows[1:])
    tps = [r["tokens_per_s"] for r in rows[1:]]
    med = statistics.median(tps)
    assert all(med / 4 < v < 4 * med for v in tps), (med, tps)
    for r in rows:  # tokens/s counts the tokens of the steps it covers
        assert r["tokens_per_s"] * r["step_time"] == pytest.approx(8 * 32)
    # the step times add up to the wall time less the 3 evals and 3 checkpoints (2.4 s of sleep)
    stepped = sum(r["step_time"] * (r["step"] - p) for r, p in zip(rows, [0] + [r["step"] for r in rows]))
    assert stepped < wall - 6 * slow, (stepped, wall)
    assert stepped > 0.2 * (wall - 6 * slow - t.compile_s), (stepped, wall)


def test_refuses_to_overwrite_run_without_resume(tmp_path, cache_dir):
    from intellect_jax.trainer.loop import RunDirError, Trainer

    cfg = tiny_cfg(tmp_path, cache_dir, run={"steps": 2})
    t = Trainer(cfg)
    t.train()
    t.close()
    with pytest.raises(RunDirError, match="--ckpt.resume"):
        Trainer(cfg)


def test_grad_accumulation_matches_full_batch(tmp_path, cache_dir, monkeypatch):
    from intellect_jax.trainer.loop import Trainer

    from intellect_jax.trainer import step as T

    made = []
    orig = T.make_train_step
    monkeypatch.setattr(T, "make_train_step", lambda *a, **kw: (made.append(kw["micro_steps"]), orig(*a, **kw))[1])
    a = Trainer(tiny_cfg(tmp_path / "a", cache_dir, run={"steps": 3}))
    b = Trainer(tiny_cfg(tmp_path / "b", cache_dir, run={"steps": 3, "micro_batch_size": 4}))
    assert made == [1, 2]  # b really accumulates over two micro-batches
    ma, mb = a.train(), b.train()
    a.close(save=False)
    b.close(save=False)
    np.testing.assert_allclose(mb["loss"], ma["loss"], rtol=1e-5)
    np.testing.assert_allclose(mb["grad_norm"], ma["grad_norm"], rtol=1e-4)


def test_wsd_sqrt_schedule_values():
    cfg = OptimConfig(lr=1.0, schedule="wsd-sqrt", warmup_steps=10, decay_steps=20, min_lr_ratio=0.0)
    f = make_schedule(cfg, total_steps=100)
    assert float(f(0)) == pytest.approx(0.1)  # step 0 already moves: (0+1)/10
    assert float(f(4)) == pytest.approx(0.5)
    assert float(f(9)) == pytest.approx(1.0)
    assert float(f(50)) == pytest.approx(1.0)
    assert float(f(79)) == pytest.approx(1.0)
    assert float(f(80)) == pytest.approx(1.0)  # cooldown starts at 100 - 20
    assert float(f(85)) == pytest.approx(1 - math.sqrt(5 / 20))
    assert float(f(95)) == pytest.approx(1 - math.sqrt(15 / 20))
    assert float(f(100)) == pytest.approx(0.0, abs=1e-7)
    g = make_schedule(OptimConfig(lr=2.0, schedule="cosine", warmup_steps=0), total_steps=10)
    h = make_schedule(OptimConfig(lr=2.0, schedule="linear", warmup_steps=0), total_steps=10)
    assert float(g(2)) == pytest.approx(1.0 + math.cos(0.2 * math.pi))  # 2 * (1 + cos(pi/5)) / 2
    assert float(h(2)) == pytest.approx(1.6)
    assert float(g(10)) == pytest.approx(0.0, abs=1e-7) and float(h(10)) == pytest.approx(0.0, abs=1e-7)
    floor = make_schedule(OptimConfig(lr=2.0, schedule="linear", warmup_steps=0, min_lr_ratio=0.1), 10)
    assert float(floor(5)) == pytest.approx(0.2 + 1.8 * 0.5) and float(floor(10)) == pytest.approx(0.2)


def test_learning_rate_follows_the_train_states_step(tmp_path, cache_dir):
    """The schedule reads the train state's step, not a counter inside the optimizer state: a
    state adopted with an optimizer state from later in the run (a joiner served by an
    overlapped donor, a node re-registering with an older outer state) trains at its own
    step's learning rate. Here the optimizer state comes from step 12, where the cooldown has
    reached 0; at step 4 the rate is the peak and the params must move."""
    from intellect_jax.diloco.state import host_copy
    from intellect_jax.trainer.loop import Role, Trainer

    t = Trainer(tiny_cfg(tmp_path, cache_dir), role=Role.INNER)
    try:
        t.train()
        assert float(t.schedule(12)) == 0.0
        params, opt = host_copy(t.state.params), host_copy(t.state.opt_state)
        t.set_state(4, params, opt)
        out = t.train(until=5)
        after = host_copy(t.state.params)
    finally:
        t.close(save=False)
    assert float(out["lr"]) == pytest.approx(float(t.schedule(4))) and float(t.schedule(4)) > 0
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(params)))
    assert moved > 0.1 * float(t.schedule(4)), moved  # Adam moves each value by about lr


def test_z_loss_hand_computed():
    logits = jnp.array([[[1.0, 2.0, 0.0], [3.0, -1.0, 0.5]]])  # B=1, L=2, V=3
    targets = jnp.array([[1, 0]])
    total, aux = head_loss(logits, jnp.eye(3), targets, z_weight=0.5)  # x @ I = the logits
    lse0 = math.log(math.e**1 + math.e**2 + 1)
    lse1 = math.log(math.e**3 + math.e**-1 + math.e**0.5)
    ce = ((lse0 - 2.0) + (lse1 - 3.0)) / 2
    z = (2.0**2 + 3.0**2) / 2  # mean of squared max logits = 6.5
    assert float(aux["ce"]) == pytest.approx(ce, rel=1e-6)
    assert float(aux["z"]) == pytest.approx(6.5)
    assert float(total) == pytest.approx(ce + 0.5 * z, rel=1e-6)


@pytest.mark.parametrize("chunk", [1, pytest.param(4, marks=pytest.mark.slow), 12])
def test_fused_head_loss_matches_logits_path(chunk):
    """head_loss == the reference on x @ w: value, aux and gradients, including cotangents on
    the aux outputs (differentiating ce alone or z alone) and a bf16 input."""
    kx, kw, kt = jax.random.split(jax.random.key(0), 3)
    B, L, D, V = 3, 12, 16, 50
    x = jax.random.normal(kx, (B, L, D))
    w = 0.5 * jax.random.normal(kw, (D, V))
    t = jax.random.randint(kt, (B, L), 0, V)
    zw = 0.05

    def ref(x, w):
        return ref_loss(jnp.einsum("bld,dv->blv", x, w), t, zw)

    def fused(x, w):
        return head_loss(x, w, t, zw, chunk=chunk)

    (v0, a0), (v1, a1) = ref(x, w), fused(x, w)
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    for k in ("ce", "z"):
        np.testing.assert_allclose(a1[k], a0[k], rtol=1e-6)
    picks = {"total": lambda r: r[0], "ce": lambda r: r[1]["ce"], "z": lambda r: r[1]["z"],
             "mix": lambda r: 2.0 * r[0] - 3.0 * r[1]["ce"] + 0.7 * r[1]["z"]}
    for name, pick in picks.items():
        g0 = jax.grad(lambda x, w: pick(ref(x, w)), argnums=(0, 1))(x, w)
        g1 = jax.jit(jax.grad(lambda x, w: pick(fused(x, w)), argnums=(0, 1)))(x, w)
        for a, b in zip(g1, g0):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-7, err_msg=name)
    gb = jax.grad(lambda x: fused(x, w)[0])(x.astype(jnp.bfloat16))
    assert gb.dtype == jnp.bfloat16
    np.testing.assert_allclose(gb.astype(jnp.float32), jax.grad(lambda x: ref(x, w)[0])(x), atol=2e-3)


@pytest.mark.parametrize("chunk", [1, 5, None])
def test_row_nll_matches_the_reference(chunk):
    kx, kw, kt = jax.random.split(jax.random.key(1), 3)
    B, L, D, V = 4, 10, 8, 37
    x, w = jax.random.normal(kx, (B, L, D)), jax.random.normal(kw, (D, V))
    t = jax.random.randint(kt, (B, L), 0, V)
    logits = jnp.einsum("bld,dv->blv", x, w)
    want = jnp.sum(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, t[..., None], -1)[..., 0], axis=1)
    np.testing.assert_allclose(row_nll(x, w, t, chunk=chunk), want, rtol=1e-5)
    assert np.mean(row_nll(x, w, t)) / L == pytest.approx(float(ref_loss(logits, t)[1]["ce"]), rel=1e-5)


def test_eval_never_builds_the_logits():
    """A long-sequence, large-vocabulary eval: the compiled eval step needs over 10x less memory
    than evaluating through the [B, L, V] logits did."""
    from intellect_jax.model.config import ModelConfig
    from intellect_jax.model.llama import abstract
    from intellect_jax.trainer import step as T

    cfg = ModelConfig.preset("debug", compute_dtype="float32", vocab_size=131072, max_seq_len=512,
                             hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, ffn_size=128)
    graphdef, params = abstract(cfg)
    params = nnx.to_pure_dict(params)
    tok = jax.ShapeDtypeStruct((4, 513), jnp.int32)

    def old_eval(params, tok_BxL1):  # what evaluation did before: the whole logits
        logits = T.apply_model(graphdef, params, tok_BxL1[:, :-1]).astype(jnp.float32)
        tgt = jnp.take_along_axis(logits, tok_BxL1[:, 1:, None], -1)[..., 0]
        return jnp.sum(jax.nn.logsumexp(logits, -1) - tgt, axis=1)

    def temp_bytes(fn):
        return jax.jit(fn).lower(params, tok).compile().memory_analysis().temp_size_in_bytes

    new, old = temp_bytes(T.make_eval_step(graphdef)), temp_bytes(old_eval)
    assert old > 1e9 and new * 10 < old, (new, old)  # 4 x 512 x 131072 fp32 logits = 1 GiB


def test_chunk_len():
    assert chunk_len(16, 128, 4096) == 16  # 16 x 16 x 4096 = 2^20 logits
    assert chunk_len(1, 8192, 128256) == 8  # Llama-3 vocab: 8 tokens per chunk, 4 MB
    assert chunk_len(4, 33, 10**7) == 1  # nothing fits: one token per chunk
    assert chunk_len(2, 33, 10) == 33


def test_toml_unknown_key_and_bad_type(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[optim]\nlrr = 1.0\n")
    with pytest.raises(ConfigError, match=r"optim\.lrr: unknown key"):
        C.load_toml(p)
    p.write_text("[data]\nseq_len = 'long'\n")
    with pytest.raises(ConfigError, match=r"data\.seq_len"):
        C.load_toml(p)
    p.write_text("[model]\npreset = 'debug'\nnum_kv_heads = 3\n")
    with pytest.raises(ConfigError, match="num_kv_heads"):
        C.load_toml(p)


def test_all_shipped_configs_validate():
    root = os.path.join(os.path.dirname(__file__), "..", "configs")
    names = sorted(f for f in os.listdir(root) if f.endswith(".toml"))
    assert {"debug.toml", "150m.toml", "1b.toml", "10b.toml"} <= set(names)
    for name in names:
        C.load_toml(os.path.join(root, name))
    ten = C.load_toml(os.path.join(root, "10b.toml"))
    assert (ten.optim.lr, ten.optim.warmup_steps, ten.optim.z_loss_weight) == (7.5e-5, 1000, 2e-4)
    assert (ten.data.seq_len, ten.data.batch_size, ten.optim.schedule) == (8192, 128, "wsd-sqrt")


def _cli(*args, cwd=None):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    return subprocess.run([sys.executable, "-m", "intellect_jax.train", *args], capture_output=True,
                          text=True, timeout=300, env=env, cwd=cwd)


@pytest.mark.slow
def test_cli_rejects_bad_key_naming_it():
    r = _cli("--optim.lrr", "1e-3")
    assert r.returncode != 0
    assert "--optim.lrr" in r.stderr + r.stdout
    r = _cli("--optim.lr", "fast")
    assert r.returncode != 0 and "--optim.lr" in r.stderr + r.stdout


def test_cli_help_lists_options():
    r = _cli("--help")
    assert r.returncode == 0
    for opt in ("--run.steps", "--optim.lr", "--data.seq_len", "--ckpt.resume", "--model.preset"):
        assert opt in r.stdout, opt


def _main(argv, capsys):
    from intellect_jax import train
    from intellect_jax.cli import run_main

    code = run_main(lambda: train.main(argv))
    return code, capsys.readouterr().err.strip()


def _base_argv(tmp_path, cache_dir):
    return ["--run.out_dir", str(tmp_path / "runs"), "--run.name", "bad", "--run.steps", "2",
            "--run.no-progress", "--data.cache_dir", cache_dir, "--data.seq_len", "32",
            "--data.batch_size", "8", "--data.bpe_vocab_size", "1024"]


@pytest.mark.parametrize(
    "case", ["missing_path", "empty_corpus", "too_short", "vocab_too_big", "unwritable_run_dir"]
)
def test_bad_input_one_line_error_nothing_written(case, tmp_path, cache_dir, capsys):
    argv = _base_argv(tmp_path, cache_dir)
    if case == "missing_path":
        argv += ["--data.sources.0.path", str(tmp_path / "no_such_dir")]
        needle = "no_such_dir"
    elif case == "empty_corpus":
        (tmp_path / "empty.txt").write_text("")
        argv += ["--data.sources.0.path", str(tmp_path / "empty.txt")]
        needle = "empty.txt"
    elif case == "too_short":
        (tmp_path / "short.txt").write_text("Brevity is the soul of wit.")
        argv += ["--data.sources.0.path", str(tmp_path / "short.txt")]
        needle = "short.txt"
    elif case == "vocab_too_big":
        argv += ["--model.vocab_size", "512"]
        needle = "vocab"
    else:
        (tmp_path / "afile").write_text("x")
        argv[1] = str(tmp_path / "afile" / "runs")
        needle = "afile"
    code, err = _main(argv, capsys)
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err
    assert not (tmp_path / "runs").exists()  # nothing written, not even the run directory
    if case == "unwritable_run_dir":
        assert (tmp_path / "afile").read_text() == "x"
