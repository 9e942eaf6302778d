"""Per-node identities: the keys command, credential checks, mutual TLS bound to identities,
revocation, channels only their owner may open, and the listener's budgets."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from intellect_jax.diloco.transfer import channel as state_channel
from intellect_jax.net import AuthError, Authority, Credentials, IdentityError, NetNode, PeerTimeout
from intellect_jax.net.frames import MsgType
from intellect_jax.net.listener import Listener, prefix_of
from intellect_jax.net.transport import TransportConfig, connect
from intellect_jax.testing.identities import transport_config

from helpers import ROOT, expire, wait_for


def _keys(*args: str, cwd: Path, capsys: Any) -> tuple[int, str, str]:
    """``python -m intellect_jax.keys --dir <cwd>/k ARGS`` in this process: (exit code, out, err)."""
    from intellect_jax.cli import run_main
    from intellect_jax.keys import main

    code = run_main(lambda: main(["--dir", str(cwd / "k"), *args]))
    out, err = capsys.readouterr()
    return code, out, err


def test_keys_command_manages_the_run_authority(tmp_path: Path, capsys: Any) -> None:
    r = subprocess.run([sys.executable, "-m", "intellect_jax.keys", "--dir", "k", "init", "--run-id", "r1"],
                       cwd=tmp_path, text=True, capture_output=True, env={**os.environ, "PYTHONPATH": ROOT},
                       timeout=60)  # the command itself, once; the rest in this process
    assert r.returncode == 0 and "run authority in k" in r.stdout, r.stderr
    code, out, _ = _keys("issue", "alice", "bob", cwd=tmp_path, capsys=capsys)
    assert code == 0 and "alice" in out and "bob" in out
    k = tmp_path / "k"
    for name in ("ca", "coordinator", "operator", "alice", "bob"):  # private keys are the owner's alone
        assert stat.S_IMODE((k / f"{name}.key").stat().st_mode) == 0o600, name
    assert _keys("revoke", "bob", cwd=tmp_path, capsys=capsys)[1].strip() == "bob: 1 certificate(s) revoked"
    listing = _keys("list", cwd=tmp_path, capsys=capsys)[1]
    assert "REVOKED" in next(line for line in listing.splitlines() if line.startswith("bob"))
    assert "valid" in next(line for line in listing.splitlines() if line.startswith("alice"))
    Credentials.load(k, "alice")
    with pytest.raises(IdentityError, match=r"identity bob is revoked"):
        Credentials.load(k, "bob")
    for args, needle in ((("init",), "already holds a run authority"), (("issue", "coordinator"), "reserved"),
                         (("issue", "bad name"), "invalid identity"), (("revoke", "carol"), "never issued"),
                         (("revoke", "coordinator"), "cannot be revoked")):
        code, _, err = _keys(*args, cwd=tmp_path, capsys=capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (args, err)


def test_credentials_fail_in_one_line_naming_the_file(tmp_path: Path) -> None:
    auth = Authority.init(tmp_path / "run", "r")
    auth.issue("a")
    auth.issue("b")
    other = Authority.init(tmp_path / "other", "r")
    other.issue("a")
    run = tmp_path / "run"
    (run / "mixed").mkdir()
    for f in ("ca.crt", "a.key"):
        (run / "mixed" / f).write_bytes((run / f).read_bytes())
    (run / "mixed" / "a.crt").write_bytes((tmp_path / "other" / "a.crt").read_bytes())  # a foreign certificate
    (run / "swapped").mkdir()
    for f in ("ca.crt", "a.crt"):
        (run / "swapped" / f).write_bytes((run / f).read_bytes())
    (run / "swapped" / "a.key").write_bytes((run / "b.key").read_bytes())
    (run / "renamed").mkdir()
    (run / "renamed" / "ca.crt").write_bytes((run / "ca.crt").read_bytes())
    for ext in ("crt", "key"):
        (run / "renamed" / f"c.{ext}").write_bytes((run / f"b.{ext}").read_bytes())
    cases = [
        (tmp_path / "nowhere", "a", "no such keys directory"),
        (run, "zed", "identity zed: no certificate"),
        (run / "mixed", "a", "a.crt: not issued by this run's authority"),
        (run / "swapped", "a", "a.key: private key does not match"),
        (run / "renamed", "c", "c.crt: certificate of 'b', not of 'c'"),
        (run, "../a", "invalid identity"),
    ]
    for d, name, needle in cases:
        with pytest.raises(IdentityError, match=needle) as e:
            Credentials.load(d, name)
        assert "\n" not in str(e.value)
    expire(auth, "b")
    with pytest.raises(IdentityError, match=r"b.crt: certificate of b expired on"):
        Credentials.load(run, "b")
    (run / "crl.pem").write_bytes((tmp_path / "other" / "crl.pem").read_bytes())  # a list the run never signed
    with pytest.raises(IdentityError, match="revocation list not signed by this run's authority"):
        Credentials.load(run, "a")


def test_connections_are_tls13_bound_to_both_identities() -> None:
    a, b = transport_config("id-a", "id-run"), transport_config("id-b", "id-run")
    with Listener(a) as lst:
        conn = connect(b, lst.address, "chan/1", expect="id-a", timeout=5)
        srv = lst.accept("chan/1", peer="id-b", timeout=5)
        assert (conn.identity, srv.identity) == ("id-a", "id-b")
        assert srv._sock.version() == "TLSv1.3" and conn._sock.version() == "TLSv1.3"
        x = np.arange(200_000, dtype=np.float32)
        conn.send(MsgType.DATA, x)
        y = np.empty_like(x)
        srv.recv_payload_into(srv.recv_header(MsgType.DATA, deadline=time.monotonic() + 5), y)
        assert np.array_equal(x, y)
        conn.close()
        srv.close()
        # a client that expects someone else at that address does not talk to it
        with pytest.raises(AuthError, match="is 'id-a', not 'id-c'"):
            connect(b, lst.address, "chan/2", expect="id-c", timeout=5)
        # a plaintext client gets nothing: the listener drops it
        raw = socket.create_connection(lst.address)
        raw.sendall(b"IJNT" + bytes(200))
        raw.settimeout(5)
        try:
            assert raw.recv(100) == b""
        except ConnectionResetError:
            pass
        raw.close()
        wait_for(lambda: lst.refused["handshake failed"] == 2, 5, "the listener to count both")  # and the one
        # that hung up on id-a


def test_foreign_authority_is_refused_both_ways(tmp_path: Path) -> None:
    Authority.init(tmp_path, "id-run").issue("id-a")
    foreign = TransportConfig("id-run", Credentials.load(tmp_path, "id-a"))
    home = transport_config("id-a", "id-run")
    with Listener(home) as lst:  # a foreign client: refused by the listener, before any channel
        with pytest.raises(AuthError):
            connect(foreign, lst.address, "chan/1", timeout=5)
        with pytest.raises(PeerTimeout, match="recently rejected"):
            lst.accept("chan/1", peer=None, timeout=0.5)
    with Listener(foreign) as lst:  # a foreign listener: our client refuses its certificate
        with pytest.raises(AuthError, match="certificate not of this run"):
            connect(home, lst.address, "chan/1", timeout=5)


def test_a_client_certificate_refused_in_tls_is_told_at_once(tmp_path: Path) -> None:
    """A client that trusts the listener but holds a certificate of another authority: the
    listener's TLS refuses it with an alert, and lingers so that no reset loses the alert; the
    client says so at once instead of retrying to its deadline."""
    Authority.init(tmp_path / "f", "id-run").issue("id-x")
    home = transport_config("id-a", "id-run")
    foreign = Credentials.load(tmp_path / "f", "id-x")
    both = tmp_path / "both.crt"  # it trusts the run's authority too
    both.write_bytes(Path(home.identity.ca).read_bytes() + Path(foreign.ca).read_bytes())
    client = TransportConfig("id-run", Credentials("id-x", both, foreign.cert, foreign.key, foreign.revocations))
    with Listener(home) as lst:
        for _ in range(3):
            t0 = time.monotonic()
            with pytest.raises(AuthError, match="refused the connection on channel 'chan/1': .*TLS error"):
                connect(client, lst.address, "chan/1", timeout=10)
            assert time.monotonic() - t0 < 3


def test_revocation_refuses_the_next_connection_at_once(tmp_path: Path) -> None:
    auth = Authority.init(tmp_path, "r")
    for n in ("srv", "m1", "m2"):
        auth.issue(n)
    cfg = {n: TransportConfig("r", Credentials.load(tmp_path, n)) for n in ("srv", "m1", "m2")}
    with Listener(cfg["srv"]) as lst:
        m1 = connect(cfg["m1"], lst.address, "c", timeout=5)
        assert lst.accept("c", peer="m1", timeout=5).identity == "m1"
        m1.close()
        auth.revoke("m1")  # the operator, while the listener runs
        with pytest.raises(AuthError, match="identity m1 is revoked"):
            connect(cfg["m1"], lst.address, "c", timeout=5)
        m2 = connect(cfg["m2"], lst.address, "c", timeout=5)  # everyone else as before
        assert lst.accept("c", peer="m2", timeout=5).identity == "m2"
        m2.close()
        assert lst.refused["refused"] >= 1
    with pytest.raises(IdentityError, match="identity m1 is revoked"):  # nor can it start again
        Credentials.load(tmp_path, "m1")


@pytest.mark.parametrize("channel", ["ring/7/1>2/0", state_channel("ch-owner", 3)])
def test_a_channel_is_handed_out_only_from_its_owner(channel: str) -> None:
    """Mallory opens the channel that belongs to alice (a ring link of alice's, the state
    channel of a joiner alice was admitted to serve), first and twice: the listener closes
    mallory's connections and hands out alice's."""
    owner, mallory, alice = (transport_config(n, "ch-run") for n in ("ch-owner", "ch-mallory", "ch-alice"))
    with Listener(owner) as lst:
        fake = [connect(mallory, lst.address, channel, timeout=5) for _ in range(2)]
        real = connect(alice, lst.address, channel, timeout=5)
        got = lst.accept(channel, peer="ch-alice", timeout=5)
        assert got.identity == "ch-alice"
        assert lst.refused["channel of another identity"] == 2
        got.send(MsgType.META, b"{}")
        assert real.recv(MsgType.META, deadline=time.monotonic() + 5)[1] == b"{}"
        for c in (*fake, real, got):
            c.close()


@pytest.mark.slow
def test_a_member_hoarding_unclaimed_connections_does_not_stop_an_honest_one() -> None:
    """1,000 connections from one member nobody claims: it keeps ``pending_per_peer`` of them,
    the rest are refused on arrival, and an honest member's connection goes through."""
    owner = transport_config("h-owner", "h-run", pending_per_peer=64)
    hoarder, honest = transport_config("h-hoarder", "h-run"), transport_config("h-honest", "h-run")
    with Listener(owner) as lst:
        refused, held = 0, []
        for i in range(1000):
            try:
                held.append(connect(hoarder, lst.address, f"state/x/{i}", timeout=5))
            except AuthError as e:
                assert "unclaimed connections already" in str(e)
                refused += 1
        assert (len(held), refused) == (64, 936)
        t0 = time.monotonic()
        conn = connect(honest, lst.address, "state/h-honest/1", timeout=5)
        assert lst.accept("state/h-honest/1", peer="h-honest", timeout=5).identity == "h-honest"
        assert time.monotonic() - t0 < 2
        for c in (*held, conn):
            c.close()


