"""``dracap db upgrade|downgrade|current``: schema migrations from the command line.

``services/cli.py`` calls :func:`register` with its top-level subparsers (``dracap db
...``, or ``python -m services.cli db ...`` without the console script; this module
has no entry point of its own, since the runtime imports nothing above it). Each verb
sets ``func`` on the namespace; the function returns the process exit code. The
database is found like every command finds its servers
(:mod:`services.runtime.bus.endpoints`: ``--database-url``, else ``DRACAP_DATABASE_URL``,
else ``<data-dir>/connection.json``); one that cannot be reached is one line on
stderr and exit 1.

``dracap db logins`` creates (or, ``--rotate``, renews) each service kind's own
database login and writes the URL it connects with to ``<data-dir>/database/<kind>.url``
(:mod:`services.runtime.store.logins`); the services find it there.

Node agents have no database user (they talk to NATS only, docs/agent.md): the ``dracap
db node-role`` of earlier versions is gone, and migration 0012 drops the users it made.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from pathlib import Path

from migrations import runner as migrating
from services.exitcodes import ExitCode
from services.runtime.bus.endpoints import add_endpoint_arguments, endpoints_from_args, reaching
from services.runtime.ground.settings import Settings, load_settings


def _on_database(args: argparse.Namespace, action: Callable[[Settings], str | None]) -> str:
    """Run ``action`` on the database the flags, environment or connection.json name."""
    database_url = endpoints_from_args(args).database()
    with reaching("PostgreSQL", database_url):
        return action(load_settings().with_database(database_url)) or "base"


def _upgrade(args: argparse.Namespace) -> int:
    print(f"database at {_on_database(args, lambda s: migrating.upgrade(s, args.revision))}")
    return ExitCode.OK


def _downgrade(args: argparse.Namespace) -> int:
    print(f"database at {_on_database(args, lambda s: migrating.downgrade(s, args.revision))}")
    return ExitCode.OK


def _current(args: argparse.Namespace) -> int:
    print(_on_database(args, migrating.current_revision))
    return ExitCode.OK


def _logins(args: argparse.Namespace) -> int:
    from services.runtime.store import logins

    rotate = logins.rotated_kinds(args.rotate)
    database_url = endpoints_from_args(args).database()
    data_dir = Path(args.data_dir)
    with reaching("PostgreSQL", database_url):
        done = asyncio.run(
            logins.ensure_logins(
                database_url,
                data_dir,
                prefix=args.login_prefix,
                rotate=rotate,
                url_host=args.url_host,
            )
        )
    for login in done:
        print(f"{login.kind:<12} {login.user:<32} {login.change:<8} {login.path}")
    print(f"wrote {len(done)} login URLs under {data_dir / 'database'} (mode 0600)")
    return ExitCode.OK


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``db`` noun and its verbs to the CLI."""
    db = subparsers.add_parser("db")
    verbs = db.add_subparsers(dest="db_verb", required=True)
    up = verbs.add_parser("upgrade", help="migrate up (default: to the newest revision)")
    up.add_argument("revision", nargs="?", default=migrating.HEAD)
    up.set_defaults(func=_upgrade)
    down = verbs.add_parser("downgrade", help="migrate down (default: one step)")
    down.add_argument("revision", nargs="?", default="-1")
    down.set_defaults(func=_downgrade)
    current = verbs.add_parser("current", help="print the current revision")
    current.set_defaults(func=_current)
    logins = verbs.add_parser(
        "logins",
        help="create or rotate each service's own database login; write its URL file",
        description="With an administrator's URL (the one that ran `db upgrade`): one login "
        "user per service kind, in its group role, and <data-dir>/database/<kind>.url "
        "(mode 0600) for each, where the services find it. Run again, it keeps the "
        "passwords of the files.",
    )
    logins.add_argument(
        "--rotate",
        nargs="*",
        metavar="KIND",
        help="new passwords for these kinds (none named: every kind); restart them after",
    )
    logins.add_argument(
        "--login-prefix",
        default="dracap",
        metavar="PREFIX",
        help="login names <PREFIX>_<kind>_login (default: dracap)",
    )
    logins.add_argument(
        "--url-host",
        metavar="HOST[:PORT]",
        help="the server as the services reach it (default: as the administrator's URL names it)",
    )
    logins.set_defaults(func=_logins)
    for verb in (up, down, current, logins):
        add_endpoint_arguments(verb, database=True)
