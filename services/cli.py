"""``dracap``: the command line.

``dracap NOUN VERB`` style; every feature module adds its own sub-commands through a
``register(subparsers)`` function, so this file only wires them together. Exit codes
are shared by all commands:

* 0 — done;
* 1 — an invariant was violated (``replay verify``) or an internal error occurred;
* 2 — bad input: a file that cannot be read or decoded, a bad flag;
* 3 — not found; 4 — rejected by the control plane.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

EXIT_OK = 0
EXIT_VIOLATION = 1
EXIT_BAD_INPUT = 2
EXIT_NOT_FOUND = 3
EXIT_REJECTED = 4

# Modules that contribute sub-commands; each has ``register(subparsers) -> None`` and sets
# ``func`` (a callable taking the parsed namespace and returning an exit code).
COMMAND_MODULES = (
    "services.reservation.command",
    "services.runtime.dbcommand",
    "services.replay.command",
    "services.up",
    "services.claims.command",
    "services.enforcement.command",
    "services.enforcement.prove_command",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dracap",
        description="Share GPU memory and vNIC bandwidth between Kubernetes tenants (DRA).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return EXIT_BAD_INPUT
    code: int = func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
