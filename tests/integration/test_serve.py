"""Every control-plane service as its own process, as a deployment runs them.

``dracap serve relay``, ``dracap serve claims --insecure``, ``dracap serve
reservation``, ``dracap serve enforcement --insecure``, ``dracap reclaim`` and ``dracap
agent`` (NATS only: no database URL, none in its environment) run as separate processes
against the real PostgreSQL and nats-server (one subject prefix for the test); the test
loads an inventory through the admin API and takes a claim through apply -> Ready ->
delete -> released.

The same with the broker's accounts (`dracap auth init`): each process logs in with its
own credential (``--creds``), as docker-compose.yml and deploy/kubernetes run them,
the enforcement service, the audit and billing subscribers and the agent included, and
a tenant reads its claim's audit trail; each process then answers ``/readyz`` 200 (its
checks, through the login it has), ``/healthz`` 200 and 404 on any other path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Final

import pytest

from services.brokerauth import Installation, init_auth
from services.exitcodes import ExitCode
from services.runtime.bus.apiclient import ApiClient, ApiError
from services.runtime.bus.credentials import AuthDir
from services.runtime.ground.settings import Settings
from services.runtime.ops.embedded import EmbeddedNats, free_port

ROOT = Path(__file__).resolve().parents[2]
DRIVER = "gpu.dracap.io"
NAMESPACE = "tenant-a"


def _inventory(devices: int = 1, memory: str = "40Gi") -> tuple[bytes, bytes]:
    device_class = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": DRIVER},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
    }
    rslice = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "node-a-gpus"},
        "spec": {
            "driver": DRIVER,
            "nodeName": "node-a",
            "pool": {"name": "node-a-gpus", "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": f"gpu-{i}",
                    "allowMultipleAllocations": True,
                    "capacity": {"memory": {"value": memory}},
                }
                for i in range(devices)
            ],
        },
    }
    return json.dumps(device_class).encode(), json.dumps(rslice).encode()


def _claim(name: str, memory: str = "10Gi") -> bytes:
    exactly = {"deviceClassName": DRIVER, "capacity": {"requests": {"memory": memory}}}
    return json.dumps(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
        }
    ).encode()


#: the line each service process logs once it runs
_STARTED: Final = re.compile(r" started( \(|$)", re.MULTILINE)


class Processes:
    def __init__(self, settings: Settings, nats_url: str, prefix: str, tmp: Path) -> None:
        self.settings, self.nats_url, self.prefix, self.tmp = settings, nats_url, prefix, tmp
        self.running: dict[str, asyncio.subprocess.Process] = {}
        self.commands: dict[str, list[str]] = {}
        self.env = {**os.environ, "DRACAP_APP_ROLE": settings.app_role}
        self.env.pop("DRACAP_NATS_CREDS", None)

    def argv(self, *words: str, database: bool = True, nats: bool = True) -> list[str]:
        out = [sys.executable, "-m", "services.cli", *words, "--data-dir", str(self.tmp / "d")]
        if database:
            out += ["--database-url", self.settings.database_url]
        if nats:
            out += ["--nats", self.nats_url, "--prefix", self.prefix]
        return out

    def without_database(self) -> dict[str, str]:
        """The environment less every database URL (a node agent's)."""
        return {k: v for k, v in self.env.items() if not k.startswith("DRACAP_DATABASE")}

    async def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.commands[name] = argv
        log = (self.tmp / f"{name}.log").open("wb")
        self.running[name] = await asyncio.create_subprocess_exec(
            *argv, cwd=ROOT, env=env or self.env, stdout=log, stderr=log
        )
        log.close()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
            for p in sorted(self.tmp.glob("*.log"))
        )

    async def started(self) -> None:
        """Wait until every process says it runs (a process told to stop while it still
        starts ends with 130, not 0: the teardown's clean exit is asked of running ones)."""
        name = ""
        try:
            async with asyncio.timeout(60):
                for name in self.running:
                    log = self.tmp / f"{name}.log"
                    while not _STARTED.search(log.read_text(errors="replace")):
                        if self.running[name].returncode is not None:
                            return  # ended early: the exit code tells
                        await asyncio.sleep(0.1)
        except TimeoutError:
            raise AssertionError(f"{name} never said it started\n{self.logs()}") from None

    async def stop(self) -> dict[str, int | None]:
        with contextlib.suppress(AssertionError):
            await self.started()
        for process in self.running.values():
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
        codes: dict[str, int | None] = {}
        for name, process in self.running.items():
            try:
                async with asyncio.timeout(30):
                    codes[name] = await process.wait()
            except TimeoutError:
                process.kill()
                codes[name] = await process.wait()
        return codes


