"""The launcher (`python -m intellect_jax.launch`): `--join NODE@K` starts the node only once the
run has done K outer steps (its units, no processes), and the one launcher run end to end (slow:
a joiner by live transfer over sockets, the coordinator SIGKILLed and restarted from its journal,
strangers refused)."""

import json
import os
import re
import subprocess
import sys

import pytest

from helpers import LAUNCH_TINY, ROOT, free_port, launch, one_history, rows, run_rows

from intellect_jax.coordinator.journal import RunRecord
from intellect_jax.coordinator.leases import count
from intellect_jax.launch import Launcher, parse
from intellect_jax.model.config import ConfigError

BASE = ["--config", "configs/debug_diloco.toml", "--nodes", "2", "--table-every", "0", "--timeout", "30"]


def test_a_joiner_starts_once_the_run_has_done_k_outer_steps(tmp_path):
    L = Launcher(*parse([*BASE, "--out-dir", str(tmp_path), "--join", "late@3"]))
    started: list[tuple[str, int]] = []

    def start(name, resume=False):
        started.append((name, L.progress))
        L.nodes[name].status = "running"

    def tick():  # one outer step per poll; every node done at 6
        L.progress += 1
        if L.progress >= 6:
            for v in L.nodes.values():
                v.status = "done"

    L.start_coordinator, L.start_node = lambda: None, start
    L.hooks.append(tick)
    assert L.run() == 0
    assert started == [("node0", 0), ("node1", 0), ("late", 3)]


def test_a_joiner_that_the_run_never_reaches_still_starts_and_ends(tmp_path):
    L = Launcher(*parse([*BASE, "--out-dir", str(tmp_path), "--join", "late@9"]))
    started: list[str] = []

    def start(name, resume=False):
        started.append(name)
        L.nodes[name].status = "running"

    def finish():  # the founders end the run at once; the joiner is told it is complete
        for v in L.nodes.values():
            if v.status == "running":
                v.status = "done"

    L.start_coordinator, L.start_node = lambda: None, start
    L.hooks.append(finish)
    assert L.run() == 0 and started == ["node0", "node1", "late"]


def test_a_joiner_named_like_a_founder_is_refused():
    with pytest.raises(ConfigError, match="^--join node1@2: node1 is one of the --nodes 2"):
        parse([*BASE, "--join", "node1@2"])


