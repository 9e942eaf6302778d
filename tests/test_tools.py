"""eval / export / plot tools on a real (tiny) run, and their bad-input errors."""

import json

import numpy as np
import pytest

from intellect_jax import eval as eval_tool
from intellect_jax import export as export_tool
from intellect_jax import plot as plot_tool
from intellect_jax.cli import run_main

from helpers import tiny_cfg

pytestmark = pytest.mark.xdist_group("tools")  # (on one worker: the trained run below is made once)


@pytest.fixture(scope="session")  # (once per worker, however the worker orders its tests)
def run_dir(tmp_path_factory):
    from intellect_jax.trainer.loop import Trainer

    cache = str(tmp_path_factory.mktemp("cache"))
    t = Trainer(tiny_cfg(tmp_path_factory.mktemp("r"), cache, run={"steps": 4, "log_every": 1},
                         ckpt={"every": 2}))
    t.train()
    t.close()
    return t.run_dir


def test_eval_prints_one_json_line(run_dir, tmp_path, capsys):
    text = tmp_path / "held_out.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 40)
    out = eval_tool.main(["--checkpoint", str(run_dir), "--data", str(text)])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(line) == out
    assert out["step"] == 4 and out["tokens"] > 0
    assert out["perplexity"] == pytest.approx(np.exp(out["loss"]))
    early = eval_tool.main(["--checkpoint", str(run_dir), "--data", str(text), "--step", "2"])
    assert early["step"] == 2 and early["loss"] != out["loss"]


def test_a_run_trained_with_cudnn_attention_loads_on_a_cpu(run_dir, tmp_path):
    """The attention kernel is the loading machine's choice: a checkpoint whose config forced
    cuDNN (a GPU run) still loads here for eval and export."""
    import shutil

    from intellect_jax.trainer.load import load_run

    copy = tmp_path / "gpu_run"
    shutil.copytree(run_dir, copy)
    patched = 0
    for f in (copy / "ckpt").rglob("*"):
        if f.is_file() and b'"attention_impl": null' in (raw := f.read_bytes()):
            f.write_bytes(raw.replace(b'"attention_impl": null', b'"attention_impl": "cudnn"'))
            patched += 1
    assert patched  # the stored config was found and now forces cuDNN
    run = load_run(copy)
    assert run.cfg.model.attention_impl == "cudnn" and run.model_cfg.attention_impl == "xla"