@pytest.fixture
async def services(
    settings: Settings, nats_url: str, tmp_path: Path
) -> AsyncIterator[tuple[Processes, ApiClient]]:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    procs = Processes(settings, nats_url, prefix, tmp_path)
    await procs.start("relay", procs.argv("serve", "relay"))
    claims = procs.argv("serve", "claims", "--insecure", "--metrics-port", str(free_port()))
    await procs.start("claims", claims)
    await procs.start("reservation", procs.argv("serve", "reservation"))
    await procs.start("enforcement", procs.argv("serve", "enforcement", "--insecure"))
    await procs.start("reclaim", procs.argv("reclaim", "--poll", "0.2", nats=False))
    agent = procs.argv(
        "agent", "--node", "node-a", "--checkpoint", "none", "--metrics-port", "0", database=False
    )
    await procs.start("agent", agent, procs.without_database())
    try:
        async with ApiClient.connect(nats_url, prefix) as api:
            yield procs, api
    finally:
        codes = await procs.stop()
        assert all(code == 0 for code in codes.values()), (codes, procs.logs())


def _scrape(argv: list[str]) -> str:
    port = argv[argv.index("--metrics-port") + 1]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text: str = reply.read().decode()
        return text


async def _admin(api: ApiClient, op: str, body: Any) -> None:
    """Retry until the claims API process answers (it is starting)."""
    async with asyncio.timeout(60):
        while True:
            try:
                await api.admin(op, body)
                return
            except ApiError:
                raise
            except Exception:
                await asyncio.sleep(0.2)


async def _phase(api: ApiClient, name: str, want: str, procs: Processes) -> dict[str, Any]:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(60):
            while True:
                view: dict[str, Any] = (await api.claims(NAMESPACE, "get", {"name": name}))["claim"]
                if view["phase"] == want:
                    return view
                await asyncio.sleep(0.1)
    raise AssertionError(f"claim {name} never {want}:\n{procs.logs()}")


async def test_each_service_as_its_own_process_serves_the_claim_flow(
    services: tuple[Processes, ApiClient],
) -> None:
    procs, api = services
    device_class, rslice = _inventory()
    await _admin(api, "deviceclasses.apply", device_class)
    await api.admin("slices.apply", rslice)
    await api.admin("namespaces.access", {"namespace": NAMESPACE, "classes": ["*"]})
    await api.claims(NAMESPACE, "apply", _claim("train"))
    ready = await _phase(api, "train", "ready", procs)
    assert ready["shares"][0]["consumed"] == {"memory": "10Gi"}
    await api.claims(NAMESPACE, "delete", {"name": "train"})
    await _phase(api, "train", "released", procs)
    nodes = (await api.admin("nodes.list"))["nodes"]
    assert [(n["node"], n["lease"]) for n in nodes] == [("node-a", "live")]
    # the claims process serves the metrics derived from the log, per class
    text = await asyncio.to_thread(_scrape, procs.commands["claims"])
    assert f'dracap_claim_convergence_seconds_count{{class="{DRIVER}"}} 1.0' in text
    assert f'dracap_claim_decisions_total{{class="{DRIVER}",outcome="admitted"}} 1.0' in text
    assert f'dracap_capacity_allocated_ratio{{capacity="memory",class="{DRIVER}"}}' in text


async def test_the_claims_api_will_not_serve_anonymously_unless_told(
    settings: Settings, nats_url: str, tmp_path: Path
) -> None:
    procs = Processes(settings, nats_url, "tnoauth", tmp_path)
    done = await asyncio.create_subprocess_exec(
        *procs.argv("serve", "claims"), cwd=ROOT, env=procs.env, stderr=asyncio.subprocess.PIPE
    )
    _, err = await done.communicate()
    text = err.decode()
    assert done.returncode == ExitCode.BAD_INPUT and text.count("\n") == 1, text
    assert "directory" in text and "--insecure" in text


# --- with the broker's accounts: each service its own credential -----------------------------


@pytest.fixture
def secure_nats(tmp_path: Path) -> Iterator[tuple[str, AuthDir, str]]:
    """A nats-server with the accounts `dracap auth init` writes for node-a and tenant-a."""
    prefix = f"t{uuid.uuid4().hex[:10]}"
    auth = AuthDir(tmp_path / "d" / "auth")
    installation = Installation(prefix=prefix, namespaces={NAMESPACE: ["alice"]}, nodes=["node-a"])
    init_auth(auth, installation)
    server = EmbeddedNats(tmp_path, config=auth.accounts)
    url = server.start()
    try:
        yield url, auth, prefix
    finally:
        server.stop()