def test_one_byte_strangers_hold_a_slot_for_the_first_bytes_timeout_only() -> None:
    """A stranger that sent one byte of its hello is dropped after ``first_bytes_timeout``,
    and one network (a /24) gets ``handshakes_per_prefix`` slots however many addresses it has."""
    cfg = transport_config("s-owner", "s-run", first_bytes_timeout=0.5, handshakes_per_prefix=12)
    member = transport_config("s-member", "s-run")
    with Listener(cfg) as lst:
        socks = []
        for a in range(10, 14):  # 4 addresses of 127.0.3.0/24, 5 connections each: 12 get a slot
            for _ in range(5):
                s = socket.socket()
                s.bind((f"127.0.3.{a}", 0))
                s.connect(lst.address)
                s.sendall(b"\x16")
                socks.append(s)
        time.sleep(0.2)
        assert lst.refused["network over its handshake budget"] == 8
        t0 = time.monotonic()
        for s in socks:  # the 12 slotted ones are closed after 0.5 s, the 8 others at once
            s.settimeout(3)
            try:
                assert s.recv(10) == b""
            except ConnectionResetError:
                pass
        assert time.monotonic() - t0 < 1.5
        assert lst.refused["no handshake in time"] == 12
        connect(member, lst.address, "c", timeout=5).close()  # 127.0.0.1 was never short of a slot


