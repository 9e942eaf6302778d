"""A joiner trusts nothing of its donor's that it did not check: fuzzed state headers fail the
transfer with a ``NetError`` (never another exception) and the next correct transfer works; a
donor's receipt is parsed like any header; the received state must hash to what the run recorded
(not to what the donor says), its outer params and momentum must be finite and its inner AdamW
moments within what an honest Adam can hold (:func:`~intellect_jax.trainer.optim.adam_envelope`)."""

from __future__ import annotations

import copy
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from intellect_jax.coordinator.protocol import Admission
from intellect_jax.diloco import state as S
from intellect_jax.diloco.parts import LoopConfig, NodeParts, TransferFailed
from intellect_jax.diloco.transfer import NetTransport, leaf_paths, vet_received
from intellect_jax.net.arrays import spec
from intellect_jax.net.blob import send_blob
from intellect_jax.net.errors import FrameError, NetError
from intellect_jax.net.transport import send_msg
from intellect_jax.trainer.optim import OptimConfig, adam_envelope, make_tx

from helpers import leaves, node_parts, outer_step
from wire_fuzz import RAW, FakeNet, malformed, mutations, send_raw

FUZZ = settings(max_examples=100, deadline=None)
H = 4


def _small() -> S.DilocoState:
    w = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    return S.DilocoState(w, S.MomentumState({"w": w["w"] / 10}), {"m": -w["w"]}, 1, H, None, (0.5,), skipped=False)


def _header(s: S.DilocoState) -> dict[str, Any]:
    arrays = s.arrays()
    return {"outer_step": s.outer_step, "inner_step": s.inner_step, "hash": S.state_hash(s), "norms": list(s.norms),
            "skipped": s.skipped, "paths": leaf_paths(arrays),
            "arrays": [[d.name, list(shape)] for d, shape in map(spec, leaves(arrays))]}


def _offer(net: FakeNet, header: dict[str, Any] | bytes, s: S.DilocoState) -> Any:
    """A donor's connection with ``header`` (or a raw payload) and the state's arrays sent."""
    donor = net.connect("joiner", "state/j/1", name="joiner j")
    if isinstance(header, bytes):
        send_raw(donor, header)
    else:
        send_msg(donor, header)
    for a in leaves(s.arrays()):
        send_blob(donor, a.reshape(-1).view(np.uint8))
    return donor


def test_a_joiner_meets_fuzzed_state_headers_with_net_errors_only() -> None:
    s, net = _small(), FakeNet()
    joiner = NetTransport(net, "j", watch_interval=0.05)  # type: ignore[arg-type]
    adm = Admission("d1", "x", 0, 1, 1)
    valid = _header(s)

    def receive(header: dict[str, Any] | bytes) -> BaseException | None:
        donor = _offer(net, header, s)
        try:
            meta, got = joiner.receive(adm, s, lambda: False, timeout=2)
            vet_received(adm, meta, got, H, lambda opt: None)
            return None
        except NetError as e:  # anything else fails the test
            return e
        finally:
            donor.close()

    @FUZZ
    @given(mutations(valid))
    def fuzz(m: tuple[str, str, dict[str, Any]]) -> None:
        kind, key, header = m
        err = receive(header)
        assert "\n" not in str(err)
        if malformed(kind, key, header, valid, loose=("norms", "skipped")):
            assert isinstance(err, FrameError) and "donor d1: malformed state header" in str(err), (header, err)
        elif header != valid:
            assert isinstance(err, NetError), header  # e.g. another hash, step or shape

    @FUZZ
    @given(RAW)
    def raw(payload: bytes) -> None:
        assert isinstance(receive(payload), FrameError)

    fuzz()
    raw()
    for bad, why in (({**valid, "outer_step": 1e400}, "outer_step: Input should be a valid integer"),
                     ({**valid, "norms": [float("nan")]}, "norms.0: Input should be a finite number"),
                     ({**valid, "hash": ["x"]}, "hash: Input should be a valid string")):
        err = receive(bad)
        assert isinstance(err, FrameError) and why in str(err), err
    assert receive(valid) is None  # the same joiner then takes a correct state
    assert joiner.last["bytes"] == sum(a.nbytes for a in leaves(s.arrays()))


class _Answering(FakeNet):
    """The joiner's end answers ``reply`` (a receipt) as soon as the donor dials."""

    reply: dict[str, Any] | bytes = {"ok": True}

    def connect(self, address: Any, channel: str, **kw: Any) -> Any:
        mine = super().connect(address, channel, **kw)
        theirs = self.pending.get()
        (send_raw if isinstance(self.reply, bytes) else send_msg)(theirs, self.reply)  # type: ignore[operator]
        self.keep = theirs
        return mine


def test_a_donor_meets_fuzzed_receipts_with_net_errors_only() -> None:
    s, net = _small(), _Answering()
    donor = NetTransport(net, "d1", watch_interval=0.05)  # type: ignore[arg-type]
    meta = {k: v for k, v in _header(s).items() if k not in ("paths", "arrays")}

    @FUZZ
    @given(st.one_of(mutations({"ok": True}).map(lambda m: m[2]), RAW))
    def fuzz(reply: dict[str, Any] | bytes) -> None:
        net.reply = reply
        try:
            donor.send("joiner:1", "j", s, meta, timeout=2)
        except NetError:
            return
        finally:
            net.keep.close()
        assert reply == {"ok": True}, reply

    fuzz()
    net.reply = {"ok": True}
    assert donor.send("joiner:1", "j", s, meta, timeout=2) == sum(a.nbytes for a in leaves(s.arrays()))


