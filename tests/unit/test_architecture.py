"""The layering is a checked contract, not a paragraph (import-linter, ``pyproject.toml``).

* ``events/`` is pure, and so are the allocator's and admission's decisions;
* the services (claims, enforcement, replay, reservation) do not import each other:
  what two of them share lives in ``events/`` (pure) or ``services/runtime/``;
* ``services/runtime/`` imports no service, nor the commands that compose services;
* the node agent reaches NATS only: none of its modules imports the event store, a
  fold of its own or a database role (the enforcement service holds those);
* ``services/`` is layered: ``cli`` > ``commands`` > ``stack`` > the services >
  ``runtime`` > ``exitcodes``, and every sub-package must be declared in a layer;
* the command words are one folder, ``services/commands/``: ``prove`` above ``up``,
  the other words independent, above what ``audit`` and ``usage`` share;
* ``services/runtime/`` is floored: ``hosting`` > ``delivery`` | ``ops`` > ``store`` |
  ``bus`` | ``kube`` | ``kubeletplugin`` > ``ground``, every module in a floor; the
  store imports no nats, the two Kubernetes sides neither asyncpg nor nats; the live
  state stands above the check of its start, above the snapshots;
* the tc enforcer stands above its netlink backend, both above what they share (no
  circle between them);
* the big modules' parts are layered too: the fold and the state codec above the
  state, the event codec above envelopes above the catalog; validation above a slice's
  rules above the field rules; the allocator above diagnosis above the search above
  the requests and the allocated state; ``ClaimsApi`` above its parts above their
  core; consumers above their handlers above the event store above appends.

The tree must keep every contract, and each contract must catch the import it exists
to forbid: the second test copies the sources, adds one such import, and expects the
contract to break.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[2]
CONTRACTS = {
    "events-pure",
    "decisions-pure",
    "services-independent",
    "runtime-imports-no-service",
    "services-layers",
    "agent-off-the-database",
    "events-meaning-above-records",
    "validation-layers",
    "allocator-layers",
    "claims-api-layers",
    "store-layers",
    "runtime-floors",
    "live-state-layers",
    "store-speaks-sql",
    "kubernetes-sides-off-the-servers",
    "commands-layers",
    "tc-layers",
}
AGENT = "agent-off-the-database"
ALLOCATOR = "allocator-layers"
FLOORS = "runtime-floors"
LIVE = "live-state-layers"
KUBE_SIDES = "kubernetes-sides-off-the-servers"
COMMANDS = "commands-layers"
NO_SERVICE = "runtime-imports-no-service"
LINT_ONE = """
import sys
from importlinter.cli import lint_imports
sys.exit(lint_imports(config_filename="pyproject.toml", limit_to_contracts=(sys.argv[1],),
                      no_cache=True))