#: audit and billing as compose runs them (a process each) and as ``dracap up`` does (one)
LEDGERS: Final = {
    "apart": [("audit", ("audit", "serve")), ("usage", ("usage", "serve"))],
    "together": [("ledger", ("serve", "ledger"))],
}


@pytest.mark.parametrize("ledger", sorted(LEDGERS))
async def test_each_service_with_its_own_credential_serves_the_claim_flow(
    settings: Settings, secure_nats: tuple[str, AuthDir, str], tmp_path: Path, ledger: str
) -> None:
    url, auth, prefix = secure_nats
    procs = Processes(settings, url, prefix, tmp_path)

    def creds(name: str) -> list[str]:  # and a metrics port of its own: health endpoints
        path = str(auth.path / "creds" / f"{name}.nk")
        return ["--creds", path, "--metrics-port", str(free_port())]

    await procs.start("relay", [*procs.argv("serve", "relay"), *creds("service-relay")])
    await procs.start("claims", [*procs.argv("serve", "claims"), *creds("service-claims")])
    reservation = [*procs.argv("serve", "reservation"), *creds("service-reservation")]
    await procs.start("reservation", reservation)
    reclaim = procs.argv("reclaim", "--poll", "0.2", nats=False)
    await procs.start("reclaim", [*reclaim, "--metrics-port", str(free_port())])
    for name, command in LEDGERS[ledger]:
        await procs.start(name, [*procs.argv(*command), *creds("service-ledger")])
    enforcement = [*procs.argv("serve", "enforcement"), *creds("service-enforcement")]
    await procs.start("enforcement", enforcement)
    agent = procs.argv("agent", "--node", "node-a", "--checkpoint", "none", database=False)
    await procs.start("agent", [*agent, *creds("agent-node-a")], procs.without_database())
    try:
        async with ApiClient.connect(url, prefix, auth.operator()) as api:
            device_class, rslice = _inventory()
            await _admin(api, "deviceclasses.apply", device_class)
            await api.admin("slices.apply", rslice)
            await api.admin("namespaces.access", {"namespace": NAMESPACE, "classes": ["*"]})
        async with ApiClient.connect(url, prefix, auth.tenant(NAMESPACE, "alice")) as alice:
            await alice.claims(NAMESPACE, "apply", _claim("train"))
            await _phase(alice, "train", "ready", procs)
            audited = await _audited(alice, "train", procs)
            assert {r["actor"] for r in audited if r["decision"] == "submitted"} == {
                f"tenant:alice@{NAMESPACE}"
            }
            await alice.claims(NAMESPACE, "delete", {"name": "train"})
            await _phase(alice, "train", "released", procs)
        await _every_process_ready(procs)
        await procs.started()  # each said so in its log, as an operator reads it
    finally:
        codes = await procs.stop()
    assert all(code == 0 for code in codes.values()), (codes, procs.logs())
    assert "permissions violation" not in procs.logs().lower(), procs.logs()


def _get(port: str, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


async def _every_process_ready(procs: Processes) -> None:
    """Each process, with its own credential, is alive and ready on its metrics port: its
    servers answer (NATS through the login it has), its consumer pulls, its state is
    fresh; any other path is 404."""
    for name, argv in procs.commands.items():
        port = argv[argv.index("--metrics-port") + 1]
        answer: tuple[int, bytes] = (0, b"")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(60):
                while (answer := await asyncio.to_thread(_get, port, "/readyz"))[0] != 200:  # noqa: ASYNC110 (polls another process)
                    await asyncio.sleep(0.2)
        assert answer[0] == 200, (name, answer, procs.logs())
        ready = json.loads(answer[1])
        assert ready["ready"] is True and ready["down"] == [], (name, ready)
        status, body = await asyncio.to_thread(_get, port, "/healthz")
        assert status == 200 and json.loads(body)["alive"] is True, name
        assert (await asyncio.to_thread(_get, port, "/nope"))[0] == 404, name


async def _audited(api: ApiClient, claim: str, procs: Processes) -> list[dict[str, Any]]:
    """The claim's audit records once the audit subscriber has its reservation."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(60):
            while True:
                records: list[dict[str, Any]] = (
                    await api.claims(NAMESPACE, "audit", {"claim": claim})
                )["records"]
                if any(r["decision"] == "capacity_reserved" for r in records):
                    return records
                await asyncio.sleep(0.1)
    raise AssertionError(f"no audit of {claim}:\n{procs.logs()}")
