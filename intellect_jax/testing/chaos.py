"""`python -m intellect_jax.testing.chaos --seed SEED --nodes N --config C`: a seeded random fault
schedule against real processes (the real CLI, sockets, coordinator and checkpoints), then a
summary. It takes every option of `python -m intellect_jax.launch` too.

Faults, fired as the run passes randomly chosen outer steps (kinds as the summary counts them):

- ``kill``: SIGKILL a node and restart it with `--ckpt.resume` (as is, after flipping bytes in
  its newest checkpoint, or after deleting its newest checkpoint so that it resumes from an
  older one);
- ``stop``: SIGSTOP a node for 10-30 s;
- ``coordinator``: SIGKILL the coordinator and restart it from its journal;
- ``coordinator_stop``: SIGSTOP the coordinator for 5-20 s, then SIGCONT (it must excuse its
  own stall: nobody is evicted for it);
- ``outage``: a correlated outage: SIGKILL every running node but one (one that holds the
  run's newest state), then restart them all with `--ckpt.resume` after 2-8 s (the survivor
  races through the rest of the run alone, faster than the others restart, so a schedule's
  outages come after its other faults);
- ``node_and_coordinator``: SIGKILL a node and the coordinator together, then restart both.

After the run, one more node registers and must be told that the run is complete. The summary
(one JSON line) gives the faults (and how many of each kind fired, and any left unfired), the
outer steps done, the steps whose hashes disagree across every node that ever logged them,
every node's exit status, the mean number of contributors per outer step, and the final
validation loss against a fault-free run of the same job (on as many
nodes or, e.g., on one (`--reference [NODES]`): every outer step keeps a contributor, so a run with faults should end
no worse than one node training alone).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from intellect_jax.cli import run_main
from intellect_jax.coordinator.journal import JournalError, RunRecord
from intellect_jax.launch import Launcher, NodeView, parse, parser
from intellect_jax.model.config import ConfigError

KINDS = ("kill", "kill", "stop", "coordinator", "coordinator_stop", "outage", "node_and_coordinator")
HOW = ("resume", "resume", "damaged", "older")  # which checkpoint a killed node comes back from


class Chaos:
    """Fires the planned faults as the run passes their outer steps, at least ``gap`` seconds
    apart. A node is only killed or stopped while another running node holds the run's newest
    state (it logged the newest outer step, or the one before, since its process started); an
    outage spares one such node; and a node only comes back from a damaged or an older
    checkpoint while such a node is running; so the run's newest state always survives
    somewhere (losing it for good needs an operator's ``--allow-rollback-to`` or the
    coordinator's ``--auto-rollback-after``; the simulation covers that). A fault that no node
    may take now is tried again at the next poll."""

    def __init__(self, launcher: Launcher, seed: int, faults: int, outer_steps: int, gap: float = 5.0) -> None:
        self.L, self.rng, self.gap = launcher, np.random.default_rng(seed), gap
        kinds = [str(x) for x in self.rng.choice(KINDS, size=faults)]
        steps = sorted(self.rng.integers(1, max(2, outer_steps - 3), size=faults))
        # an outage's survivor races through the rest of the run alone, faster than the others
        # restart: a schedule's outages come after its other faults, which would not fire otherwise
        kinds = [x for x in kinds if x != "outage"] + [x for x in kinds if x == "outage"]
        self.plan = [(int(k), str(kind)) for k, kind in zip(steps, kinds)]
        self.timers: list[tuple[float, str, Any]] = []  # (when, what, action)
        self.injected: list[str] = []
        self.fired: Counter[str] = Counter()
        self.closed = False
        self._last = 0.0

    # ---- the schedule ----------------------------------------------------------------------
    def tick(self) -> None:
        now = time.monotonic()
        for timer in [x for x in self.timers if x[0] <= now]:
            self.timers.remove(timer)
            timer[2]()
        if self.closed:
            return
        if self.plan and self.L.progress >= self.plan[0][0] and now - self._last >= self.gap:
            k, kind = self.plan[0]
            if self.fire(kind, k):
                self.plan.pop(0)
                self.fired[kind] += 1
                self._last = time.monotonic()

    def close(self) -> list[str]:
        """The run is over: fire what resumes a stopped process now, drop the restarts (there is
        no coordinator any more); returns what was dropped."""
        self.closed = True
        dropped = []
        for _, what, action in sorted(self.timers, key=lambda x: x[0]):
            if what.startswith("cont "):
                action()
            else:
                dropped.append(what)
        self.timers.clear()
        return dropped

    def _after(self, secs: float, what: str, action: Any) -> None:
        self.timers.append((time.monotonic() + secs, what, action))

    # ---- who may take a fault ---------------------------------------------------------------
    def _live(self) -> list[NodeView]:
        return [v for v in self.L.nodes.values() if v.status == "running" and v.proc is not None
                and v.proc.poll() is None]

    def _holds(self, v: NodeView) -> bool:
        """``v``'s current process logged the run's newest outer step (or the one before: the
        nodes of one epoch log a step a moment apart)."""
        return v.live_outer > 0 and v.live_outer >= self.L.progress - 1

    def _victims(self) -> list[NodeView]:
        """Running nodes that may be killed or stopped: another running node holds the newest
        state. Those whose process has registered, if any (not one still starting up)."""
        live = self._live()
        ok = [v for v in live if any(self._holds(u) for u in live if u is not v)]
        return [v for v in ok if v.registered] or ok

    def _coordinator_up(self) -> bool:
        c = self.L.coord
        return c is not None and c.poll() is None

    # ---- faults -----------------------------------------------------------------------------
    def fire(self, kind: str, k: int) -> bool:
        """Inject one fault; False if it may not be taken now (try again later)."""
        L = self.L
        if kind == "coordinator":
            if not self._coordinator_up():
                return False
            down = float(self.rng.uniform(1.0, 3.0))
            self.injected.append(f"coordinator SIGKILL at outer step {k} ({down:.1f}s down)")
            L.kill_coordinator(down)
            return True
        if kind == "coordinator_stop":
            return self._stop_coordinator(k)
        if kind == "outage":
            return self._outage(k)
        victims = self._victims()
        if not victims or (kind == "node_and_coordinator" and not self._coordinator_up()):
            return False
        v = victims[int(self.rng.integers(0, len(victims)))]
        if kind == "stop":
            secs = float(self.rng.uniform(10.0, 30.0))
            self.injected.append(f"SIGSTOP {v.name} at outer step {k} for {secs:.0f}s")
            L.say("chaos", f"SIGSTOP {v.name} for {secs:.0f}s")
            assert v.proc is not None
            v.proc.send_signal(signal.SIGSTOP)
            v.status = "stopped"

            def cont(v=v, proc=v.proc) -> None:
                if v.proc is proc and proc.poll() is None:
                    L.say("chaos", f"SIGCONT {v.name}")
                    proc.send_signal(signal.SIGCONT)
                    v.status = "running"

            self._after(secs, f"cont {v.name}", cont)
            return True
        how = str(self.rng.choice(HOW))
        delay = float(self.rng.uniform(1.0, 4.0))
        if kind == "node_and_coordinator":
            down = float(self.rng.uniform(1.0, 3.0))
            self.injected.append(f"SIGKILL {v.name} and the coordinator at outer step {k}; coordinator back in "
                                 f"{down:.1f}s, {v.name} in {delay:.0f}s ({how})")
            self._kill_node(v, delay, how)
            self._kill_coordinator(down)
            return True
        self.injected.append(f"SIGKILL {v.name} at outer step {k}, restart in {delay:.0f}s ({how})")
        self._kill_node(v, delay, how)
        return True

    def _stop_coordinator(self, k: int) -> bool:
        L = self.L
        if not self._coordinator_up() or any(what == "cont coordinator" for _, what, _ in self.timers):
            return False
        secs = float(self.rng.uniform(5.0, 20.0))
        proc = L.coord
        assert proc is not None
        self.injected.append(f"coordinator SIGSTOP at outer step {k} for {secs:.0f}s")
        L.say("chaos", f"SIGSTOP coordinator for {secs:.0f}s")
        proc.send_signal(signal.SIGSTOP)

        def cont(proc=proc) -> None:
            if proc.poll() is None:  # (not SIGKILLed meanwhile)
                L.say("chaos", "SIGCONT coordinator")
                proc.send_signal(signal.SIGCONT)

        self._after(secs, "cont coordinator", cont)
        return True

    def _outage(self, k: int) -> bool:
        live = self._live()
        keep = [v for v in live if self._holds(v)]
        if len(live) < 2 or not keep:
            return False
        survivor = keep[int(self.rng.integers(0, len(keep)))]
        delay = float(self.rng.uniform(2.0, 8.0))
        gone = [v for v in live if v is not survivor]
        hows = [str(self.rng.choice(HOW)) for _ in gone]
        self.injected.append(f"outage at outer step {k}: SIGKILL " + ", ".join(v.name for v in gone)
                             + f" ({survivor.name} survives), restart in {delay:.0f}s ("
                             + ", ".join(hows) + ")")
        self.L.say("chaos", f"outage: SIGKILL every running node but {survivor.name}")
        for v, how in zip(gone, hows):
            self._kill_node(v, delay, how)
        return True

    def _kill_node(self, v: NodeView, delay: float, how: str) -> None:
        L = self.L
        L.say("chaos", f"SIGKILL {v.name}; restarting it in {delay:.0f}s with --ckpt.resume ({how} checkpoint)")
        assert v.proc is not None
        v.proc.kill()
        v.proc.wait()
        v.status = "restarting"

        def restart(v=v, how=how) -> None:
            ckdir = L.run_dir / v.name / "ckpt"
            steps = sorted((int(p.name) for p in ckdir.iterdir() if p.name.isdigit()), reverse=True) \
                if ckdir.is_dir() else []
            if steps and how != "resume" and [u for u in self._live() if u is not v and self._holds(u)]:
                if how == "damaged":
                    _flip_bytes(ckdir / str(steps[0]))
                else:
                    shutil.rmtree(ckdir / str(steps[0]))
            L.start_node(v.name, resume=True)

        self._after(delay, f"restart {v.name}", restart)

    def _kill_coordinator(self, down: float) -> None:
        """SIGKILL the coordinator now and restart it (from its journal) in ``down`` seconds,
        without blocking the schedule meanwhile."""
        L = self.L
        assert L.coord is not None
        L.say("chaos", f"SIGKILL coordinator; restarting it in {down:.1f}s")
        L.coord.kill()
        L.coord.wait()
        self._after(down, "restart coordinator", L.start_coordinator)


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
    """Hash agreement over every row any node ever wrote, steps done, final validation loss;
    with data leases, the journal's account of the data (tokens trained and discarded,
    duplicates, goodput) and whether its bookkeeping holds (every unit in one place)."""
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
    try:
        rec = RunRecord.from_json(json.loads(journal.read_text())) if journal.exists() else None
    except (ValueError, JournalError) as e:
        rec, damaged = None, f"coordinator.journal unreadable: {e}"
    else:
        damaged = None
    led = rec.leases if rec is not None else None
    return {"outer_steps": max(by_step, default=0), "forked_steps": sorted(k for k, h in by_step.items() if len(h) > 1),
            "final_val_loss": statistics.mean(finals) if finals else None,
            "completed": rec.completed if rec is not None else None,
            "mean_contributors": round(statistics.mean(contributors.values()), 2) if contributors else None,
            "data": None if led is None else {**led.status(), "problems": led.problems()},
            "journal_error": damaged}


def run_chaos(args: argparse.Namespace, extra: list[str]) -> int:
    from intellect_jax.config import parse_args

    cfg = parse_args(["--config", args.config, *extra])
    H, n_outer = cfg.diloco.inner_steps, cfg.run.steps // cfg.diloco.inner_steps
    extra = [*extra, "--ckpt.every", str(H), "--ckpt.keep", "3"]  # a checkpoint at every boundary
    ref = None
    if args.reference is not None:
        n_ref = args.reference
        base = Launcher(argparse.Namespace(**{**vars(args), "nodes": n_ref}), extra, {}, {},
                        run_name=f"{cfg.run.name}-reference{n_ref}")
        if base.run() != 0:
            print("the fault-free reference run failed", flush=True)
            return 1
        ref = summarize(base.run_dir, n_outer)
    L = Launcher(args, extra, {}, {}, run_name=f"{cfg.run.name}-chaos{args.seed}")
    chaos = Chaos(L, args.seed, args.faults, n_outer)
    L.hooks.append(chaos.tick)
    t0 = time.monotonic()
    L.run()  # (returns once no node is running, stopped or waiting for its restart)
    dropped = chaos.close()
    statuses = {n: v.status + (f" ({why})" if v.status != "done" and (why := v.why()) else "")
                for n, v in L.nodes.items()}
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
          and all(st == "done" for st in statuses.values())
          and not s["journal_error"]
          and (not cfg.diloco.leases or (s["data"] is not None and not s["data"]["problems"]
                                         and s["data"]["units_outstanding"] == 0)))
    out = {"seed": args.seed, "ok": ok, "faults": chaos.injected, "fault_counts": dict(chaos.fired),
           "not_fired": [f"{kind} at outer step {k}" for k, kind in chaos.plan] + dropped, **s, "node_exits": statuses,
           "late_registration_exit": late_code, "seconds": round(time.monotonic() - t0, 1)}
    if ref is not None:
        out["reference_nodes"], out["reference_val_loss"] = n_ref, ref["final_val_loss"]
        out["reference_data"] = ref["data"]
        if s["final_val_loss"] and ref["final_val_loss"]:
            out["val_loss_ratio"] = round(s["final_val_loss"] / ref["final_val_loss"], 4)
    print(json.dumps(out), flush=True)
    return 0 if ok else 1


_AS_MANY = object()  # --reference given without a count (argparse would int() a string const)


def main(argv: list[str] | None = None) -> int:
    ap = parser(prog="python -m intellect_jax.testing.chaos")
    ap.description = __doc__.split("\n\n")[0]
    ap.add_argument("--seed", type=int, required=True, help="seeds the random fault schedule")
    ap.add_argument("--faults", type=int, default=5, help="faults in the schedule")
    ap.add_argument("--reference", type=int, nargs="?", const=_AS_MANY, default=None, metavar="NODES",
                    help="first run the job without faults on NODES nodes (default: as many as --nodes), "
                         "to compare final val losses")
    args, extra, kills, joins = parse(argv, ap)
    if kills or joins or args.kill_coordinator is not None:
        raise ConfigError("--kill, --join and --kill-coordinator are the launcher's; a chaos run draws its faults")
    if args.reference is _AS_MANY:
        args.reference = args.nodes
    elif args.reference is not None and args.reference < 1:
        raise ConfigError(f"--reference NODES must be >= 1, got {args.reference}")
    code = run_chaos(args, extra)
    if code:
        raise SystemExit(code)
    return code


if __name__ == "__main__":
    sys.exit(run_main(main))
