"""``python -m intellect_jax.coordinator``: run the elastic-DiLoCo coordinator (or query one).

Its identity is ``coordinator`` in the run's keys directory (``--keys``, else
``$INTELLECT_KEYS``; made by ``python -m intellect_jax.keys init``); ``--status`` speaks as
``operator`` (``--identity`` to choose). Prints ``coordinator listening on
HOST:PORT`` on stdout once bound; logs one line per membership event on stderr; stops on
SIGTERM/SIGINT. ``--status HOST:PORT`` prints a running coordinator's status as JSON.

The run's journal (its newest outer step and hash, completion, rollbacks) is kept by default
in ``coordinator_state/<run id>.journal`` under the working directory (``--journal`` to put it
elsewhere): a restarted coordinator reloads it and the run's history cannot fork. Running
without one (``--no-journal``) is an explicit choice, warned about at start.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import signal
import sys
import threading

from pathlib import Path

from intellect_jax.cli import run_main
from intellect_jax.model.config import ConfigError
from intellect_jax.coordinator.client import coordinator_status
from intellect_jax.coordinator.server import Coordinator
from intellect_jax.coordinator.protocol import CoordinatorConfig
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from intellect_jax.coordinator.journal import Journal, JournalError, verify_votes
from intellect_jax.net.identity import CA_CERT, COORDINATOR, OPERATOR, Credentials, keys_dir
from intellect_jax.net.transport import TransportConfig

DEFAULT_RUN_ID = "intellect-jax"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = CoordinatorConfig()
    p = argparse.ArgumentParser(prog="python -m intellect_jax.coordinator", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="0.0.0.0", help="interface to bind (default: all)")
    p.add_argument("--port", type=int, default=29400, help="port to bind (0: any free port)")
    p.add_argument("--keys", default=None, metavar="DIR",
                   help="the run's keys directory (default: $INTELLECT_KEYS)")
    p.add_argument("--identity", default=None,
                   help=f"whose certificate to use (default: {COORDINATOR}; {OPERATOR} with --status)")
    p.add_argument("--run-id", default=DEFAULT_RUN_ID, help="run id; nodes must use the same")
    p.add_argument("--model-fingerprint", default=None, help="the run's model config fingerprint "
                   "(default: the first registrant's)")
    p.add_argument("--heartbeat-timeout", type=float, default=d.heartbeat_timeout)
    p.add_argument("--boundary-timeout", type=float, default=d.boundary_timeout)
    p.add_argument("--join-window", type=float, default=d.join_window,
                   help="the first barrier closes no earlier than this after the first registration")
    p.add_argument("--min-nodes", type=int, default=d.min_nodes, help="founding members a fresh run waits for")
    p.add_argument("--journal", default=None, metavar="FILE",
                   help="the run's record (newest outer step and its hash, completion), kept across restarts "
                        "(default: coordinator_state/<run id>.journal in the working directory)")
    p.add_argument("--no-journal", action="store_true",
                   help="keep the run's record in memory only: a restarted coordinator forgets the run's history")
    p.add_argument("--auto-rollback-after", type=float, default=d.auto_rollback_after, metavar="SECONDS",
                   help="with no live node holding the run's newest state for this long, roll back by itself to "
                        "the newest state registered nodes hold from checkpoints (0: never, wait for "
                        "--allow-rollback-to; default %(default)s)")
    p.add_argument("--outer-steps", type=int, default=None, help="the run's length (default: the nodes' config)")
    p.add_argument("--allow-rollback-to", type=int, default=None, metavar="K",
                   help="let the run restart from a checkpoint of outer step K or later, behind the journal's "
                        "newest step (when the newest state is lost for good); logged")
    p.add_argument("--status", metavar="HOST:PORT", default=None, help="print a running coordinator's status")
    p.add_argument("--verify-journal", metavar="FILE", default=None,
                   help="check a journal's signed votes against the run authority's certificate (in --keys) and exit")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def verify_journal(path: str, keys: Path) -> int:
    """Every recorded step's hash must carry the signed votes of a majority of its members."""
    rec = Journal(path).load_any()
    try:
        ca = x509.load_pem_x509_certificate((keys / CA_CERT).read_bytes()).public_bytes(serialization.Encoding.DER)
    except ValueError:
        raise JournalError(f"{keys / CA_CERT}: not a PEM certificate") from None
    bad = verify_votes(rec, ca)
    if bad:
        raise JournalError(f"journal {path}: {len(bad)} of {len(rec.hashes)} recorded steps not signed by a quorum: "
                           + "; ".join(f"outer step {k}: {why}" for k, why in list(bad.items())[:5]))
    print(f"journal {path}: run {rec.run_id}, {len(rec.hashes)} recorded steps "
          f"({min(rec.hashes, default=0)}..{max(rec.hashes, default=0)}), each signed by a quorum of its members")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.verify_journal:
        return verify_journal(args.verify_journal, keys_dir(args.keys))
    who = args.identity or (OPERATOR if args.status else COORDINATOR)
    cfg = TransportConfig(run_id=args.run_id, identity=Credentials.load(keys_dir(args.keys), who))
    if args.status:
        print(json.dumps(coordinator_status(args.status, cfg), indent=2))
        return 0
    if args.no_journal and args.journal:
        raise ConfigError("--journal and --no-journal: choose one")
    if args.auto_rollback_after < 0:
        raise ConfigError(f"--auto-rollback-after must be >= 0 seconds (0: never), got {args.auto_rollback_after}")
    try:
        config = CoordinatorConfig(heartbeat_timeout=args.heartbeat_timeout, boundary_timeout=args.boundary_timeout,
                                   join_window=args.join_window, min_nodes=args.min_nodes,
                                   fingerprint=args.model_fingerprint, outer_steps=args.outer_steps,
                                   allow_rollback_to=args.allow_rollback_to,
                                   auto_rollback_after=args.auto_rollback_after or None)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    safe = re.sub(r"[^\w.-]", "_", args.run_id)
    journal = None if args.no_journal else args.journal or str(Path("coordinator_state") / f"{safe}.journal")
    if journal is not None:
        logging.getLogger("intellect_jax.coordinator").info("journal: %s", Path(journal).resolve())
    coord = Coordinator(cfg, args.host, args.port, config, journal=journal).start()
    print(f"coordinator listening on {coord.address_str}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(1.0) and coord.service.failure is None:
        pass
    coord.stop()
    if coord.service.failure is not None:  # (its journal could not be saved: one line, exit status 2)
        raise JournalError(coord.service.failure)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
