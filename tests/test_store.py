"""Checkpoints: the DiLoCo node's checkpoint store (round trip, fallback past damage, a joiner's
checkpoint of the state it received) and the trainer's own resume past a damaged checkpoint."""

import numpy as np
import pytest

from intellect_jax.coordinator.protocol import Admission
from intellect_jax.diloco import state as S

from helpers import TINY_ARGS, flip_bytes, leaves, node_parts, node_trainer, outer_step, tiny_cfg


@pytest.mark.slow
def test_checkpoint_store_round_trip_and_fallback_past_a_damaged_checkpoint(tmp_path, cache_dir):
    from intellect_jax.diloco.store import CheckpointStore
    from intellect_jax.trainer.checkpoint import CheckpointError

    t, inner = node_parts(tmp_path, cache_dir)
    tx = S.nesterov_sgd(0.7, 0.9)
    s0 = inner.init_state(tx)
    warnings = []
    store = CheckpointStore(t, resume=True, warn=warnings.append)
    s1 = outer_step(inner, s0, tx, 4)
    store.save(s1, wait=True)
    s2 = outer_step(inner, s1, tx, 8)
    rng = np.random.default_rng(0)  # error feedback: the node's own, saved beside and never hashed;
    # here on the devices, sharded like the params (a GPU node's, encoded there); restored to the host
    resid = S.jax.tree.map(lambda p: rng.standard_normal(p.shape).astype(np.float32), s2.outer_params)
    s2 = s2._replace(residual=S.jax.device_put(resid, t.shardings.params))
    assert any(len(x.sharding.device_set) == 8 for x in S.jax.tree.leaves(s2.residual))
    store.save(s2, wait=True)
    back = store.load(8)
    assert S.state_hash(back) == S.state_hash(s2) == S.state_hash(s2._replace(residual=None))
    assert (back.outer_step, back.inner_step) == (2, 8)
    assert back.data == s2.data
    for a, b in zip(leaves(back.residual), leaves(resid)):
        assert isinstance(a, np.ndarray)
        np.testing.assert_array_equal(a, b)
    assert store.load(4).residual is None  # a checkpoint without one (another codec, an older run)
    for a, b in zip(*(leaves(x.inner_opt_state) for x in (back, s2))):
        np.testing.assert_array_equal(a, b)
    # flip bytes in the newest checkpoint's largest array file: resume falls back to the older one
    flip_bytes(t.run_dir / "ckpt" / "8" / "diloco")
    got = store.latest()
    assert got.outer_step == 1 and S.state_hash(got) == S.state_hash(s1)
    assert len(warnings) == 1 and "checkpoint 8 is damaged" in warnings[0] and "falling back to checkpoint 4" in warnings[0]
    # names where the damage is: the item when a checksum shows it, the checkpoint when tensorstore
    # cannot decode the file (which of the two depends on what the flipped byte lands in)
    assert "ckpt/8/diloco" in warnings[0] or "ckpt/8: " in warnings[0], warnings
    # a state the run did not keep (same inner step, other bytes) is replaced, not kept beside
    other = s1._replace(outer_params=S.to_host(t.state.params), inner_opt_state=inner.live_opt_state())
    store.save(other, wait=True)
    assert S.state_hash(store.load(4)) == S.state_hash(other)
    # nothing readable: one error, no fallback left
    flip_bytes(t.run_dir / "ckpt" / "4" / "diloco")
    with pytest.raises(CheckpointError, match="no readable checkpoint"):
        store.latest()
    t.close(save=False)


