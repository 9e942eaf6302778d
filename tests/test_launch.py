"""The launcher's `--join NODE@K`: the node starts only once the run has done K outer steps."""

import pytest

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
