"""Pseudo-gradients made on the devices: per-shard int8 pieces that decode to the host codec's values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import triton
from flax import nnx
from helpers import TINY_DATA, TINY_MODEL, tiny_cfg

from intellect_jax.diloco.config import DilocoConfig
from intellect_jax.diloco.device_pg import (
    DevicePseudoGradient,
    PgPath,
    Piece,
    assemble,
    host_quantize,
    pg_path,
)
from intellect_jax.diloco.parts import DilocoError
from intellect_jax.kernels import quant_triton as K
from intellect_jax.model import sharding as S
from intellect_jax.model.config import ModelConfig
from intellect_jax.model.llama import Llama
from intellect_jax.net import quant

# the tiny model: every shard of every kind of leaf, through the Triton interpreter
CFG = ModelConfig.preset(name=TINY_MODEL["preset"], **{k: v for k, v in TINY_MODEL.items() if k != "preset"},
                         vocab_size=TINY_DATA["bpe_vocab_size"])
BLOCK = 64


def interpreted_kernel(x: jax.Array, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The Triton kernel's source, run by Triton's interpreter on the shard's values."""
    n = int(x.size)
    nb = quant.num_blocks(n, block)
    s, q = torch.empty(nb), torch.empty(n, dtype=torch.int8)
    K.quantize_kernel[(triton.cdiv(nb, K.ROWS),)](torch.from_numpy(np.array(x)), n, s, q, BLOCK=block, ROWS=K.ROWS)
    return s.numpy(), q.numpy()


def _params(mesh):
    model = S.init_sharded(lambda: Llama(CFG, rngs=nnx.Rngs(params=0)), mesh)
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _train_a_bit(params):
    key = jax.random.key(1)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    moved = [x - 1e-3 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, [jax.device_put(m, x.sharding) for m, x in zip(moved, leaves)])


@pytest.mark.parametrize("fsdp,tp", [pytest.param(8, 1, marks=pytest.mark.slow), (4, 2),
                                     pytest.param(1, 1, marks=pytest.mark.slow)])
def test_pieces_decode_to_the_host_codec_of_each_shard(fsdp, tp):
    mesh = S.make_mesh(fsdp=fsdp, tp=tp, devices=jax.devices()[: fsdp * tp])
    outer = _params(mesh)
    host_outer = jax.tree.map(np.asarray, outer)
    dpg = DevicePseudoGradient(BLOCK, interpreted_kernel)
    dpg.mark(outer)
    inner = _train_a_bit(outer)
    pieces = dpg.pieces(inner)
    pg = assemble(pieces, host_outer, BLOCK)

    exact = jax.tree.map(lambda o, i: o - np.asarray(i), host_outer, inner)
    leaves = jax.tree.leaves(exact)
    n_unique = 0
    for x, d in zip(jax.tree.leaves(inner), jax.tree.leaves(pg)):
        # each distinct shard is one piece (replicas along tp are sent once)
        n_unique += len({tuple((s.start, s.stop) for s in sh.index) for sh in x.addressable_shards})
    assert len(pieces) == n_unique
    for p in pieces:  # every piece: the host codec's bytes for that shard of outer - inner
        shard = leaves[p.leaf][tuple(slice(a, b) for a, b in p.index)].reshape(-1)
        rs, rq = quant.quantize_int8(np.ascontiguousarray(shard), BLOCK)
        np.testing.assert_array_equal(p.scale.view(np.uint32), rs.view(np.uint32))
        np.testing.assert_array_equal(p.codes, rq)
    # within half an int8 step of the exact difference, and only codes + scales came off the devices
    for e, d in zip(leaves, jax.tree.leaves(pg)):
        assert np.abs(d - e).max() <= 0.5 * np.abs(e).max() / 127 * 1.0001
    n = sum(x.size for x in leaves)
    assert n < dpg.last_bytes <= n * (1 + 4 / BLOCK) + 4 * len(pieces)