def test_a_donor_gives_up_after_its_configured_transfer_timeout() -> None:
    """The donor's transfer takes the node's ``diloco.transfer_timeout``, not a fixed 600 s."""
    s, seen = _small(), []
    donor = NetTransport(_Answering(), "d1", watch_interval=0.05, serve_timeout=7.5)  # type: ignore[arg-type]
    donor.send = lambda *a: seen.append(a[4]) or 0  # type: ignore[method-assign]
    assert donor.serve("j", "joiner:1", s, {}).wait(5)
    assert seen == [7.5]


# ---------------------------------------------------------------------------- what the hash does not cover
CFG = OptimConfig(b1=0.9, b2=0.95, clip_norm=1.0)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 12), st.floats(1e-3, 1e3), st.integers(0, 2**31 - 1), st.sampled_from([0.0, 1.0]))
def test_honest_adam_states_are_within_the_envelope(steps: int, scale: float, seed: int, clip: float) -> None:
    cfg = CFG.model_copy(update={"clip_norm": clip})
    tx, rng = make_tx(cfg), np.random.default_rng(seed)
    params = {"a": jnp.zeros((3, 4)), "b": jnp.zeros(5)}
    state = tx.init(params)
    for _ in range(steps):  # gradients of any size and sign, some of them tiny
        g = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape) * scale * rng.choice([1e-30, 1.0]),
                                               jnp.float32), params)
        _, state = tx.update(g, state, params)
    assert adam_envelope(jax.tree.map(np.asarray, state), cfg) is None


def test_adam_states_outside_the_envelope_are_named() -> None:
    tx = make_tx(CFG)
    params = {"w": jnp.zeros(4)}
    state = tx.init(params)
    _, state = tx.update({"w": jnp.asarray([0.3, -0.2, 0.1, 0.0])}, state, params)
    state = jax.tree.map(np.asarray, state)
    assert adam_envelope(state, CFG) is None

    def with_adam(**kw: Any) -> Any:
        return (state[0], state[1]._replace(**kw), state[2])

    mu, nu = state[1].mu["w"], state[1].nu["w"]
    for bad, why in ((with_adam(mu={"w": mu * 1e30}), r"beyond 0\.45\d x sqrt"),
                     (with_adam(mu={"w": np.float32([0, 0, 0, 1e-3])}), "beyond"),  # no second moment to match
                     (with_adam(nu={"w": -nu}), "negative Adam second moments at \\['w'\\]"),
                     (with_adam(nu={"w": nu + 1.0}), "beyond the clip norm 1.0"),
                     (with_adam(mu={"w": np.float32([np.nan, 0, 0, 0])}), "non-finite values .* at \\[1\\]"),
                     (with_adam(count=np.int32(-1)), "step count of -1"),
                     (with_adam(count=np.int32(0)), "beyond 0 x sqrt")):  # moments without a step
        assert re.search(why, adam_envelope(bad, CFG) or ""), (why, adam_envelope(bad, CFG))


def test_a_joiner_refuses_a_bogus_state_and_moments_out_of_bounds(tmp_path, cache_dir) -> None:
    """A donor serving outer params of -123 and momentum 1e30 under a header that hashes right is
    refused against the hash the run recorded; so are moments no honest AdamW holds. The
    donor's honest state is taken, moments and all."""
    from intellect_jax.diloco.loop import NodeLoop
    from intellect_jax.diloco.store import MemoryStore

    t, inner = node_parts(tmp_path, cache_dir)
    tx = S.nesterov_sgd(0.7, 0.9)
    s = outer_step(inner, inner.init_state(tx), tx, H)
    honest = s._replace(inner_opt_state=inner.snapshot(), data=None)
    recorded = S.state_hash(honest)
    bogus = honest._replace(outer_params=jax.tree.map(lambda x: np.full_like(x, -123), honest.outer_params),
                            outer_opt_state=S.MomentumState(jax.tree.map(lambda x: np.full_like(x, 1e30),
                                                                         honest.outer_params)))

    class Transport:
        sent: S.DilocoState = honest

        def receive(self, adm: Admission, template: Any, cancelled: Any, timeout: float) -> Any:
            return {k: v for k, v in _header(self.sent).items() if k not in ("paths", "arrays")}, \
                copy.deepcopy(self.sent)

    class Client:
        def admission_revoked(self, adm: Admission) -> bool:
            return False

    transport, store = Transport(), MemoryStore()
    loop = NodeLoop(LoopConfig(inner_steps=H, outer_steps=3), NodeParts("j", inner, Client(), None, transport, store))
    adm = Admission("d1", "x", 0, 1, 1, state_hash=recorded)
    adam = honest.inner_opt_state[1]
    refused = f"donor d1 sent a state of outer step 1 that hashes to .*; the run recorded {recorded[:12]}"
    for sent, why in ((bogus, refused),
                      (honest._replace(inner_opt_state=(honest.inner_opt_state[0], adam._replace(
                          mu=jax.tree.map(lambda m: m * np.float32(1e30), adam.mu)), honest.inner_opt_state[2])),
                       "donor d1 sent the state of outer step 1 with Adam first moments at .* beyond"),
                      (honest._replace(inner_opt_state=(honest.inner_opt_state[0], adam._replace(
                          nu=jax.tree.map(lambda v: -v - 1, adam.nu)), honest.inner_opt_state[2])),
                       "with negative Adam second moments")):
        transport.sent = sent
        with pytest.raises(TransferFailed, match=why):
            loop._receive(adm)
        assert not store.states  # nothing of it was kept
    transport.sent = honest
    got = loop._receive(adm)
    assert S.state_hash(got) == recorded
    for a, b in zip(leaves(t.state.opt_state), leaves(honest.inner_opt_state)):
        np.testing.assert_array_equal(a, b)  # the donor's moments, taken
    inner.train(H + 2)  # and trains on
    assert inner.step == H + 2
    t.close(save=False)