def test_prefix_of() -> None:
    assert prefix_of("10.1.2.3") == "10.1.2.0/24"
    assert prefix_of("2001:db8:1:2:3:4:5:6") == "2001:db8:1:2::/64"
    assert prefix_of("::ffff:10.1.2.3") == "10.1.2.0/24"
    assert prefix_of("not-an-ip") == "not-an-ip"


def test_netnode_ring_needs_identities() -> None:
    with NetNode(transport_config("solo", "solo-run")) as node:
        ring = node.ring([("solo", node.address)], 0)
        assert np.array_equal(ring.all_reduce_mean(np.ones(3, np.float32)), np.ones(3, np.float32))
        threading.Thread(target=ring.close).start()


def test_a_listener_serves_past_file_descriptor_1023() -> None:
    """A coordinator of a large run holds more than 1,024 descriptors; the listener's wait for
    a stranger's hello must not depend on ``select`` (limited to descriptors below 1024)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1400 if hard == resource.RLIM_INFINITY else min(hard, 1400)
    if want < 1300:
        pytest.skip(f"the descriptor limit ({hard}) is too low")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    pipes = [os.pipe() for _ in range(600)]  # 1,200 descriptors
    try:
        owner, member = transport_config("fd-owner", "fd-run"), transport_config("fd-member", "fd-run")
        with Listener(owner) as lst:
            pipes.append(os.pipe())
            while min(pipes[-1]) < 1024:  # (descriptors other tests' threads freed since: taken again)
                pipes.append(os.pipe())
            conn = connect(member, lst.address, "c", timeout=5)
            assert conn._sock.fileno() > 1023 and lst.accept("c", peer="fd-member", timeout=5).identity == "fd-member"
            conn.close()
    finally:
        for a, b in pipes:
            os.close(a), os.close(b)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_concurrent_connections_of_one_member_respect_its_pending_places() -> None:
    """100 connections of one member at once, 8 places: never more than 8 filed (the place is
    taken when its TLS handshake ends, before it names its channel)."""
    from concurrent.futures import ThreadPoolExecutor

    owner = transport_config("cc-owner", "cc-run", pending_per_peer=8)
    member = transport_config("cc-member", "cc-run")

    def one(i: int) -> Any:
        try:
            return connect(member, lst.address, f"x/{i}", timeout=10)
        except AuthError:
            return None

    with Listener(owner) as lst, ThreadPoolExecutor(16) as ex:
        conns = list(ex.map(one, range(100)))
        kept = [c for c in conns if c is not None]
        assert len(kept) == 8 and lst._per_peer["cc-member"] == 8
        for c in kept:
            c.close()


def test_a_damaged_revocation_list_keeps_the_last_good_one(tmp_path: Path) -> None:
    auth = Authority.init(tmp_path, "r")
    for n in ("srv", "m1", "m2"):
        auth.issue(n)
    cfg = {n: TransportConfig("r", Credentials.load(tmp_path, n)) for n in ("srv", "m1", "m2")}
    auth.revoke("m2")
    with Listener(cfg["srv"]) as lst:
        with pytest.raises(AuthError, match="identity m2 is revoked"):  # the listener has read the list
            connect(cfg["m2"], lst.address, "c", timeout=5)
        (tmp_path / "crl.pem").write_bytes(b"-----BEGIN X509 CRL-----\nhalf a copy")  # a copy in progress
        connect(cfg["m1"], lst.address, "c", timeout=5).close()  # members are still served ...
        with pytest.raises(AuthError, match="identity m2 is revoked"):  # ... and m2 is still out
            connect(cfg["m2"], lst.address, "c", timeout=5)


def test_a_stranger_with_a_whole_hello_that_stalls_holds_its_slot_twice_first_bytes_timeout() -> None:
    import ssl

    cfg = transport_config("st-owner", "st-run", first_bytes_timeout=0.5)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    try:
        ctx.wrap_bio(incoming, outgoing).do_handshake()
    except ssl.SSLWantReadError:
        pass
    hello = outgoing.read()  # a real TLS client hello; then nothing more
    with Listener(cfg) as lst:
        s = socket.create_connection(lst.address)
        s.sendall(hello)
        s.settimeout(5)
        t0 = time.monotonic()
        try:
            while s.recv(1 << 16):  # the server's part of the handshake, then the close
                pass
        except ConnectionResetError:
            pass
        assert 0.3 < time.monotonic() - t0 < 1.5  # 2 x 0.5 s from its arrival, not handshake_timeout (10 s)
        s.close()
        wait_for(lambda: lst.refused["no handshake in time"] == 1, 5, "the listener to count it")


def test_unclaimed_connections_are_capped_per_channel_prefix() -> None:
    """Over ``pending_per_prefix`` unclaimed connections on one prefix (members together), the
    next is refused; other prefixes and a claimed channel's new connection go on."""
    owner = transport_config("cp-owner", "cp-run", pending_per_prefix=6)
    members = [transport_config(f"cp-m{i}", "cp-run") for i in range(3)]
    with Listener(owner) as lst:
        held = [connect(m, lst.address, f"state/x/{i}", timeout=5) for i in range(2) for m in members]
        with pytest.raises(AuthError, match=r"channels state/\.\.\. hold 6 unclaimed connections already"):
            connect(members[0], lst.address, "state/x/9", timeout=5)
        other = connect(members[0], lst.address, "ring/1/0>1/0", timeout=5)  # another prefix: served
        lst.accept("state/x/0", peer="cp-m0", timeout=5).close()  # one claimed: a place is free again
        more = connect(members[1], lst.address, "state/x/8", timeout=5)
        assert lst._per_kind == {"state": 6, "ring": 1}
        for c in (*held, other, more):
            c.close()