def test_assemble_refuses_gaps_and_misfits():
    like = {"a": np.zeros((4, 8), np.float32)}
    s, q = quant.quantize_int8(np.ones(16, np.float32), 16)
    half = Piece(0, ((0, 2), (0, 8)), s, q)
    with pytest.raises(ValueError, match=r"leaf 0 of shape \(4, 8\): pieces cover 16 of 32"):
        assemble([half], like, 16)
    with pytest.raises(ValueError, match="16 codes and 1 scales for 8 elements"):
        assemble([Piece(0, ((0, 1), (0, 8)), s, q)], like, 16)
    other = Piece(0, ((2, 4), (0, 8)), s, q)
    np.testing.assert_array_equal(assemble([half, other], like, 16)["a"], np.ones((4, 8)))
    s8, q8 = quant.quantize_int8(np.ones(8, np.float32), 16)
    overlapping = [half, Piece(0, ((1, 2), (0, 8)), s8, q8)]  # 24 of 32 elements, but row 1 twice
    with pytest.raises(ValueError, match=r"piece of leaf 0 at \(\(1, 2\), \(0, 8\)\) overlaps the one at"):
        assemble(overlapping, like, 16)
    for bad in (Piece(1, ((0, 2), (0, 8)), s, q), Piece(0, ((0, 2),), s, q)):  # no such leaf; a rank too few
        with pytest.raises(ValueError, match="the tree has 1 leaves"):
            assemble([bad], like, 16)


def test_no_anchor_is_an_error():
    with pytest.raises(RuntimeError, match="no anchor"):
        DevicePseudoGradient(BLOCK, host_quantize).pieces({"w": jnp.zeros(3)})


PATHS = [  # settings, processes, kernel runs here -> (device, kernel, overlap) or the error
    ({}, 1, False, (True, False, True)),  # overlapped by default: the device path, host codec
    ({}, 1, True, (True, True, True)),
    ({}, 2, True, (True, True, False)),  # several processes: device, synchronous
    ({}, 2, False, (True, False, False)),
    ({"overlap": False}, 1, False, (False, False, False)),  # "auto" without the kernel: host
    ({"overlap": False}, 1, True, (True, True, False)),  # "auto" with it: device
    ({"overlap": False, "pseudo_gradient": "device"}, 1, False, (True, False, False)),
    ({"pseudo_gradient": "host"}, 1, True, (False, False, False)),
    ({"mode": "fp32"}, 1, False, (False, False, False)),  # unset overlap needs the int8 wire
    ({"mode": "fp32"}, 1, True, (True, True, False)),
    ({"mode": "fp32", "overlap": True}, 1, False, (True, False, True)),
    ({"block_size": 48}, 1, True, (True, False, True)),  # the kernel needs power-of-two blocks
    ({"block_size": 48, "overlap": False}, 1, True, (False, False, False)),
    ({"block_size": 48}, 2, True, (True, False, False)),
    ({"pseudo_gradient": "host"}, 2, False, "needs a single-process node"),
    ({"overlap": True}, 2, True, "not available on a node of several processes"),
]


@pytest.mark.parametrize("settings,processes,kernel,want", PATHS)
def test_the_pseudo_gradient_path_decision_table(settings, processes, kernel, want):
    d = DilocoConfig(**settings)
    if isinstance(want, str):
        with pytest.raises(DilocoError, match=want):
            pg_path(d, processes, kernel)
        return
    path = pg_path(d, processes, kernel)
    assert (path.device, path.kernel, path.overlap) == want
    dpg = path.build(d.block_size)
    assert (dpg is not None) == path.device
    if dpg is not None:
        assert dpg.block == d.block_size and dpg.quantize is (K.quantize if path.kernel else host_quantize)


def test_the_path_says_what_it_runs():
    assert PgPath(False, False, False).describe(None) == "pseudo-gradient made on the host; synchronous rounds"
    assert PgPath(True, True, True).describe(5) == ("pseudo-gradient made on the devices, quantized by the Triton "
                                                    "kernel; overlapped rounds: each average merged 5 inner steps "
                                                    "into the next round")