"""


def test_import_contracts_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True) == 0


def test_every_contract_is_declared() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    declared = {c["id"] for c in config["tool"]["importlinter"]["contracts"]}
    assert declared == CONTRACTS


def _lint_copy(tmp_path: Path, contract: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}  # the copy, not the installed tree
    return subprocess.run(
        [sys.executable, "-c", LINT_ONE, contract],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("events/fold.py", "import services.runtime.ground.errors", "events-pure"),
        ("services/reservation/allocating.py", "import nats", "decisions-pure"),
        ("services/claims/admission.py", "import services.reservation", "services-independent"),
        ("services/enforcement/proving.py", "import services.claims", "services-independent"),
        (
            "services/runtime/ops/gauges.py",
            "import services.reservation",
            "runtime-imports-no-service",
        ),
        ("services/runtime/hosting/process.py", "import services.cli", NO_SERVICE),
        ("services/enforcement/agent.py", "import services.runtime.store.eventstore", AGENT),
        ("services/enforcement/leasing.py", "import services.enforcement.leases", AGENT),
        ("services/enforcement/proving.py", "import services.commands.up", "services-layers"),
        ("services/exitcodes.py", "import services.runtime.ground.errors", "services-layers"),
        ("services/ledger/__init__.py", "", "services-layers"),  # a package in no layer
        ("services/stack.py", "import services.commands.up", "services-layers"),
        ("services/reservation/searching.py", "import nats", "decisions-pure"),
        ("events/state.py", "import events.fold", "events-meaning-above-records"),
        ("events/statecodec.py", "import events.fold", "events-meaning-above-records"),
        ("events/catalog.py", "import events.envelopes", "events-meaning-above-records"),
        ("events/fieldchecks.py", "import events.validation", "validation-layers"),
        ("events/slicevalidation.py", "import events.validation", "validation-layers"),
        ("services/reservation/searching.py", "import services.reservation.allocating", ALLOCATOR),
        ("services/reservation/allocated.py", "import services.reservation.searching", ALLOCATOR),
        ("services/claims/apicore.py", "import services.claims.api", "claims-api-layers"),
        ("services/claims/apitenant.py", "import services.claims.apiwrites", "claims-api-layers"),
        (
            "services/runtime/store/appends.py",
            "import services.runtime.store.eventstore",
            "store-layers",
        ),
        (
            "services/runtime/delivery/handlers.py",
            "import services.runtime.delivery.consuming",
            "store-layers",
        ),
        ("services/enforcement/agent.py", "import services.runtime.delivery.handlers", AGENT),
        ("services/commands/up.py", "import services.commands.prove", COMMANDS),
        ("services/commands/audit.py", "import services.commands.usage", COMMANDS),
        ("services/commands/querying.py", "import services.commands.audit", COMMANDS),
        ("services/commands/stray.py", "", COMMANDS),  # a command in no layer
        ("services/runtime/ops/health.py", "import services.commands", NO_SERVICE),
        ("services/runtime/ground/errors.py", "import services.runtime.store", FLOORS),
        ("services/runtime/store/rows.py", "import services.runtime.bus", FLOORS),
        ("services/runtime/bus/replies.py", "import services.runtime.store", FLOORS),
        ("services/runtime/ops/health.py", "import services.runtime.delivery", FLOORS),
        ("services/runtime/delivery/pulling.py", "import services.runtime.ops", FLOORS),
        ("services/runtime/kube/client.py", "import services.runtime.hosting", FLOORS),
        ("services/runtime/stray.py", "", FLOORS),  # a module in no floor
        ("services/runtime/store/snapshots.py", "import services.runtime.store.livestate", LIVE),
        (
            "services/runtime/store/snapshotcheck.py",
            "import services.runtime.store.livestate",
            LIVE,
        ),
        ("services/runtime/store/rows.py", "import nats", "store-speaks-sql"),
        ("services/runtime/kube/slices.py", "import asyncpg", KUBE_SIDES),
        ("services/runtime/kubeletplugin/wire.py", "import nats", KUBE_SIDES),
        ("services/enforcement/agent.py", "import services.runtime.store.rows", AGENT),
        ("services/enforcement/tcnetlink.py", "import services.enforcement.tc", "tc-layers"),
        ("services/enforcement/tcobjects.py", "import services.enforcement.tcnetlink", "tc-layers"),
        ("services/commands/showing.py", "import services.commands.claim", COMMANDS),
        ("services/commands/claim.py", "import services.commands.objects", COMMANDS),
    ],
)  # fmt: skip
def test_a_contract_breaks_when_its_import_comes_back(
    tmp_path: Path, module: str, line: str, contract: str
) -> None:
    ignore = shutil.ignore_patterns("__pycache__")
    for package in ("events", "services"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    assert _lint_copy(tmp_path, contract).returncode == 0  # the copy is as clean as the tree
    target = tmp_path / module
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("a", encoding="utf-8") as source:
        source.write(f"\n{line}\n")
    linted = _lint_copy(tmp_path, contract)
    assert linted.returncode != 0, linted.stdout
    assert "BROKEN" in linted.stdout
