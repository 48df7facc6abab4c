"""docker-compose.yml's topology as separate processes, secure, on real servers.

The command lines come from docker-compose.yml itself, so this test fails when the file
drifts: the one-shot jobs (``auth-init``, ``migrate``, ``logins``) and every dracap
service of the file (relay, claims, reservation, enforcement, reclamation, audit,
billing, snapshots and the node agent) run with the file's ``command`` and
``environment``, translated only where a container differs from a test: the ``dracap``
volume is a temporary directory, the servers' host names are the test's servers (a
nats-server started with the accounts ``auth-init`` wrote, and a database of this test's
own on the real PostgreSQL), ``${NODE_NAME:-node-a}`` is its default, each metrics port
is a free one on 127.0.0.1, and the logins carry a prefix of their own (roles are the
server's, shared with other test sessions). Each service so runs with its own NATS
credential and its own database login, and the test checks in ``pg_stat_activity`` that
no service connects as anyone else.

Then the README's tour, with the operator's credential and the CLI as an operator runs
it: ``dracap apply -f`` the inventory, ``claim apply --wait`` until Ready, ``devices``,
``audit``, ``usage``, ``claim delete``. Then every service in turn is killed (SIGKILL),
started again with the same command, and the system must still converge: a new claim
becomes Ready, the audit subscriber records it, and it is released again (the examples'
node-b runs no agent, so node-a must keep room); billing answers at the end. These
claims go through the operator's API client in the test's process (the tour has
shown the CLI; a process start per step would double the test's time). Every wait is
bounded and waits on a condition (a health check of compose's kind: the metrics port
answers; a claim's phase; a query's answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import urllib.request
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import asyncpg
import pytest
import yaml

from services.exitcodes import CommandError
from services.runtime.bus.apiclient import ApiClient, ApiError
from services.runtime.bus.credentials import AuthDir
from services.runtime.bus.endpoints import EndpointError
from services.runtime.ops.embedded import EmbeddedNats, free_port
from services.runtime.store.provisioning import KINDS

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
EXAMPLES = ROOT / "deploy" / "examples"
VOLUME: Final = "/var/lib/dracap"  #: the `dracap` volume's mount point in every container
ONE_SHOTS: Final = ("auth-init", "migrate", "logins")
SERVICES: Final = (
    "relay",
    "claims",
    "reservation",
    "enforcement",
    "reclamation",
    "audit",
    "billing",
    "snapshots",
    "agent",
)
#: the services that connect to the database (the agent talks to NATS only)
ON_THE_DATABASE: Final = {
    "relay": "relay",
    "claims": "claims",
    "reservation": "reservation",
    "enforcement": "enforcement",
    "reclamation": "reclamation",
    "audit": "ledger",
    "billing": "ledger",
    "snapshots": "snapshots",
}
_DEFAULT = re.compile(r"\$\{[A-Z_]+:-([^}]*)\}")
WAIT_S: Final = 60.0  #: the upper bound of every wait


def _compose() -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = yaml.safe_load(COMPOSE.read_text())["services"]
    return services


class Topology:
    """The compose file's processes on this machine."""

    def __init__(self, tmp: Path, owner_url: str, token: str) -> None:
        self.tmp, self.owner_url, self.token = tmp, owner_url, token
        self.data = tmp / "dracap"  #: the `dracap` volume
        self.data.mkdir()
        self.compose = _compose()
        self.nats_url = ""
        self.running: dict[str, asyncio.subprocess.Process] = {}
        self.ports: dict[str, int] = {}

    def argv(self, name: str) -> list[str]:
        """Service ``name``'s command from the compose file, translated (module docstring)."""
        words = [
            _DEFAULT.sub(r"\1", str(w)).replace(VOLUME, str(self.data))
            for w in self.compose[name]["command"]
        ]
        if "--metrics-port" in words:
            port = self.ports.setdefault(name, free_port())
            words[words.index("--metrics-port") + 1] = str(port)
        if "--metrics-addr" in words:
            words[words.index("--metrics-addr") + 1] = "127.0.0.1"
        if name == "logins":  # roles are the server's: this test's own names
            words += ["--login-prefix", f"t{self.token}"]
        return [sys.executable, "-m", "services.cli", *words]

    def env(self, name: str) -> dict[str, str]:
        """The compose file's environment of ``name``, its servers the test's."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("DRACAP_")}
        for key, value in (self.compose[name].get("environment") or {}).items():
            if key == "DRACAP_NATS_URL":
                value = self.nats_url
            elif key.startswith("DRACAP_DATABASE_URL"):
                value = self.owner_url  # (a service given the owner's URL fails below)
            env[key] = str(value)
        return env

    async def run_once(self, name: str) -> None:
        """A one-shot job: it must end with 0."""
        done = await asyncio.create_subprocess_exec(
            *self.argv(name),
            cwd=ROOT,
            env=self.env(name),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        async with asyncio.timeout(WAIT_S):
            out, _ = await done.communicate()
        assert done.returncode == 0, (name, out.decode())

    async def start(self, name: str) -> None:
        log = (self.tmp / f"{name}.log").open("ab")
        self.running[name] = await asyncio.create_subprocess_exec(
            *self.argv(name), cwd=ROOT, env=self.env(name), stdout=log, stderr=log
        )
        log.close()

    async def healthy(self, name: str) -> None:
        """Compose's health check of ``name``: its metrics port answers (bounded)."""
        url = f"http://127.0.0.1:{self.ports[name]}/metrics"

        def probe() -> bool:
            try:
                with urllib.request.urlopen(url, timeout=2) as reply:
                    return bool(reply.status == 200)
            except OSError:
                return False

        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(WAIT_S):
                while not await asyncio.to_thread(probe):
                    assert self.running[name].returncode is None, (name, self.logs())
                    await asyncio.sleep(0.1)
                return
        raise AssertionError(f"{name} never became healthy:\n{self.logs()}")

    async def kill(self, name: str) -> None:
        process = self.running[name]
        process.send_signal(signal.SIGKILL)
        await process.wait()

    async def stop(self) -> dict[str, int]:
        for process in self.running.values():
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
        codes = {}
        for name, process in self.running.items():
            try:
                async with asyncio.timeout(30):
                    codes[name] = await process.wait()
            except TimeoutError:
                process.kill()
                codes[name] = await process.wait()
        return codes

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.tmp.glob("*.log"))
        )

    async def dracap(self, *words: str) -> str:
        """An operator's command: the operator's credential of `auth init`, the test's NATS."""
        creds = AuthDir(self.data / "auth").operator_path()
        argv = [sys.executable, "-m", "services.cli", *words]
        argv += ["--nats", self.nats_url, "--creds", str(creds), "--data-dir", str(self.tmp / "op")]
        env = {k: v for k, v in os.environ.items() if not k.startswith("DRACAP_")}
        done = await asyncio.create_subprocess_exec(
            *argv,
            cwd=ROOT,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        async with asyncio.timeout(WAIT_S + 30):
            out, err = await done.communicate()
        if done.returncode != 0:
            raise AssertionError(
                f"dracap {' '.join(words)}: exit {done.returncode}\n{out.decode()}\n"
                f"{err.decode()}\n{self.logs()}"
            )
        return out.decode()


def _claim(name: str) -> str:
    return json.dumps(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "tenant-a"},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {
                                "deviceClassName": "gpu-memory.dracap.io",
                                "capacity": {"requests": {"memory": "1Gi"}},
                            },
                        }
                    ]
                }
            },
        }
    )


