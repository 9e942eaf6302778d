"""Recovery of a whole run of real processes (slow): every node SIGKILLed and restarted from its
orbax checkpoint while the coordinator process is SIGSTOPped (what only real processes show: a
stopped coordinator whose kernel still accepts connections, real checkpoints, real signals),
driven from a :class:`~intellect_jax.launch.Launcher` hook in this process against the real CLI.

The seeded simulation (test_diloco_sim.py) carries the logic of the other recovery paths in
process: a joiner killed right after its live transfer resumes from the checkpoint of the state
it received (`test_joiner_killed_right_after_a_live_transfer_resumes_from_that_checkpoint`; its
real orbax checkpoint with the joiner's own data position: test_store.py), every holder lost
between checkpoints rolls back by itself (`test_every_holder_lost_between_checkpoints_the_
coordinator_rolls_back_by_itself`; rows agreeing with a journal on disk: test_diloco.py), and this
test's path too (`test_every_node_restarted_while_the_coordinator_is_paused_registers_after_waiting`).
"""

import json
import os
import re
import signal
import threading
import time

import pytest

from intellect_jax.launch import Launcher, parse

from helpers import ROOT, TINY_ARGS, one_history, rows

CONFIG = os.path.join(ROOT, "configs", "debug_diloco.toml")

# the tiny model and data of the chaos test; the run's length, H and checkpoints are each test's
SMALL = [*TINY_ARGS, "--run.eval_every", "0", "--run.log_every", "10", "--ckpt.keep", "3"]


class Recorder(Launcher):
    """A launcher that also keeps every line it prints (the coordinator's included)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.out: list[tuple[str, str]] = []
        self._out_lock = threading.Lock()

    def say(self, who: str, line: str) -> None:
        with self._out_lock:
            self.out.append((who, line))
        super().say(who, line)

    def text(self, who: str | None = None) -> str:
        with self._out_lock:
            return "\n".join(f"[{w}] {line}" for w, line in self.out if who is None or w == who)


def _launcher(tmp_path, cache_dir, *args, timeout=240):
    argv = ["--config", CONFIG, "--out-dir", str(tmp_path / "runs"), "--table-every", "0", "--timeout", str(timeout),
            "--heartbeat-timeout", "5", *SMALL, *args, "--data.cache_dir", cache_dir]
    a, extra, kills, joins = parse(argv)
    return Recorder(a, extra, kills, joins)


def _run(L: Launcher) -> int:
    """``L.run()``; whatever happens, no process it started outlives the test."""
    try:
        return L.run()
    finally:
        for v in L.nodes.values():
            if v.proc is not None and v.proc.poll() is None:
                v.proc.send_signal(signal.SIGCONT)
                v.proc.kill()
                v.proc.wait()
        if L.coord is not None and L.coord.poll() is None:
            L.coord.send_signal(signal.SIGCONT)
            L.coord.kill()
            L.coord.wait()


def _journal(L: Launcher) -> dict:
    return json.loads((L.run_dir / "coordinator.journal").read_text())


def _ckpts(L: Launcher, node: str) -> list[int]:
    """Inner steps of the node's committed checkpoints, oldest first."""
    d = L.run_dir / node / "ckpt"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit() and (p / "commit_success.txt").exists()) \
        if d.is_dir() else []


def _since_start(v) -> list[str]:
    """The lines of the node's current process (from the line every process prints as it starts)."""
    starts = [i for i, line in enumerate(v.lines) if "pseudo-gradient made" in line]
    return v.lines[starts[-1]:] if starts else []


class Script:
    """A launcher hook that runs ``steps`` (callables returning True when done) in order, one
    per poll (an exception ends the run: the launcher stops everything and it propagates)."""

    def __init__(self, *steps) -> None:
        self.steps = list(steps)

    def __call__(self) -> None:
        if self.steps and self.steps[0]():
            self.steps.pop(0)


def _kill(v) -> None:
    v.proc.kill()
    v.proc.wait()


# ------------------------------------------------------------------------------------- (a)


