"""``dracap agent --node NAME``: run the node agent of one node.

The agent connects to PostgreSQL (the event log) and NATS (the events stream), makes
sure the stream exists, and consumes the events addressed to its node until SIGINT or
SIGTERM (see :mod:`services.enforcement.agent`). Connection settings come from the
flags, else from the environment (``DRACAP_DATABASE_URL``, ``DRACAP_NATS_URL``; see
:mod:`services.runtime.settings`). ``--enforcer none`` (the only one built in so far)
applies no limit and reports enforcement level ``none``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from typing import Any

from events.subjects import BusNames, SubjectError
from services.enforcement.agent import Agent
from services.enforcement.enforcers import Enforcer, NoneEnforcer
from services.runtime.bus import connect_bus, ensure_stream
from services.runtime.eventstore import EventStore
from services.runtime.settings import SettingsError, load_settings

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_BAD_INPUT = 2

ENFORCERS: dict[str, type[Enforcer]] = {"none": NoneEnforcer}


async def serve(args: argparse.Namespace) -> int:
    """Run the agent until a signal arrives."""
    settings = load_settings()
    if args.database_url:
        settings = settings.with_database(args.database_url)
    nats_url = args.nats or settings.nats_url
    names = BusNames(args.prefix)
    store = await EventStore.open(settings)
    nc, js = await connect_bus(nats_url, name=f"dracap-agent-{args.node}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await ensure_stream(js, names)
        agent = Agent(store, js, names, node=args.node, enforcer=ENFORCERS[args.enforcer]())
        logging.getLogger("dracap.agent").info("agent of node %s started", args.node)
        await agent.run(stop)
    finally:
        await nc.drain()
        await store.close()
    return EXIT_OK


def run(args: argparse.Namespace) -> int:
    """Entry point of ``dracap agent``."""
    try:
        BusNames(args.prefix).node_filter(args.node)
    except SubjectError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return asyncio.run(serve(args))
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return EXIT_OK


def register(sub: Any) -> None:
    """Add ``dracap agent`` to the command line."""
    parser = sub.add_parser(
        "agent",
        help="run the node agent of one node (applies and removes share limits)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    parser.add_argument("--node", required=True, help="the node this agent runs on")
    parser.add_argument("--nats", metavar="URL", help="NATS URL (default: DRACAP_NATS_URL)")
    parser.add_argument(
        "--database-url", metavar="URL", help="PostgreSQL URL (default: DRACAP_DATABASE_URL)"
    )
    parser.add_argument("--prefix", default="dracap", help="subject prefix (default: dracap)")
    parser.add_argument("--enforcer", choices=sorted(ENFORCERS), default="none")
    parser.set_defaults(func=run)
