"""`python -m intellect_jax.memory`: compiled per-device memory of a config's real steps."""

import subprocess
import sys

import pytest

from intellect_jax.memory import main
from intellect_jax.model.config import ConfigError

DEBUG = ["--config", "configs/debug.toml", "--devices", "8", "--data.seq_len", "256"]


def test_reports_the_compiled_steps_of_the_config():
    r = main(DEBUG)
    assert r["devices"] == 8 and r["mesh"]["fsdp"] == 8 and r["batch"] == [16, 256]
    tr, ev = r["train"], r["eval"]
    # the train step's arguments are the sharded params + AdamW state the analytic figure counts
    assert tr["arguments_bytes"] == pytest.approx(r["analytic_params_and_opt_bytes"], rel=0.05)
    assert tr["aliased_bytes"] > 0.9 * r["analytic_params_and_opt_bytes"]  # the donated state is reused
    assert ev["arguments_bytes"] < 0.5 * tr["arguments_bytes"]  # eval takes the params only
    assert tr["peak_bytes"] > tr["temporaries_bytes"] > 0
    # what a DiLoCo node holds beside the step, and the two phases the margin is taken over
    d = r["diloco"]
    assert d["held_bytes"]["pseudo_gradient"] == r["params"] * 4 // 8 and d["merge"]["peak_bytes"] > 0
    assert r["node_peak_bytes"] == tr["peak_bytes"] + d["resident_bytes"]
    assert r["eval_node_peak_bytes"] > tr["arguments_bytes"] + d["resident_bytes"] + ev["temporaries_bytes"]
    assert r["margin_bytes"] == r["usable_bytes"] - max(r["node_peak_bytes"], r["eval_node_peak_bytes"])


@pytest.mark.slow
def test_smaller_micro_batches_need_fewer_temporaries():
    whole = main([*DEBUG, "--run.micro_batch_size", "16"])["train"]["temporaries_bytes"]
    parts = main([*DEBUG, "--run.micro_batch_size", "8"])["train"]["temporaries_bytes"]
    assert parts < whole


def test_bad_input_names_the_culprit():
    with pytest.raises(ConfigError, match="run.micro_batch_size"):
        main([*DEBUG, "--run.micro_batch_size", "5"])
    with pytest.raises(ConfigError, match="--devices 16: only 8 cpu devices"):  # jax already started with 8
        main(["--config", "configs/debug.toml", "--devices", "16"])
    p = subprocess.run([sys.executable, "-m", "intellect_jax.memory", "--config", "configs/debug.toml",
                        "--devices", "0"], capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 2 and "--devices 0: one node has 1 to 1024" in p.stderr and p.stdout == ""


def test_a_node_encoding_on_its_devices_counts_its_residuals_and_shifted_start():
    r = main([*DEBUG, "--diloco.mode", "top1", "--diloco.encode", "device", "--diloco.feedback_local", "0.5"])
    held, per_device_fp32 = r["diloco"]["held_bytes"], r["params"] * 4 // 8
    assert held["feedback_residual"] == held["next_residual"] == per_device_fp32
    assert held["shifted_start"] == held["placed_outer"] and held["encode_temporaries"] > 0
    assert "shifted_start" not in main([*DEBUG, "--diloco.mode", "top1", "--diloco.encode", "device"])["diloco"]["held_bytes"]
