"""Gathered contributions (top-k, top-1, int1) encoded on the devices (XLA): the host codec's bytes, error feedback
there, through the in-process and the socket ring, and in the outer loop beside host encoders."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from intellect_jax.diloco.device_codec import DeviceEncoder, supported
from intellect_jax.kernels import codecs_xla
from intellect_jax.net import quant
from intellect_jax.net.comm import RingConfig
from intellect_jax.testing.local_ring import LocalGroup

# 2-bit (top-1 of 4) and 3-bit (top-1 of 8) positions, 12-bit and 16-bit (top-k, chunks above 4096)
ROWS = [("top1of4", 4096), ("top1of8", 256), ("topk64", 4096), ("topk4", 8192), ("int1", 1024), ("int1", 64)]


def _device_bytes(x: np.ndarray, mode: str, C: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(payload, what it decodes to on the devices, bytes of its levels) of flat ``x`` as one piece."""
    full, r = divmod(x.size, C)
    outs = ([(codecs_xla.encode_rows(jnp.asarray(x[: full * C].reshape(full, C)), mode, C), C)] if full else []) + \
        ([(codecs_xla.encode_rows(jnp.asarray(x[full * C:].reshape(1, r)), mode, C), r)] if r else [])
    secs = [[np.asarray(o[m]).reshape(-1) for o, _ in outs] for m in range(3)]
    levels = np.concatenate(secs[0])
    wire = np.concatenate([levels.view(np.uint8), *secs[1], *secs[2]])
    dec = np.concatenate([np.asarray(codecs_xla.decode_rows(o[0], *o[3], mode, n)).reshape(-1) for o, n in outs])
    return wire, dec, levels.nbytes


@pytest.mark.parametrize("mode,C", ROWS)
def test_rows_are_the_host_codec_s_bytes(mode, C):
    """Positions and codes bit for bit, levels to float32 rounding; full chunks and a tail."""
    rng = np.random.default_rng(0)
    assert codecs_xla.aligned(mode, C) and supported(mode, C) is None
    for n in (3 * C + 77, min(77, C - 1)):  # full chunks and a tail; a tail alone
        x = (rng.standard_t(3, n) * 1e-3).astype(np.float32)
        host = quant.encode(x, mode, C)
        wire, dec, nl = _device_bytes(x, mode, C)
        assert wire.nbytes == host.nbytes
        np.testing.assert_array_equal(wire[nl:], host[nl:])
        np.testing.assert_allclose(wire[:nl].view(np.float32), host[:nl].view(np.float32), rtol=1e-6)
        np.testing.assert_array_equal(dec, quant.decode(wire, n, mode, C))  # as every rank decodes it


def test_unaligned_codecs_stay_on_the_host():
    assert not codecs_xla.aligned("topk5", 100) and "whole bytes" in supported("topk5", 100)
    assert not codecs_xla.aligned("top1of8", 40)  # 5 groups of 3-bit positions
    assert not codecs_xla.aligned("int1", 100) and "whole bytes" in supported("int1", 100)
    assert "host" in supported("int2", 64) and "host" in supported("int4", 64)


def test_a_non_finite_value_anywhere_poisons_its_chunk_only():
    x = np.random.default_rng(1).standard_normal(3 * 256).astype(np.float32)
    x[256 + 5] = np.nan  # in chunk 1, wherever it is
    for mode in ("top1of4", "topk8"):
        wire, _, nl = _device_bytes(x, mode, 256)
        lv = wire[:nl].view(np.float32).reshape(-1, 2)
        assert np.isfinite(lv[[0, 2]]).all() and np.isnan(lv[1]).all()
        assert not np.isfinite(quant.decode(wire, x.size, mode, 256)).all()
    wire, _, nl = _device_bytes(x, "int1", 256)  # int1: its block's scale
    s = wire[:nl].view(np.float32)
    assert np.isfinite(s[[0, 2]]).all() and np.isnan(s[1])
    x[256 + 5], x[9] = np.inf, 3e38  # inf: an infinite scale; huge finite values: a finite one
    s = _device_bytes(x, "int1", 256)[0][:nl].view(np.float32)
    assert np.isfinite(s[[0, 2]]).all() and s[1] == np.inf
    for mode in ("top1of4", "topk8"):  # kept values whose float32 sum passes float32's range: finite levels
        wire, _, n_lv = _device_bytes(np.linspace(1e36, 3e38, 3 * 256).astype(np.float32), mode, 256)
        assert np.isfinite(wire[:n_lv].view(np.float32)).all(), mode
    for n in (24, 40, 1000):  # blocks (or a last one) whose mean of a / n rounds past float32's range
        s = _device_bytes(np.full(n, np.finfo(np.float32).max, np.float32), "int1", 1024 if n == 1000 else 64)[0]
        assert np.isfinite(s[:4].view(np.float32)).all(), n


