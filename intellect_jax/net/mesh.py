"""The butterfly's mesh, opened and checked link by link: no peer holds back the others' links.

The ring opens its links one after the other, and every rank reads every header before it
sends a byte of data: there, one peer that never connects, or never sends its header, stops
the call before anybody's pieces leave. In the butterfly exchange each rank's own pieces must
reach every honest owner whatever a third rank does (so that what an owner lacks at the end
names its sender, :mod:`.butterfly`), so here every link is a :class:`Pending`: a thread of its
own opens it and sends our header on it, or reads and checks the peer's, while the call runs;
the call's thread for that link waits for it at its first use, and for nothing else. A link
that fails (it does not open before the opening deadline, its header does not come, parse or
match ours) becomes a :class:`DeadLink`, whose every use raises the failure: the call runs on
the links that stand, and fails on that one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from intellect_jax.net.errors import NetError, PeerTimeout

OPENING = 0.5  # share of a butterfly call's deadline given to opening its links and reading their headers
# (a member that starts later than that, measured from each rank's own start, has too little of the
# deadline left for its pieces, and is named as missing)


class DeadLink:
    """A mesh link that could not be opened, or whose peer's header did not hold: every send or
    read raises its failure (a fresh exception of the same kind each time)."""

    cert: bytes | None = None
    bytes_sent = 0
    bytes_received = 0

    def __init__(self, peer: str, error: NetError) -> None:
        self.peer, self.error = peer, error

    def _fail(self, *_: Any, **__: Any) -> Any:
        raise type(self.error)(f"{self.peer}: no link ({self.error})")

    send = recv_header = recv_payload_into = recv = skip_unread = _fail

    def abort(self) -> None:
        """Nothing to shut."""

    def close(self) -> None:
        """Nothing to close."""


class Pending:
    """A mesh link that ``opener()`` opens (and checks) in a thread of its own: the first use of
    an attribute waits for that thread, never past ``deadline`` and a second, and then acts on
    the connection, or on a :class:`DeadLink` of its failure (also handed to ``failed``).
    :meth:`abort` and :meth:`close` do not wait: they act on the link once it is there."""

    def __init__(self, peer: str, opener: Callable[[], Any], deadline: float,
                 failed: Callable[[NetError], None]) -> None:
        self.peer, self._deadline, self._failed = peer, deadline, failed
        self._link: Any = None
        self.opened_at: float | None = None  # when the opener's link was there (its peer's header read and checked)
        self._shut: str | None = None  # "abort" or "close", if asked before the link was there
        self._lock = threading.Lock()
        self._done = threading.Event()
        threading.Thread(target=self._open, args=(opener,), name=f"open-{peer}", daemon=True).start()

    def _open(self, opener: Callable[[], Any]) -> None:
        try:
            link = opener()
        except Exception as e:  # noqa: BLE001 - a link's failure is its result
            err = e if isinstance(e, NetError) else NetError(f"{type(e).__name__}: {e}")
            self._failed(err)
            link = DeadLink(self.peer, err)
        self._settle(link)

    def _settle(self, link: Any) -> None:
        with self._lock:
            late = self._link is not None  # (given up on: a timeout stands in for it)
            if not late:
                self._link = link
                self.opened_at = time.monotonic()
            shut = self._shut
        if late:
            link.close()
        elif shut:
            getattr(link, shut)()
        self._done.set()

    def get(self) -> Any:
        """The connection, or a :class:`DeadLink` (waiting for the opener, up to the deadline)."""
        if self._done.is_set():  # (every frame asks: no lock once settled)
            return self._link
        if not self._done.wait(max(0.0, self._deadline - time.monotonic()) + 1.0):
            err = PeerTimeout(f"{self.peer}: no link before the deadline")
            with self._lock:
                if self._link is None:
                    self._failed(err)
                    self._link = DeadLink(self.peer, err)
            self._done.set()  # (settled: a later ask does not wait again; a late opener's link is closed)
        return self._link

    def __getattr__(self, name: str) -> Any:
        return getattr(self.get(), name)

    @property
    def bytes_sent(self) -> int:
        link = self._link
        return 0 if link is None else link.bytes_sent

    @property
    def bytes_received(self) -> int:
        link = self._link
        return 0 if link is None else link.bytes_received

    def abort(self) -> None:
        self._shutdown("abort")

    def close(self) -> None:
        self._shutdown("close")

    def _shutdown(self, how: str) -> None:
        with self._lock:
            link = self._link
            if link is None:
                self._shut = "close" if "close" in (how, self._shut) else how
        if link is not None:
            getattr(link, how)()
