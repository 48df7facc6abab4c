"""``dracap``: the command line.

``dracap NOUN VERB`` style; every feature module adds its own sub-commands through a
``register(subparsers)`` function, so this file only wires them together. Every
command exits with a code of the one table in :mod:`services.exitcodes` (0 done,
1 error, 2 bad input, 3 not found, 4 rejected, 5 invariant violated).

Every command finds its servers the same way (:mod:`services.runtime.endpoints`), and
an expected failure — no server configured or reachable, a missing database, a server
that does not answer in time, a :class:`~services.exitcodes.CommandError` — is one
line on stderr, never a traceback.

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
from typing import Final

from services.exitcodes import CommandError, ExitCode

#: Each command word and the module that adds it: ``register(subparsers) -> None`` adds
#: the module's commands and sets ``func`` (taking the parsed namespace, returning an
#: exit code). Only the module of the command asked for is imported, so a command does
#: not pay for (or depend on) the imports of the others; help without a command lists all.
COMMANDS: Final = {
    "allocate": "services.reservation.command",
    "db": "services.runtime.dbcommand",
    "replay": "services.replay.command",
    "up": "services.up",
    "claim": "services.claims.command",
    "devices": "services.claims.command",
    "policy": "services.claims.command",
    "class": "services.claims.command",
    "node": "services.claims.command",
    "agent": "services.enforcement.command",
    "reclaim": "services.reclamation.command",
    "serve": "services.serve",
    "prove": "services.prove",
    "auth": "services.brokerauth",
    "simulate": "services.planning.command",
    "plan": "services.planning.command",
    "audit": "services.audit.command",
    "usage": "services.billing.command",
    "report": "services.report.command",
}
COMMAND_MODULES: Final = tuple(dict.fromkeys(COMMANDS.values()))


def _modules_for(argv: Sequence[str]) -> tuple[str, ...]:
    """The module of the command word in ``argv``; every module when there is none."""
    word = next((arg for arg in argv if not arg.startswith("-")), None)
    module = COMMANDS.get(word or "")
    return (module,) if module else COMMAND_MODULES


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of ``argv``'s command (of every command when ``argv`` names none)."""
    parser = argparse.ArgumentParser(
        prog="dracap",
        description="Share GPU memory and vNIC bandwidth between Kubernetes tenants (DRA).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _modules_for(argv or ()):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def _stop_now(_signum: int, _frame: object) -> None:
    os._exit(ExitCode.INTERRUPTED)  # see the module docstring


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:  # this process is the command: SIGTERM before it runs ends it (130)
        signal.signal(signal.SIGTERM, _stop_now)
    try:
        return _dispatch(sys.argv[1:] if argv is None else list(argv))
    except KeyboardInterrupt:  # SIGINT where the command does not answer it
        return ExitCode.INTERRUPTED


def _dispatch(argv: list[str]) -> int:
    # imported here, after main() took SIGTERM: importing takes a while
    from services.runtime.credentials import CredentialError
    from services.runtime.endpoints import ConnectionFileError, EndpointError
    from services.runtime.errors import RetryableError
    from services.runtime.printable import printable
    from services.runtime.settings import SettingsError

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
        print(f"error: {printable(exc)}", file=sys.stderr)
        return exc.exit_code
    except (EndpointError, CredentialError, RetryableError, SettingsError) as exc:  # one line
        print(f"error: {printable(exc)}", file=sys.stderr)
        bad_input = isinstance(exc, ConnectionFileError | CredentialError | SettingsError)
        return ExitCode.BAD_INPUT if bad_input else ExitCode.ERROR
    return code


if __name__ == "__main__":
    sys.exit(main())