@pytest.mark.processes
def test_launched_run_joiner_coordinator_restart_and_refused_nodes(tmp_path):
    """The one launcher run end to end, over the butterfly exchange with CenteredClip: 2 founders,
    node2 joins after outer step 1 by live transfer (its donor trains meanwhile), the coordinator is SIGKILLed after step 3 and restarted from its
    journal; a node of another run authority and one with another model are refused in one line.
    node2's process starts at outer step 1 of 20: the run must outlast its start-up (imports,
    compilation) on a loaded machine, or it would be told that the run is complete."""
    from intellect_jax.net.identity import Authority

    port = free_port()
    env = dict(os.environ)
    # a node of another authority and one with another model, refused: started with the founders,
    # so that however slow their start-up they meet a live coordinator (started at outer step 1,
    # they once found the 20-step run over, on a slow machine). The run's authority is made here
    # first (the launcher takes the one it finds), so that its operator can let "other" in.
    Authority.init(tmp_path / "runs" / "debug_diloco" / "keys", "intellect-jax").issue("other")
    Authority.init(tmp_path / "elsewhere", "intellect-jax").issue("intruder")
    base = [sys.executable, "-m", "intellect_jax.train", "--config", "configs/debug_diloco.toml",
            "--diloco.coordinator", f"127.0.0.1:{port}", "--run.out_dir", str(tmp_path / "bad"),
            *LAUNCH_TINY, "--data.cache_dir", str(tmp_path / "cache"), "--diloco.register_timeout", "120",
            "--diloco.reconnect_timeout", "60"]  # a refusal never comes after these: fail, not hang
    bad = [
        subprocess.Popen(base + ["--diloco.node_id", "intruder", "--diloco.keys", str(tmp_path / "elsewhere")],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env),
        subprocess.Popen(base + ["--diloco.node_id", "other", "--diloco.keys",
                                 str(tmp_path / "runs" / "debug_diloco" / "keys"), "--model.num_layers", "3"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env),
    ]
    # node2 starts at outer step 1 of 20: the run must outlast its start-up on a loaded machine
    p = launch(tmp_path, "--nodes", "2", "--join", "node2@1", "--kill-coordinator", "3", "--run.steps", "100",
               "--diloco.leases", "--diloco.unit_steps", "1", "--diloco.exchange", "butterfly", "--diloco.robust", "cclip",
               port=port, env=env)
    (out_foreign, err_foreign), (out_model, err_model) = [b.communicate(timeout=300) for b in bad]
    out = p.communicate(timeout=600)[0]
    # on failure: every line that is not an outer-step row (the errors), then the tail
    assert p.returncode == 0, "\n".join(l for l in out.splitlines() if "outer step" not in l)[-6000:]
    assert [b.returncode for b in bad] == [2, 2], (err_foreign[-500:], err_model[-500:])
    assert len(err_foreign.strip().splitlines()) == 1 and "certificate not of this run" in err_foreign, \
        (err_foreign[-500:], out_foreign[-2000:])
    assert len(err_model.strip().splitlines()) == 1 and "fingerprint" in err_model, (err_model[-500:],
                                                                                   out_model[-2000:])
    assert "SIGKILL coordinator" in out and "resumed member" in out and "journal: the run is at outer step" in out
    assert out.count("butterfly exchange: each segment's owner checks every member's signed piece and aggregates "
                     "them with cclip") == 3, out[-3000:]  # node0, node1, node2
    ref = one_history(rows(tmp_path / "runs" / "debug_diloco" / n) for n in ["node0", "node1"])
    steps = one_history(rows(tmp_path / "runs" / "debug_diloco" / n) for n in ["node0", "node1", "node2"])
    assert sorted(steps) == list(range(1, 21))
    # every node kept the coordinator's signed record of each barrier it passed (coordinator.claims),
    # beside its checkpoints: the newest is the final step's, with the hash the run recorded
    for n in ("node0", "node1", "node2"):
        kept = json.loads((tmp_path / "runs" / "debug_diloco" / n / "records.json").read_text())
        assert (kept[-1]["outer_step"], kept[-1]["state_hash"]) == (20, steps[20]), (n, kept[-1])
        assert all(steps.get(r["outer_step"], r["state_hash"]) == r["state_hash"] for r in kept)
    joiner, _ = run_rows(tmp_path, "node2")
    first = joiner[0]["outer_step"]
    assert first >= 2 and joiner[0]["nodes"] == 3
    assert joiner[0]["outer_hash"] == ref[first]  # the joiner's state is the founders'
    # the donor served from a background thread and trained on after it; that it trains *while* it
    # serves is shown with a transfer of many rounds in process
    # (test_diloco_sim.py::test_a_donor_trains_its_round_while_a_long_transfer_goes_on): here the
    # transfer takes milliseconds, and the nodes' pauses around it are the barrier's and the
    # loaded machine's (a founder that reaches the barrier first waits longest)
    m = re.search(r"\[(node\d)\] served node2: .* \(wall ([\d.]+) -> ([\d.]+)\)", out)
    assert m, out[-3000:]
    donor, t1 = m.group(1), float(m.group(3))
    assert max(r["time"] for r in run_rows(tmp_path, donor)[1]) > t1
    # every round's data was leased (units of 1 inner step): across the joiner and the coordinator's
    # SIGKILL, each recorded step trained exactly its contributors' units, none twice, nothing out
    assert "data leased from the coordinator in units of 1 inner steps" in out
    rec = RunRecord.from_json(json.loads((tmp_path / "runs" / "debug_diloco" / "coordinator.journal").read_text()))
    led = rec.leases
    contributors = {r["outer_step"]: r["contributors"] for n in ("node0", "node1", "node2")
                    for r in run_rows(tmp_path, n)[0]}
    assert led.problems() == [] and led.outstanding() == 0 and led.status()["duplicates"] == 0
    assert {s: len(per) for s, per in led.commits.items()} == contributors
    assert all(count(u) == 5 for per in led.commits.values() for u in per.values())
    assert len(led.trained) == 5 * sum(contributors.values())


def test_a_node_that_exits_badly_says_why():
    """The launcher's table and the chaos summary carry the last error line of a node that
    exited non-zero (a chaos failure in CI once showed only "exit 2")."""
    from intellect_jax.launch import NodeView

    v = NodeView("node2", lines=["[node2] outer step 3: epoch 1", "[node2] error: coordinator 127.0.0.1:9 unreachable",
                                 "[node2] bye"])
    assert v.why() == "error: coordinator 127.0.0.1:9 unreachable"
    assert NodeView("n", lines=["[n] Traceback (most recent call last):", "[n] ValueError: bad"]).why() == "ValueError: bad"
    assert NodeView("n", lines=["[n] outer step 1: fine"]).why() == ""
    assert NodeView("n", lines=["[n] Traceback (most recent call last):", "[n] AssertionError"]).why() == "AssertionError"
    # a restarted process that died silently is not blamed on its predecessor's error
    assert NodeView("n", lines=["[n] error: old", "[n] started again"], first_line=1).why() == ""
