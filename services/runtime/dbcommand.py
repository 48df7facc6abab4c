"""``dracap db upgrade|downgrade|current``: schema migrations from the command line.

``services/cli.py`` calls :func:`register` with its top-level subparsers. Each verb
sets ``func`` on the namespace; the function returns the process exit code.
"""

from __future__ import annotations

import argparse
import sys

from services.runtime import migrating
from services.runtime.settings import load_settings


def _upgrade(args: argparse.Namespace) -> int:
    print(f"database at {migrating.upgrade(load_settings(), args.revision) or 'base'}")
    return 0


def _downgrade(args: argparse.Namespace) -> int:
    print(f"database at {migrating.downgrade(load_settings(), args.revision) or 'base'}")
    return 0


def _current(args: argparse.Namespace) -> int:
    print(migrating.current_revision(load_settings()) or "base")
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``db`` noun and its verbs to the CLI."""
    db = subparsers.add_parser("db", help="database schema migrations")
    verbs = db.add_subparsers(dest="db_verb", required=True)
    up = verbs.add_parser("upgrade", help="migrate up (default: to the newest revision)")
    up.add_argument("revision", nargs="?", default=migrating.HEAD)
    up.set_defaults(func=_upgrade)
    down = verbs.add_parser("downgrade", help="migrate down (default: one step)")
    down.add_argument("revision", nargs="?", default="-1")
    down.set_defaults(func=_downgrade)
    current = verbs.add_parser("current", help="print the current revision")
    current.set_defaults(func=_current)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (``python -m services.runtime.dbcommand upgrade``)."""
    parser = argparse.ArgumentParser(prog="dracap")
    register(parser.add_subparsers(dest="noun", required=True))
    args = parser.parse_args(["db", *(sys.argv[1:] if argv is None else argv)])
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
