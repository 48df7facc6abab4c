"""``dracap auth init``: write the broker's accounts and every user's credentials.

The command line only: :mod:`services.brokerauth` says what the accounts, users and
permissions are (the stack, ``dracap up`` and the durables use it too); this reads the
inventory and the flags, writes them under the auth directory and prints a summary.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from services.brokerauth import init_auth, installation_from
from services.exitcodes import CommandError, ExitCode
from services.runtime.bus.credentials import AUTH_DIR, CREDS_DIR, AuthDir


def run(args: argparse.Namespace) -> int:
    from events.manifests import ManifestError, load_paths

    try:
        objects = [obj for _, obj in load_paths(args.inventory)] if args.inventory else []
    except ManifestError as exc:
        raise CommandError(str(exc), ExitCode.BAD_INPUT) from None
    installation = installation_from(
        objects,
        prefix=args.prefix,
        namespaces=args.namespace,
        nodes=args.node,
        users=args.user,
        operators=args.operator,
    )
    auth = AuthDir(args.auth_dir or Path(args.data_dir) / AUTH_DIR)
    try:
        principals = init_auth(auth, installation)
    except OSError as exc:
        raise CommandError(
            f"cannot write {auth.path}: {exc.strerror or exc}", ExitCode.ERROR
        ) from None
    counts: dict[str, int] = {}
    for principal in principals:
        counts[principal.kind] = counts.get(principal.kind, 0) + 1
    summary = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    print(f"wrote {auth.accounts} and {auth.directory}")
    print(f"credentials for {summary} in {auth.path / CREDS_DIR} (mode 0600)")
    return ExitCode.OK


def register(sub: Any) -> None:
    parser = sub.add_parser("auth", help="broker accounts, users and credentials")
    actions = parser.add_subparsers(dest="action", required=True)
    init = actions.add_parser(
        "init",
        help="write the broker's accounts and every user's credentials",
        description="Write nats-server accounts (public keys) and one credential file "
        "per user: services, node agents, operators, tenant users.",
    )
    init.add_argument(
        "--inventory",
        nargs="*",
        default=[],
        metavar="PATH",
        help="manifests naming Namespaces and ResourceSlices (their nodes)",
    )
    init.add_argument("--namespace", action="append", default=[], metavar="NS")
    init.add_argument("--node", action="append", default=[], metavar="NODE")
    init.add_argument(
        "--user",
        action="append",
        default=[],
        metavar="NS/USER",
        help="a tenant user (default: one user named like its namespace)",
    )
    init.add_argument("--operator", action="append", default=[], metavar="NAME")
    init.add_argument("--prefix", default="dracap", help="subject prefix (default: dracap)")
    init.add_argument("--data-dir", default=".dracap", metavar="DIR")
    init.add_argument("--auth-dir", metavar="DIR", help="default: <data-dir>/auth")
    init.set_defaults(func=run)