def _own_dir(auth_dir: Path, dest: Path, name: str) -> Path:
    """A machine's keys directory: the authority's certificate and list, and ``name``'s key."""
    dest.mkdir()
    for f in ("ca.crt", "crl.pem", f"{name}.crt", f"{name}.key"):
        shutil.copy2(auth_dir / f, dest / f)
    return dest


def test_a_revocation_reaches_every_member_through_the_coordinator(tmp_path: Path) -> None:
    """Each machine holds its own keys directory. The operator revokes mallory and copies the
    list to the coordinator's machine only: the coordinator hands it to its members with their
    next heartbeat, node a checks the authority's signature, takes it and refuses mallory at
    once (and keeps it in its own crl.pem). A list the authority did not sign, or an older one,
    changes nothing."""
    from intellect_jax.coordinator.client import CoordinatorClient
    from intellect_jax.coordinator.server import Coordinator
    from helpers import coord_config

    auth_dir = tmp_path / "authority"
    auth = Authority.init(auth_dir, "crl-run")
    for n in ("a", "mallory"):
        auth.issue(n)
    mine = {n: _own_dir(auth_dir, tmp_path / n, n) for n in ("coordinator", "a", "mallory")}
    cfg = {n: TransportConfig("crl-run", Credentials.load(d, n)) for n, d in mine.items()}
    old_list = (auth_dir / "crl.pem").read_bytes()
    coord = Coordinator(cfg["coordinator"], config=coord_config(min_nodes=2)).start()
    node_a = NetNode(cfg["a"])
    client = CoordinatorClient(coord.address, cfg["a"], "a", f"127.0.0.1:{node_a.address[1]}", devices=1,
                               fingerprint="fp", heartbeat_interval=0.2, reconnect_timeout=5.0)
    try:
        client.register()
        connect(cfg["mallory"], node_a.address, "c", timeout=5).close()  # a member, for now
        auth.revoke("mallory")
        shutil.copy2(auth_dir / "crl.pem", mine["coordinator"] / "crl.pem")  # the operator's one copy
        serial = int(str(auth.index()["mallory"][0]["serial"]), 16)
        wait_for(lambda: cfg["a"].identity.revocations.revoked(serial), 10.0, "the list at node a")
        with pytest.raises(AuthError, match="identity mallory is revoked"):
            connect(cfg["mallory"], node_a.address, "c", timeout=5)  # (its own machine has the old list)
        assert (mine["a"] / "crl.pem").read_bytes() == (auth_dir / "crl.pem").read_bytes()
        rev = cfg["a"].identity.revocations
        assert rev.install(old_list, "test") is False and rev.revoked(serial)  # an older list: kept the one in force
        Authority.init(tmp_path / "foreign", "crl-run")
        with pytest.raises(IdentityError, match="not signed by this run's authority"):
            rev.install((tmp_path / "foreign" / "crl.pem").read_bytes(), "test")
        assert rev.revoked(serial)
    finally:
        client.close()
        node_a.close()
        coord.stop()


def test_a_revocation_list_gone_bad_later_or_unwritable_is_never_fatal(tmp_path: Path) -> None:
    """Started without a list, a damaged one later is a warning (nothing revoked yet), not an
    error on every connection; a list that cannot be written to the keys directory is in force
    all the same."""
    auth = Authority.init(tmp_path / "auth", "r")
    auth.issue("m1")
    mine = _own_dir(tmp_path / "auth", tmp_path / "m1", "m1")
    (mine / "crl.pem").unlink()
    creds = Credentials.load(mine, "m1")
    rev = creds.revocations
    (mine / "crl.pem").write_bytes(b"-----BEGIN X509 CRL-----\nhalf a copy")
    assert rev.refresh() == frozenset() and rev.current() is None  # a warning, nothing raised
    auth.revoke("m1")
    rev.path = tmp_path / "auth" / "crl.pem" / "not-a-dir"  # where nothing can be written
    assert rev.install((tmp_path / "auth" / "crl.pem").read_bytes(), "test") is True
    serial = int(str(auth.index()["m1"][0]["serial"]), 16)
    assert rev.revoked(serial) and rev.current()[0] == 1  # type: ignore[index]
