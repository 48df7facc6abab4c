"""``services.cli``: each command word has its module, and a command imports only its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from services import cli

ROOT = Path(__file__).resolve().parents[2]

ONLY_ALLOCATE = """
import sys
from services import cli
cli.build_parser(["allocate", "-f", "x"])
loaded = sorted(m for m in cli.COMMAND_MODULES if m in sys.modules)
print(",".join(loaded), "alembic" in sys.modules, "services.up" in sys.modules)
"""


def test_every_command_word_names_the_module_that_adds_it() -> None:
    parser = cli.build_parser()
    [sub] = [a for a in parser._actions if a.dest == "command"]
    assert set(sub.choices or {}) == set(cli.COMMANDS)


def test_a_command_imports_only_its_own_module() -> None:
    done = subprocess.run(
        [sys.executable, "-c", ONLY_ALLOCATE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.split() == ["services.reservation.command", "False", "False"]
