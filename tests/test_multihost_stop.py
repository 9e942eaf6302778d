"""A multi-process node's `train(until, stop)`: the lead's stop() decides for every process."""

import threading

from intellect_jax.diloco.multihost import Follower, Followers, LeadInner
from intellect_jax.net.comm import NetNode
from intellect_jax.net.transport import TransportConfig, connect


class Steps:
    """A trainer that only counts steps, with `Trainer.train`'s stop rule (asked before each step)."""

    def __init__(self) -> None:
        self.step = 0

    def train(self, until, stop=None):
        while self.step < until and not (stop is not None and stop()):
            self.step += 1
        return {"step": self.step}


def test_followers_stop_where_the_lead_stops():
    cfg = TransportConfig(run_id="mh", secret=b"multihost-test-secret-0123456789", io_timeout=5.0)
    net = NetNode(cfg)
    mine, theirs = Steps(), Steps()
    f_conn = connect(cfg, net.address, "c", timeout=5)
    followers = Followers.__new__(Followers)  # (one follower, connected by hand: no JAX runtime here)
    followers.conns = {1: net.accept("c", timeout=5)}
    follower = Follower(theirs, None, f_conn)  # type: ignore[arg-type]
    served: list[int] = []
    th = threading.Thread(target=lambda: served.append(follower.run()), daemon=True)
    th.start()
    lead = LeadInner(mine, None, followers)  # type: ignore[arg-type]
    try:
        # the follower cannot see the lead's stop(): it stops at the lead's answers alone
        asked: list[int] = []
        assert lead.train(10, stop=lambda: asked.append(mine.step) or mine.step >= 4) == {"step": 4}
        assert asked == [0, 1, 2, 3, 4]
        assert lead.train(10, stop=lambda: True) == {"step": 4}  # stops before any step
        assert lead.train(6) == {"step": 6}  # no stop: no per-step answers
        assert lead.train(12, stop=lambda: False) == {"step": 12}  # until first: stop() not asked at 12
    finally:
        followers.close()  # "stop": the follower returns
        th.join(timeout=10)
        f_conn.close(), net.close()
    assert served == [4] and theirs.step == 12
