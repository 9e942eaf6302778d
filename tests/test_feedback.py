"""Error feedback in the outer loop (gathered codecs): the loop equals a plain reference bit for
bit, feedback recovers what top-k drops, a node's residual is its own, and the configuration
names what it needs."""

import copy
import dataclasses
import time

import numpy as np
import pytest

from intellect_jax.diloco.config import DilocoConfig
from intellect_jax.diloco.guard import GuardConfig, check_average, remember, tree_norm
from intellect_jax.diloco.parts import LoopConfig, Outcome
from intellect_jax.diloco.store import MemoryStore
from intellect_jax.diloco.state import init_state, nesterov_sgd, outer_step, pseudo_gradient, state_hash
from intellect_jax.net.comm import RingConfig
from intellect_jax.testing.local import NumpyInner, run_local
from intellect_jax.testing.local_ring import LocalGroup
from intellect_jax.testing.sim import Sim, SimParams

TOPK = RingConfig(mode="topk2", block_size=32, piece_numel=64)  # 6% of each chunk of 32


def _task(n, dim=64, seed=3):
    rs = np.random.default_rng(seed)
    targets = [rs.standard_normal(dim).astype(np.float32) for _ in range(n)]
    init = {"w": rs.standard_normal(dim).astype(np.float32), "u": np.zeros((4, 8), np.float32)}
    return targets, init, np.mean(targets, axis=0)


def reference(n, H, R, fb, ring=TOPK, alpha=0.0, outers=None):
    """Synchronous DiLoCo with error feedback, written plainly: node i sends c_i = pg_i + fb x e_i
    and keeps e_i = c_i - decode(encode(c_i)); with local feedback ``alpha`` it starts each round
    but the last from outer - alpha x fb x e_i and measures pg_i from there. -> hashes by outer
    step, final state, residuals (``outers``: a dict filled with the outer params by step)."""
    guard = GuardConfig()
    targets, init, goal = _task(n)
    nodes = [NumpyInner(targets[i], init, goal) for i in range(n)]
    tx = nesterov_sgd(0.7, 0.9)
    s = init_state(copy.deepcopy(init), tx, None, 0)
    res = [None] * n
    starts = [s.outer_params] * n
    hashes = {}
    for r in range(R):
        cs = []
        for i, x in enumerate(nodes):
            x.train((r + 1) * H)
            pg = pseudo_gradient(starts[i], x.weights)
            if fb and res[i] is not None:
                pg = {k: (v + np.float32(fb) * res[i][k]).astype(np.float32) for k, v in pg.items()}
            cs.append(pg)
        ds = [{k: np.empty_like(v) for k, v in c.items()} for c in cs] if fb else None
        avg = LocalGroup(n, ring).all_reduce_mean_all(cs, ds)[0]
        res = ds if fb else res
        scale = tree_norm(s.outer_params) if len(s.norms) < guard.min_history else None
        norm, why = check_average(avg, s.norms, guard, scale)
        assert why is None
        s = outer_step(s, avg, tx, inner_step=(r + 1) * H)._replace(norms=remember(s.norms, norm, guard))
        hashes[s.outer_step] = state_hash(s)
        if outers is not None:
            outers[s.outer_step] = s.outer_params
        k = np.float32(alpha * fb)
        for i, x in enumerate(nodes):
            starts[i] = s.outer_params if not k or r == R - 1 or res[i] is None else \
                {n_: (w - k * res[i][n_]).astype(np.float32) for n_, w in s.outer_params.items()}
            x.set_params(starts[i])
    return hashes, s, res


@pytest.mark.parametrize("fb", [1.0, 0.5])
def test_loop_with_feedback_equals_the_reference_bit_for_bit(fb):
    n, H, R = 3, 5, 6
    targets, init, goal = _task(n)
    inners = [NumpyInner(targets[i], init, goal) for i in range(n)]
    outs = run_local(LoopConfig(inner_steps=H, outer_steps=R, feedback=fb), inners, TOPK)
    assert set(outs) <= {Outcome.FINISHED, Outcome.COMPLETED}
    want, final, _ = reference(n, H, R, fb)
    for x in inners:
        assert {m["outer_step"]: m["outer_hash"] for _, m in x.records} == want
    # and feedback is a different algorithm: without it the same task makes other states
    assert reference(n, H, R, 0.0)[0][R] != want[R]