def _tree(seed: int = 1):
    rng = np.random.default_rng(seed)
    return {"a": rng.standard_normal((64, 96)).astype(np.float32), "b": rng.standard_normal(1000).astype(np.float32),
            "c": rng.standard_normal((128, 512)).astype(np.float32)}


def _placed(tree):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tp"))
    sh = {"a": NamedSharding(mesh, P("fsdp", "tp")), "b": NamedSharding(mesh, P()),
          "c": NamedSharding(mesh, P(None, "fsdp"))}
    return {k: jax.device_put(v, sh[k]) for k, v in tree.items()}, sh


@pytest.mark.parametrize("mode,C,bucket,piece", [("top1of4", 256, 1 << 26, 1 << 18), ("top1of4", 256, 5_000, 512),
                                                ("topk8", 512, 70_000, 1024), ("int1", 256, 5_000, 512)])
def test_a_sharded_tree_encodes_like_the_host_and_keeps_its_residual_placed(mode, C, bucket, piece):
    """Buckets of several leaves, pieces across leaves, tails: the ring's pieces (what the host
    would send, to float32 rounding of the levels); the next residual is exactly what the
    payload dropped, sharded like the pseudo-gradient; a muted node sends zeros."""
    host, res = _tree(), {k: 0.1 * v for k, v in _tree(2).items()}
    dev, sh = _placed(host)
    cfg = RingConfig(mode=mode, block_size=C, bucket_numel=bucket, piece_numel=piece)
    enc = DeviceEncoder(mode, C, bucket, piece)
    e, nxt, finite = enc.encode(dev, None, 1.0, False)
    got = LocalGroup(1, cfg).all_reduce_mean_all([e])[0]  # what every rank decodes
    ref = LocalGroup(2, cfg).all_reduce_mean_all([host, host])[0]  # the host codec's
    for k in host:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(np.asarray(nxt[k]), host[k] - got[k])
        assert nxt[k].sharding.is_equivalent_to(sh[k], host[k].ndim)
    assert finite and enc.last_bytes < sum(v.nbytes for v in host.values()) / 8
    e2, nxt2, _ = enc.encode(dev, res, 0.5, False)  # contribution d + 0.5 * residual (host arrays placed)
    got2 = LocalGroup(1, cfg).all_reduce_mean_all([e2])[0]
    for k in host:
        np.testing.assert_allclose(np.asarray(nxt2[k]) + got2[k], host[k] + 0.5 * res[k], rtol=1e-5, atol=1e-6)
    e0, _, _ = enc.encode(dev, nxt, 0.5, True)
    assert not any(np.any(v) for v in LocalGroup(1, cfg).all_reduce_mean_all([e0])[0].values())
    assert enc.norm(dev) == pytest.approx(np.sqrt(sum(np.sum(v.astype(np.float64) ** 2) for v in host.values())),
                                          rel=1e-5)
    bad = dict(dev, b=dev["b"].at[3].set(jnp.inf))
    assert enc.norm(bad) == np.inf and not enc.encode(bad, None, 1.0, False)[2]


@pytest.mark.parametrize("spec,shape", [(P("fsdp", None), (512, 8192)), (P(None, "fsdp", None), (8, 512, 1024)),
                                        (P(None, "fsdp"), (1024, 4096))])
def test_a_leaf_sharded_on_any_axis_is_never_gathered_whole(spec, shape):
    """The model's stacked layers and its embedding are sharded on a later axis: flattening them
    must move them with all-to-alls, never gather a whole leaf on a device."""
    from intellect_jax.diloco.device_codec import _encode_bucket

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(8, 1), ("fsdp", "tp"))
    sh, one = NamedSharding(mesh, spec), NamedSharding(mesh, P())
    d = [jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sh)]
    scalars = [jax.ShapeDtypeStruct((), t, sharding=one) for t in (jnp.float32, jnp.bool_)]
    c = _encode_bucket.lower(d, d, *scalars, mode="top1of4", chunk=4096, placed=(sh,)).compile()
    shard = np.prod(shape) * 4 / 8
    assert "all-gather" not in c.as_text()
    assert c.memory_analysis().temp_size_in_bytes < 4 * shard


