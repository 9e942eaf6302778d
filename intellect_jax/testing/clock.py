"""Virtual time for the seeded simulation: :class:`SimClock` and its lock, condition and event.

It runs the very same control-plane code as :class:`~intellect_jax.coordinator.clock.RealClock`
in *virtual* time: when every thread it knows is blocked in one of its primitives, it jumps to
the earliest deadline, so a test can run minutes of heartbeats, timeouts and backoffs in
milliseconds, independent of how loaded the machine is, and a run where every thread waits
forever is reported as a hang instead of blocking the test.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from typing import Any

class Hang(RuntimeError):
    """Every thread of a simulation waits with no deadline: nothing can ever happen again."""


class _Waiter:
    __slots__ = ("deadline", "event", "done", "timed_out", "hung")

    def __init__(self, deadline: float) -> None:
        self.deadline, self.event = deadline, threading.Event()
        self.done = self.timed_out = self.hung = False


class SimClock:
    """Virtual time for threads that block only through this clock (see the module docstring).

    Invariant: ``_running`` counts the spawned threads that are not blocked in one of this
    clock's primitives. When it drops to zero, time jumps to the earliest pending deadline and
    that waiter runs. Threads not spawned through :meth:`spawn` (e.g. pytest's) may call
    :meth:`now` but must not block on the clock's primitives.
    """

    def __init__(self, start: float = 0.0, *, real_timeout: float = 60.0) -> None:
        self._mu = threading.Lock()
        self._now = start
        self._running = 0
        self._timers: list[tuple[float, int, _Waiter]] = []
        self._parked: set[_Waiter] = set()
        self._seq = itertools.count()
        self.real_timeout = real_timeout  # a thread blocked this long in real time is a harness bug
        self.hang: Hang | None = None
        self.errors: list[tuple[str, BaseException]] = []  # uncaught exceptions of spawned threads

    # ---- Clock -------------------------------------------------------------------------------
    def now(self) -> float:
        with self._mu:
            return self._now

    def sleep(self, seconds: float) -> None:
        w = self._waiter(seconds)
        with self._mu:
            self._park(w)
        self._await(w)

    def Lock(self) -> SimLock:  # noqa: N802
        return SimLock(self)

    def Condition(self, lock: Any = None) -> SimCondition:  # noqa: N802
        return SimCondition(self, lock)

    def Event(self) -> SimEvent:  # noqa: N802
        return SimEvent(self)

    def spawn(self, target: Callable[[], Any], name: str) -> threading.Thread:
        def run() -> None:
            try:
                target()
            except BaseException as e:  # noqa: BLE001 - recorded for the simulation's report
                self.errors.append((name, e))
            finally:
                with self._mu:
                    self._running -= 1
                    self._advance()

        with self._mu:
            self._running += 1
        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        return t

    # ---- internals ---------------------------------------------------------------------------
    def _waiter(self, timeout: float | None) -> _Waiter:
        return _Waiter(float("inf") if timeout is None else self._now + max(0.0, timeout))

    def _park(self, w: _Waiter) -> None:
        """(under _mu) The calling thread is about to wait on ``w``."""
        if self.hang is not None:
            w.done = w.hung = True
            w.event.set()
            return
        if w.deadline != float("inf"):
            heapq.heappush(self._timers, (w.deadline, next(self._seq), w))
        self._parked.add(w)
        self._running -= 1
        self._advance()

    def _await(self, w: _Waiter) -> bool:
        """Block the real thread until ``w`` is woken; True if it timed out."""
        if not w.event.wait(self.real_timeout):
            raise Hang(f"a simulated thread ({threading.current_thread().name}) was not woken within "
                       f"{self.real_timeout:.0f}s of real time (it is blocked outside the clock?)")
        if w.hung:
            raise Hang(str(self.hang))
        return w.timed_out

    def _wake(self, w: _Waiter, timed_out: bool = False) -> bool:
        """(under _mu) Make ``w``'s thread runnable; False if it already was."""
        if w.done:
            return False
        w.done, w.timed_out = True, timed_out
        self._parked.discard(w)
        self._running += 1
        w.event.set()
        return True

    def _advance(self) -> None:
        """(under _mu) While nothing can run, jump to the earliest deadline."""
        while self._running == 0:
            while self._timers and self._timers[0][2].done:
                heapq.heappop(self._timers)
            if not self._timers:
                if self._parked:  # everyone waits for a notify that nobody is left to send
                    self.hang = Hang(f"all {len(self._parked)} simulated threads wait forever at t={self._now:.3f}")
                    for w in list(self._parked):
                        self._wake(w)
                        w.hung = True
                return
            deadline = self._timers[0][0]
            self._now = max(self._now, deadline)
            while self._timers and self._timers[0][0] <= self._now:
                self._wake(heapq.heappop(self._timers)[2], timed_out=True)


class SimLock:
    """A mutex whose contended acquire counts as blocked for the :class:`SimClock`."""

    def __init__(self, clock: SimClock) -> None:
        self._c = clock
        self._held = False
        self._waiters: list[_Waiter] = []

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        c = self._c
        while True:
            with c._mu:
                if not self._held:
                    self._held = True
                    return True
                if not blocking:
                    return False
                w = c._waiter(None if timeout < 0 else timeout)
                self._waiters.append(w)
                c._park(w)
            if c._await(w):
                with c._mu:
                    if w in self._waiters:
                        self._waiters.remove(w)
                return False

    def release(self) -> None:
        with self._c._mu:
            self._release()

    def _release(self) -> None:
        """(under the clock's _mu) Free the lock; a thread parked on it becomes runnable."""
        if not self._held:
            raise RuntimeError("release of an unlocked SimLock")
        self._held = False
        while self._waiters:
            if self._c._wake(self._waiters.pop(0)):
                break

    def locked(self) -> bool:
        return self._held

    def __enter__(self) -> SimLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class SimCondition:
    """`threading.Condition` semantics over a :class:`SimLock`, timeouts in virtual time."""

    def __init__(self, clock: SimClock, lock: SimLock | None = None) -> None:
        self._c = clock
        self._lock = lock or SimLock(clock)
        self._waiters: list[_Waiter] = []

    def __enter__(self) -> SimCondition:
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def acquire(self) -> bool:
        return self._lock.acquire()

    def release(self) -> None:
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        """Release the lock, wait for a notify or the timeout, re-acquire; False on timeout."""
        c = self._c
        with c._mu:
            w = c._waiter(timeout)
            self._lock._release()  # with the park, atomically: a thread parked on the lock is
            self._waiters.append(w)  # runnable before time may jump to a deadline
            c._park(w)
        try:
            timed_out = c._await(w)
        finally:
            self._lock.acquire()
        return not timed_out

    def wait_for(self, predicate: Callable[[], Any], timeout: float | None = None) -> Any:
        end = None if timeout is None else self._c.now() + timeout
        result = predicate()
        while not result:
            left = None if end is None else end - self._c.now()
            if left is not None and left <= 0:
                break
            self.wait(left)
            result = predicate()
        return result

    def notify(self, n: int = 1) -> None:
        c = self._c
        with c._mu:
            woken = 0
            while self._waiters and woken < n:
                woken += c._wake(self._waiters.pop(0))

    def notify_all(self) -> None:
        self.notify(len(self._waiters) or 1)


class SimEvent:
    def __init__(self, clock: SimClock) -> None:
        self._cond = SimCondition(clock)
        self._flag = False

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        with self._cond:
            self._flag = True
            self._cond.notify_all()

    def clear(self) -> None:
        with self._cond:
            self._flag = False

    def wait(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._flag, timeout)