@pytest.mark.processes
def test_every_node_restarted_from_its_checkpoint_while_the_coordinator_is_stopped(tmp_path, cache_dir):
    """2 nodes; after a few outer steps the coordinator is SIGSTOPped, every node SIGKILLed and
    restarted with --ckpt.resume while it is still stopped; SIGCONT after 12 s (over twice the
    heartbeat timeout, and once both restarted nodes wait for it). The restarted nodes wait out the stall, register as resumed
    members, nobody is evicted for the coordinator's stall, the run completes without a fork."""
    H, N, STALL = 20, 6, 12.0
    L = _launcher(tmp_path, cache_dir, "--nodes", "2", "--run.steps", str(N * H), "--diloco.inner_steps", str(H),
                  "--ckpt.every", str(H))
    st: dict = {}
    names = ("node0", "node1")

    def stop_coordinator() -> bool:
        if L.progress < 2:
            return False
        L.say("test", "SIGSTOP coordinator")
        L.coord.send_signal(signal.SIGSTOP)
        st["coord"], st["t_stop"] = L.coord, time.monotonic()
        return True

    def kill_and_restart() -> bool:
        # every node holds the newest state and its checkpoint (no barrier passes while the coordinator is stopped)
        vs = [L.nodes[n] for n in names]
        k = max(v.live_outer for v in vs)
        quiet = time.monotonic() - st["t_stop"] >= 3.0 and all(v.live_outer == k for v in vs)
        if not (quiet and all(k * H in _ckpts(L, n) for n in names)):
            return False
        st["k"] = k
        for v in vs:
            L.say("test", f"SIGKILL {v.name} (outer step {k}); restarting it with --ckpt.resume")
            _kill(v)
        for n in names:
            L.start_node(n, resume=True)
        return True

    def cont() -> bool:
        waited = all(any("waiting for" in line for line in _since_start(L.nodes[n])) for n in names)
        dt = time.monotonic() - st["t_stop"]
        if not ((dt >= STALL and waited) or dt >= 90.0):
            return False
        L.say("test", f"SIGCONT coordinator after {dt:.1f}s")
        st["coord"].send_signal(signal.SIGCONT)
        return True

    L.hooks.append(Script(stop_coordinator, kill_and_restart, cont))
    code = _run(L)
    out = L.text()
    assert "k" in st, out[-4000:]
    assert code == 0 and {v.status for v in L.nodes.values()} == {"done"}, out[-4000:]
    assert L.nodes["node0"].starts == L.nodes["node1"].starts == 2
    assert _journal(L)["completed"] is True and _journal(L)["hwm_step"] == N
    steps = one_history(rows(L.run_dir / n) for n in names)
    assert max(steps) == N, steps
    k = st["k"]
    for n in names:
        mine = "\n".join(_since_start(L.nodes[n]))
        assert f"resuming from the checkpoint of outer step {k}" in mine, mine[-3000:]
        assert f"node {n}: waiting for" in mine, mine[-3000:]
        assert re.search(rf"node {n}: registered with .* after waiting (\d+\.\d)s", mine), mine[-3000:]
        assert "registered as member" in mine, mine[-3000:]
    coord = L.text("coord")
    assert re.search(r"coordinator stalled for (\d+\.\d)s \(it could not act\)", coord), coord[-3000:]
    stall = max(float(x) for x in re.findall(r"coordinator stalled for (\d+\.\d)s", coord))
    assert stall >= STALL - 2.0, coord[-3000:]
    assert "no heartbeat" not in out and "missed boundary" not in out, out[-4000:]
    # only the killed sessions are evicted (their connections closed), each once
    evicted = [m.groups() for m in re.finditer(r"coordinator: evicted (\S+): (.+)", coord)]
    assert sorted(n for n, _ in evicted) == ["node0", "node1"] and {why for _, why in evicted} == {"connection lost"}, \
        evicted


# ------------------------------------------------------------------------------------- units


def test_launch_auto_rollback_after_and_the_chaos_plan(capsys):
    """--auto-rollback-after is parsed for the coordinator (a negative one is a one-line error);
    seeded plans draw the new fault kinds, outages after the schedule's other faults."""
    from intellect_jax.cli import run_main
    from intellect_jax.testing.chaos import KINDS, Chaos
    from intellect_jax.launch import main

    base = ["--config", CONFIG, "--nodes", "2"]
    assert parse([*base, "--auto-rollback-after", "5"])[0].auto_rollback_after == 5.0
    assert parse(base)[0].auto_rollback_after is None  # the coordinator's default
    capsys.readouterr()
    assert run_main(lambda: main([*base, "--auto-rollback-after", "-1"])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--auto-rollback-after" in err[0], err
    seen = set()
    for seed in range(20):
        plan = Chaos(object(), seed, 6, 30).plan  # type: ignore[arg-type]
        assert plan == Chaos(object(), seed, 6, 30).plan  # type: ignore[arg-type]
        kinds = [kind for _, kind in plan]
        assert set(kinds) <= set(KINDS) and [k for k, _ in plan] == sorted(k for k, _ in plan)
        assert kinds == [x for x in kinds if x != "outage"] + [x for x in kinds if x == "outage"]
        seen |= set(kinds)
    assert seen == set(KINDS)
