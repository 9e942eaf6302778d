"""Live recovery: a donor streams its DiLoCo state to a joiner over the authenticated socket
layer, in the background, while it keeps training.

The state (outer params + momentum, the inner optimizer state, step counters) is written with
orbax into a temporary directory, packed as one tar blob and sent with `net.blob`; the joiner
unpacks it, restores it with orbax against the shapes it expects, and checks its hash.
"""

from __future__ import annotations

import json
import shutil
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from intellect_jax.net.blob import recv_blob, send_blob
from intellect_jax.net.comm import NetNode
from intellect_jax.net.frames import MsgType

MAX_STATE_BYTES = 1 << 40


def channel(joiner_id: str, outer_step: int) -> str:
    return f"state/{joiner_id}/{outer_step}"


def _save_tar(tree: Any, workdir: Path) -> Path:
    ckpt = workdir / "state"
    with ocp.StandardCheckpointer() as c:
        c.save(ckpt, tree)
        c.wait_until_finished()
    tar_path = workdir / "state.tar"
    with tarfile.open(tar_path, "w") as tar:
        tar.add(ckpt, arcname="state")
    return tar_path


def send_state(net: NetNode, joiner_addr: str, joiner_id: str, meta: dict, tree: Any, *,
               timeout: float) -> dict:
    """Blocking send (run it in a thread); returns timing/size stats."""
    t0 = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="ij-send-"))
    try:
        tar_path = _save_tar(tree, workdir)
        deadline = time.monotonic() + timeout
        with net.connect(joiner_addr, channel(joiner_id, meta["outer_step"]), timeout=timeout,
                         name=f"joiner {joiner_id}") as conn:
            conn.send(MsgType.META, json.dumps(meta).encode(), deadline=deadline)
            size = send_blob(conn, tar_path, name="state.tar", deadline=deadline)
            conn.recv(MsgType.META, deadline=deadline, max_len=1 << 12)  # the joiner's receipt
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {"bytes": size, "seconds": time.monotonic() - t0}


def serve_in_background(net: NetNode, joiner_addr: str, joiner_id: str, meta: dict, tree: Any, *,
                        timeout: float, log) -> threading.Thread:
    """Stream `tree` (a host snapshot) to a joiner from a daemon thread; the caller trains on."""

    def run() -> None:
        t = time.time()
        log(f"serving state of outer step {meta['outer_step']} to {joiner_id} ({joiner_addr})")
        try:
            st = send_state(net, joiner_addr, joiner_id, meta, tree, timeout=timeout)
            log(f"served {joiner_id}: {st['bytes'] / 2**20:.1f} MiB in {st['seconds']:.1f}s "
                f"(wall {t:.3f} -> {time.time():.3f})")
        except Exception as e:  # the joiner died or stalled: it will be re-queued
            log(f"serving {joiner_id} failed: {e}")

    th = threading.Thread(target=run, name=f"serve-{joiner_id}", daemon=True)
    th.start()
    return th


def recv_state(net: NetNode, joiner_id: str, outer_step: int, abstract: Any, *,
               timeout: float) -> tuple[dict, Any]:
    """Wait for the donor, receive and restore the state; returns (meta, tree)."""
    deadline = time.monotonic() + timeout
    workdir = Path(tempfile.mkdtemp(prefix="ij-recv-"))
    try:
        with net.accept(channel(joiner_id, outer_step), timeout=timeout, name="donor") as conn:
            _, raw = conn.recv(MsgType.META, deadline=deadline, max_len=1 << 16)
            meta = json.loads(raw)
            with open(workdir / "state.tar", "wb") as f:
                recv_blob(conn, f, max_bytes=MAX_STATE_BYTES, deadline=deadline)
            with tarfile.open(workdir / "state.tar") as tar:
                tar.extractall(workdir, filter="data")
            with ocp.StandardCheckpointer() as c:
                tree = c.restore(workdir / "state", abstract)
            conn.send(MsgType.META, b'{"ok": true}', deadline=deadline)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return meta, tree