@pytest.mark.slow
def test_a_joiners_checkpoint_of_the_received_state_resumes(tmp_path, cache_dir):
    """A joiner writes the state it received as its own checkpoint before training on it; if
    it dies before its next checkpoint, --ckpt.resume starts from that one: it carries the
    joiner's own data position (the donor's is another shard's), never an empty one that the
    data pipeline refuses. A checkpoint from before that fix ({} on disk) resumes at the start
    of the node's shard."""
    from intellect_jax.diloco.loop import NodeLoop
    from intellect_jax.diloco.parts import LoopConfig, NodeParts, TransferFailed
    from intellect_jax.diloco.store import CheckpointStore

    td, donor = node_parts(tmp_path, cache_dir, "donor")
    tx = S.nesterov_sgd(0.7, 0.9)
    s = outer_step(donor, donor.init_state(tx), tx, 4)
    sent = s._replace(inner_opt_state=donor.snapshot(), data=None)
    meta = {"outer_step": 1, "inner_step": 4, "hash": S.state_hash(s), "norms": [], "skipped": False}
    td.close(save=False)

    class Transport:
        header = meta

        def receive(self, adm, template, cancelled, timeout):
            return dict(self.header), sent

    class Client:
        def admission_revoked(self, adm):
            return False

    t, inner = node_parts(tmp_path, cache_dir, "joiner")
    inner.train(2)  # the joiner read some of its own shard before it was admitted
    position = inner.data_state()
    transport = Transport()
    parts = NodeParts("joiner", inner, Client(), None, transport, CheckpointStore(t))
    loop, adm = NodeLoop(LoopConfig(inner_steps=4, outer_steps=3), parts), Admission("donor", "x", 0, 1, 1)
    for bad, why in (({}, "malformed"), ({**meta, "outer_step": "one"}, "malformed"), ({**meta, "norms": [[1]]},
                     "malformed"), ({**meta, "hash": None}, "malformed"), ({**meta, "hash": "0" * 32}, "hashes to"),
                     ({**meta, "outer_step": 2}, "admitted for outer step 1"),
                     ({**meta, "inner_step": 5}, "admitted for outer step 1, i.e. inner step 4")):
        transport.header = bad  # a donor's header is its word: a bad one fails the transfer, nothing is saved
        with pytest.raises(TransferFailed, match=why):
            loop._receive(adm)
    assert CheckpointStore(t).latest() is None
    transport.header = meta
    got = loop._receive(adm)
    assert S.state_hash(got) == meta["hash"]
    t.close(save=False)  # SIGKILL before the next checkpoint; the process comes back with --ckpt.resume
    from intellect_jax.diloco.inner import TrainerInner

    t2 = node_trainer(tiny_cfg(tmp_path / "joiner", cache_dir, run={"steps": 12}, ckpt={"resume": True}))
    inner2 = TrainerInner(t2)
    back = CheckpointStore(t2, resume=True).latest()
    assert back is not None and back.outer_step == 1 and S.state_hash(back) == meta["hash"]
    assert back.data == position
    inner2.adopt(back)  # the data pipeline takes the position (it refused {} before)
    assert inner2.data_state() == position
    inner2.train(6)
    assert inner2.step == 6 and inner2.data_state() != position
    # a checkpoint written with no data position ({} on disk) resumes at the start of the shard
    CheckpointStore(t2).save(back._replace(inner_opt_state=inner2.live_opt_state(), inner_step=8, outer_step=2,
                                           data=None), wait=True)
    old = CheckpointStore(t2, resume=True).latest()
    assert old.outer_step == 2 and old.data is None
    t2.close(save=False)


@pytest.mark.slow
def test_trainer_resume_falls_back_past_a_damaged_checkpoint(tmp_path, cache_dir, capsys):
    from intellect_jax.cli import run_main
    from intellect_jax.trainer.loop import Trainer

    cfg = tiny_cfg(tmp_path, cache_dir, run={"steps": 6}, ckpt={"every": 2, "keep": 3, "async_save": False})
    t = Trainer(cfg)
    t.train()
    t.close()
    ck = t.run_dir / "ckpt"
    flip_bytes(ck / "6" / "state")
    resumed = Trainer(tiny_cfg(tmp_path, cache_dir, run={"steps": 6}, ckpt={"every": 2, "resume": True}))
    assert resumed.step == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint 6 is damaged" in err[0] and "falling back to checkpoint 4" in err[0], err
    resumed.close(save=False)
    # every checkpoint damaged: one error line and exit code 2
    for step in ("2", "4"):
        flip_bytes(ck / step / "state")
    from intellect_jax import train

    argv = ["--run.out_dir", str(tmp_path / "runs"), "--run.name", "t", "--run.steps", "6", "--run.no-progress",
            "--data.cache_dir", cache_dir, "--data.batch_size", "8", *TINY_ARGS, "--ckpt.resume"]
    code = run_main(lambda: train.main(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: no readable checkpoint"), err
    assert sum("is damaged" in line for line in err) == 3 and len(err) == 4


