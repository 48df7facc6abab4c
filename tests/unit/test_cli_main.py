"""``services.cli``: each command word has its module, and a command imports only its own.

``dracap --help`` lists every command without importing any command module, nats-py,
asyncio or the database drivers; ``dracap claim list`` imports neither the manifest
loader (and with it the CEL parser), nor alembic and SQLAlchemy, nor aiohttp (nats-py's
WebSocket transport, deferred by :mod:`services.runtime.ground.deferred`).
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services import cli

ROOT = Path(__file__).resolve().parents[2]

ONLY_ALLOCATE = """
import sys
from services import cli
cli.build_parser(["allocate", "-f", "x"])
loaded = sorted(m for m in cli.COMMAND_MODULES if m in sys.modules)
print(",".join(loaded), "alembic" in sys.modules, "services.commands.up" in sys.modules)
"""

#: what a start-up may not have imported: (argv, modules)
HEAVY = ("alembic", "sqlalchemy", "aiohttp", "celpy", "events.selectors", "events.manifests")
LOADED = """
import sys
from services import cli
from services.runtime.ground.deferred import defer_unused_imports
defer_unused_imports()
argv = sys.argv[1:]
try:
    cli._dispatch(argv)
except SystemExit:
    pass
real = [m for m in sys.modules if type(sys.modules[m]).__name__ != "_StandIn"]
print(" ".join(sorted(real)))
"""


def _loaded(*argv: str) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-c", LOADED, *argv], cwd=ROOT, capture_output=True, text=True
    )
    return set(done.stdout.split())


class _Recorder:
    """A sub-parsers action that records the words a module adds."""

    def __init__(self) -> None:
        self.words: list[str] = []
        self._action = argparse.ArgumentParser().add_subparsers()

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        self.words.append(name)
        parser: argparse.ArgumentParser = self._action.add_parser(name, **kwargs)
        return parser


@pytest.mark.parametrize("module", cli.COMMAND_MODULES)
def test_each_module_adds_exactly_the_words_the_table_gives_it(module: str) -> None:
    recorder = _Recorder()
    importlib.import_module(module).register(recorder)
    assert sorted(recorder.words) == sorted(
        w for w, c in cli.COMMANDS.items() if c.module == module
    )


def test_help_without_a_command_lists_every_word_with_its_help() -> None:
    parser = cli.build_parser()
    [sub] = [a for a in parser._actions if a.dest == "command"]
    assert set(sub.choices or {}) == set(cli.COMMANDS)
    helps = {action.dest: action.help for action in sub._choices_actions}
    assert helps == {word: command.help for word, command in cli.COMMANDS.items()}


def test_a_command_imports_only_its_own_module() -> None:
    done = subprocess.run(
        [sys.executable, "-c", ONLY_ALLOCATE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.split() == ["services.commands.allocate", "False", "False"]


def test_help_imports_no_command_and_no_client_library() -> None:
    loaded = _loaded("--help")
    assert "argparse" in loaded  # the probe ran
    assert not loaded & set(cli.COMMAND_MODULES)
    assert not loaded & {"asyncio", "nats", "asyncpg", "msgspec", "yaml", *HEAVY}


def test_claim_list_imports_no_manifest_loader_database_driver_layer_or_aiohttp() -> None:
    # the connection is refused at once (nothing listens on port 1): the imports are made
    loaded = _loaded("claim", "list", "--nats", "nats://127.0.0.1:1")
    assert "services.commands.claim" in loaded and "nats" in loaded
    assert not loaded & set(HEAVY)


def test_a_deferred_module_is_imported_at_its_first_use() -> None:
    probe = """
import sys
from services.runtime.ground.deferred import defer_unused_imports
defer_unused_imports()
import nats.aio.client  # imports aiohttp: the stand-in
print(type(sys.modules["aiohttp"]).__name__)
import aiohttp
print(aiohttp.ClientSession.__name__, type(sys.modules["aiohttp"]).__name__)
from aiohttp import web
print(web.__name__)
"""
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.split() == ["_StandIn", "ClientSession", "module", "aiohttp.web"]
