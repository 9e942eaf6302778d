"""Slow multi-process tests: a node spanning 2 host processes; SIGKILL during an async save."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import TINY_ARGS, free_port, rows

pytestmark = pytest.mark.processes


def _args(out_dir, cache, name, steps, *extra):
    return [
        sys.executable, "-m", "intellect_jax.train", "--run.name", name, "--run.out_dir", str(out_dir),
        "--run.steps", str(steps), "--run.log_every", "1", "--run.no-progress", "--run.eval_batches", "1",
        *TINY_ARGS, "--data.batch_size", "8", "--data.cache_dir", str(cache), "--optim.lr", "3e-3",
        "--optim.warmup_steps", "2", *extra,
    ]


def _env(devices: int) -> dict:
    return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                JAX_PLATFORMS="cpu")


def _losses(run_dir):
    return [r["loss"] for r in rows(run_dir)]


def test_two_hosts_times_four_devices_equal_one_host_times_eight(tmp_path, cache_dir):
    cache = cache_dir  # the session's, built once (conftest.py)
    one = subprocess.run(_args(tmp_path, cache, "one", 3), env=_env(8), capture_output=True,
                         text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-2000:]
    port = free_port()
    procs = [
        subprocess.Popen(
            _args(tmp_path, cache, "two", 3, "--dist.coordinator_address", f"127.0.0.1:{port}",
                  "--dist.num_processes", "2", "--dist.process_id", str(i)),
            env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    a, b = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert abs(x - y) < 1e-5 * abs(x), (a, b)


def test_sigkill_during_async_save_keeps_last_checkpoint(tmp_path, cache_dir):
    from intellect_jax.trainer.checkpoint import Checkpointer

    cache = cache_dir  # the session's, built once (conftest.py)
    argv = _args(tmp_path, cache, "k", 400, "--ckpt.every", "1", "--ckpt.keep", "50")
    proc = subprocess.Popen(argv, env=_env(1), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ckdir = tmp_path / "k" / "ckpt"
    killed_mid_save = False
    newest_at_kill = None
    deadline = time.time() + 300
    try:
        while time.time() < deadline and proc.poll() is None:
            names = os.listdir(ckdir) if ckdir.is_dir() else []
            done = [n for n in names if n.isdigit()]
            tmp = [n for n in names if "tmp" in n]
            if len(done) >= 2 and tmp:
                proc.send_signal(signal.SIGKILL)
                killed_mid_save = True
                newest_at_kill = max(int(n) for n in done)  # complete (renamed) before the kill
                break
            time.sleep(0.005)
    finally:
        proc.kill()
        proc.wait()
    assert killed_mid_save, "never caught a save in progress"
    leftovers = [n for n in os.listdir(ckdir) if "tmp" in n]
    assert leftovers, "the kill was meant to leave a partial checkpoint behind"
    ck = Checkpointer(ckdir, every=1, keep=50)
    latest = ck.latest_step()
    ck.close()
    assert latest is not None and latest >= 2
    assert latest >= newest_at_kill, (latest, newest_at_kill)
    metrics = tmp_path / "k" / "metrics.jsonl"
    rows_before = len(metrics.read_text().splitlines())
    # resuming restores the last complete checkpoint and finishes the run
    r = subprocess.run(argv[:argv.index("--run.steps") + 1] + [str(latest + 2)]
                       + argv[argv.index("--run.steps") + 2:] + ["--ckpt.resume"],
                       env=_env(1), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"step {latest + 2}" in r.stdout
    # it trained exactly the two steps after the restored one (not from scratch)
    new_rows = [json.loads(l) for l in metrics.read_text().splitlines()[rows_before:]]
    assert [row["step"] for row in new_rows] == [latest + 1, latest + 2]
    # the partial save was cleaned up and the final step is a complete checkpoint
    names = os.listdir(ckdir)
    assert not [n for n in names if "tmp" in n], names
    assert str(latest + 2) in names
    ck = Checkpointer(ckdir, every=1, keep=50)
    try:
        assert ck.latest_step() == latest + 2
        assert ck.restore_json("meta", latest + 2)["step"] == latest + 2
    finally:
        ck.close()
