"""`python -m intellect_jax.keys [--dir DIR] init | issue NODE... | revoke NODE... | list`

The run operator's authority over who is in the run (:mod:`intellect_jax.net.identity`):

* ``init``: a new run authority in DIR, with the coordinator's and the operator's identities;
* ``issue NODE``: a key and a certificate for node NODE (``DIR/NODE.key``, ``DIR/NODE.crt``).
  Give the node ``ca.crt``, ``crl.pem`` and its own two files, never ``ca.key``;
* ``revoke NODE``: put NODE's certificates on the revocation list (``crl.pem``). A coordinator
  or node reading DIR refuses NODE's next connection, and the coordinator evicts it; copy
  ``crl.pem`` to nodes on other machines;
* ``list``: every identity issued, its certificate's expiry and whether it is revoked.

DIR defaults to ``$INTELLECT_KEYS``, else ``./keys``.
"""

from __future__ import annotations

import argparse
import os
import sys

from intellect_jax.cli import run_main
from intellect_jax.net.identity import DEFAULT_DAYS, KEYS_ENV, Authority


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m intellect_jax.keys", description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=os.environ.get(KEYS_ENV, "keys"), help="the keys directory")
    sub = p.add_subparsers(dest="cmd", required=True)
    init = sub.add_parser("init", help="make a new run authority")
    init.add_argument("--run-id", default="intellect-jax")
    init.add_argument("--days", type=int, default=DEFAULT_DAYS, help="validity of the authority")
    issue = sub.add_parser("issue", help="issue node identities")
    issue.add_argument("nodes", nargs="+")
    issue.add_argument("--days", type=int, default=DEFAULT_DAYS)
    revoke = sub.add_parser("revoke", help="revoke node identities")
    revoke.add_argument("nodes", nargs="+")
    sub.add_parser("list", help="list the identities issued")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.cmd == "init":
        Authority.init(a.dir, a.run_id, a.days)
        print(f"run authority in {a.dir}: ca.crt, ca.key (keep it here), crl.pem, coordinator and operator issued")
        return
    auth = Authority.load(a.dir)
    if a.cmd == "issue":
        for node in a.nodes:
            cert, key = auth.issue(node, a.days)
            print(f"{node}: {cert} {key}")
    elif a.cmd == "revoke":
        for node in a.nodes:
            n = auth.revoke(node)
            print(f"{node}: {n} certificate(s) revoked" if n else f"{node}: already revoked")
    else:
        for name, certs in sorted(auth.index().items()):
            for c in certs:
                print(f"{name:24s} serial {str(c['serial'])[:16]}  until {c['not_after']}  "
                      f"{'REVOKED' if c['revoked'] else 'valid'}")


if __name__ == "__main__":
    sys.exit(run_main(main))
