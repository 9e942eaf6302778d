"""`python -m intellect_jax.launch --nodes N --config configs/debug_diloco.toml [events]`

Runs a whole elastic DiLoCo run on this machine: a coordinator (with a journal in the run
directory) and N node processes, each with its own slice of fake CPU devices, their logs
prefixed by node, a live table, and failures: `--kill NODE@K` (SIGKILL NODE while it works on
outer step K), `--join NODE@K` (NODE starts once the run has done K outer steps, as the nodes'
output shows, so it joins mid-run and gets the state from a live peer),
`--kill-coordinator K` (SIGKILL the coordinator after outer step K and restart it on the same
port). Seeded random fault schedules are `python -m intellect_jax.testing.chaos`, which takes
the other options too and draws its own faults.
`--auto-rollback-after SECONDS` goes to the coordinator (with no live node holding the newest
state that long, it rolls back by itself to the newest state registered nodes hold). Extra
`--section.key value` options go to every node.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from intellect_jax.cli import run_main
from intellect_jax.model.config import ConfigError
from intellect_jax.net.identity import Authority, IdentityError

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
    starts: int = 0
    live_outer: int = 0  # newest outer step its current process logged (0 until its first)
    registered: bool = False  # its current process has registered with the coordinator
    lines: list[str] = field(default_factory=list)
    first_line: int = 0  # where its current process's lines begin in `lines`

    def why(self) -> str:
        """The last error line its current process printed ("error: ..." or a traceback's last
        line), at most 200 characters: why a node that exited badly did."""
        for line in reversed(self.lines[max(self.first_line, len(self.lines) - 200):]):
            text = line.split("] ", 1)[-1] if line.startswith("[") else line
            if text.startswith("error: ") or re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Group|Refused|Unavailable)(: |$)",
                                                     text):
                return text[:200]
        return ""


def _event(spec: str, flag: str) -> tuple[str, int]:
    m = re.fullmatch(r"([\w.-]+)@(\d+)", spec)
    if not m:
        raise ConfigError(f"{flag} {spec!r}: expected NODE@OUTER_STEP, e.g. node1@3")
    return m.group(1), int(m.group(2))


def parser(prog: str = "python -m intellect_jax.launch") -> argparse.ArgumentParser:
    """The launcher's options (the chaos command adds its own to these)."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[1])
    ap.add_argument("--nodes", type=int, required=True, help="nodes started at once (node0 .. nodeN-1)")
    ap.add_argument("--config", required=True)
    ap.add_argument("--devices-per-node", type=int, default=1, help="fake CPU devices per node")
    ap.add_argument("--kill", action="append", default=[], metavar="NODE@K")
    ap.add_argument("--join", action="append", default=[], metavar="NODE@K")
    ap.add_argument("--kill-coordinator", type=int, default=None, metavar="K")
    ap.add_argument("--out-dir", default="runs")
    ap.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
    ap.add_argument("--heartbeat-timeout", type=float, default=10.0, help="the coordinator's")
    ap.add_argument("--auto-rollback-after", type=float, default=None, metavar="SECONDS",
                    help="the coordinator's: roll back by itself after this long with no live holder of the "
                         "newest state (0: never; default: the coordinator's)")
    ap.add_argument("--table-every", type=float, default=10.0, help="seconds between live tables (0: off)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="give up after this many seconds")
    return ap


def parse(argv: list[str] | None, ap: argparse.ArgumentParser | None = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = [a for x in argv for a in (x.split("@", 1) if x.startswith("--kill-coordinator@") else [x])]
    ap = ap or parser()
    args, extra = ap.parse_known_args(argv)
    if args.nodes < 1:
        raise ConfigError(f"--nodes must be >= 1, got {args.nodes}")
    if args.auto_rollback_after is not None and args.auto_rollback_after < 0:
        raise ConfigError(f"--auto-rollback-after must be >= 0 seconds (0: never), got {args.auto_rollback_after}")
    kills = dict(_event(s, "--kill") for s in args.kill)
    joins = dict(_event(s, "--join") for s in args.join)
    founder = next((n for n in joins if n in {f"node{i}" for i in range(args.nodes)}), None)
    if founder is not None:
        raise ConfigError(f"--join {founder}@{joins[founder]}: {founder} is one of the --nodes {args.nodes} started at "
                          "once; a joiner needs another name")
    return args, extra, kills, joins


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launcher:
    def __init__(self, args, extra: list[str], kills: dict[str, int], joins: dict[str, int],
                 run_name: str | None = None):
        self.args, self.extra, self.kills, self.joins = args, list(extra), kills, joins
        if not Path(args.config).is_file():
            raise FileNotFoundError(f"--config {args.config}: no such file")
        founders = [f"node{i}" for i in range(args.nodes)]
        self.names = founders + list(joins)
        self.nodes = {n: NodeView(n) for n in self.names}
        self.port = args.port or _free_port()
        self.env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
                        XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices_per_node}")
        self.coord: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.progress = 0  # most outer steps any node has completed
        self.coord_killed = False
        self.hooks: list = []  # called every poll (the chaos schedule)
        from intellect_jax.config import parse_args

        cfg = parse_args(["--config", args.config, *extra])  # the nodes' config, validated up front
        self.cfg = cfg
        self.fingerprint = cfg.model.build().fingerprint()
        self.run_name = run_name or cfg.run.name
        if "--run.name" in self.extra:
            i = self.extra.index("--run.name")
            del self.extra[i : i + 2]
        self.run_dir = Path(args.out_dir) / self.run_name
        self.keys = self.run_dir / "keys"  # the run's authority: one certificate per node, made here

    def authority(self) -> Authority:
        """The run's keys (made on first use), with a certificate for every node named so far."""
        try:
            auth = Authority.load(self.keys)
        except IdentityError:
            auth = Authority.init(self.keys, self.cfg.diloco.run_id)
        issued = auth.index()
        for name in self.names:
            if name not in issued:
                auth.issue(name)
        return auth

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
            view.lines.append(line)
            if "registered as " in line and view.proc is proc:
                view.registered = True
            m = OUTER_RE.search(line)
            if m:
                view.outer, view.epoch = int(m.group(1)), int(m.group(2))
                view.loss, view.sync_s = float(m.group(4)), float(m.group(5))
                if view.proc is proc:  # not the last lines of a process already replaced
                    view.live_outer = view.outer
                with self.lock:
                    self.progress = max(self.progress, view.outer)

    def start_coordinator(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.authority()
        cmd = [sys.executable, "-m", "intellect_jax.coordinator", "--host", "127.0.0.1",
               "--port", str(self.port), "--min-nodes", str(self.args.nodes),
               "--heartbeat-timeout", str(self.args.heartbeat_timeout), "--model-fingerprint", self.fingerprint,
               "--run-id", self.cfg.diloco.run_id, "--journal", str(self.run_dir / "coordinator.journal"),
               "--keys", str(self.keys)]
        rollback_after = getattr(self.args, "auto_rollback_after", None)
        if rollback_after is not None:
            cmd += ["--auto-rollback-after", str(rollback_after)]
        self.coord = subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True)
        threading.Thread(target=self._pump, args=("coord", self.coord, None), daemon=True).start()

    def kill_coordinator(self, down: float = 2.0) -> None:
        self.say("launch", f"SIGKILL coordinator; restarting in {down:.0f}s")
        assert self.coord is not None
        self.coord.kill()
        self.coord.wait()
        time.sleep(down)
        self.start_coordinator()

    def start_node(self, name: str, resume: bool = False) -> None:
        i = self.names.index(name) if name in self.names else len(self.names)
        if not (self.keys / f"{name}.crt").exists():  # a node named after the start (a late joiner)
            if name not in self.names:
                self.names.append(name)
            self.authority()
        cmd = [sys.executable, "-m", "intellect_jax.train", "--config", self.args.config,
               "--diloco.enabled", "--diloco.coordinator", f"127.0.0.1:{self.port}",
               "--diloco.node_id", name, "--diloco.keys", str(self.keys), "--run.no-progress",
               "--run.out_dir", self.args.out_dir, *self.extra]
        if not self.cfg.diloco.leases:  # without leases every node reads a shard of its own
            n = max(len(self.names), 1)
            cmd += ["--diloco.data_rank", str(i % n), "--diloco.data_ranks", str(n)]
        cmd += ["--run.name", f"{self.run_name}/{name}"]
        if resume:
            cmd += ["--ckpt.resume"]
        view = self.nodes.setdefault(name, NodeView(name))
        view.proc = subprocess.Popen(cmd, env=dict(self.env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        view.status, view.starts, view.live_outer, view.registered = "running", view.starts + 1, 0, False
        view.first_line = len(view.lines)
        threading.Thread(target=self._pump, args=(name, view.proc, view), daemon=True).start()
        self.say("launch", f"started {name} (pid {view.proc.pid}{', resuming' if resume else ''})")

    def table(self) -> None:
        rows = [f"{'node':<8} {'status':<10} {'epoch':>5} {'outer':>5} {'loss':>8} {'sync s':>7}"]
        for v in self.nodes.values():
            rows.append(f"{v.name:<8} {v.status:<10} {v.epoch:>5} {v.outer:>5} {v.loss:>8.4f} {v.sync_s:>7.2f}")
        self.say("table", "\n" + "\n".join(rows))

    def running(self) -> list[NodeView]:
        return [v for v in self.nodes.values() if v.status in ("running", "stopped", "pending", "restarting")]

    def run(self) -> int:
        self.start_coordinator()
        for n in self.names:
            if n not in self.joins:  # joiners start in `_events`, once the run is far enough
                self.start_node(n)
        t_end = time.monotonic() + self.args.timeout
        t_table = time.monotonic() + self.args.table_every
        try:
            while time.monotonic() < t_end:
                self._events()
                for hook in self.hooks:
                    hook()
                for v in self.nodes.values():
                    if v.proc is not None and v.status == "running" and v.proc.poll() is not None:
                        v.status = "done" if v.proc.returncode == 0 else f"exit {v.proc.returncode}"
                        why = v.why() if v.status != "done" else ""
                        self.say("launch", f"{v.name} {v.status}" + (f" ({why})" if why else ""))
                if not self.running():
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
                    v.proc.send_signal(signal.SIGCONT)
                    v.proc.kill()
            if self.coord is not None and self.coord.poll() is None:
                self.coord.send_signal(signal.SIGCONT)  # (it may be SIGSTOPped)
                self.coord.send_signal(signal.SIGTERM)
                try:
                    self.coord.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.coord.kill()
                    self.coord.wait()
        self.table()
        ok = all(v.status in ("done", "killed") for v in self.nodes.values())
        return 0 if ok else 1

    def _events(self) -> None:
        for name, k_kill in self.kills.items():
            v = self.nodes[name]
            if v.status == "running" and v.outer >= k_kill - 1 and v.proc is not None and v.proc.poll() is None:
                self.say("launch", f"SIGKILL {name} during outer step {k_kill}")
                v.proc.kill()
                v.proc.wait()
                v.status = "killed"
        with self.lock:
            k = self.progress
        idle = not any(v.status == "running" for v in self.nodes.values())  # (it will be told the run is over)
        for name, k_join in self.joins.items():
            if self.nodes[name].status == "pending" and (k >= k_join or idle):
                self.say("launch", f"the run has done {k} outer steps: starting {name}")
                self.start_node(name)
        kc = self.args.kill_coordinator
        if kc is not None and not self.coord_killed and k >= kc:
            self.coord_killed = True
            self.kill_coordinator()


def main(argv: list[str] | None = None) -> int:
    args, extra, kills, joins = parse(argv)
    code = Launcher(args, extra, kills, joins).run()
    if code:
        raise SystemExit(code)
    return code


if __name__ == "__main__":
    sys.exit(run_main(main))
