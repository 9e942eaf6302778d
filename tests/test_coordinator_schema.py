"""The coordinator's wire schemas (issue 21): every request is parsed strictly before it touches
the membership (fuzzed against a live service), and every reply the client reads is parsed too,
so a malformed one from an impostor or broken coordinator is one clear ProtocolError."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from intellect_jax.coordinator.client import CoordinatorClient
from intellect_jax.coordinator.protocol import PROTOCOL, CoordinatorConfig, Epoch, ProtocolError
from intellect_jax.coordinator.schema import parse_request
from intellect_jax.coordinator.service import CoordinatorService
from helpers import FP

OPS = ("register", "hb", "sync", "admit", "received", "leave", "status", "lease")


def _templates(sess: dict[str, str]) -> dict[str, dict[str, Any]]:
    """A valid request of every op (node a)."""
    a = {"node": "a", "session": sess["a"]}
    return {
        "register": {"node": "a", "addr": "127.0.0.1:9000", "devices": 1, "protocol": PROTOCOL, "fingerprint": FP,
                     "founder": True, "outer_steps": 10,
                     "resume": {"outer_step": 0, "epoch_id": 0, "rank": 0, "state_hash": "h", "members": ["a"]}},
        "hb": {}, "status": {},
        "sync": {**a, "step": 0, "state_hash": "h0", "retry_of": None, "sits_out": None,
                 "report": {"avg_failed": False, "accused": ["b", "why"]}},
        "admit": {**a, "requeue": False},
        "received": {**a, "step": 1},
        "leave": a,
        "lease": {**a, "round": 0, "round_steps": 10, "unit_steps": 5, "unit_tokens": 640},
    }


_scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
            | st.text(max_size=12) | st.text(min_size=129, max_size=300))
_json = st.recursive(_scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                     max_leaves=8)


@st.composite
def _malformed(draw: Any, sess: dict[str, str]) -> dict[str, Any]:
    """A request of a random op with a field missing, of a wrong type (also inside ``report``
    and ``resume``), an extra field, or random JSON."""
    op = draw(st.sampled_from(OPS))
    req = {"op": op, **_templates(sess)[op]}
    kind = draw(st.sampled_from(["drop", "retype", "extra", "nested", "random"]))
    keys = sorted(req)
    if kind == "drop":
        del req[draw(st.sampled_from(keys))]
    elif kind == "retype":
        req[draw(st.sampled_from(keys))] = draw(_json)
    elif kind == "extra":
        req[draw(st.text(min_size=1, max_size=10).filter(lambda k: k not in req))] = draw(_json)
    elif kind == "nested" and op in ("sync", "register"):
        key = "report" if op == "sync" else "resume"
        inner = dict(req[key])
        inner[draw(st.sampled_from(sorted(inner) + ["more"]))] = draw(_json)
        req[key] = inner
    else:
        req = draw(st.dictionaries(st.text(max_size=10), _json, max_size=6))
        if draw(st.booleans()):
            req["op"] = op
    return req


def _stable(status: dict[str, Any]) -> dict[str, Any]:
    return {**status, "nodes": [{k: v for k, v in n.items() if k != "heartbeat_age"} for n in status["nodes"]]}


@pytest.mark.slow
def test_fuzzed_requests_of_every_type_get_one_line_errors_and_the_service_works_on() -> None:
    svc = CoordinatorService(CoordinatorConfig(min_nodes=2, join_window=0.0, heartbeat_timeout=60.0,
                                               keepalive_interval=0.01, tick_interval=0.02)).start()
    sess = {}
    for n in "ab":
        reg = {"op": "register", **_templates({"a": ""})["register"], "node": n, "resume": None}
        sess[n] = svc.handle(reg, identity=n)["session"]
    before = _stable(svc.status())
    seen: set[str] = set()

    @settings(max_examples=400, deadline=None, database=None)
    @given(st.data())
    def fuzz(data: Any) -> None:
        req = data.draw(_malformed(sess))
        try:
            parse_request(req)
            assume(False)  # (valid after all: not what this test is about)
        except ProtocolError:
            pass
        identity = data.draw(st.sampled_from(["a", "b", "mallory", None]))
        session = ("a", sess["a"]) if data.draw(st.booleans()) else None
        reply = svc.handle(req, session, deadline=time.monotonic(), identity=identity)
        assert reply["ok"] is False and reply["error"] == "ProtocolError" and reply["reason"] == "malformed", reply
        msg = reply["message"]
        assert msg.startswith("malformed ") and "\n" not in msg and len(msg) < 400, msg
        op = req.get("op")
        if isinstance(op, str) and op in OPS:
            assert msg.startswith(f"malformed {op!r} request: "), msg
            seen.add(op)

    try:
        fuzz()
        assert seen == set(OPS)
        assert _stable(svc.status()) == before  # nothing changed
        assert any(t.name.startswith("coordinator-tick-") and t.is_alive() for t in threading.enumerate())
        replies: dict[str, dict] = {}

        def go(n: str) -> None:
            replies[n] = svc.handle({"op": "sync", "node": n, "session": sess[n], "step": 0, "state_hash": "h0"},
                                    deadline=time.monotonic() + 10.0, identity=n)

        ts = [threading.Thread(target=go, args=(n,)) for n in "ab"]
        for t in ts:
            t.start()
        for t in ts:
            t.join(15)
        assert all(r["ok"] and [m[0] for m in r["epoch"]["members"]] == ["a", "b"] for r in replies.values()), replies
        assert svc.membership.record.hashes == {0: "h0"}
    finally:
        svc.stop()


# ---------------------------------------------------------------------------------------------
# the client reads every reply through its schema
# ---------------------------------------------------------------------------------------------
_REGISTERED = {"ok": True, "node_id": "a", "session": "t" * 32, "member": True, "outer_step": 0, "epoch_id": 0,
               "fingerprint": FP, "heartbeat_timeout": 5.0, "note": ""}
_EPOCH = {"epoch_id": 1, "outer_step": 0, "members": [["a", "h:1"], ["b", "h:2"]], "rank": 0, "serve": [],
          "hash_mismatch": [], "changed": True, "sitting_out": []}


class _Wire:
    """A coordinator that answers each op with what the test says."""

    name = "coordinator 10.9.9.9:1"

    def __init__(self, **replies: Any) -> None:
        self.replies = {"register": _REGISTERED} | replies

    def open(self, msg: dict[str, Any], timeout: float) -> tuple[Any, dict[str, Any]]:
        return object(), self.replies["register"]

    def beat(self, handle: Any, msg: dict[str, Any], patience: float) -> dict[str, Any]:
        return self.replies["hb"]

    def close(self, handle: Any) -> None:
        pass

    def request(self, msg: dict[str, Any], deadline: float | None, connect_timeout: float) -> dict[str, Any]:
        return self.replies[msg["op"]]


def _client(**replies: Any) -> CoordinatorClient:
    return CoordinatorClient(None, None, "a", "h:1", fingerprint=FP, wire=_Wire(**replies), heartbeat_interval=3600.0,
                             say=lambda line: None)


def test_the_client_parses_good_replies_into_its_types() -> None:
    adm = {"donor_id": "b", "donor_addr": "h:2", "admitted_at": 0, "outer_step": 1, "epoch_id": 1, "state_hash": "x"}
    c = _client(sync={"ok": True, "epoch": _EPOCH}, admit={"ok": True, "admission": adm},
                received={"ok": True, "accepted": True}, status={"ok": True, "status": {"outer_step": 0}},
                leave={"ok": True})
    try:
        assert c.register().session == "t" * 32
        ep = c.sync(0, "h0")
        assert isinstance(ep, Epoch) and ep.members == (("a", "h:1"), ("b", "h:2")) and ep.node_ids == ["a", "b"]
        assert c.wait_admission().state_hash == "x" and c.state_received(1) is True
        assert c.status() == {"outer_step": 0}
        c.leave()
    finally:
        c.close()


@pytest.mark.parametrize("op, reply, says", [
    ("register", _REGISTERED | {"session": 5}, "malformed register reply from coordinator 10.9.9.9:1: session: "),
    ("sync", {"ok": True, "epoch": {k: v for k, v in _EPOCH.items() if k != "members"}},
     "malformed sync reply from coordinator 10.9.9.9:1: epoch.members: Field required"),
    ("sync", {"ok": True, "epoch": _EPOCH | {"rank": 2}}, "epoch: Value error, rank 2 outside a ring of 2"),
    ("sync", {"ok": True, "epoch": _EPOCH | {"members": [["a"]]}}, "epoch.members.0: List should have at least 2"),
    ("admit", {"ok": True, "admission": {"donor_id": None}}, "malformed admit reply from coordinator 10.9.9.9:1: "
                                                             "admission.donor_id: "),
    ("received", {"ok": True}, "malformed received reply from coordinator 10.9.9.9:1: accepted: Field required"),
    ("status", {"ok": True, "status": []}, "malformed status reply from coordinator 10.9.9.9:1: status: "),
    ("sync", {"ok": False, "error": 7}, "malformed error reply from coordinator 10.9.9.9:1: error: "),
    ("sync", {"epoch": _EPOCH}, "malformed error reply from coordinator 10.9.9.9:1: ok: Field required"),
    ("hb", {"ok": True, "view": {"role": "boss"}}, "malformed hb reply from coordinator 10.9.9.9:1: view.role: "),
])
def test_a_malformed_reply_is_one_protocol_error(op: str, reply: dict[str, Any], says: str) -> None:
    c = _client(**{op: reply})
    try:
        with pytest.raises(ProtocolError) as ei:
            if op == "register":
                c.register()
            else:
                assert c.register().member
                if op == "hb":
                    c._beat(object())
                elif op == "status":
                    c.status()
                elif op == "sync":
                    c.sync(0, "h0")
                elif op == "admit":
                    c.wait_admission()
                else:
                    c.state_received(1)
        assert says in str(ei.value) and "\n" not in str(ei.value), str(ei.value)
    finally:
        c.close()


def test_fuzzed_requests_over_sockets_then_a_three_node_run_keeps_one_history(coordinator) -> None:
    """The same fuzz against a live socket coordinator, from members and a stranger to the run's
    membership (each malformed request on its own TLS connection, plus frames that are not JSON
    objects); afterwards three nodes run three barriers: one hash per step, nobody evicted."""
    from concurrent.futures import ThreadPoolExecutor

    from intellect_jax.coordinator.wire import SocketWire
    from intellect_jax.net import FrameError, PeerClosed, recv_msg
    from intellect_jax.net.frames import MsgType
    from helpers import coord_client, coord_transport, free_port

    coord = coordinator(min_nodes=3)
    cs = [coord_client(coord.address, n, free_port()) for n in "abc"]
    try:
        for c in cs:
            c.register()
        sess = {"a": cs[0]._session}
        wires = {n: SocketWire(coord.address, coord_transport(n)) for n in ("a", "b", "mallory")}
        before = _stable(coord.status())

        @settings(max_examples=60, deadline=None, database=None)
        @given(st.data())
        def fuzz(data: Any) -> None:
            wire = wires[data.draw(st.sampled_from(sorted(wires)))]
            conn = wire._connect(5.0)
            try:
                if data.draw(st.integers(0, 9)) == 0:  # a frame that is no JSON object
                    conn.send(MsgType.META, data.draw(st.sampled_from([b"[1, 2]", b"\"x\"", b"{", b"\xff"])))
                else:
                    req = data.draw(_malformed(sess))
                    try:
                        parse_request(req)
                        assume(False)  # (valid after all)
                    except ProtocolError:
                        pass
                    conn.send(MsgType.META, json.dumps(req).encode())
                reply = recv_msg(conn, time.monotonic() + 5.0)
                assert reply["ok"] is False and reply["error"] == "ProtocolError", reply
            except (FrameError, PeerClosed):
                pass  # (the server may hang up after its one-line answer to a broken frame)
            finally:
                conn.close()

        fuzz()
        assert _stable(coord.status()) == before
        with ThreadPoolExecutor(3) as ex:
            for k in range(3):
                eps = [f.result(20) for f in [ex.submit(c.sync, k, f"h{k}") for c in cs]]
                assert all(ep.node_ids == ["a", "b", "c"] for ep in eps)
        status = coord.status()
        assert status["evictions"] == [] and status["high_water_mark"] == {"outer_step": 2, "hash": "h2"}
        assert coord.membership.record.hashes == {0: "h0", 1: "h1", 2: "h2"}
    finally:
        for c in cs:
            c.close()


def test_a_ring_address_nobody_can_dial_is_refused_at_registration(coordinator: Any) -> None:
    """Every member builds its rings from the others' addresses: one that is no host:port would
    fail every ring of the run, so the socket coordinator refuses it at registration (one line)
    and nobody is registered."""
    from intellect_jax.coordinator.wire import SocketWire
    from intellect_jax.net import recv_msg
    from intellect_jax.net.frames import MsgType
    from helpers import coord_transport

    coord = coordinator(min_nodes=2)
    wire = SocketWire(coord.address, coord_transport("mallory"))
    for addr in ("sim://x", "garbage", "10.0.0.1:99999", "10.0.0.1:", "[::1]:8x", "10.0.0.1:0", ":5"):
        conn = wire._connect(5.0)
        try:
            req = {**_templates({"a": "-"})["register"], "op": "register", "node": "mallory", "addr": addr}
            conn.send(MsgType.META, json.dumps(req).encode())
            reply = recv_msg(conn, time.monotonic() + 5.0)
        finally:
            conn.close()
        assert reply["ok"] is False and reply["reason"] == "malformed", reply
        assert reply["message"].startswith("malformed 'register' request: addr: not a") and "\n" not in reply["message"]
    assert coord.status()["nodes"] == []


@pytest.mark.parametrize(("senders", "numel", "want"), [(70, 64, 64), (20, 1 << 18, 8)])
def test_a_report_on_many_bad_senders_still_parses(senders: int, numel: int, want: int) -> None:
    """An owner holding bad pieces of many senders reports the first and as many more as the
    schema takes (64) and the report's size budget leaves (``net.audit.MAX_CASE_BYTES``: here
    eight more fp32 pieces of 2^18 values): a longer list would get the whole sync refused."""
    from intellect_jax.coordinator.schema import Report
    from intellect_jax.diloco.loop import round_report
    from intellect_jax.net.evidence import evidence

    ids = [f"n{i}" for i in range(senders + 1)]
    ev = evidence(step=3, epoch=4, call=0, segment=0, piece=0, numel=numel, mode="fp32", block=64,
                  payload=b"\xff" * (4 * numel), signature=b"\x01" * 64, cert=b"\x02" * 400)
    report = round_report(False, ids, [(r, "non-finite values", ev) for r in range(1, senders + 1)], [], None)
    parsed = Report.model_validate(report)
    assert parsed.accused == ["n1", "non-finite values"] and len(parsed.more) == want
    assert [a.accused[0] for a in parsed.more] == ids[2:2 + want]
    assert len(json.dumps(report)) < (16 << 20)  # the coordinator's MAX_MSG