def test_host_stand_in_equals_the_interpreted_kernel():
    x = jnp.asarray(np.random.default_rng(0).standard_normal(5000).astype(np.float32))
    for a, b in zip(host_quantize(x, BLOCK), interpreted_kernel(x, BLOCK)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_diloco_nodes_on_the_device_path_agree_and_learn(tmp_path, cache_dir):
    """Two real trainers in one process, overlapped DiLoCo rounds over the in-process ring with
    top-1 of 4 and error feedback (as GPU nodes run by default): node 1 makes its pseudo-gradient by the device path (anchor, per-shard
    pieces, assembly; quantized by the host stand-in, which the test above holds equal to the
    kernel: the interpreter is too slow for whole models) and encodes on the host; node 0
    encodes on its 4 devices (diloco/device_codec.py), residual and all, its encoding launched
    at the window before the next round's steps. One hash per outer
    step, loss falls, node 0's residual stays on its devices like its params (and in its
    checkpoint), and only the codec's bytes left them. With local feedback: each merge lands on
    the outer params shifted by the residual where it lives, and both end on the outer params."""
    import json

    import jax

    from intellect_jax.diloco.device_codec import DeviceEncoder
    from intellect_jax.diloco.inner import TrainerInner
    from intellect_jax.diloco.store import MemoryStore
    from intellect_jax.testing.local import run_local
    from intellect_jax.diloco.parts import LoopConfig, Outcome
    from intellect_jax.net.comm import RingConfig
    from intellect_jax.trainer.loop import Role, Trainer

    class Merging(TrainerInner):
        def merge(self, placed):
            self.merged = getattr(self, "merged", []) + [(self.step, jax.device_get(placed))]
            super().merge(placed)

    H, outer = 4, 4
    ring = RingConfig(mode="top1of4", block_size=4096)
    trainers = [Trainer(tiny_cfg(tmp_path / f"n{i}", cache_dir, run={"steps": H * outer, "log_every": 1}),
                        node_rank=i, node_count=2, role=Role.INNER, devices=jax.devices()[4 * i:4 * i + 4])
                for i in range(2)]  # each on its own devices (see helpers.node_trainer)
    dpgs = [DevicePseudoGradient(BLOCK, host_quantize) for _ in trainers]
    enc = DeviceEncoder(ring.mode, ring.block_size, ring.bucket_numel, ring.piece_numel)
    stores = [MemoryStore(), MemoryStore()]
    inners = [Merging(trainers[0], dpgs[0], enc), Merging(trainers[1], dpgs[1])]
    try:
        outs = run_local(LoopConfig(inner_steps=H, outer_steps=outer, feedback=0.9, feedback_local=0.5, ckpt_every=H,
                                    overlap=True, overlap_delay=2),
                         inners, ring, stores=stores)
        rows = [[json.loads(line) for line in (t.run_dir / "metrics.jsonl").read_text().splitlines()]
                for t in trainers]
        params = trainers[0].state.params
        ends = [jax.device_get(t.state.params) for t in trainers]
    finally:
        for t in trainers:
            t.close(save=False)
    assert set(outs) <= {Outcome.FINISHED, Outcome.COMPLETED}
    hashes = [{r["outer_step"]: r["outer_hash"] for r in rs if "outer_hash" in r} for rs in rows]
    assert sorted(hashes[0]) == list(range(1, outer + 1)) and hashes[0] == hashes[1]
    loss = [r["loss"] for r in rows[0] if "loss" in r]
    assert np.mean(loss[-H:]) < np.mean(loss[:H]) - 0.3
    n = trainers[0].mcfg.num_params()
    assert n < dpgs[1].last_bytes < 1.1 * n  # int8 + scales, not 4 bytes per value
    assert 0 < enc.last_bytes < 0.15 * n  # top-1 of 4's 1.02 bits per value, not int8's 8.5
    r0 = stores[0].states[H * outer].residual
    assert all(isinstance(x, jax.Array) and x.sharding.is_equivalent_to(p.sharding, p.ndim)
               for x, p in zip(jax.tree.leaves(r0), jax.tree.leaves(params)))
    assert any(np.any(np.asarray(x)) for x in jax.tree.leaves(r0))
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(stores[1].states[H * outer].residual))
    final = stores[0].states[H * outer].outer_params
    for end in ends:  # the last round ends on the outer params, not on a shifted start
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(end), jax.tree.leaves(final)))
    for inner, st in zip(inners, stores):  # round r merged step r's outer params less 0.45 x its residual
        assert [step for step, _ in inner.merged] == [r * H + 2 for r in range(1, outer)]
        for step, placed in inner.merged:
            s = st.states[step - 2]
            want = jax.tree.map(lambda w, e: w - np.float32(0.45) * np.asarray(e), s.outer_params, s.residual)
            for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(want)):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
