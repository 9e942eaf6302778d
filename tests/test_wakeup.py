"""The call's condition variable (net/wakeup.py): a waiter that names what it waits for is woken
only once that holds, one that names nothing by every notify, any of them by its timeout; a
predicate that raises wakes its waiter, and one that notifies in turn loses nobody."""

from __future__ import annotations

import threading
import time

import pytest

from intellect_jax.net.wakeup import Cond


def _waiter(cond: Cond, ready, timeout: float, until=None):  # noqa: ANN001, ANN202
    """A thread that waits (under the lock, as the call's threads do) until ``ready()``,
    counting how often it woke; returns (thread, wakes, finished)."""
    wakes, done = [0], threading.Event()

    def run() -> None:
        end = time.monotonic() + timeout
        with cond:
            while not ready() and time.monotonic() < end:
                cond.wait(end - time.monotonic(), until=until)
                wakes[0] += 1
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, wakes, done


def _settle() -> None:
    time.sleep(0.05)  # (long enough for a thread to reach its wait here: the waits below are 10 s)


def test_a_waiter_is_woken_only_once_what_it_waits_for_holds():
    cond, state = Cond(), {"a": 0, "b": 0}
    ta, wa, da = _waiter(cond, lambda: state["a"] >= 1, 10.0, until=lambda: state["a"] >= 1)
    tb, wb, db = _waiter(cond, lambda: state["b"] >= 1, 10.0, until=lambda: state["b"] >= 1)
    plain_state = {"n": 0}
    tp, wp, dp = _waiter(cond, lambda: plain_state["n"] >= 50, 10.0)  # (no predicate: every notify)
    _settle()
    for _ in range(50):
        with cond:
            plain_state["n"] += 1
            cond.notify_all()
        time.sleep(0.001)
    assert dp.wait(5.0) and wp[0] >= 2  # (woken by the notifies, not by its timeout)
    assert wa[0] == 0 and wb[0] == 0 and not da.is_set() and not db.is_set()
    with cond:
        state["a"] = 1
        cond.notify_all()
    assert da.wait(5.0) and wa[0] == 1 and not db.is_set() and wb[0] == 0
    with cond:
        state["b"] = 1
        cond.notify_all()
    assert db.wait(5.0) and wb[0] == 1
    for t in (ta, tb, tp):
        t.join(5.0)
    assert cond._waiters == []


def test_a_timeout_wakes_a_waiter_whatever_its_predicate():
    cond = Cond()
    with cond:
        t0 = time.monotonic()
        assert cond.wait(0.05, until=lambda: False) is False
        assert 0.04 <= time.monotonic() - t0 < 5.0
        assert cond._waiters == []
        assert cond.wait(0.0) is False  # (a deadline already passed: no wait at all)


def test_a_predicate_that_raises_wakes_its_waiter():
    cond, calls = Cond(), []

    def bad() -> bool:
        calls.append(1)
        raise ValueError("boom")

    t, wakes, done = _waiter(cond, lambda: bool(calls), 10.0, until=bad)
    _settle()
    with cond:
        cond.notify_all()
    assert done.wait(5.0) and wakes[0] == 1
    t.join(5.0)


def test_a_predicate_that_changes_state_and_notifies_loses_nobody():
    """As ``AuditFrames._decided`` does: deciding under the lock, then telling every waiter.
    Its own notify comes while a notify looks at the waiters; the waiter its change concerns is
    woken all the same, and no waiter's lock is released twice."""
    cond, state = Cond(), {"asked": False, "decided": False}

    def decided() -> bool:
        if state["asked"] and not state["decided"]:
            state["decided"] = True
            cond.notify_all()
        return state["decided"]

    t1, w1, d1 = _waiter(cond, lambda: state["decided"], 10.0, until=lambda: state["decided"])
    _settle()
    t2, w2, d2 = _waiter(cond, decided, 10.0, until=decided)
    _settle()
    with cond:
        state["asked"] = True
        cond.notify_all()
    assert d1.wait(5.0) and d2.wait(5.0)
    assert w1[0] == 1 and w2[0] == 1
    for t in (t1, t2):
        t.join(5.0)
    assert cond._waiters == [] and not cond._notifying


