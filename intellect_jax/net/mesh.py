"""The butterfly's mesh, opened and checked link by link: no peer holds back the others' links.

The ring opens its links one after the other, and every rank reads every header before it
sends a byte of data: there, one peer that never connects, or never sends its header, stops
the call before anybody's pieces leave. In the butterfly exchange each rank's own pieces must
reach every honest owner whatever a third rank does (so that what an owner lacks at the end
names its sender, :mod:`.butterfly`), so here:

* every link is opened by its own thread (:func:`each`), bounded by the opening deadline;
* every header is read by its own thread too, and a peer whose header does not arrive or does
  not match ours loses that link only;
* a link that failed becomes a :class:`DeadLink`, whose every use raises the failure: the call
  then runs on the links that stand, and fails on that one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from intellect_jax.net.errors import NetError, PeerTimeout

T = TypeVar("T")
OPENING = 0.5  # share of a butterfly call's deadline given to opening its links and reading their headers
# (a member that starts later than that, measured from each rank's own start, has too little of the
# deadline left for its pieces, and is named as missing)
_PENDING = object()


class DeadLink:
    """A mesh link that could not be opened, or whose peer's header did not hold: every send or
    read raises its failure (a fresh exception of the same kind each time)."""

    cert: bytes | None = None
    identity = ""
    bytes_sent = 0
    bytes_received = 0

    def __init__(self, peer: str, error: NetError) -> None:
        self.peer, self.error = peer, error

    def _fail(self, *_: Any, **__: Any) -> Any:
        raise type(self.error)(f"{self.peer}: no link ({self.error})")

    send = recv_header = recv_payload_into = recv = _fail

    def abort(self) -> None:
        """Nothing to shut."""

    def close(self) -> None:
        """Nothing to close."""


def failure(e: BaseException) -> NetError:
    """``e`` as the :class:`NetError` that ends a link."""
    return e if isinstance(e, NetError) else NetError(f"{type(e).__name__}: {e}")


def each(fns: Sequence[Callable[[], T]], deadline: float, discard: Callable[[T], None] = lambda _: None,
         name: str = "mesh") -> list[T | NetError]:
    """Run every ``fns[i]()`` in a thread of its own; their results, or the :class:`NetError`
    each raised (one still running after ``deadline`` gets a timeout, and whatever it returns
    later goes to ``discard``)."""
    results: list[Any] = [_PENDING] * len(fns)
    lock = threading.Lock()
    gave_up = [False]

    def run(i: int) -> None:
        try:
            r: Any = fns[i]()
        except Exception as e:  # noqa: BLE001 - a link's failure is its result
            r = failure(e)
        with lock:
            late = gave_up[0]
            if not late:
                results[i] = r
        if late and not isinstance(r, NetError):
            discard(r)

    threads = [threading.Thread(target=run, args=(i,), name=f"{name}{i}", daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 1.0)
    with lock:
        gave_up[0] = True
        return [PeerTimeout("not done before the deadline") if r is _PENDING else r for r in results]
