"""`python -m intellect_jax.launch --chaos SEED`: a seeded random fault schedule against real
processes (the real CLI, sockets, coordinator and checkpoints), then a summary.

Faults, fired as the run passes randomly chosen outer steps: SIGKILL a node and restart it with
`--ckpt.resume` (as is, after flipping bytes in its newest checkpoint, or after deleting its
newest checkpoint so that it resumes from an older one); SIGSTOP a node for 10-30 s; SIGKILL
the coordinator and restart it from its journal. After the run, one more node registers and
must be told that the run is complete. The summary (one JSON line) gives the faults, the
outer steps done, the steps whose hashes disagree across every node that ever logged them,
every node's exit status, the mean number of contributors per outer step, and the final
validation loss against a fault-free run of the same job (`--chaos-reference`, on as many
nodes or, e.g., on one: every outer step keeps a contributor, so a run with faults should end
no worse than one node training alone).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from intellect_jax.launch import Launcher


class Chaos:
    """Fires the planned faults as the run passes their outer steps, at least ``gap`` seconds
    apart. A node is only killed or stopped while another one is running, and it only comes
    back from a damaged or an older checkpoint while another one is running, so the run's
    newest state always survives somewhere (losing it for good needs an operator's
    ``--allow-rollback-to``; the simulation covers that)."""

    def __init__(self, launcher: Launcher, seed: int, faults: int, outer_steps: int, gap: float = 5.0) -> None:
        self.L, self.rng, self.gap = launcher, np.random.default_rng(seed), gap
        kinds = self.rng.choice(["kill", "kill", "stop", "coordinator"], size=faults)
        steps = sorted(self.rng.integers(1, max(2, outer_steps - 3), size=faults))
        self.plan = [(int(k), str(kind)) for k, kind in zip(steps, kinds)]
        self.timers: list[tuple[float, Any]] = []
        self.injected: list[str] = []
        self._last = 0.0

    def tick(self) -> None:
        now = time.monotonic()
        for t, action in [x for x in self.timers if x[0] <= now]:
            self.timers.remove((t, action))
            action()
        if self.plan and self.L.progress >= self.plan[0][0] and now - self._last >= self.gap:
            k, kind = self.plan[0]
            if self.fire(kind, k):
                self.plan.pop(0)
                self._last = time.monotonic()

    def _live(self) -> list[Any]:
        return [v for v in self.L.nodes.values() if v.status == "running" and v.proc is not None
                and v.proc.poll() is None]

    def fire(self, kind: str, k: int) -> bool:
        """Inject one fault; False if no node may take it now (try again later)."""
        L = self.L
        if kind == "coordinator":
            down = float(self.rng.uniform(1.0, 3.0))
            self.injected.append(f"coordinator SIGKILL at outer step {k} ({down:.1f}s down)")
            L.kill_coordinator(down)
            return True
        live = self._live()
        if len(live) < 2:
            return False
        v = live[int(self.rng.integers(0, len(live)))]
        if kind == "stop":
            secs = float(self.rng.uniform(10.0, 30.0))
            self.injected.append(f"SIGSTOP {v.name} at outer step {k} for {secs:.0f}s")
            L.say("chaos", f"SIGSTOP {v.name} for {secs:.0f}s")
            v.proc.send_signal(signal.SIGSTOP)
            v.status = "stopped"

            def cont(v=v) -> None:
                L.say("chaos", f"SIGCONT {v.name}")
                v.proc.send_signal(signal.SIGCONT)
                v.status = "running"

            self.timers.append((time.monotonic() + secs, cont))
            return True
        how = str(self.rng.choice(["resume", "resume", "damaged", "older"]))
        delay = float(self.rng.uniform(1.0, 4.0))
        self.injected.append(f"SIGKILL {v.name} at outer step {k}, restart in {delay:.0f}s ({how})")
        L.say("chaos", f"SIGKILL {v.name}; restarting it in {delay:.0f}s with --ckpt.resume ({how} checkpoint)")
        v.proc.kill()
        v.proc.wait()
        v.status = "restarting"

        def restart(v=v, how=how) -> None:
            ckdir = L.run_dir / v.name / "ckpt"
            steps = sorted((int(p.name) for p in ckdir.iterdir() if p.name.isdigit()), reverse=True) \
                if ckdir.is_dir() else []
            if steps and how != "resume" and [u for u in self._live() if u is not v]:
                if how == "damaged":
                    _flip_bytes(ckdir / str(steps[0]))
                else:
                    shutil.rmtree(ckdir / str(steps[0]))
            L.start_node(v.name, resume=True)

        self.timers.append((time.monotonic() + delay, restart))
        return True


def _flip_bytes(step_dir: Path) -> None:
    files = [p for p in step_dir.rglob("*") if p.is_file()]
    if files:
        f = max(files, key=lambda p: p.stat().st_size)
        b = bytearray(f.read_bytes())
        for i in range(len(b) // 3, len(b) // 3 + 16):
            b[i] ^= 0xFF
        f.write_bytes(bytes(b))


def rows(run_dir: Path) -> dict[str, list[dict]]:
    out = {}
    for m in sorted(run_dir.glob("*/metrics.jsonl")):
        out[m.parent.name] = [json.loads(line) for line in m.read_text().splitlines() if line.strip()]
    return out


def summarize(run_dir: Path, outer_steps: int) -> dict[str, Any]:
    """Hash agreement over every row any node ever wrote, steps done, final validation loss."""
    by_step: dict[int, set[str]] = {}
    contributors: dict[int, int] = {}
    finals = []
    for node_rows in rows(run_dir).values():
        for r in node_rows:
            if "outer_hash" in r:
                by_step.setdefault(r["outer_step"], set()).add(r["outer_hash"])
                contributors[r["outer_step"]] = r["contributors"]
                if r["outer_step"] == outer_steps and r.get("val_loss") is not None:
                    finals.append(r["val_loss"])
    journal = run_dir / "coordinator.journal"
    completed = json.loads(journal.read_text()).get("completed", False) if journal.exists() else None
    return {"outer_steps": max(by_step, default=0), "forked_steps": sorted(k for k, h in by_step.items() if len(h) > 1),
            "final_val_loss": statistics.mean(finals) if finals else None, "completed": completed,
            "mean_contributors": round(statistics.mean(contributors.values()), 2) if contributors else None}


def run_chaos(args: argparse.Namespace, extra: list[str]) -> int:
    from intellect_jax.config import parse_args

    cfg = parse_args(["--config", args.config, *extra])
    H, n_outer = cfg.diloco.inner_steps, cfg.run.steps // cfg.diloco.inner_steps
    extra = [*extra, "--ckpt.every", str(H), "--ckpt.keep", "3"]  # a checkpoint at every boundary
    ref = None
    if args.chaos_reference is not None:
        n_ref = args.chaos_reference
        base = Launcher(argparse.Namespace(**{**vars(args), "nodes": n_ref}), extra, {}, {},
                        run_name=f"{cfg.run.name}-reference{n_ref}")
        if base.run() != 0:
            print("the fault-free reference run failed", flush=True)
            return 1
        ref = summarize(base.run_dir, n_outer)
    L = Launcher(args, extra, {}, {}, run_name=f"{cfg.run.name}-chaos{args.chaos}")
    chaos = Chaos(L, args.chaos, args.chaos_faults, n_outer)
    L.hooks.append(chaos.tick)
    t0 = time.monotonic()
    L.run()
    while chaos.timers:  # a node killed at the very end is still restarted (and told the run is done)
        time.sleep(0.2)
        chaos.tick()
    statuses = {n: v.status for n, v in L.nodes.items()}
    s = summarize(L.run_dir, n_outer)
    late_code = None
    if s["completed"]:  # one more node registers after the end: it is told so and exits 0
        L.start_coordinator()
        L.names.append("late")
        L.start_node("late")
        late = L.nodes["late"]
        late_code = late.proc.wait(timeout=300)
        L.coord.send_signal(signal.SIGTERM)
        L.coord.wait(timeout=10)
        late_code = late_code if any("nothing to do" in line for line in late.lines) else f"{late_code} (not told)"
    late_ok = late_code == 0
    ok = (not s["forked_steps"] and s["completed"] and s["outer_steps"] == n_outer and late_ok
          and all(st == "done" for st in statuses.values()))
    out = {"seed": args.chaos, "ok": ok, "faults": chaos.injected, **s, "node_exits": statuses,
           "late_registration_exit": late_code, "seconds": round(time.monotonic() - t0, 1)}
    if ref is not None:
        out["reference_nodes"], out["reference_val_loss"] = n_ref, ref["final_val_loss"]
        if s["final_val_loss"] and ref["final_val_loss"]:
            out["val_loss_ratio"] = round(s["final_val_loss"] / ref["final_val_loss"], 4)
    print(json.dumps(out), flush=True)
    return 0 if ok else 1
