"""Time and blocking for the DiLoCo control plane, behind one object so tests can replace it.

Production code asks its clock for the time (`now`), to `sleep`, for locks, conditions and
events, and to `spawn` threads. :class:`RealClock` hands out `time.monotonic` and the
`threading` primitives; the seeded simulation swaps in a virtual-time clock
(:mod:`intellect_jax.testing.clock`) that runs the very same code.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...

    def Lock(self) -> Any: ...  # noqa: N802 - mirrors threading's factory names

    def Condition(self, lock: Any = None) -> Any: ...  # noqa: N802

    def Event(self) -> Any: ...  # noqa: N802

    def spawn(self, target: Callable[[], Any], name: str) -> Any: ...


class RealClock:
    """Wall-clock monotonic time and the `threading` module."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))

    def Lock(self) -> Any:  # noqa: N802
        return threading.Lock()

    def Condition(self, lock: Any = None) -> Any:  # noqa: N802
        return threading.Condition(lock)

    def Event(self) -> Any:  # noqa: N802
        return threading.Event()

    def spawn(self, target: Callable[[], Any], name: str) -> threading.Thread:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        return t


REAL = RealClock()


@contextlib.contextmanager
def abort_when(clock: Clock, broken: Callable[[], bool], abort: Callable[[], None],
               interval: float) -> Iterator[None]:
    """While the body runs, check ``broken()`` every ``interval`` and call ``abort()`` once if it
    turns true (e.g. a ring member was evicted: unblock the all-reduce now instead of at its
    deadline)."""
    done = clock.Event()

    def watch() -> None:
        while not done.wait(interval):
            if broken():
                abort()
                return

    clock.spawn(watch, name="abort-watch")
    try:
        yield
    finally:
        done.set()
