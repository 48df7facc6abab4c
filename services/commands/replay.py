"""``dracap replay``: verify, forensic questions, export/import and snapshots.

Verbs (``docs/forensics.md`` has examples):

* ``verify [--log FILE]``: on the database, the fold of the log from position 0 against
  every stored snapshot and the guard rows (:mod:`services.replay.verify`); on a file,
  the fold alone (a file has no guard rows) and every checkpoint line against the fold at
  its position. Exit 0 clean, 5 (``INVARIANT_VIOLATED``) when the guard rows differ, 7
  (``SNAPSHOT_MISMATCH``) for a forged or stale snapshot or checkpoint, 6
  (``EVENTS_REFUSED``) when the only finding is events the fold refuses (each listed);
* ``state [--at POSITION|TIME] [-o table|json|yaml]`` (default: the head), ``timeline
  OBJECT``, ``diff A B``, ``plot DEVICE|NODE|CLASS --out FILE.png``
  (:mod:`services.replay.history`); an object's name that several objects answer to is
  exit 2, naming them; a device is ``pool/device`` (as ``dracap devices`` prints it),
  ``driver/pool/device`` or its name;
* ``export --out FILE [--checkpoint-every N]`` / ``import FILE``
  (:mod:`services.replay.transfer`; checkpoint lines: :mod:`services.replay.checkpoints`);
* ``snapshot [--every-events N] [--every-minutes M] [--once]``: write snapshots of the
  fold (:mod:`services.runtime.store.snapshots`), once or as a service — the writer the
  deployments run (compose's ``snapshots``, Kubernetes' ``dracap-snapshots``): it logs to
  stderr, serves ``--metrics-port``, and stops on SIGTERM or SIGINT after writing what
  was folded since its last snapshot. It connects as ``DRACAP_DATABASE_URL_SNAPSHOTS``'s
  user (``dracap_snapshots``, migration 0010) when that is set.

Every question takes ``--log FILE`` (an export: no database needed) or finds the
database like every command (:mod:`services.runtime.bus.endpoints`; read-only role first).
Expected failures are one line on stderr: a file that is not a dracap log, was cut
short or fails its checksum (exit 2), a database that cannot be reached (exit 1), a log
whose positions are out of order (exit 5, naming the position), an import into a
non-empty log (4). An event the fold refuses is skipped by every verb, as by every
reader (:mod:`events.folding`), and logged once on stderr. Every answer is printed
through :mod:`services.runtime.ground.printable`: text a tenant wrote reaches the terminal with
its control characters escaped, in every format.
Reading a file or exporting shows a progress line when stderr is a terminal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from typing import Any, Final, TypeVar

import msgspec

from services.exitcodes import CommandError, ExitCode
from services.replay import history
from services.replay.checkpoints import EVERY as CHECKPOINT_EVERY
from services.replay.checkpoints import CheckpointMismatchError
from services.replay.logfile import LogFileError
from services.replay.render import (
    Progress,
    diff_table,
    progress_for,
    state_table,
    timeline_table,
    to_yaml,
)
from services.replay.sources import (
    DatabaseSource,
    FileSource,
    LogSource,
    parse_point,
    resolve,
)
from services.replay.transfer import ImportRefusedError, check_file, export_log, import_log
from services.replay.verify import Report, recorder, refused_lines, summary, verify
from services.runtime.bus.endpoints import add_endpoint_arguments, endpoints_from_args, reaching
from services.runtime.ground.outputs import check_in, check_out, written
from services.runtime.ground.printable import json_text, printable
from services.runtime.ground.settings import ServiceKind, Settings, load_settings
from services.runtime.store.eventstore import connected
from services.runtime.store.snapshots import EVERY_EVENTS

T = TypeVar("T")
log = logging.getLogger("dracap.snapshots")


def _settings(args: argparse.Namespace, service: ServiceKind | None) -> tuple[Settings, str]:
    endpoints = endpoints_from_args(args, service=service)
    url = endpoints.database()
    return endpoints.settings(load_settings()), url


def _run(
    args: argparse.Namespace, work: Callable[[], Coroutine[Any, Any, T]], url: str | None
) -> T:
    """Run ``work`` mapping the expected failures to one-line command errors."""
    try:
        if url is None:
            return asyncio.run(work())
        with reaching("PostgreSQL", url):
            return asyncio.run(work())
    except LogFileError as exc:
        raise CommandError(str(exc), ExitCode.BAD_INPUT) from None
    except history.ReplayBrokenError as exc:
        raise CommandError(str(exc), ExitCode.INVARIANT_VIOLATED) from None
    except history.AmbiguousNameError as exc:
        raise CommandError(str(exc), ExitCode.BAD_INPUT) from None
    except ImportRefusedError as exc:
        code = ExitCode.REJECTED if exc.position is None else ExitCode.INVARIANT_VIOLATED
        raise CommandError(str(exc), code) from None


@contextlib.contextmanager
def _progress(what: str, unit: str) -> Iterator[Progress | None]:
    """:func:`progress_for` ``what`` in ``unit``, closed on exit."""
    progress = progress_for(what, unit)
    try:
        yield progress
    finally:
        if progress is not None:
            progress.close()


@contextlib.asynccontextmanager
async def _source(args: argparse.Namespace, settings: Settings | None) -> AsyncIterator[LogSource]:
    if args.log:
        with _progress(f"reading {args.log}", "bytes") as progress:
            yield FileSource(args.log, progress)
        return
    assert settings is not None
    async with connected(settings) as connection, DatabaseSource(connection) as source:
        yield source


def _question(args: argparse.Namespace, ask: Callable[[LogSource], Awaitable[T]]) -> T:
    settings, url = (None, None) if args.log else _settings(args, ServiceKind.READONLY)

    async def work() -> T:
        async with _source(args, settings) as source:
            return await ask(source)

    return _run(args, work, url)


def _emit(data: Any, output: str, table: Callable[[], str]) -> None:
    if output == "json":
        print(json_text(msgspec.json.format(msgspec.json.encode(data), indent=2)))
    elif output == "yaml":
        print(to_yaml(msgspec.to_builtins(data)))
    else:
        print(table())


# --- verbs ---------------------------------------------------------------------------------


#: The exit code of each outcome of a verification (the worst found: 5, then 7, then 6).
_VERIFIED: Final = {
    "ok": ExitCode.OK,
    "refused": ExitCode.EVENTS_REFUSED,
    "snapshot": ExitCode.SNAPSHOT_MISMATCH,
    "mismatch": ExitCode.INVARIANT_VIOLATED,
}


def _verify(args: argparse.Namespace) -> int:
    if args.log:
        return _verify_file(args)
    settings, url = _settings(args, ServiceKind.READONLY)
    with reaching("PostgreSQL", url):
        report = asyncio.run(verify(settings))
    print(summary(report))
    return _VERIFIED[report.outcome]


def _verify_file(args: argparse.Namespace) -> int:
    report = Report()
    with _progress(f"verifying {args.log}", "bytes") as progress:
        try:
            state = check_file(args.log, progress, checkpoints=True, on_refused=recorder(report))
        except ImportRefusedError as exc:
            _print(f"INVARIANT VIOLATED at position {exc.position}: {exc}")
            print(f"FAILED: first violating position {exc.position}")
            return ExitCode.INVARIANT_VIOLATED
        except CheckpointMismatchError as exc:
            _print(f"CHECKPOINT MISMATCH at position {exc.position}: {exc}")
            print(f"FAILED: forged or stale checkpoint at position {exc.position}")
            return ExitCode.SNAPSHOT_MISMATCH
        except LogFileError as exc:
            raise CommandError(str(exc), ExitCode.BAD_INPUT) from None
    _print(f"replayed {state.position} events of {args.log}")
    for line in refused_lines(report.refused):
        _print(line)
    if report.refused:
        print(
            f"REFUSED: {len(report.refused)} event(s) of the file are refused and skipped by "
            f"every reader (first at position {report.refused[0].position}); every checkpoint "
            "is the fold at its position"
        )
        return ExitCode.EVENTS_REFUSED
    print(
        "OK: every event folds without breaking an invariant and every checkpoint is the "
        "fold at its position (a file has no guard rows)"
    )
    return ExitCode.OK


def _print(line: str) -> None:
    print(printable(line))


def _state(args: argparse.Namespace) -> int:
    point = None if args.at is None else parse_point(args.at)

    async def ask(source: LogSource) -> dict[str, Any]:
        position = await source.head() if point is None else await resolve(source, point)
        return history.view(await history.state_at(source, position))

    view = _question(args, ask)
    _emit(view, args.output, lambda: state_table(view))
    return ExitCode.OK


def _timeline(args: argparse.Namespace) -> int:
    async def ask(source: LogSource) -> tuple[history.Entity | None, list[history.Step]]:
        final = await history.state_at(source, await source.head())
        entity = history.find_entity(final, args.object)
        if entity is None:
            return None, []
        return entity, await history.timeline(source, entity)

    entity, steps = _question(args, ask)
    if entity is None:
        raise CommandError(
            f"{args.object!r}: no claim (namespace/name), share, device or node of that name "
            "in the log",
            ExitCode.NOT_FOUND,
        )
    what = f"{entity.kind} {entity.key}"
    _emit(
        {"kind": entity.kind, "key": entity.key, "steps": steps},
        args.output,
        lambda: timeline_table(what, steps),
    )
    return ExitCode.OK


def _diff(args: argparse.Namespace) -> int:
    a_point, b_point = parse_point(args.a, "A"), parse_point(args.b, "B")

    async def ask(source: LogSource) -> tuple[int, int, list[history.Change]]:
        a, b = await resolve(source, a_point), await resolve(source, b_point)
        left = history.view(await history.state_at(source, a))
        right = history.view(await history.state_at(source, b))
        return a, b, history.diff(left, right)

    a, b, changes = _question(args, ask)
    _emit(
        {"from": a, "to": b, "changes": changes},
        args.output,
        lambda: diff_table(a, b, changes),
    )
    return ExitCode.OK


def _plot(args: argparse.Namespace) -> int:
    from services.replay.plot import check_plotting

    check_plotting()
    check_out("--out", args.out, ".png")

    async def ask(source: LogSource) -> tuple[str, str, list[history.Sample], str]:
        final = await history.state_at(source, await source.head())
        kind, key = _scope(final, args.object)
        samples, unit = await history.usage_series(source, kind, key, args.capacity)
        return kind, key, samples, unit

    kind, key, samples, unit = _question(args, ask)
    if not samples:
        raise CommandError(f"{args.object}: nothing was ever consumed there", ExitCode.NOT_FOUND)
    from services.replay.plot import plot_usage

    with written("--out", args.out):
        plot_usage(
            samples,
            args.out,
            title=f"{args.capacity} consumed on {kind} {key}, by tenant",
            capacity=args.capacity,
            unit=unit,
        )
    print(f"wrote {args.out} ({len(samples)} samples)")
    return ExitCode.OK


def _scope(state: Any, text: str) -> tuple[str, str]:
    kind, _, ident = text.partition(":") if ":" in text else ("", "", text)
    if kind == "class" or (not kind and ident in state.classes):
        return "class", ident
    entity = history.find_entity(state, text)
    if entity is None or entity.kind not in ("device", "node"):
        raise CommandError(
            f"{text!r}: no device, node or DeviceClass of that name in the log", ExitCode.NOT_FOUND
        )
    return entity.kind, entity.key


def _export(args: argparse.Namespace) -> int:
    if args.checkpoint_every < 0:
        raise CommandError(
            f"--checkpoint-every {args.checkpoint_every}: must be >= 0 (0: no checkpoints)",
            ExitCode.BAD_INPUT,
        )
    check_out("--out", args.out)
    settings, url = _settings(args, ServiceKind.READONLY)
    with _progress(f"exporting to {args.out}", "events") as progress:

        async def work() -> tuple[int, int]:
            async with connected(settings) as connection:
                return await export_log(
                    connection,
                    args.out,
                    source=args.source,
                    progress=progress,
                    checkpoint_every=args.checkpoint_every,
                )

        try:
            count, last = _run(args, work, url)
        except OSError as exc:
            raise CommandError(f"--out {args.out}: {exc.strerror}", ExitCode.BAD_INPUT) from None
    print(f"exported {count} events (positions 1..{last}) to {args.out}")
    return ExitCode.OK


def _import(args: argparse.Namespace) -> int:
    check_in("FILE", args.file)
    settings, url = _settings(args, None)
    with _progress(f"importing {args.file}", "bytes") as progress:

        async def work() -> int:
            async with connected(settings) as connection:
                return await import_log(connection, args.file, progress=progress)

        count = _run(args, work, url)
    print(f"imported {count} events from {args.file}")
    return ExitCode.OK


def _snapshot(args: argparse.Namespace) -> int:
    if args.every_events < 1:
        raise CommandError(f"--every-events {args.every_events}: must be >= 1", ExitCode.BAD_INPUT)
    if args.every_minutes <= 0:
        raise CommandError(f"--every-minutes {args.every_minutes}: must be > 0", ExitCode.BAD_INPUT)
    if not args.once:
        from services.runtime.hosting.process import run_service

        return run_service(lambda: _serve_snapshots(args))
    settings, url = _settings(args, ServiceKind.SNAPSHOTS)
    try:
        return _run(args, lambda: _snapshot_once(settings), url)
    except KeyboardInterrupt:
        return ExitCode.OK


async def _snapshot_once(settings: Settings) -> int:
    from services.runtime.store.eventstore import EventStore
    from services.runtime.store.livestate import HEAD, LiveState
    from services.runtime.store.snapshots import write_snapshot

    async with await EventStore.open(settings) as store:
        live = LiveState(store)
        await live.load_snapshot()
        await live.fresh(HEAD)
        if not live.state.position:
            print("the log is empty: no snapshot written")
            return ExitCode.OK
        position = await write_snapshot(store.pool, live.state)
        print(f"snapshot written at position {position}")
        return ExitCode.OK


async def _serve_snapshots(args: argparse.Namespace) -> int:
    """The writer as a service: fold the log as it grows, snapshot it by the rule of
    :mod:`services.runtime.store.snapshots`, and once more when SIGTERM or SIGINT stops it.
    Of several writers one writes at a time, the others fold and stand by
    (:mod:`services.runtime.ops.leadership`)."""
    from services.runtime.hosting.storehosting import serving
    from services.runtime.ops.leadership import SNAPSHOT_WRITER_KEY, Leadership
    from services.runtime.store.snapshots import serve_snapshots

    async with serving(args, "snapshots", login=ServiceKind.SNAPSHOTS, series=False) as context:
        live = await context.live_state()
        log.info(
            "snapshot writer started at position %d (every %d events or %g minutes)",
            live.state.position,
            args.every_events,
            args.every_minutes,
        )
        lease = Leadership(context.settings, SNAPSHOT_WRITER_KEY, "snapshots")
        writing = lease.run(
            context.stop,
            lambda stop: serve_snapshots(
                context.store.pool,
                live,
                stop,
                every_events=args.every_events,
                every_seconds=args.every_minutes * 60,
            ),
        )
        await context.tailing(live, writing)
    log.info("snapshot writer stopped")
    return ExitCode.OK


# --- the parser ----------------------------------------------------------------------------


def _log_or_database(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log", metavar="FILE", help="an exported log file instead of the database"
    )
    add_endpoint_arguments(parser, database=True)


def _output(parser: argparse.ArgumentParser, *choices: str) -> None:
    parser.add_argument("-o", "--output", choices=choices, default="table")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``replay`` noun and its verbs to the CLI."""
    replay = subparsers.add_parser("replay")
    verbs = replay.add_subparsers(dest="replay_verb", required=True)

    check = verbs.add_parser("verify", help="fold the log and check its invariants")
    check.add_argument(
        "--from-start",
        action="store_true",
        help="(kept for scripts: verify always folds from position 0, checking every snapshot)",
    )
    _log_or_database(check)
    check.set_defaults(func=_verify)

    state = verbs.add_parser("state", help="devices, shares, claims and nodes at a point")
    state.add_argument(
        "--at", metavar="POSITION|TIME", help="a position or an ISO 8601 time (default: the head)"
    )
    _output(state, "table", "json", "yaml")
    _log_or_database(state)
    state.set_defaults(func=_state)

    line = verbs.add_parser("timeline", help="every event that touched a claim/share/device/node")
    line.add_argument(
        "object",
        metavar="CLAIM|SHARE|DEVICE|NODE",
        help="namespace/name, a ShareID, a device "
        "(name or driver/pool/device) or a node; prefix claim:, share:, device:, node: to choose",
    )
    _output(line, "table", "json", "yaml")
    _log_or_database(line)
    line.set_defaults(func=_timeline)

    between = verbs.add_parser("diff", help="what changed between two points")
    between.add_argument("a", metavar="A", help="a position or an ISO 8601 time")
    between.add_argument("b", metavar="B", help="a position or an ISO 8601 time")
    _output(between, "table", "json", "yaml")
    _log_or_database(between)
    between.set_defaults(func=_diff)

    plot = verbs.add_parser("plot", help="consumed capacity over time, stacked by tenant (PNG)")
    plot.add_argument("object", metavar="DEVICE|NODE|CLASS")
    plot.add_argument("--out", required=True, metavar="FILE.png")
    plot.add_argument("--capacity", default="memory", help="which capacity (default memory)")
    _log_or_database(plot)
    plot.set_defaults(func=_plot)

    export = verbs.add_parser("export", help="write the log to a portable NDJSON file")
    export.add_argument("--out", required=True, metavar="FILE")
    export.add_argument("--source", default="", help="a note stored in the file's header")
    export.add_argument(
        "--checkpoint-every",
        type=int,
        default=CHECKPOINT_EVERY,
        metavar="N",
        help=f"a checkpoint of the fold every N events and after the last, so that "
        f"state --at need not fold from 1 (default {CHECKPOINT_EVERY:,}; 0: none)",
    )
    add_endpoint_arguments(export, database=True)
    export.set_defaults(func=_export)

    load = verbs.add_parser("import", help="load an exported file into an empty log")
    load.add_argument("file", metavar="FILE")
    add_endpoint_arguments(load, database=True)
    load.set_defaults(func=_import)

    snap = verbs.add_parser("snapshot", help="write snapshots of the fold (once, or as a service)")
    snap.add_argument("--once", action="store_true", help="write one now and exit")
    snap.add_argument(
        "--every-events",
        type=int,
        default=EVERY_EVENTS,
        metavar="N",
        help="events between two snapshots of a small state; grows with the state "
        "(services/runtime/store/snapshots.py)",
    )
    snap.add_argument("--every-minutes", type=float, default=10.0, metavar="M")
    snap.add_argument(
        "--metrics-port", type=int, default=0, help="service: Prometheus port (0: off)"
    )
    snap.add_argument(
        "--metrics-addr", default="127.0.0.1", metavar="ADDR", help="where metrics bind"
    )
    add_endpoint_arguments(snap, database=True)
    snap.set_defaults(func=_snapshot)