@pytest.fixture
async def topology(empty_database_url: str, tmp_path: Path) -> AsyncIterator[Topology]:
    token = uuid.uuid4().hex[:8]
    topo = Topology(tmp_path, empty_database_url, token)
    nats: EmbeddedNats | None = None
    try:
        await topo.run_once("auth-init")
        # compose's nats: JetStream, the accounts auth-init wrote
        assert "auth/accounts.conf" in " ".join(topo.compose["nats"]["command"])
        (tmp_path / "natsd").mkdir()
        nats = EmbeddedNats(tmp_path / "natsd", config=topo.data / "auth" / "accounts.conf")
        topo.nats_url = await asyncio.to_thread(nats.start)
        await topo.run_once("migrate")
        await topo.run_once("logins")
        for name in SERVICES:
            await topo.start(name)
        yield topo
    finally:
        codes = await topo.stop()
        if nats is not None:
            nats.stop()
        admin = await asyncpg.connect(empty_database_url)
        try:
            for kind in KINDS:
                await admin.execute(f'DROP ROLE IF EXISTS "t{token}_{kind.value}_login"')
        finally:
            await admin.close()
    assert all(code == 0 for code in codes.values()), (codes, topo.logs())
    assert "permissions violation" not in topo.logs().lower(), topo.logs()
    assert "Traceback" not in topo.logs(), topo.logs()


def test_the_test_runs_every_dracap_service_of_the_compose_file() -> None:
    dracap = {n for n, s in _compose().items() if str(s.get("image", "")).startswith("dracap")}
    assert dracap == {*ONE_SHOTS, *SERVICES}