@pytest.mark.parametrize("waiters", (1, 4))
def test_a_notify_with_nobody_waiting_or_nothing_ready_wakes_nobody(waiters):
    cond = Cond()
    with cond:
        cond.notify_all()  # nobody waits
    threads = [_waiter(cond, lambda: False, 0.5, until=lambda: False) for _ in range(waiters)]
    _settle()
    for _ in range(20):
        with cond:
            cond.notify_all()
    for t, wakes, done in threads:
        assert done.wait(5.0) and wakes[0] == 1  # (its timeout, once)
        t.join(5.0)


def test_the_lock_is_re_entrant_and_a_wait_releases_every_level():
    """As threading.Condition's default lock: a thread holding the condition may take it again,
    and a wait lets another thread in however deeply the waiter holds it (in a thread of its
    own, so that a lock that is not re-entrant fails this test instead of hanging it)."""
    cond, came, seen = Cond(), [], []

    def other() -> None:
        with cond:
            came.append(1)
            cond.notify_all()

    def nested() -> None:
        with cond:
            with cond:
                t = threading.Thread(target=other, daemon=True)
                t.start()
                seen.append(cond.wait(5.0, until=lambda: bool(came)) and came == [1])
            seen.append(cond._lock._is_owned())  # (still held at the outer level)
        t.join(5.0)

    n = threading.Thread(target=nested, daemon=True)
    n.start()
    n.join(10.0)
    assert not n.is_alive() and seen == [True, True]


def test_a_predicate_that_notifies_on_every_look_cannot_hold_the_notifier():
    cond, looks = Cond(), [0]

    def restless() -> bool:
        looks[0] += 1
        cond.notify_all()
        return False

    t, wakes, done = _waiter(cond, lambda: looks[0] > 0, 10.0, until=restless)
    _settle()
    with cond:
        cond.notify_all()  # (returns: after as many looks again as there were waiters, all are woken)
    assert done.wait(5.0) and wakes[0] == 1 and looks[0] == 1
    t.join(5.0)


def test_an_interrupt_in_a_predicate_leaves_every_waiter_not_yet_woken_waiting():
    """A KeyboardInterrupt (not an Exception) in one waiter's predicate reaches the notifier; the
    waiters it had not woken stay registered, and a later notify wakes them, releasing no
    waiter's lock twice (a review's case)."""
    cond, state = Cond(), {"go": False, "boom": True}

    def boom() -> bool:
        if state["boom"]:
            state["boom"] = False
            raise KeyboardInterrupt
        return state["go"]

    t1, w1, d1 = _waiter(cond, lambda: state["go"], 10.0)  # (no predicate: woken by the first notify)
    _settle()
    t2, w2, d2 = _waiter(cond, lambda: state["go"], 10.0, until=boom)
    _settle()
    t3, w3, d3 = _waiter(cond, lambda: state["go"], 10.0, until=lambda: state["go"])
    _settle()
    with pytest.raises(KeyboardInterrupt):
        with cond:
            cond.notify_all()
    with cond:
        assert len(cond._waiters) >= 2 and not cond._notifying
        state["go"] = True
        cond.notify_all()
    for t, done in ((t1, d1), (t2, d2), (t3, d3)):
        assert done.wait(5.0)
        t.join(5.0)
    assert cond._waiters == []


def test_waiting_or_notifying_without_the_lock_is_an_error():
    cond = Cond()
    with pytest.raises(RuntimeError, match="does not hold"):
        cond.wait(0.01)
    with pytest.raises(RuntimeError, match="does not hold"):
        cond.notify_all()
    assert cond._waiters == []