class HeldEvalInner(NumpyInner):
    """Evaluates only the params it holds, as a multi-process node's lead does."""

    def evaluate(self, params=None):
        assert params is None, "evaluate(params) is not available on this node"
        return super().evaluate()


def test_local_feedback_equals_the_reference_bit_for_bit_and_ends_on_the_outer_params():
    """Each round starts from outer - alpha x fb x the node's residual, its pseudo-gradient is
    measured from there; every evaluation is of the outer params (held by the trainer first,
    shifted after), and the last round ends on them (what is exported)."""
    n, H, R, fb, alpha = 3, 5, 6, 0.9, 0.5
    targets, init, goal = _task(n)
    inners = [HeldEvalInner(targets[i], init, goal) for i in range(n)]
    run_local(LoopConfig(inner_steps=H, outer_steps=R, feedback=fb, feedback_local=alpha, eval_every=H),
              inners, TOPK)
    outers: dict = {}
    want, final, _ = reference(n, H, R, fb, alpha=alpha, outers=outers)
    judge = NumpyInner(targets[0], init, goal)
    for x in inners:
        assert {m["outer_step"]: m["outer_hash"] for _, m in x.records} == want
        assert all(np.array_equal(x.weights[k], final.outer_params[k]) for k in final.outer_params)
        evals = {m["outer_step"]: m["val_loss"] for _, m in x.records}
        assert evals == {k: judge.evaluate(o) for k, o in outers.items()}
    assert reference(n, H, R, fb)[0][R] != want[R]  # and it is not plain error feedback


class LateStore(MemoryStore):
    """A checkpoint read ``late`` seconds late (a slow disk): its node registers after the others."""

    def __init__(self, initial, late):
        super().__init__(initial)
        self.late = late

    def latest(self):
        time.sleep(self.late)
        return super().latest()


@pytest.mark.parametrize("late", [0.0, 0.3])
def test_local_feedback_resumes_where_it_stopped(late):
    """Stopped after 3 of 6 outer steps and resumed from each node's checkpoint (its residual
    included): the trainer restarts from the shifted point, and the run equals the unbroken one.
    (``late``: nodes 1 and 2 read their checkpoints later; run_local's nodes still resume together,
    not node 0 alone through the rebuilt run's first barrier.)"""
    n, H, R, fb, alpha = 3, 5, 6, 1.0, 0.5
    targets, init, goal = _task(n)
    want = reference(n, H, R, fb, alpha=alpha)[0]
    stores = [MemoryStore() for _ in range(n)]
    cfg = LoopConfig(inner_steps=H, outer_steps=R, feedback=fb, feedback_local=alpha, ckpt_every=H)
    first = [NumpyInner(targets[i], init, goal) for i in range(n)]
    run_local(dataclasses.replace(cfg, stop_at=3), first, TOPK, stores=stores)
    assert all(st.states[3 * H].residual is not None for st in stores)
    again = [NumpyInner(targets[i], init, goal) for i in range(n)]
    run_local(cfg, again, TOPK, stores=[LateStore(st.states[3 * H], late * (i > 0)) for i, st in enumerate(stores)])
    for a, b in zip(first, again):
        assert [m["outer_step"] for _, m in b.records] == [4, 5, 6]  # resumed, not started over
        assert {m["outer_step"]: m["outer_hash"] for _, m in a.records + b.records} == want


def test_a_node_resuming_behind_the_run_joins_at_its_own_data_position():
    """Nodes 0 and 2 resume from their checkpoints of outer step 3, node 1 from its older one of
    step 2: node 1 joins and receives the run's state from a donor, and goes on from its own
    checkpoint's data position, not from the start of its shard as a fresh trainer would."""
    n, H, R = 3, 5, 6
    targets, init, goal = _task(n)
    stores = [MemoryStore() for _ in range(n)]
    cfg = LoopConfig(inner_steps=H, outer_steps=R, ckpt_every=H)
    run_local(dataclasses.replace(cfg, stop_at=3), [NumpyInner(targets[i], init, goal) for i in range(n)], TOPK,
              stores=stores)
    own = stores[1].states[2 * H].data
    assert own == {"pos": 2 * H}
    again = [NumpyInner(targets[i], init, goal) for i in range(n)]
    lines: list[str] = []
    resumed = [MemoryStore(st.states[(2 if i == 1 else 3) * H]) for i, st in enumerate(stores)]
    run_local(cfg, again, TOPK, stores=resumed, log=lines.append)
    assert any(line.startswith("[node1] admitted") for line in lines), lines
    received = min(k for k in resumed[1].states)  # the received state, saved as it came
    assert resumed[1].states[received].data == own, resumed[1].states[received].data
    assert again[1].data["pos"] == own["pos"] + (R * H - received)  # and trained on from there


