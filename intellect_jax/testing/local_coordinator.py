"""The coordinator in process: a :class:`CoordinatorService` that can be crashed and restarted,
reached through :class:`LocalWire` (function calls whose messages still go through JSON)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from intellect_jax.testing.identities import credentials
from intellect_jax.coordinator.clock import REAL, Clock
from intellect_jax.coordinator.journal import Journal
from intellect_jax.coordinator.protocol import CoordinatorConfig
from intellect_jax.coordinator.service import CoordinatorService, Session
from intellect_jax.net.errors import PeerClosed


class LocalCoordinator:
    """An in-process coordinator for in-process runs (the sweep benchmark, the fault simulation):
    a :class:`CoordinatorService` that can be crashed and restarted (a new instance that
    reloads the journal), reached through :class:`LocalWire`."""

    def __init__(self, config: CoordinatorConfig | None = None, *, run_id: str = "local", clock: Clock = REAL,
                 journal: Journal | None = None, on_event: Callable[[str], None] | None = None,
                 ca: bytes | None = None) -> None:
        self.config, self.run_id, self.clock, self.journal = config, run_id, clock, journal
        self.on_event, self.ca = on_event, ca  # ca: the run authority's certificate (evidence must be signed)
        self.service: CoordinatorService | None = None
        self.start()

    def start(self, config: CoordinatorConfig | None = None) -> CoordinatorService:
        """(Re)start, with another config if given (e.g. an operator's allow_rollback_to)."""
        self.service = CoordinatorService(config or self.config, run_id=self.run_id, clock=self.clock,
                                          journal=self.journal, on_event=self.on_event, ca=self.ca).start()
        return self.service

    def crash(self) -> None:
        """Stop abruptly: blocked requests fail, sessions die, only the journal survives."""
        svc, self.service = self.service, None
        if svc is not None:
            svc.stop()

    def wire(self, identity: str | None = None) -> LocalWire:
        """A client's connections; ``identity``: the node id it authenticates as (None: the
        node its first registration names, as its certificate would)."""
        return LocalWire(self, identity)


class _LocalSession:
    def __init__(self, service: CoordinatorService, session: Session) -> None:
        self.service, self.session, self.closed = service, session, False


def _as_sent(msg: dict[str, Any]) -> dict[str, Any]:
    """A message as the other side of a socket would read it (JSON: tuples become lists)."""
    return json.loads(json.dumps(msg))


class LocalWire:
    """One client's connections to a :class:`LocalCoordinator`, as function calls (messages go
    through JSON, as on a socket), each authenticated as ``identity``. A crashed coordinator
    raises :class:`~intellect_jax.net.errors.PeerClosed`, like a dropped socket."""

    def __init__(self, host: LocalCoordinator, identity: str | None = None) -> None:
        self.host, self.identity = host, identity
        self.name = "local coordinator"

    def _service(self) -> CoordinatorService:
        svc = self.host.service
        if svc is None or svc.stopped:
            raise PeerClosed("local coordinator is down")
        return svc

    def open(self, msg: dict[str, Any], timeout: float) -> tuple[_LocalSession | None, dict[str, Any]]:
        svc = self._service()
        if self.identity is None and isinstance(msg.get("node"), str):
            self.identity = msg["node"]
        cert = credentials(self.identity).cert_der if self.host.ca is not None and self.identity else None
        reply = _as_sent(svc.handle(_as_sent(msg), identity=self.identity, cert=cert))  # (a register: no vote)
        return (_LocalSession(svc, (reply["node_id"], reply["session"])) if reply.get("ok") else None), reply

    def beat(self, handle: _LocalSession, msg: dict[str, Any], patience: float) -> dict[str, Any]:
        if handle.closed or handle.service is not self.host.service or handle.service.stopped:
            raise PeerClosed("session connection to the local coordinator lost")
        return _as_sent(handle.service.handle(_as_sent(msg), handle.session, identity=self.identity))

    def close(self, handle: _LocalSession) -> None:
        if not handle.closed:
            handle.closed = True
            if not handle.service.stopped:
                handle.service.disconnect(handle.session)

    def request(self, msg: dict[str, Any], deadline: float | None, connect_timeout: float) -> dict[str, Any]:
        return _as_sent(self._service().handle(_as_sent(msg), deadline=deadline, identity=self.identity))
