"""``dracap``: the command line.

``dracap NOUN VERB`` style; every feature module adds its own sub-commands through a
``register(subparsers)`` function, so this file only wires them together. Every
command exits with a code of the one table in :mod:`services.exitcodes` (0 done,
1 error, 2 bad input, 3 not found, 4 rejected, 5 invariant violated).

Start-up
--------
A command imports only what it uses. :data:`COMMANDS` names each command word's module
and its one-line help, so ``dracap --help`` lists every command without importing any of
them, and ``dracap claim list`` imports ``services.commands.claim`` alone (which in turn
imports what listing claims needs, not the manifest loader or the CEL parser). nats-py
imports aiohttp (0.1 s) for a WebSocket transport dracap never uses: the CLI defers that
import to its first use (:mod:`services.runtime.ground.deferred`). ``tests/unit/test_cli_main.py``
checks both; docs/operations.md gives the figures.

Errors
------
Every command finds its servers the same way (:mod:`services.runtime.bus.endpoints`), and
an expected failure — no server configured or reachable, a missing database, a server
that does not answer in time, a :class:`~services.exitcodes.CommandError` — is one
line on stderr, never a traceback. The error types of modules the command did not
import cannot have been raised, so they are looked up only among the loaded modules.

SIGTERM is a request to stop. A long-running service answers it on its event loop once
it runs (it ends its work and exits 0); before that — while the command imports,
parses or connects — the process exits at once with ``ExitCode.INTERRUPTED`` (130):
nothing is half-done then, and without it the process died of the signal (-15). The
exit is immediate (``os._exit``) rather than an exception raised wherever the signal
lands: one raised inside an extension module's import crashed the interpreter. SIGINT
keeps Python's ``KeyboardInterrupt``, answered with 130 and no traceback where the
command does not answer it itself.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any, Final, NamedTuple

from services.exitcodes import CommandError, ExitCode


class Command(NamedTuple):
    """A command word: the module whose ``register(subparsers)`` adds it, and its help."""

    module: str
    help: str


#: Each command word, the module that adds it (``register(subparsers) -> None`` adds the
#: module's commands and sets ``func``, taking the parsed namespace and returning an
#: exit code) and the line ``dracap --help`` shows for it — the one home of that line.
COMMANDS: Final = {
    "up": Command(
        "services.commands.up",
        "run the whole control plane in one process (embedded servers if needed)",
    ),
    "apply": Command(
        "services.commands.objects",
        "apply DeviceClasses, ResourceSlices, Namespaces and ResourceClaims from files",
    ),
    "get": Command("services.commands.objects", "show objects of one kind, or one by name"),
    "delete": Command("services.commands.objects", "delete an object by kind and name"),
    "claim": Command(
        "services.commands.claim", "apply, get, list, delete, watch and reserve ResourceClaims"
    ),
    "devices": Command(
        "services.commands.claim", "capacity, consumption and tenants of every device"
    ),
    "policy": Command("services.commands.claim", "change a device capacity's request policy"),
    "class": Command("services.commands.claim", "list DeviceClasses, set one's mode or remove it"),
    "node": Command("services.commands.claim", "node leases, lost nodes and fencing"),
    "audit": Command(
        "services.commands.audit", "who did what to which share, when and why (audit records)"
    ),
    "usage": Command(
        "services.commands.usage",
        "usage per namespace and DeviceClass (GiB-hours, Gbit/s-hours), unknown apart",
    ),
    "report": Command(
        "services.commands.report",
        "the Grafana dashboard's panels as one PNG, computed from the event log",
    ),
    "replay": Command(
        "services.commands.replay",
        "replay the event log (forensics): verify, state, timeline, diff, plot, export, …",
    ),
    "allocate": Command(
        "services.commands.allocate",
        "decide ResourceClaims against DeviceClasses and ResourceSlices from files",
    ),
    "simulate": Command(
        "services.commands.plan",
        "simulate a trace of claims per mode and placement policy on the real allocator",
    ),
    "plan": Command(
        "services.commands.plan", "capacity math step by step, from raw to schedulable"
    ),
    "serve": Command(
        "services.commands.serve",
        "run one control-plane service as its own process (relay, claims, reservation, "
        "enforcement, kubernetes-bridge)",
    ),
    "agent": Command(
        "services.commands.agent",
        "run the node agent of one node (applies and removes share limits)",
    ),
    "reclaim": Command(
        "services.commands.reclaim",
        "run the reclamation service (node lease expiry, fence hook)",
    ),
    "auth": Command("services.commands.auth", "broker accounts, users and credentials"),
    "db": Command("services.commands.db", "database schema migrations and database users"),
    "prove": Command("services.commands.prove", "prove on this machine that limits hold"),
}
COMMAND_MODULES: Final = tuple(dict.fromkeys(c.module for c in COMMANDS.values()))
#: The exceptions that are one line on stderr (module, class, exit code; ``None``: bad
#: input for the ``bad_input`` ones, else an error), once their module is loaded.
_ONE_LINE: Final = (
    ("services.runtime.bus.endpoints", "ConnectionFileError", ExitCode.BAD_INPUT),
    ("services.runtime.bus.credentials", "CredentialError", ExitCode.BAD_INPUT),
    ("services.runtime.ground.loginfiles", "LoginFileError", ExitCode.BAD_INPUT),
    ("services.runtime.ground.settings", "SettingsError", ExitCode.BAD_INPUT),
    ("services.runtime.bus.endpoints", "EndpointError", ExitCode.ERROR),
    ("services.runtime.ground.errors", "RetryableError", ExitCode.ERROR),
)


class _Words:
    """The sub-parsers action, handing each command word its help from :data:`COMMANDS`."""

    def __init__(self, action: Any) -> None:
        self._action = action

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        command = COMMANDS.get(name)
        if command is not None:
            kwargs["help"] = command.help
        parser: argparse.ArgumentParser = self._action.add_parser(name, **kwargs)
        return parser


def _word(argv: Sequence[str]) -> str | None:
    """The command word of ``argv`` (its first argument that is not an option)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of ``argv``'s command; with no command word, every word with its help
    and nothing imported (``dracap --help``)."""
    parser = argparse.ArgumentParser(
        prog="dracap",
        description="Share GPU memory and vNIC bandwidth between Kubernetes tenants (DRA).",
    )
    action = parser.add_subparsers(dest="command", metavar="COMMAND")
    words = _Words(action)
    command = COMMANDS.get(_word(argv or ()) or "")
    if command is not None:
        importlib.import_module(command.module).register(words)
    for name in COMMANDS:
        if name not in action.choices:  # listed for help; parsing it needs its module
            words.add_parser(name, add_help=False)
    return parser


def _stop_now(_signum: int, _frame: object) -> None:
    os._exit(ExitCode.INTERRUPTED)  # see the module docstring


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:  # this process is the command: SIGTERM before it runs ends it (130)
        signal.signal(signal.SIGTERM, _stop_now)
        from services.runtime.ground.deferred import defer_unused_imports

        defer_unused_imports()
    try:
        return _dispatch(sys.argv[1:] if argv is None else list(argv))
    except KeyboardInterrupt:  # SIGINT where the command does not answer it
        return ExitCode.INTERRUPTED


def _one_line(exc: BaseException) -> ExitCode | None:
    """The exit code of an expected failure (one line), None for any other error."""
    for module, name, code in _ONE_LINE:
        loaded = sys.modules.get(module)
        kind = getattr(loaded, name, None) if loaded is not None else None
        if isinstance(kind, type) and isinstance(exc, kind):
            return code
    return None


def _dispatch(argv: list[str]) -> int:
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return ExitCode.BAD_INPUT
    try:
        code: int = func(args)
    except BrokenPipeError:  # the reader of the output went away (`dracap devices | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return ExitCode.OK
    except CommandError as exc:  # one line, whatever text of a tenant's it carries
        _say(exc)
        return exc.exit_code
    except Exception as exc:
        one_line = _one_line(exc)
        if one_line is None:
            raise
        _say(exc)
        return one_line
    return code


def _say(exc: BaseException) -> None:
    from services.runtime.ground.printable import printable

    print(f"error: {printable(exc)}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