def test_local_feedback_in_overlapped_rounds_merges_onto_the_shifted_start():
    """Overlapped rounds merge each average onto outer - alpha x fb x residual, keeping the
    progress since the window: one history, every node ends on the outer params, and the run
    differs from plain error feedback's."""
    n, H, R, fb = 3, 5, 6, 0.9

    class Merging(NumpyInner):
        def merge(self, placed):
            self.merged.append((self.step, copy.deepcopy(placed)))
            super().merge(placed)

    targets, init, goal = _task(n)
    finals = {}
    for alpha in (0.0, 0.5):
        inners = [Merging(targets[i], init, goal) for i in range(n)]
        for x in inners:
            x.merged = []
        stores = [MemoryStore() for _ in range(n)]
        run_local(LoopConfig(inner_steps=H, outer_steps=R, feedback=fb, feedback_local=alpha, overlap=True,
                             overlap_delay=2, ckpt_every=H), inners, TOPK, stores=stores)
        hashes = [{m["outer_step"]: m["outer_hash"] for _, m in x.records} for x in inners]
        assert hashes[0] == hashes[1] == hashes[2] and sorted(hashes[0]) == list(range(1, R + 1))
        final = stores[0].states[R * H].outer_params
        assert all(np.array_equal(x.weights[k], final[k]) for x in inners for k in final)
        for x, st in zip(inners, stores):  # round r merged the outer params of step r, shifted by its residual
            assert [step for step, _ in x.merged] == [r * H + 2 for r in range(1, R)]
            for step, placed in x.merged:
                s = st.states[step - 2]
                k = np.float32(alpha * fb)
                want = s.outer_params if s.residual is None or not k else \
                    {n_: (w - k * s.residual[n_]).astype(np.float32) for n_, w in s.outer_params.items()}
                assert all(np.array_equal(placed[n_], want[n_]) for n_ in want)
        finals[alpha] = hashes[0][R]
    assert finals[0.0] != finals[0.5]


def test_feedback_recovers_what_topk_drops():
    """Gradient descent on a quadratic whose steps are exchanged as top-k at 6%: without feedback
    most coordinates never move enough and it ends far from the optimum; with feedback it gets
    most of the way to the full-precision run. (A step must be a small fraction of the distance
    left, as an outer step is: feedback delivers many rounds' worth of a coordinate at once.)"""
    rng = np.random.default_rng(0)
    n, d = 4, 256
    targets = [rng.standard_normal(d).astype(np.float32) for _ in range(n)]
    goal = np.mean(targets, axis=0)
    dist = {}
    for name, ring, fb in (("fp32", RingConfig(mode="fp32"), 0), ("plain", TOPK, 0), ("fed", TOPK, 1)):
        group, w = LocalGroup(n, ring), np.zeros(d, np.float32)
        res = [np.zeros(d, np.float32) for _ in targets]
        for _ in range(300):
            cs = [np.float32(0.02) * (w - t) + np.float32(fb) * e for t, e in zip(targets, res)]
            ds = [np.empty(d, np.float32) for _ in cs] if fb else None
            w = w - group.all_reduce_mean_all(cs, ds)[0]
            res = ds if fb else res
        dist[name] = float(np.linalg.norm(w - goal))
    assert dist["plain"] > 100 * dist["fp32"] and dist["fed"] < 0.15 * dist["plain"], dist


