"""`python -m intellect_jax.launch --nodes N --config configs/debug_diloco.toml [events]`

Runs a whole elastic DiLoCo run on this machine: a coordinator and N node processes, each with
its own slice of fake CPU devices, their logs prefixed by node, a live table, and scripted
failures: `--kill NODE@K` (SIGKILL inside the all-reduce of outer step K), `--join NODE@K`
(NODE starts with the others, then registers only once the run has done K outer steps, so it
joins mid-run and gets the state from a live peer), `--kill-coordinator K` (SIGKILL the
coordinator after outer step K and restart it on the same port). Extra `--section.key value`
options go to every node.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from intellect_jax.cli import run_main
from intellect_jax.diloco.node import CHAOS_ENV
from intellect_jax.net.auth import SECRET_ENV

OUTER_RE = re.compile(r"outer step (\d+): epoch (\d+) \((\d+) nodes\), loss ([\d.nan]+), sync ([\d.]+)s")


@dataclass
class NodeView:
    name: str
    proc: subprocess.Popen | None = None
    outer: int = 0
    epoch: int = 0
    loss: float = float("nan")
    sync_s: float = float("nan")
    status: str = "pending"
    lines: list[str] = field(default_factory=list)


def _event(spec: str, flag: str) -> tuple[str, int]:
    m = re.fullmatch(r"([\w.-]+)@(\d+)", spec)
    if not m:
        raise ValueError(f"{flag} {spec!r}: expected NODE@OUTER_STEP, e.g. node1@3")
    return m.group(1), int(m.group(2))


def parse(argv: list[str] | None):
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = [a for x in argv for a in (x.split("@", 1) if x.startswith("--kill-coordinator@") else [x])]
    ap = argparse.ArgumentParser(prog="python -m intellect_jax.launch", description=__doc__.split("\n\n")[1])
    ap.add_argument("--nodes", type=int, required=True, help="nodes started at once (node0 .. nodeN-1)")
    ap.add_argument("--config", required=True)
    ap.add_argument("--devices-per-node", type=int, default=1, help="fake CPU devices per node")
    ap.add_argument("--kill", action="append", default=[], metavar="NODE@K")
    ap.add_argument("--join", action="append", default=[], metavar="NODE@K")
    ap.add_argument("--kill-coordinator", type=int, default=None, metavar="K")
    ap.add_argument("--out-dir", default="runs")
    ap.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
    ap.add_argument("--table-every", type=float, default=10.0, help="seconds between live tables (0: off)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="give up after this many seconds")
    args, extra = ap.parse_known_args(argv)
    if args.nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {args.nodes}")
    kills = dict(_event(s, "--kill") for s in args.kill)
    joins = dict(_event(s, "--join") for s in args.join)
    return args, extra, kills, joins


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launcher:
    def __init__(self, args, extra: list[str], kills: dict[str, int], joins: dict[str, int]):
        self.args, self.extra, self.kills, self.joins = args, extra, kills, joins
        if not Path(args.config).is_file():
            raise FileNotFoundError(f"--config {args.config}: no such file")
        founders = [f"node{i}" for i in range(args.nodes)]
        self.names = founders + [n for n in joins if n not in founders]
        self.nodes = {n: NodeView(n) for n in self.names}
        self.port = args.port or _free_port()
        self.env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
                        XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices_per_node}")
        self.env.setdefault(SECRET_ENV, secrets.token_hex(32))
        self.coord: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.progress = 0  # most outer steps any node has completed
        self.coord_killed = False
        from intellect_jax.config import parse_args

        cfg = parse_args(["--config", args.config, *extra])  # the nodes' config, validated up front
        self.fingerprint = cfg.model.build().fingerprint()
        self.run_name = cfg.run.name
        if "--run.name" in self.extra:
            i = self.extra.index("--run.name")
            del self.extra[i : i + 2]

    def say(self, who: str, line: str) -> None:
        tag = f"[{who}]"
        with self.lock:
            print(line if line.startswith(tag) else f"{tag} {line}", flush=True)

    def _pump(self, who: str, proc: subprocess.Popen, view: NodeView | None) -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            line = line.rstrip()
            self.say(who, line)
            if view is None:
                continue
            m = OUTER_RE.search(line)
            if m:
                view.outer, view.epoch = int(m.group(1)), int(m.group(2))
                view.loss, view.sync_s = float(m.group(4)), float(m.group(5))
                with self.lock:
                    self.progress = max(self.progress, view.outer)

    def start_coordinator(self) -> None:
        cmd = [sys.executable, "-m", "intellect_jax.coordinator", "--host", "127.0.0.1",
               "--port", str(self.port), "--min-nodes", str(self.args.nodes), "--heartbeat-timeout", "10",
               "--model-fingerprint", self.fingerprint]
        self.coord = subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True)
        threading.Thread(target=self._pump, args=("coord", self.coord, None), daemon=True).start()

    def start_node(self, name: str) -> None:
        i = self.names.index(name)
        cmd = [sys.executable, "-m", "intellect_jax.train", "--config", self.args.config,
               "--diloco.enabled", "--diloco.coordinator", f"127.0.0.1:{self.port}",
               "--diloco.node_id", name, "--diloco.data_rank", str(i),
               "--diloco.data_ranks", str(len(self.names)), "--run.no-progress",
               "--run.out_dir", self.args.out_dir, *self.extra]
        cmd += ["--run.name", f"{self.run_name}/{name}"]
        if name in self.joins:  # starts now, registers once the run has done that many outer steps
            cmd += ["--diloco.join_after", str(self.joins[name])]
        env = dict(self.env)
        if name in self.kills:
            env[CHAOS_ENV] = str(self.kills[name])
        view = self.nodes[name]
        view.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        view.status = "running"
        threading.Thread(target=self._pump, args=(name, view.proc, view), daemon=True).start()
        self.say("launch", f"started {name} (pid {view.proc.pid})")

    def table(self) -> None:
        rows = [f"{'node':<8} {'status':<10} {'epoch':>5} {'outer':>5} {'loss':>8} {'sync s':>7}"]
        for v in self.nodes.values():
            rows.append(f"{v.name:<8} {v.status:<10} {v.epoch:>5} {v.outer:>5} {v.loss:>8.4f} {v.sync_s:>7.2f}")
        self.say("table", "\n" + "\n".join(rows))

    def run(self) -> int:
        self.start_coordinator()
        for n in self.names:
            self.start_node(n)
        t_end = time.monotonic() + self.args.timeout
        t_table = time.monotonic() + self.args.table_every
        try:
            while time.monotonic() < t_end:
                self._events()
                for v in self.nodes.values():
                    if v.proc is not None and v.status == "running" and v.proc.poll() is not None:
                        v.status = "done" if v.proc.returncode == 0 else f"exit {v.proc.returncode}"
                        self.say("launch", f"{v.name} {v.status}")
                if all(v.status not in ("running", "pending") for v in self.nodes.values()):
                    break
                if self.args.table_every and time.monotonic() > t_table:
                    self.table()
                    t_table = time.monotonic() + self.args.table_every
                time.sleep(0.2)
            else:
                self.say("launch", f"timeout after {self.args.timeout:.0f}s")
        finally:
            for v in self.nodes.values():
                if v.proc is not None and v.proc.poll() is None:
                    v.proc.kill()
            if self.coord is not None and self.coord.poll() is None:
                self.coord.send_signal(signal.SIGTERM)
                self.coord.wait(timeout=10)
        self.table()
        expected_dead = set(self.kills)
        ok = all(v.status == "done" for n, v in self.nodes.items() if n not in expected_dead)
        return 0 if ok else 1

    def _events(self) -> None:
        with self.lock:
            k = self.progress
        kc = self.args.kill_coordinator
        if kc is not None and not self.coord_killed and k >= kc:
            self.coord_killed = True
            self.say("launch", f"SIGKILL coordinator after outer step {k}; restarting in 2s")
            self.coord.kill()
            self.coord.wait()
            time.sleep(2)
            self.start_coordinator()


def main(argv: list[str] | None = None) -> int:
    args, extra, kills, joins = parse(argv)
    code = Launcher(args, extra, kills, joins).run()
    if code:
        raise SystemExit(code)
    return code


if __name__ == "__main__":
    sys.exit(run_main(main))