@pytest.mark.parametrize("mode,C", [("top1of4", 256), ("topk8", 512), ("int1", 64)])
def test_a_muted_node_s_zeros_are_made_on_the_host_and_decode_to_zeros(mode, C):
    """A node sitting a round out sends zeros made without any device program: valid payloads
    for every piece (tails and an empty leaf included), decoding to zeros; for top-1 the very
    bytes the devices make of zeros."""
    other = {**_tree(), "d": np.zeros(0, np.float32)}
    like = {k: np.zeros_like(v) for k, v in other.items()}
    enc = DeviceEncoder(mode, C, 5_000, 512)
    z = enc.zeros(like)
    cfg = RingConfig(mode=mode, block_size=C, bucket_numel=5_000, piece_numel=512)
    got = LocalGroup(2, cfg).all_reduce_mean_all([z, other])[0]
    ref = LocalGroup(2, cfg).all_reduce_mean_all([like, other])[0]
    for k in like:
        np.testing.assert_array_equal(got[k], ref[k])
    if not mode.startswith("topk"):
        dev = enc.encode(jax.tree.map(jnp.asarray, like), None, 1.0, False)[0]
        assert all(np.array_equal(x, y) for bx, by in zip(z.payloads, dev.payloads) for x, y in zip(bx, by))


def test_an_encoded_contribution_shares_a_socket_ring_with_host_encoders():
    """Rank 0 brings payloads made on the devices, the others host trees: every rank gets the
    same bits, those of the in-process fake; a contribution made for other settings is refused."""
    from test_net_ring import _nodes, _ring, _run

    cfg = RingConfig(mode="top1of4", block_size=256, bucket_numel=70_000, piece_numel=1024)
    trees = [_tree(s) for s in (1, 3, 4)]
    e = DeviceEncoder("top1of4", 256, 70_000, 1024).encode(_placed(trees[0])[0], None, 1.0, False)[0]
    inputs = [e, trees[1], trees[2]]
    nodes = _nodes(3)
    try:
        outs, errs = _run(_ring(nodes, cfg), inputs)
    finally:
        for n in nodes:
            n.close()
    assert errs == [None] * 3
    fake = LocalGroup(3, cfg).all_reduce_mean_all(inputs)[0]
    for o in outs:
        for k in fake:
            np.testing.assert_array_equal(o[k].view(np.uint32), fake[k].view(np.uint32))
    with pytest.raises(ValueError, match="encoded as"):
        LocalGroup(3, RingConfig(mode="top1of4", block_size=256)).all_reduce_mean_all(inputs)
    with pytest.raises(ValueError, match="dropped"):
        LocalGroup(1, cfg).all_reduce_mean_all([e], [jax.tree.map(np.zeros_like, trees[0])])
    broken = dataclasses.replace(e, payloads=((e.payloads[0][0][:-1],) + e.payloads[0][1:],) + e.payloads[1:])
    with pytest.raises(ValueError, match="encoded piece 0"):
        LocalGroup(1, cfg).all_reduce_mean_all([broken])


def test_gpu_nodes_encode_on_their_devices_and_others_where_asked():
    from pydantic import ValidationError

    from intellect_jax.diloco.config import DilocoConfig
    from intellect_jax.diloco.device_pg import pg_path
    from intellect_jax.diloco.parts import DilocoError

    top1 = DilocoConfig(mode="top1")
    assert pg_path(top1, 1, kernel=True).encode and not pg_path(top1, 1, kernel=False).encode
    forced = pg_path(DilocoConfig(mode="top1", encode="device", overlap=False), 1, kernel=False)
    assert forced.encode and forced.device and "encoded on the devices" in forced.describe(None)
    assert pg_path(top1, 1, kernel=False, gpu=True).encode  # XLA: no kernel needed, a GPU is
    assert not pg_path(top1, 1, kernel=True, gpu=False).encode
    assert not pg_path(DilocoConfig(mode="int2"), 1, kernel=True).encode  # int2: the host's
    assert not pg_path(DilocoConfig(mode="top1", encode="host"), 1, kernel=True).encode
    assert not pg_path(top1, 2, kernel=True).encode  # a node of several processes: the host's
    with pytest.raises(DilocoError, match="single-process"):
        pg_path(DilocoConfig(mode="top1", encode="device"), 2, kernel=False)
    with pytest.raises(DilocoError, match="whole bytes"):
        pg_path(DilocoConfig(mode="topk", topk=6, encode="device"), 1, kernel=False)
    assert not pg_path(DilocoConfig(mode="topk", topk=6), 1, kernel=True).encode  # auto: falls back
    assert pg_path(DilocoConfig(mode="int1", block_size=1024), 1, kernel=True).encode  # int1: the devices'
    with pytest.raises(ValidationError, match="topk, top1 or int1"):
        DilocoConfig(mode="int8", encode="device")


