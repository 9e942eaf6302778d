"""A condition variable whose waiters say what they wait for.

Every thread of a call (a link's sender and receiver, the encoder, the audits) waits on the
call's one condition, and most changes of state concern one of them: a row that came concerns
the owner's aggregation, a piece sent the links paced against it. ``threading.Condition``'s
``notify_all`` wakes every waiter, each of which takes the GIL, finds nothing for it and waits
again: about 430 wake-ups per butterfly call at a rank of 4 (docs/results.md). Here a waiter may
pass ``until``, a predicate the notifier checks under the lock, as the waiter would on waking:
``notify_all`` wakes it only once that holds. A waiter without one is woken every time, and a
timeout wakes any waiter, so a predicate that misses a change delays its waiter by at most its
timeout and never loses it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType


class Cond:
    """``with cond:``, ``cond.wait(timeout, until=...)`` (under the lock) and ``cond.notify_all()``
    (under the lock), as ``threading.Condition``'s."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # (re-entrant, as threading.Condition's default)
        self._waiters: list[tuple[threading.Lock, Callable[[], bool] | None]] = []
        self._notifying = self._again = False  # (a predicate that notifies: see notify_all)

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._lock.release()

    def wait(self, timeout: float | None, until: Callable[[], bool] | None = None) -> bool:
        """Release the lock (every level held) until notified (with ``until``: once it holds at
        a notify) or ``timeout`` seconds passed (None: no limit), then take it again. True:
        notified."""
        if not self._lock._is_owned():  # type: ignore[attr-defined]
            raise RuntimeError("wait on a Cond whose lock this thread does not hold")
        waiter = threading.Lock()
        waiter.acquire()
        entry = (waiter, until)
        self._waiters.append(entry)
        saved = self._lock._release_save()  # type: ignore[attr-defined]  # (as threading.Condition does)
        try:
            return waiter.acquire(True, -1 if timeout is None else max(0.0, timeout))
        finally:
            self._lock._acquire_restore(saved)  # type: ignore[attr-defined]
            if entry in self._waiters:  # (timed out: nobody released it)
                self._waiters.remove(entry)

    def notify_all(self) -> None:
        """Wake every waiter without a predicate and every one whose predicate holds now (one
        whose predicate raises is woken: its own thread meets the error). A predicate may
        change state and notify in turn (under the lock, as its waiter would): the waiters left
        are then looked at again once this pass is over, as many times as there were waiters,
        and after that all of them are woken (a predicate that notifies on every look cannot
        keep this thread here). An exception of any kind leaves every waiter not yet woken in
        the list."""
        if not self._lock._is_owned():  # type: ignore[attr-defined]
            raise RuntimeError("notify on a Cond whose lock this thread does not hold")
        if self._notifying:
            self._again = True
            return
        self._notifying = True
        try:
            looks = len(self._waiters) + 1
            for look in range(looks):
                self._again, todo, self._waiters = False, self._waiters, []
                for n, entry in enumerate(todo):
                    waiter, until = entry
                    try:
                        wake = until is None or look == looks - 1 or bool(until())
                    except Exception:
                        wake = True
                    except BaseException:
                        self._waiters += todo[n:]
                        raise
                    if wake:
                        waiter.release()
                    else:
                        self._waiters.append(entry)
                if not self._again:
                    return
        finally:
            self._notifying = False