async def _logins_in_use(topo: Topology) -> set[str]:
    """Each database service's login, once every one of them is connected (bounded)."""
    wanted = {f"t{topo.token}_{kind}_login" for kind in ON_THE_DATABASE.values()}
    admin = await asyncpg.connect(topo.owner_url)
    try:
        async with asyncio.timeout(WAIT_S):
            while True:
                rows = await admin.fetch(
                    "SELECT DISTINCT usename FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
                seen = {row["usename"] for row in rows}
                if wanted <= seen:
                    return seen
                await asyncio.sleep(0.2)
    finally:
        await admin.close()


async def test_the_compose_topology_runs_secure_and_recovers_from_each_kill(
    topology: Topology,
) -> None:
    topo = topology
    for name in SERVICES:
        await topo.healthy(name)
    logins = await _logins_in_use(topo)
    owner = await _owner(topo.owner_url)
    assert owner not in logins, f"a service connects as the database's owner: {logins}"
    assert set(logins) <= {f"t{topo.token}_{k.value}_login" for k in KINDS}, logins

    # the README's tour, as an operator runs it
    files = ("gpu-memory.yaml", "vnic-bandwidth.yaml", "namespaces.yaml")
    applied = await topo.dracap("apply", *[w for f in files for w in ("-f", str(EXAMPLES / f))])
    assert "deviceclass/gpu-memory.dracap.io applied" in applied
    listed = await topo.dracap("claim", "apply", "-f", str(EXAMPLES / "claims.yaml"), "--wait")
    assert re.search(r"tenant-a\s+train-small\s+ready", listed), listed
    assert "node-a-gpus/gpu-0" in await topo.dracap("devices")
    await _audited(topo, "train-small")
    await topo.dracap("usage")
    deleted = await topo.dracap("claim", "delete", "train-small", "-n", "tenant-a")
    assert "deleted" in deleted

    # kill -9 each service in turn; started again with the same command, it converges
    operator = AuthDir(topo.data / "auth").operator()
    async with ApiClient.connect(topo.nats_url, "dracap", operator) as api:
        for name in SERVICES:
            await topo.kill(name)
            await topo.start(name)
            await topo.healthy(name)
            claim = f"after-{name}"
            await _until(api, claim, "ready", topo)  # (answered once the claims API is back)
            records = await _api_audited(api, claim, topo)
            assert {r["actor"] for r in records if r["decision"] == "submitted"} == {
                "operator:operator"
            }
            # released again: node-a keeps room for the next (node-b runs no agent)
            await api.claims("tenant-a", "delete", {"name": claim})
            await _until(api, claim, "released", topo)
    await topo.dracap("usage", "-n", "tenant-a")


async def _until(api: ApiClient, claim: str, phase: str, topo: Topology) -> None:
    """Apply ``claim`` (when asked to be ready) and wait for ``phase`` (bounded)."""
    applied = phase != "ready"
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(WAIT_S):
            while True:
                try:
                    if not applied:
                        await api.claims("tenant-a", "apply", _claim(claim).encode())
                        applied = True
                    view = (await api.claims("tenant-a", "get", {"name": claim}))["claim"]
                    if view["phase"] == phase:
                        return
                except ApiError:
                    raise
                except (CommandError, EndpointError):  # no API answers: it is starting again
                    pass
                await asyncio.sleep(0.1)
    raise AssertionError(f"claim {claim} never {phase}:\n{topo.logs()}")


async def _api_audited(api: ApiClient, claim: str, topo: Topology) -> list[dict[str, Any]]:
    """The claim's audit records once they hold its reservation (bounded)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(WAIT_S):
            while True:
                with contextlib.suppress(CommandError, EndpointError):  # (starting again)
                    found = await api.claims("tenant-a", "audit", {"claim": claim})
                    records: list[dict[str, Any]] = found["records"]
                    if any(r["decision"] == "capacity_reserved" for r in records):
                        return records
                await asyncio.sleep(0.1)
    raise AssertionError(f"no audit record of {claim}'s reservation:\n{topo.logs()}")


async def _owner(url: str) -> str:
    connection = await asyncpg.connect(url)
    try:
        user: str = await connection.fetchval("SELECT current_user")
        return user
    finally:
        await connection.close()


async def _audited(topo: Topology, claim: str) -> None:
    """The audit subscriber has recorded the claim's reservation (bounded)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(WAIT_S):
            while True:
                out = await topo.dracap("audit", "-n", "tenant-a", "--claim", claim, "-o", "json")
                if "capacity_reserved" in out:
                    return
                await asyncio.sleep(0.2)
    raise AssertionError(f"no audit record of {claim}'s reservation:\n{topo.logs()}")
