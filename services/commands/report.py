"""``dracap report --out FILE.png``: the Grafana dashboard's panels as one PNG, from the log.

A dashboard needs Prometheus scraping a running stack; the report needs only the event
log, so it also works after a benchmark or on an exported log
(:mod:`services.report.panels` says how each panel is derived, ``docs/operations.md``
how they map to the dashboard's). Flags:

* ``--out FILE.png`` (required; the directory must exist);
* ``--since`` / ``--until``: the window, ISO 8601 times or ``now`` (default: the first
  and the last event recorded); ``--steps N``: how many steps it is cut into (60);
* ``--log FILE``: an exported log (``dracap replay export``) instead of the database;
  otherwise the database is found like every command finds it
  (:mod:`services.runtime.bus.endpoints`; the read-only role first) and read in one
  repeatable-read transaction.

Expected failures are one line on stderr: matplotlib missing, a bad flag or file, an
empty log or window (exit 2); a database that cannot be reached (exit 1); a log that does
not fold (exit 5).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
from typing import NamedTuple

from services.commands.querying import parse_time
from services.exitcodes import CommandError, ExitCode
from services.replay.history import ReplayBrokenError
from services.replay.logfile import LogFileError
from services.replay.sources import DatabaseSource, FileSource
from services.report.panels import Report, ReportError, build_report
from services.runtime.bus.endpoints import add_endpoint_arguments, endpoints_from_args, reaching
from services.runtime.ground.outputs import check_out, written
from services.runtime.ground.settings import ServiceKind, load_settings
from services.runtime.store.eventstore import connected

__all__ = ["register"]


def _time(flag: str, text: str | None) -> datetime.datetime | None:
    parsed = parse_time(flag, text)
    return datetime.datetime.fromisoformat(parsed) if parsed is not None else None


class _Window(NamedTuple):
    since: datetime.datetime | None
    until: datetime.datetime | None
    buckets: int


async def _from_file(path: str, window: _Window) -> Report:
    return await build_report(FileSource(path), **window._asdict())


async def _from_database(url: str, window: _Window) -> Report:
    settings = load_settings().with_database(url)
    async with (
        connected(settings) as connection,
        DatabaseSource(connection, snapshots=False) as source,
    ):
        return await build_report(source, **window._asdict())


def _report(args: argparse.Namespace) -> int:
    from services.report.figure import check_plotting, draw

    check_plotting()
    check_out("--out", args.out, ".png")
    if not 2 <= args.steps <= 1000:
        raise CommandError(f"--steps {args.steps}: must be from 2 to 1000", ExitCode.BAD_INPUT)
    since, until = _time("--since", args.since), _time("--until", args.until)
    if since is not None and until is not None and until <= since:
        raise CommandError("--until: must be later than --since", ExitCode.BAD_INPUT)
    window = _Window(since, until, args.steps)
    try:
        if args.log:
            source = args.log
            report = asyncio.run(_from_file(args.log, window))
        else:
            url = endpoints_from_args(args, service=ServiceKind.READONLY).database()
            source = "the database"
            with reaching("PostgreSQL", url):
                report = asyncio.run(_from_database(url, window))
    except LogFileError as exc:
        raise CommandError(str(exc), ExitCode.BAD_INPUT) from None
    except ReportError as exc:
        raise CommandError(str(exc), ExitCode.BAD_INPUT) from None
    except ReplayBrokenError as exc:
        raise CommandError(str(exc), ExitCode.INVARIANT_VIOLATED) from None
    with written("--out", args.out):
        draw(report, args.out, source=source)
    print(
        f"wrote {args.out}: {len(report.panels)} panels over {report.events} events "
        f"({report.start:%Y-%m-%d %H:%M:%S} to {report.end:%H:%M:%S} UTC)"
    )
    return ExitCode.OK


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``report`` command to the CLI."""
    report = subparsers.add_parser(
        "report",
        description="Fold the event log (the database, or an exported file) and draw the "
        "panels of deploy/grafana/dracap.json from it: capacity per class, tenant and "
        "device, claims and rejections, latencies per class, convergence, Unknown "
        "shares, node recovery and dead letters. No Prometheus needed.",
    )
    report.add_argument("--out", required=True, metavar="FILE.png")
    report.add_argument("--since", metavar="TIME", help="window start (default: first event)")
    report.add_argument("--until", metavar="TIME", help="window end (default: last event)")
    report.add_argument("--steps", type=int, default=60, help="steps of the window (60)")
    report.add_argument(
        "--log", metavar="FILE", help="an exported log file instead of the database"
    )
    add_endpoint_arguments(report, database=True)
    report.set_defaults(func=_report)