def _tree_bytes(root):
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def test_export_loads_in_transformers(run_dir, tmp_path, capsys):
    import torch  # installed in CI: a broken install must fail, not skip
    import transformers
    from intellect_jax.trainer.load import load_run
    from intellect_jax.trainer.step import apply_model

    out = export_tool.main(["--checkpoint", str(run_dir), "--out", str(tmp_path / "hf")])
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tok = transformers.AutoTokenizer.from_pretrained(out)
    run = load_run(run_dir)
    ids = run.tok.encode("Now is the winter of our discontent")
    assert tok("Now is the winter of our discontent", add_special_tokens=False)["input_ids"] == ids
    x = np.asarray([ids], np.int32)
    ours = np.asarray(apply_model(run.graphdef, run.params, x))
    with torch.no_grad():
        theirs = model(torch.tensor(x, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
    # refuses to overwrite; nothing changes
    before = _tree_bytes(out)
    capsys.readouterr()
    assert run_main(lambda: export_tool.main(["--checkpoint", str(run_dir), "--out", str(out)])) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "exists" in err and "overwrite" in err, err
    assert _tree_bytes(out) == before


def test_plot_writes_pngs(run_dir, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figs, real_close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    try:
        paths = plot_tool.main([str(run_dir), "--out", str(tmp_path)])
    finally:
        monkeypatch.undo()
    assert {p.name for p in paths} == {"loss.png", "lr.png", "throughput.png"}
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # what is plotted: the metrics.jsonl columns against their steps
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]

    def col(key):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    try:
        assert len(figs) == len(paths)
        by_name = {p.stem: f for p, f in zip(paths, figs)}
        expect = {"loss": ["loss", "val_loss"], "lr": ["lr"], "throughput": ["tokens_per_s"]}
        for name, keys in expect.items():
            lines = by_name[name].axes[0].get_lines()
            assert len(lines) == len(keys), name
            for line, key in zip(lines, keys):
                steps, values = col(key)
                assert steps, key
                assert list(line.get_xdata()) == steps, key
                np.testing.assert_array_equal(np.asarray(line.get_ydata(), float), values, err_msg=key)
        assert col("loss")[0] == [1, 2, 3, 4] and col("val_loss")[0] == [4]
    finally:
        for f in figs:
            real_close(f)


@pytest.mark.parametrize(
    "tool,argv,needle",
    [
        (eval_tool, ["--checkpoint", "/nonexistent/run", "--data", "x.txt"], "/nonexistent/run"),
        (export_tool, ["--checkpoint", "/nonexistent/run", "--out", "/tmp/x"], "/nonexistent/run"),
        (plot_tool, ["/nonexistent/run"], "metrics.jsonl"),
    ],
)
def test_tools_bad_paths_one_line(tool, argv, needle, capsys):
    assert run_main(lambda: tool.main(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_eval_bad_step_and_data(run_dir, tmp_path, capsys):
    assert run_main(lambda: eval_tool.main(["--checkpoint", str(run_dir), "--data", "x", "--step", "3"])) == 2
    assert "--step 3" in capsys.readouterr().err
    assert run_main(lambda: eval_tool.main(["--checkpoint", str(run_dir), "--data", str(tmp_path / "nope.txt")])) == 2
    assert "nope.txt" in capsys.readouterr().err


@pytest.mark.slow
def test_gpu_check_smoke_on_cpu():
    """The GPU node's first script runs end to end here (debug preset, XLA attention)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
    p = subprocess.run([sys.executable, str(script), "--preset", "debug", "--attention", "xla", "--seq", "128",
                        "--steps", "8"], capture_output=True, text=True, timeout=300, check=False,
                       env={**os.environ, "XLA_FLAGS": ""})
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["ok"] and r["loss_falls"] and r["loss_last"] < r["loss_first"]
    q = r["quantize"]
    assert q["scales_equal"] and q["codes_differing"] == 0 and q["numel"] > 0


def test_plot_draws_several_runs_on_one_axes(tmp_path, monkeypatch):
    """A synchronous and an overlapped DiLoCo node: one utilization line each, labeled by run."""
    import matplotlib.pyplot as plt

    runs = {}
    for mode, util in (("sync", [0.8, 0.82]), ("overlap", [0.99, 0.985])):
        d = tmp_path / mode / "node0"
        d.mkdir(parents=True)
        rows = [{"step": 25 * (i + 1), "utilization": u, "sync_s": 2.0, "overlap_wait_s": 0.1 * i}
                for i, u in enumerate(util)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs[mode] = (d, util)
    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    paths = plot_tool.main([str(runs["sync"][0]), str(runs["overlap"][0]), "--out", str(tmp_path / "png")])
    assert {p.name for p in paths} == {"utilization.png", "sync.png"}
    by_name = {p.stem: f for p, f in zip(paths, figs)}
    lines = by_name["utilization"].axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["sync/node0: compute / (compute + idle)",
                                                    "overlap/node0: compute / (compute + idle)"]
    assert [list(line.get_ydata()) for line in lines] == [runs["sync"][1], runs["overlap"][1]]
    assert len(by_name["sync"].axes[0].get_lines()) == 4  # sync_s and overlap_wait_s of each run


def test_plot_draws_the_goodput_of_a_leasing_node(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    d = tmp_path / "node0"
    d.mkdir()
    rows = [{"step": 5 * (i + 1), "goodput": g, "nodes": 2} for i, g in enumerate([1.0, 0.8, 0.85])]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    paths = plot_tool.main([str(d)])
    fig = figs[[p.name for p in paths].index("goodput.png")]
    assert list(fig.axes[0].get_lines()[0].get_ydata()) == [1.0, 0.8, 0.85]
