"""Live state transfer between two nodes over a shaped link (a script, not a test; needs root).

    sudo python benchmarks/state_transfer.py [--preset 150m] [--mbit 500] [--baseline-s 40]

Two processes, each in its own network namespace with tbf-shaped links (`benchmarks/netns.py`)
and pinned to its own CPU core (two machines, as far as one VM allows). The donor builds the
preset's trainer (real model shapes; a small batch so that it makes many inner steps), takes the
DiLoCo snapshot a donor takes at a boundary, trains for `--baseline-s` seconds alone, then keeps
training while it streams the snapshot to the joiner (`diloco.transfer.NetTransport`, the real
node's path). The joiner receives it, checks the state hash, then writes it through its
checkpoint store (orbax) and restores it. Prints one JSON line: state bytes, transfer seconds
against bytes / link rate, the donor's inner steps/s before and during the transfer, and the
joiner's checkpoint write + restore seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PORT = 29650


def _cfg(a: argparse.Namespace, name: str):
    from intellect_jax import config as C

    return C.validate({
        "run": {"name": name, "out_dir": a.out, "steps": 100000, "progress": False, "log_every": 1000},
        "model": {"preset": a.preset, "compute_dtype": "float32"},
        "data": {"seq_len": a.seq, "batch_size": a.batch, "cache_dir": str(Path(a.out) / "cache")},
        "ckpt": {"every": 0, "async_save": False},
    })


def _trainer(a: argparse.Namespace, name: str):
    from intellect_jax.trainer.loop import Role, Trainer

    return Trainer(_cfg(a, name), role=Role.INNER)


def donor(a: argparse.Namespace) -> None:
    from intellect_jax.diloco.inner import TrainerInner
    from intellect_jax.diloco.state import nesterov_sgd, state_hash
    from intellect_jax.diloco.transfer import NetTransport
    from intellect_jax.net.comm import NetNode
    from intellect_jax.testing.identities import transport_config

    os.sched_setaffinity(0, {0})  # training (and every thread it starts) on core 0
    t = _trainer(a, f"donor-{os.getpid()}")
    inner = TrainerInner(t)
    s = inner.init_state(nesterov_sgd(0.7, 0.9))._replace(outer_step=1)  # as after a first outer step
    t.train(until=2)  # compiled and warm
    snap = s._replace(inner_opt_state=inner.snapshot(), data=None)
    meta = {"outer_step": 1, "inner_step": 0, "hash": state_hash(s)}
    net = NetNode(transport_config("donor", "xfer", io_timeout=120.0), a.addr, 0)

    class Pinned(NetTransport):
        def send(self, *args, **kw):  # runs in the serve thread
            if a.transfer_cpu is not None:
                os.sched_setaffinity(0, {a.transfer_cpu})
            return super().send(*args, **kw)

    xfer = Pinned(net, "donor", log=lambda line: print(f"[donor] {line}", flush=True))

    def steps(until) -> list[float]:
        """Durations of the inner steps that ran entirely before ``until()`` turned true."""
        out = []
        while not until():
            t0 = time.perf_counter()
            t.train(until=t.step + 1)
            if not until():
                out.append(time.perf_counter() - t0)
        return out

    t_base = time.perf_counter() + a.baseline_s
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    alone = steps(lambda: time.perf_counter() >= t_base)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    done = xfer.serve("joiner", a.joiner, snap, meta, timeout=3600)
    during = steps(done.is_set)
    r2 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = [[round(b.ru_utime - a_.ru_utime, 2), round(b.ru_stime - a_.ru_stime, 2)] for a_, b in ((r0, r1), (r1, r2))]
    print(json.dumps({"role": "donor", "step_s_alone": alone, "step_s_during": during, "sent": xfer.last,
                      "process_cpu_user_sys": cpu}), flush=True)
    net.close()
    t.close(save=False)


def joiner(a: argparse.Namespace) -> None:
    from intellect_jax.diloco.inner import TrainerInner
    from intellect_jax.coordinator.protocol import Admission
    from intellect_jax.diloco.state import state_hash
    from intellect_jax.diloco.store import CheckpointStore
    from intellect_jax.diloco.transfer import NetTransport
    from intellect_jax.net.comm import NetNode
    from intellect_jax.testing.identities import transport_config

    t = _trainer(a, f"joiner-{os.getpid()}")
    inner = TrainerInner(t)
    net = NetNode(transport_config("joiner", "xfer", io_timeout=120.0), a.addr, PORT)
    print("ready", flush=True)
    xfer = NetTransport(net, "joiner")
    meta, got = xfer.receive(Admission("donor", "", 0, 1, 1), inner.template(), lambda: False, timeout=3600)
    got = got._replace(outer_step=1, inner_step=0)
    ok = state_hash(got) == meta.hash
    t0 = time.perf_counter()
    store = CheckpointStore(t)
    store.save(got, wait=True)
    back = store.load(0)
    store_s = time.perf_counter() - t0
    print(json.dumps({"role": "joiner", "hash_ok": ok and state_hash(back) == meta.hash, "received": xfer.last,
                      "checkpoint_write_and_restore_s": store_s}), flush=True)
    net.close()
    t.close(save=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="150m")
    ap.add_argument("--mbit", type=float, default=500.0)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--baseline-s", type=float, default=60.0)
    ap.add_argument("--transfer-cpu", type=int, default=None,
                    help="run the donor's sending thread on this core (default: with its training, on core 0)")
    ap.add_argument("--out", default="/tmp/ij-state-transfer")
    ap.add_argument("--role", choices=["donor", "joiner"], help=argparse.SUPPRESS)
    ap.add_argument("--addr", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--joiner", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role == "donor":
        return donor(a)
    if a.role == "joiner":
        return joiner(a)

    import netns  # beside this file

    why = netns.require_root()
    if why:
        sys.exit(f"error: {why}")
    from intellect_jax.testing.identities import credentials

    for who in ("donor", "joiner"):  # a throwaway run authority; the roles inherit $INTELLECT_TEST_KEYS
        credentials(who)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    base = [sys.executable, __file__, "--preset", a.preset, "--batch", str(a.batch), "--seq", str(a.seq),
            "--baseline-s", str(a.baseline_s), "--out", a.out,
            *(["--transfer-cpu", str(a.transfer_cpu)] if a.transfer_cpu is not None else [])]
    with netns.ShapedNet(2, a.mbit) as net:
        # Receive processing of each direction on the receiving machine's core (RPS), as it is
        # between two machines: without this, the kernel runs the joiner's receive path (and
        # the bridge hop) in the donor's softirq, on the donor's core.
        net.steer_receive(1, peer=0, cpu=1)
        net.steer_receive(0, peer=1, cpu=0 if a.transfer_cpu is None else a.transfer_cpu)
        j = subprocess.Popen(["taskset", "-c", "1", *net.exec_prefix(1), *base, "--role", "joiner",
                              "--addr", net.addr(1)], env=env, stdout=subprocess.PIPE, text=True)
        assert j.stdout is not None
        for line in j.stdout:
            if line.strip() == "ready":
                break
        d = subprocess.Popen(["taskset", "-c", "0" if a.transfer_cpu is None else f"0,{a.transfer_cpu}",
                              *net.exec_prefix(0), *base, "--role", "donor",
                              "--addr", net.addr(0), "--joiner", f"{net.addr(1)}:{PORT}"], env=env,
                             stdout=subprocess.PIPE, text=True)
        outs = {}
        for p in (d, j):
            for line in p.stdout:  # type: ignore[union-attr]
                print(line.rstrip(), flush=True)
                if line.startswith("{"):
                    r = json.loads(line)
                    outs[r["role"]] = r
            p.wait()
    dn, jn = outs["donor"], outs["joiner"]
    nbytes, secs = jn["received"]["bytes"], jn["received"]["seconds"]
    bound = nbytes * 8 / (a.mbit * 1e6)
    alone, during = statistics.mean(dn["step_s_alone"]), statistics.mean(dn["step_s_during"])
    print(json.dumps({"preset": a.preset, "mbit": a.mbit, "transfer_cpu": a.transfer_cpu, "state_bytes": nbytes, "transfer_s": round(secs, 2),
                      "line_rate_s": round(bound, 2), "transfer_over_line_rate": round(secs / bound, 3),
                      "donor_step_s_alone": round(alone, 4), "donor_step_s_during": round(during, 4),
                      "donor_step_s_stdev": [round(statistics.stdev(dn[k]), 4) for k in ("step_s_alone", "step_s_during")],
                      "donor_rate_during_over_alone": round(alone / during, 3),
                      "donor_steps": [len(dn["step_s_alone"]), len(dn["step_s_during"])], "hash_ok": jn["hash_ok"],
                      "donor_send_thread_cpu_s": round(dn["sent"]["cpu_s"], 2),
                      "donor_process_cpu_user_sys_alone_during": dn["process_cpu_user_sys"],
                      "joiner_checkpoint_write_and_restore_s": round(jn["checkpoint_write_and_restore_s"], 1)}))


if __name__ == "__main__":
    main()
