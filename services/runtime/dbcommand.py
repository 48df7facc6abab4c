"""``dracap db upgrade|downgrade|current|node-role``: schema migrations and node agents'
database users from the command line.

``services/cli.py`` calls :func:`register` with its top-level subparsers (``dracap db
...``, or ``python -m services.cli db ...`` without the console script; this module
has no entry point of its own, since the runtime imports nothing above it). Each verb
sets ``func`` on the namespace; the function returns the process exit code. The
database is found like every command finds its servers
(:mod:`services.runtime.endpoints`: ``--database-url``, else ``DRACAP_DATABASE_URL``,
else ``<data-dir>/connection.json``); one that cannot be reached is one line on
stderr and exit 1.

``dracap db node-role NODE [--password-file FILE]`` creates (or updates) the login user
of NODE's agent, a member of ``dracap_agent`` bound to NODE in this database
(:func:`services.runtime.dbroles.ensure_node_role`): an agent connecting as that user can
append its own node's reports and nothing else. It connects as the URL's user, which
must be allowed to create roles and grant ``dracap_agent`` (a superuser, or
``CREATEROLE`` with ``ADMIN OPTION`` on ``dracap_agent``, which PostgreSQL 16 gives the
user that created the role). The password is read from FILE, or generated and written there (mode
0600) when FILE does not exist; it is never printed. Without ``--password-file`` a
new user gets no password (for ``cert`` or ``peer`` authentication, or one set by hand)
and an existing one keeps its own.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from pathlib import Path

import asyncpg

from services.exitcodes import CommandError, ExitCode
from services.runtime import migrating
from services.runtime.dbroles import ensure_node_role, new_password
from services.runtime.endpoints import add_endpoint_arguments, endpoints_from_args, reaching
from services.runtime.settings import Settings, load_settings


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


def _password(path: str | None) -> str | None:
    """The password in ``path``; a new one written there (0600) when it does not exist."""
    if path is None:
        return None
    from services.runtime.provisioning import write_private

    file = Path(path)
    try:
        existing = file.read_text().strip()
    except FileNotFoundError:
        existing = ""
    except OSError as exc:
        raise CommandError(f"{path}: cannot read it: {exc}", ExitCode.BAD_INPUT) from exc
    if existing:
        return existing
    password = new_password()
    try:
        write_private(file, (password + "\n").encode())
    except OSError as exc:
        raise CommandError(f"{path}: cannot write it: {exc}", ExitCode.ERROR) from exc
    return password


async def _create_node_role(database_url: str, node: str, password: str | None) -> str:
    connection = await asyncpg.connect(database_url)
    try:
        return await ensure_node_role(connection, node, password)
    except asyncpg.InsufficientPrivilegeError as exc:
        raise CommandError(
            f"cannot create the user of node {node!r}: {exc.message} (connect as a superuser, "
            "or as a user with CREATEROLE and ADMIN OPTION on dracap_agent)",
            ExitCode.ERROR,
        ) from exc
    finally:
        await connection.close()


def _node_role(args: argparse.Namespace) -> int:
    if not args.node:
        raise CommandError("the node name is empty", ExitCode.BAD_INPUT)
    database_url = endpoints_from_args(args).database()
    password = _password(args.password_file)
    with reaching("PostgreSQL", database_url):
        role = asyncio.run(_create_node_role(database_url, args.node, password))
    where = f"password in {args.password_file}" if password else "password unchanged"
    print(f"database user {role} acts for node {args.node} ({where})")
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
    node = verbs.add_parser(
        "node-role",
        help="create the database user of one node's agent, bound to that node",
        description="Create (or update) the login user of NODE's agent: a member of "
        "dracap_agent that can append NODE's reports and nothing else.",
    )
    node.add_argument("node", metavar="NODE")
    node.add_argument(
        "--password-file",
        metavar="FILE",
        help="the user's password: read from FILE, or generated and written there (0600); "
        "without it the password is left as it is (none for a new user)",
    )
    node.set_defaults(func=_node_role)
    for verb in (up, down, current, node):
        add_endpoint_arguments(verb, database=True)
