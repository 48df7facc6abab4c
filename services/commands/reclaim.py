"""``dracap reclaim``: run the reclamation service on its own.

It needs only PostgreSQL (the event log and the lease table); the server is found like
every command finds it (:mod:`services.runtime.bus.endpoints`): ``--database-url``, else
``DRACAP_DATABASE_URL_RECLAMATION`` (its own database user), else
``DRACAP_DATABASE_URL``, else ``<data-dir>/connection.json`` of ``dracap up``. Any number
of replicas may run at once: each transition is recorded once
(:mod:`services.reclamation.service`). ``--fence-hook CMD`` is run for a node whose
lease has been expired for ``--fence-after`` seconds; its exit status 0 fences the node.
With ``--metrics-port`` it serves ``/metrics``, ``/healthz`` and ``/readyz``
(:mod:`services.runtime.ops.health`).
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from typing import Any

from services.exitcodes import ExitCode
from services.reclamation.service import DEFAULT_POLL_S, ReclamationService
from services.runtime.bus.endpoints import add_endpoint_arguments
from services.runtime.ground.settings import ServiceKind, SettingsError
from services.runtime.hosting.process import run_service
from services.runtime.hosting.storehosting import serving
from services.runtime.store.logandfold import LogAndFold

log = logging.getLogger("dracap.reclamation")


def hook_of(text: str | None) -> list[str]:
    """The fence hook's argv (``--fence-hook`` is split like a shell would)."""
    if not text:
        return []
    try:
        argv = shlex.split(text)
    except ValueError as exc:
        raise SettingsError(f"--fence-hook: {exc}") from None
    if not argv:
        raise SettingsError("--fence-hook: empty command")
    return argv


async def serve(args: argparse.Namespace) -> int:
    """Run the service until SIGINT or SIGTERM."""
    async with serving(args, "reclamation", login=ServiceKind.RECLAMATION) as context:
        live = await context.live_state(fresh=False)
        service = ReclamationService(
            context.service_context(LogAndFold(context.store, live)),
            name=args.name,
            poll_s=args.poll,
            fence_hook=hook_of(args.fence_hook),
            fence_after_s=args.fence_after,
            fence_hook_timeout_s=args.fence_hook_timeout,
        )
        log.info("reclamation service %s started", args.name)
        await context.tailing(live, service.run(context.stop))
    return ExitCode.OK


def run(args: argparse.Namespace) -> int:
    """Entry point of ``dracap reclaim``."""
    for flag, value in (("--poll", args.poll), ("--fence-after", args.fence_after)):
        if value <= 0:
            print(f"error: {flag} must be a positive number of seconds", file=sys.stderr)
            return ExitCode.BAD_INPUT
    try:
        hook_of(args.fence_hook)
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    return run_service(lambda: serve(args))


def register(sub: Any) -> None:
    """Add ``dracap reclaim`` to the command line."""
    parser = sub.add_parser(
        "reclaim",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    add_endpoint_arguments(parser, database=True)
    parser.add_argument(
        "--name",
        default="reclamation-0",
        help="this replica's name (its actor in the log: system:NAME; it must begin with "
        "'reclamation', the only actors the reclamation service's database login may append "
        "as)",
    )
    parser.add_argument(
        "--poll",
        type=float,
        default=DEFAULT_POLL_S,
        metavar="S",
        help=f"seconds between looks at the leases (default {DEFAULT_POLL_S})",
    )
    parser.add_argument(
        "--fence-hook",
        metavar="CMD",
        help="command that powers a lost node off (DRACAP_NODE, DRACAP_EPOCH set); exit 0: off",
    )
    parser.add_argument(
        "--fence-after",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds a lease stays expired before the fence hook runs (default 60)",
    )
    parser.add_argument(
        "--fence-hook-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds the fence hook may run (default 60)",
    )
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: off)")
    parser.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR")
    parser.set_defaults(func=run)
