"""A run authority for tests, demos and benchmarks: one per process tree, identities on demand.

:func:`keys_dir` makes the authority once (in a temporary directory, exported in
``$INTELLECT_TEST_KEYS`` so that child processes share it) and :func:`credentials` issues an
identity the first time it is asked for, so a test names its nodes and gets their certificates.
The product has one code path: these are real keys, certificates and TLS, only made on the fly.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path
from typing import Any

from intellect_jax.net.identity import Authority, Credentials
from intellect_jax.net.transport import TransportConfig

ENV = "INTELLECT_TEST_KEYS"
_lock = threading.Lock()
_creds: dict[str, Credentials] = {}


def keys_dir() -> Path:
    """The shared test authority's directory (made on first use)."""
    with _lock:
        d = os.environ.get(ENV)
        if d and (Path(d) / "ca.crt").exists():
            return Path(d)
        path = Path(tempfile.mkdtemp(prefix="ij-keys-"))
        Authority.init(path, "tests")
        os.environ[ENV] = str(path)
        return path


def credentials(name: str) -> Credentials:
    """``name``'s credentials from the test authority, issued on first use."""
    d = keys_dir()
    with _lock:
        if name not in _creds:
            if not (d / f"{name}.crt").exists():
                Authority.load(d).issue(name, reserved_ok=True)
            _creds[name] = Credentials.load(d, name)
        return _creds[name]


def transport_config(name: str, run_id: str = "test-run", **kw: Any) -> TransportConfig:
    """A transport config for identity ``name`` of the test authority."""
    return TransportConfig(run_id=run_id, identity=credentials(name), **kw)