# top-1 of 4 in chunks of 32 (aligned); not top-k: the task's "u" leaf is all ties, among which
# numpy's argpartition and XLA's top_k may keep different (equally valid) values
TOP1 = RingConfig(mode="top1of4", block_size=32, piece_numel=64)


def _numpy_nodes(n, device, poison_at=None):
    """The feedback tests' quadratic task; nodes in ``device`` hand the loop device contributions
    (``poison_at``: node 0's pseudo-gradient is NaN at that round)."""
    from intellect_jax.diloco.device_codec import DeviceContribution
    from intellect_jax.testing.local import NumpyInner
    from test_feedback import _task

    enc = DeviceEncoder(TOP1.mode, TOP1.block_size, TOP1.bucket_numel, TOP1.piece_numel)

    class DeviceInner(NumpyInner):
        rounds = 0

        def pseudo_gradient(self, outer_params):  # measured from where set_params left it, as on devices
            pg = super().pseudo_gradient(self.anchor)
            self.rounds += 1
            if poison_at == self.rounds and self is inners[0]:
                pg = {k: np.full_like(v, np.nan) for k, v in pg.items()}
            return DeviceContribution(jax.tree.map(jnp.asarray, pg), enc)

    targets, init, goal = _task(n)
    inners = [(DeviceInner if i in device else NumpyInner)(targets[i], init, goal) for i in range(n)]
    return inners


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_the_loop_with_device_contributions_follows_the_host_encoders(alpha):
    """Node 0 encodes on the devices: one history, the same final state as all-host encoding
    (to float32 rounding of the levels), and its residual is device arrays. With local feedback
    (``alpha``) its rounds start from params shifted on the devices, by its device residual."""
    from intellect_jax.diloco.parts import LoopConfig
    from intellect_jax.diloco.store import MemoryStore
    from intellect_jax.testing.local import run_local

    n, H, R = 3, 5, 6
    finals = []
    for device in ({0}, set()):
        inners, stores = _numpy_nodes(n, device), [MemoryStore() for _ in range(n)]
        run_local(LoopConfig(inner_steps=H, outer_steps=R, feedback=0.8, feedback_local=alpha, ckpt_every=H),
                  inners, TOP1, stores=stores)
        hashes = [{m["outer_step"]: m["outer_hash"] for _, m in x.records} for x in inners]
        assert hashes[0] == hashes[1] == hashes[2] and sorted(hashes[0]) == list(range(1, R + 1))
        finals.append(inners[1].weights)
        assert all(isinstance(x, jax.Array) == bool(device) for x in jax.tree.leaves(stores[0].states[R * H].residual))
    for k in finals[0]:
        np.testing.assert_allclose(finals[0][k], finals[1][k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_a_device_node_sits_out_a_poisoned_round_and_starts_a_broken_residual_anew(alpha):
    from intellect_jax.diloco.parts import LoopConfig
    from intellect_jax.diloco.state import init_state, nesterov_sgd
    from intellect_jax.diloco.store import MemoryStore
    from intellect_jax.testing.local import run_local
    from test_feedback import _task

    n, H, R = 3, 5, 4
    inners = _numpy_nodes(n, {0}, poison_at=3)
    bad = init_state(_task(n)[1], nesterov_sgd(0.7, 0.9), None, 0)
    bad = bad._replace(residual={k: np.full(np.shape(v), np.nan, np.float32) for k, v in bad.outer_params.items()})
    lines: list[str] = []
    stores_of_node0 = MemoryStore(bad)
    run_local(LoopConfig(inner_steps=H, outer_steps=R, feedback=1.0, feedback_local=alpha, ckpt_every=H), inners, TOP1,
              stores=[stores_of_node0] + [MemoryStore() for _ in range(n - 1)], log=lines.append)
    assert any("[node0]" in ln and "residual is not finite" in ln for ln in lines), lines
    assert sum("outer step 1 skipped" in ln for ln in lines) == n  # the poisoned average, skipped by all
    assert any("[node0]" in ln and "sitting out outer step 3" in ln for ln in lines), lines
    assert not any("outer step 3 skipped" in ln for ln in lines)  # the others' average is applied
    kept = stores_of_node0
    for a, b in zip(jax.tree.leaves(kept.states[2 * H].residual), jax.tree.leaves(kept.states[3 * H].residual)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # sat out: its residual kept as it was
    hashes = [{m["outer_step"]: m["outer_hash"] for _, m in x.records} for x in inners]
    assert hashes[0] == hashes[1] == hashes[2] and len(hashes[0]) == R