def test_residual_is_the_nodes_own_and_survives_its_checkpoint():
    """Each node's residual is exactly what its last contribution lost (in the loop's state and
    its checkpoint), different per node, and not in the hash every node agrees on."""
    n, H, R = 3, 5, 4
    targets, init, goal = _task(n)
    inners = [NumpyInner(targets[i], init, goal) for i in range(n)]
    stores = [MemoryStore() for _ in range(n)]
    run_local(LoopConfig(inner_steps=H, outer_steps=R, feedback=1.0, ckpt_every=H), inners, TOPK, stores=stores)
    _, final, res = reference(n, H, R, 1.0)
    for st in stores:
        last = st.states[R * H]
        assert state_hash(last) == state_hash(final)
    got = sorted((st.states[R * H].residual["w"] for st in stores), key=lambda a: float(a[0]))
    want = sorted((r["w"] for r in res), key=lambda a: float(a[0]))
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert not np.array_equal(got[0], got[1]) and float(np.abs(got[0]).max()) > 0


@pytest.mark.slow
def test_simulation_with_topk_and_feedback_keeps_one_history():
    """The seeded fault simulation with the gathered exchange (top-k, top-1 of 4, int1 by turns):
    kills, stalls, restarts, rollbacks and joins keep one hash per outer step (the simulation's
    own checks); every fourth seed pair with local feedback."""
    bad = []
    for seed in range(40):  # (CI's time; the command line runs hundreds)
        r = Sim(seed, SimParams(mode=("topk4", "int1", "top1of4")[seed % 3], overlap=seed % 2 == 1,
                                feedback_local=0.5 if seed % 4 >= 2 else 0.0)).run()
        if not r["ok"]:
            bad.append((seed, r["problems"]))
    assert not bad, bad[:3]


def test_config_names_the_codec_and_its_limits():
    d = DilocoConfig(mode="topk", topk=128, sparse_chunk=4096)
    assert (d.wire_mode, d.wire_block, d.gathered) == ("topk128", 4096, True)
    assert (DilocoConfig(mode="int4").wire_mode, DilocoConfig(mode="int4").gathered) == ("int4", False)
    with pytest.raises(ValueError, match="sparse_chunk"):
        DilocoConfig(mode="topk", topk=64, sparse_chunk=32)
    assert DilocoConfig(mode="top1", top1_group=8).wire_mode == "top1of8"
    with pytest.raises(ValueError, match="top1_group"):
        DilocoConfig(mode="top1", top1_group=6)
    with pytest.raises(ValueError, match="feedback"):
        DilocoConfig(mode="int2", feedback=1.5)
    with pytest.raises(ValueError, match="feedback_local must be in"):
        DilocoConfig(mode="top1", feedback_local=-0.1)
    with pytest.raises(ValueError, match="feedback_local is a share of the error feedback of a gathered codec"):
        DilocoConfig(mode="int8", feedback_local=0.5)
    with pytest.raises(ValueError, match="feedback > 0"):
        DilocoConfig(mode="top1", feedback=0.0, feedback_local=0.5)
    from intellect_jax.diloco.device_pg import pg_path

    assert pg_path(DilocoConfig(mode="topk"), 1, False).overlap  # lossy codes: overlapped by default
    assert not pg_path(DilocoConfig(mode="fp32"), 1, False).overlap


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_a_broken_residual_is_started_anew_and_the_run_goes_on(alpha):
    """A node whose residual is not finite (a damaged checkpoint, a poisoned wire) poisons one
    round at most: every node skips that average, the node starts its residual anew, one history
    (with local feedback the broken residual shifts nothing: the node trains from finite params)."""
    n, H, R = 3, 5, 4
    targets, init, goal = _task(n)
    inners = [NumpyInner(targets[i], init, goal) for i in range(n)]
    tx = nesterov_sgd(0.7, 0.9)
    bad = init_state(copy.deepcopy(init), tx, None, 0)
    bad = bad._replace(residual={k: np.full(np.shape(v), np.nan, np.float32) for k, v in bad.outer_params.items()})
    stores = [MemoryStore(bad)] + [MemoryStore() for _ in range(n - 1)]
    lines: list[str] = []
    run_local(LoopConfig(inner_steps=H, outer_steps=R, feedback=1.0, feedback_local=alpha), inners, TOPK, stores=stores,
              log=lines.append)
    assert any("[node0]" in ln and "residual is not finite" in ln for ln in lines), lines
    assert sum("outer step 1 skipped" in ln for ln in lines) == n  # every node skipped the poisoned average
    hashes = [{m["outer_step"]: m["outer_hash"] for _, m in x.records} for x in inners]
    assert hashes[0] == hashes[1] == hashes[2] and len(hashes[0]) == R
