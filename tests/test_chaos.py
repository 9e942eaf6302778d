"""The chaos tool (`python -m intellect_jax.testing.chaos`): its arguments, and one seeded
schedule of faults against real processes (slow)."""

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import TINY_ARGS, launch, loop_config, node_inner, node_trainer, ring_config, ROOT, rows

CHAOS = ["--run.steps", "600", "--diloco.inner_steps", "20", "--diloco.overlap_delay", "2", *TINY_ARGS, "--run.eval_every", "0",
         "--run.log_every", "10"]


def test_chaos_arguments_reference_and_one_line_errors(capsys, monkeypatch):
    """--reference alone means as many nodes as the run; a bad count, --nodes or a launcher-only
    fault is one line on stderr, exit 2, naming the flag."""
    from intellect_jax.cli import run_main
    from intellect_jax.testing import chaos

    seen = []
    monkeypatch.setattr(chaos, "run_chaos", lambda args, extra: seen.append(args.reference) or 0)
    base = ["--config", "configs/debug_diloco.toml", "--nodes", "3", "--seed", "1"]
    for more, want in (([], None), (["--reference"], 3), (["--reference", "1"], 1)):
        assert chaos.main([*base, *more]) == 0 and seen[-1] == want
    for bad, flag in ((["--reference", "0"], "--reference"), (["--reference", "-2"], "--reference"),
                      (["--nodes", "0"], "--nodes"), (["--kill", "node1"], "--kill")):
        capsys.readouterr()
        assert run_main(lambda: chaos.main([*base, *bad])) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and flag in err[0], err


# one schedule of five faults, each of another kind: a node SIGKILL (restarted from its checkpoint
# as is, damaged or older), a node SIGSTOP, a node and the coordinator SIGKILLed together, an
# outage of all nodes but one, a coordinator SIGSTOP (`python -m intellect_jax.testing.chaos --seed N`
# runs any other seed; the seeded simulation carries the breadth)
CHAOS_SEEDS = (155,)


def _reference_val_loss(tmp_path, cache_dir, nodes: int = 1) -> float:
    """The chaos run's fault-free reference on ``nodes`` nodes, in this process: the same config
    and data shards, real trainers and the same outer loop over the in-process ring (no processes
    to start, no checkpoints to write); the mean final validation loss of its nodes."""
    from intellect_jax.config import parse_args
    from intellect_jax.testing.local import run_local

    def cfg(i):
        return parse_args(["--config", os.path.join(ROOT, "configs", "debug_diloco.toml"), *CHAOS,
                           "--run.out_dir", str(tmp_path / "reference"), "--run.name", f"node{i}",
                           "--run.no-progress", "--data.cache_dir", cache_dir,
                           "--diloco.data_rank", str(i), "--diloco.data_ranks", str(nodes)])

    cfgs = [cfg(i) for i in range(nodes)]
    trainers = [node_trainer(c, rank=i, count=nodes, share=nodes) for i, c in enumerate(cfgs)]
    try:
        lc = loop_config(cfgs[0])
        run_local(lc, [node_inner(c, t) for c, t in zip(cfgs, trainers)], ring_config(cfgs[0]))
        finals = [r["val_loss"] for t in trainers for r in rows(t.run_dir)
                  if r.get("outer_step") == lc.outer_steps and "val_loss" in r]
    finally:
        for t in trainers:
            t.close(save=False)
    assert len(finals) == nodes, finals
    return sum(finals) / nodes


@pytest.mark.processes
def test_chaos_real_processes(tmp_path, cache_dir):
    """A seeded schedule of five faults of five kinds (CHAOS_SEEDS), 30 outer steps, each round's
    data leased from the coordinator: no fork, every node ends cleanly, every unit of data
    trained once (the journal's bookkeeping holds; what the faults threw away is counted). Every outer step keeps at least one contributor, so each run ends
    no worse than one node training alone without faults (3% slack for rejoins: a joiner's
    first round and its data position); that reference runs in this process (the same config,
    data shard and outer loop: `--reference 1` of the chaos tool without its processes), on a thread
    while the chaos run's processes wait out their faults. How far
    below it the run lands depends on how long the faults kept nodes out (timing), so it is
    printed, not asserted. The data cache is the session's (built once, not by each of the
    three nodes and the reference as they start: `test_launch` keeps that)."""
    summaries = []
    with ThreadPoolExecutor(1) as pool:
        for i, seed in enumerate(CHAOS_SEEDS):
            args = ["--nodes", "3", "--seed", str(seed), "--faults", "5", "--heartbeat-timeout", "5", "--diloco.leases",
                    "--diloco.unit_steps", "1"]
            p = launch(tmp_path, *args, tiny=CHAOS, module="intellect_jax.testing.chaos", cache=cache_dir)
            if i == 0:  # while the faults keep the run's processes waiting (SIGSTOPs, restarts)
                t0 = time.monotonic()
                ref_job = pool.submit(lambda: (_reference_val_loss(tmp_path, cache_dir), time.monotonic() - t0))
            out = p.communicate(timeout=900)[0]
            line = [ln for ln in out.splitlines() if ln.startswith('{"seed"')]
            assert line, out[-4000:]
            s = json.loads(line[-1])
            summaries.append(s)
            assert p.returncode == 0 and s["ok"], out[-4000:]
            assert s["forked_steps"] == [] and s["outer_steps"] == 30 and s["completed"]
            assert set(s["node_exits"].values()) == {"done"} and s["late_registration_exit"] == 0
            assert len(s["faults"]) >= 3 and 1 <= s["mean_contributors"] <= 3
            assert sum(1 for n in s["fault_counts"].values() if n) >= 3, s["fault_counts"]  # faults of several kinds
            d = s["data"]  # every round's data leased: each unit trained once, what faults threw away counted
            assert d["problems"] == [] and d["duplicates"] == 0 and d["units_outstanding"] == 0, d
            assert d["tokens_trained"] > 0 and d["tokens_discarded"] > 0 and 0 < d["goodput"] < 1, d
        ref, ref_s = ref_job.result()
    for s in summaries:
        assert s["final_val_loss"] <= 1.03 * ref, (s["final_val_loss"], ref)
    print(json.dumps([{k: s[k] for k in ("seed", "faults", "final_val_loss", "mean_contributors", "data", "seconds")}
                      for s in summaries] + [{"reference_val_loss": ref, "seconds": round(ref_s, 1)}]))
