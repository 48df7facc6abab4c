"""``dracap claim ...`` / ``dracap devices`` against the real services, and ``dracap up``.

The first tests start the whole stack in-process (:class:`services.stack.Stack`) on the
test's own database and a unique subject prefix, load the example inventory through
the admin API, and drive it only through ``services.cli.main`` — as a user would.
The last ones run ``dracap up`` as a subprocess with no server URLs at all (embedded
servers under a temporary data directory): it stops on SIGINT and starts again, and each
service connects to the embedded PostgreSQL as its own database user.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import kubernetes_validate
import msgspec
import pytest

from events import model
from events.subjects import BusNames
from services import cli
from services.claims import adminwrites
from services.commands.up import READY_LINE
from services.exitcodes import CommandError, ExitCode
from services.runtime.bus.apiclient import ApiClient, ApiError
from services.runtime.bus.jetstream import connect_bus
from services.runtime.ground.settings import Settings
from services.runtime.store.dbroles import url_as
from services.stack import Stack, load_inventory, read_inventory
from tests.fixtures.services import database_url_for

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "deploy" / "examples"

TRAIN_SMALL = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: train-small, namespace: tenant-a}
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: gpu-memory.dracap.io
          capacity: {requests: {memory: 10Gi}}
"""


@pytest.fixture
async def stack_flags(settings: Settings, nats_url: str) -> AsyncIterator[list[str]]:
    """The stack running in-process; yields the CLI flags that reach it."""
    names = BusNames(prefix=f"t{uuid.uuid4().hex[:10]}")
    inventory = read_inventory([str(EXAMPLES)])
    async with Stack.running(
        msgspec.structs.replace(settings, nats_url=nats_url),
        names,
        nodes=inventory.nodes,
        workers=2,
    ):
        async with ApiClient.connect(nats_url, names.prefix) as api:
            assert await load_inventory(api, inventory) == len(inventory.slices)
            assert await load_inventory(api, inventory) == 0  # already loaded
        yield ["--nats", nats_url, "--prefix", names.prefix]
    nc, js = await connect_bus(nats_url)  # the test's stream goes with it
    try:
        await js.delete_stream(names.stream)
    finally:
        await nc.close()


async def dracap(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """Run ``dracap ARGV`` (in a thread: the CLI runs its own event loop)."""
    capsys.readouterr()
    code = await asyncio.to_thread(cli.main, list(argv))
    return code, capsys.readouterr().out


def _gpu0(devices: list[dict[str, Any]]) -> dict[str, Any]:
    found = [d for d in devices if d["pool"] == "node-a-gpus" and d["device"] == "gpu-0"]
    assert len(found) == 1, devices
    return found[0]


async def test_apply_get_delete_gives_capacity_back(
    stack_flags: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    manifest = tmp_path / "claim.yaml"
    manifest.write_text(TRAIN_SMALL)
    code, out = await dracap(capsys, "claim", "apply", "-f", str(manifest), "--wait", *stack_flags)
    assert code == 0, out
    assert "ready" in out

    code, out = await dracap(
        capsys, "claim", "get", "train-small", "-n", "tenant-a", "-o", "json", *stack_flags
    )
    assert code == 0
    resource = json.loads(out)
    assert resource["apiVersion"] == "resource.k8s.io/v1" and resource["kind"] == "ResourceClaim"
    assert resource["status"]["allocation"]["devices"]["results"]
    [status] = resource["status"]["devices"]
    [condition] = status["conditions"]
    assert condition["type"] == "Ready" and condition["status"] == "True", condition
    view = resource.pop("dracap")  # dracap's own view; the rest is the 1.34 object
    kubernetes_validate.validate(resource, "1.34.0", strict=True)
    assert view["phase"] == "ready" and view["ready"] is True
    [share] = view["shares"]
    assert share["share_id"] and share["consumed"] == {"memory": "10Gi"}

    code, out = await dracap(capsys, "claim", "get", "train-small", "-n", "tenant-a", *stack_flags)
    assert code == 0 and share["share_id"] in out and "memory=10Gi" in out

    code, out = await dracap(capsys, "devices", "-o", "json", *stack_flags)
    assert code == 0
    assert _gpu0(json.loads(out))["capacity"]["memory"]["consumed"] == "10Gi"

    code, out = await dracap(
        capsys, "claim", "delete", "train-small", "-n", "tenant-a", *stack_flags
    )
    assert code == 0, out
    deadline = time.monotonic() + 60
    while True:
        code, out = await dracap(capsys, "devices", "-o", "json", *stack_flags)
        memory = _gpu0(json.loads(out))["capacity"]["memory"]
        if memory["consumed"] in ("0", "0Gi") or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert memory["consumed"] in ("0", "0Gi") and memory["free"] == memory["total"]

    code, out = await dracap(capsys, "devices", *stack_flags)
    assert code == 0 and "node-a-gpus/gpu-0" in out and "memory" in out


async def test_exit_codes(
    stack_flags: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _ = await dracap(capsys, "claim", "get", "nope", "-n", "tenant-a", *stack_flags)
    assert code == ExitCode.NOT_FOUND
    code, _ = await dracap(capsys, "claim", "delete", "nope", "-n", "tenant-a", *stack_flags)
    assert code == ExitCode.NOT_FOUND

    outsider = tmp_path / "outsider.yaml"  # a namespace without access to any class
    outsider.write_text(TRAIN_SMALL.replace("tenant-a", "tenant-z"))
    code, out = await dracap(capsys, "claim", "apply", "-f", str(outsider), *stack_flags)
    assert code == ExitCode.REJECTED, out

    broken = tmp_path / "broken.yaml"
    broken.write_text("kind: ResourceClaim\nmetadata: [")
    code, _ = await dracap(capsys, "claim", "apply", "-f", str(broken), *stack_flags)
    assert code == ExitCode.BAD_INPUT


async def test_list_and_watch(
    stack_flags: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    manifest = tmp_path / "claim.yaml"
    manifest.write_text(TRAIN_SMALL)
    code, _ = await dracap(capsys, "claim", "apply", "-f", str(manifest), "--wait", *stack_flags)
    assert code == 0
    code, out = await dracap(capsys, "claim", "list", "-n", "tenant-a", "-o", "yaml", *stack_flags)
    assert code == 0 and "name: train-small" in out
    watch = ("claim", "watch", "train-small", "-n", "tenant-a", "-o", "json", "--timeout", "0.5")
    code, out = await dracap(capsys, *watch, *stack_flags)
    assert code == 0
    assert json.loads(out.splitlines()[0])["phase"] == "ready"


# --- rejections, deletes, inventory updates, oversized requests ------------------------------

MEMORY_FIELD = "spec.devices.requests[0].exactly.capacity.requests[memory]"


async def dracap_err(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """:func:`dracap`, with stderr too."""
    capsys.readouterr()
    code = await asyncio.to_thread(cli.main, list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


async def test_a_claim_above_the_maximum_is_rejected_naming_field_and_rule_once(
    stack_flags: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    manifest = tmp_path / "big.yaml"
    manifest.write_text(TRAIN_SMALL.replace("train-small", "too-big").replace("10Gi", "45Gi"))
    code, _, err = await dracap_err(capsys, "claim", "apply", "-f", str(manifest), *stack_flags)
    assert code == ExitCode.REJECTED, err
    assert err.count(MEMORY_FIELD) == 1 and "at most 40Gi" in err and "45Gi" in err
    get = ("claim", "get", "too-big", "-n", "tenant-a")
    code, out, _ = await dracap_err(capsys, *get, "-o", "json", *stack_flags)
    view = json.loads(out)["dracap"]
    assert view["phase"] == "rejected"
    assert view["reason"].count(MEMORY_FIELD) == 1 and view["reason"].count("at most 40Gi") == 1
    code, out, _ = await dracap_err(capsys, *get, *stack_flags)
    assert out.count(MEMORY_FIELD) == 1


async def _phase(capsys: pytest.CaptureFixture[str], flags: list[str], name: str) -> str:
    code, out = await dracap(capsys, "claim", "get", name, "-n", "tenant-a", "-o", "json", *flags)
    assert code == 0, out
    phase: str = json.loads(out)["dracap"]["phase"]
    return phase


async def test_a_second_delete_answers_the_phase(
    stack_flags: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    manifest = tmp_path / "claim.yaml"
    manifest.write_text(TRAIN_SMALL)
    code, _ = await dracap(capsys, "claim", "apply", "-f", str(manifest), "--wait", *stack_flags)
    assert code == 0
    delete = ["claim", "delete", "train-small", "-n", "tenant-a", *stack_flags]
    codes = await asyncio.gather(*(asyncio.to_thread(cli.main, delete) for _ in range(2)))
    assert codes == [0, 0]
    deadline = time.monotonic() + 60
    while await _phase(capsys, stack_flags, "train-small") != "released":
        assert time.monotonic() < deadline, "the claim was not released"
        await asyncio.sleep(0.05)
    code, out = await dracap(capsys, *delete, "-o", "json")  # long after: still not "not found"
    assert code == 0, out
    assert json.loads(out)["phase"] == "released"
    code, _ = await dracap(capsys, "claim", "delete", "never-was", "-n", "tenant-a", *stack_flags)
    assert code == ExitCode.NOT_FOUND


def _shrunk_slice(pool: str, device: str, memory: str) -> bytes:
    """The example ResourceSlice of ``pool`` with ``device``'s memory total set to ``memory``."""
    [rslice] = [s for s in read_inventory([str(EXAMPLES)]).slices if s.spec.pool.name == pool]
    data = model.to_builtins(rslice)
    for entry in data["spec"]["devices"]:
        if entry["name"] == device:
            entry["capacity"]["memory"] = {"value": memory}
    return json.dumps(data).encode()


async def _slice_update_is_rejected(
    stack_flags: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    manifest = tmp_path / "claim.yaml"
    manifest.write_text(TRAIN_SMALL)
    code, _ = await dracap(capsys, "claim", "apply", "-f", str(manifest), "--wait", *stack_flags)
    assert code == 0
    code, out = await dracap(
        capsys, "claim", "get", "train-small", "-n", "tenant-a", "-o", "json", *stack_flags
    )
    [share] = json.loads(out)["dracap"]["shares"]
    nats_url, prefix = stack_flags[1], stack_flags[3]
    async with ApiClient.connect(nats_url, prefix) as api:
        shrunk = _shrunk_slice(share["pool"], share["device"], "5Gi")
        with pytest.raises(ApiError) as caught:
            await api.admin("slices.apply", shrunk)
        devices = (await api.admin("devices.list"))["devices"]
    error = caught.value
    assert error.code == "rejected" and error.exit_code == ExitCode.REJECTED
    assert re.fullmatch(r"spec\.devices\[\d+\]\.capacity\[memory\]\.value", error.field or "")
    message = str(error)
    assert f"{share['pool']}/{share['device']} memory" in message
    assert "total 5Gi asked, 10Gi allocated" in message
    assert "INSERT" not in message and "capacity_ledger" not in message
    [held] = [d for d in devices if (d["pool"], d["device"]) == (share["pool"], share["device"])]
    assert held["capacity"]["memory"]["total"] == "40Gi"  # nothing was recorded


async def test_shrinking_a_device_below_its_allocation_is_rejected(
    stack_flags: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    await _slice_update_is_rejected(stack_flags, capsys, tmp_path)
    nats_url, prefix = stack_flags[1], stack_flags[3]
    async with ApiClient.connect(nats_url, prefix) as api:  # an invalid one: said once too
        with pytest.raises(ApiError) as caught:
            await api.admin("slices.apply", _shrunk_slice("node-a-gpus", "gpu-0", "5 GiB"))
    field = "spec.devices[0].capacity[memory].value"
    assert caught.value.code == "invalid" and str(caught.value).count(field) == 1


async def test_the_ledger_refusing_a_shrink_is_the_same_rejection(
    stack_flags: list[str],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a reservation committed after the API decided: the first check sees the state from
    # before it (None), so the capacity ledger's CHECK is what refuses the append
    real = adminwrites.below_allocated
    seen: list[int] = []

    def stale_first(state: Any, slices: Any) -> Any:
        seen.append(1)
        return None if len(seen) == 1 else real(state, slices)

    monkeypatch.setattr(adminwrites, "below_allocated", stale_first)
    await _slice_update_is_rejected(stack_flags, capsys, tmp_path)
    assert len(seen) == 2


async def test_a_request_above_the_servers_max_payload_is_bad_input(nats_url: str) -> None:
    async with ApiClient.connect(nats_url, f"t{uuid.uuid4().hex[:10]}") as api:
        with pytest.raises(CommandError) as caught:
            await api.admin("slices.apply", b"x" * (api.nc.max_payload + 1))
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert "max_payload" in str(caught.value)


# --- finding the database -----------------------------------------------------------------


@pytest.fixture
def no_server_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DRACAP_DATABASE_URL", raising=False)
    monkeypatch.delenv("DRACAP_NATS_URL", raising=False)


@pytest.mark.usefixtures("no_server_variables")
async def test_replay_verify_and_db_read_the_connection_file(
    database_url: str, nats_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    connection = {"database_url": database_url, "nats_url": nats_url}
    (tmp_path / "connection.json").write_text(json.dumps(connection))
    code, out = await dracap(capsys, "db", "current", "--data-dir", str(tmp_path))
    assert code == 0 and out.strip() not in ("", "base")
    code, out = await dracap(capsys, "replay", "verify", "--data-dir", str(tmp_path))
    assert code == 0 and "OK" in out


@pytest.mark.usefixtures("no_server_variables")
async def test_a_missing_database_or_schema_is_one_line(
    postgres_admin_url: str, empty_database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = database_url_for(postgres_admin_url, f"dracap_gone_{uuid.uuid4().hex[:8]}")
    for url, says in ((missing, "does not exist"), (empty_database_url, "dracap db upgrade")):
        code, out, err = await dracap_err(capsys, "replay", "verify", "--database-url", url)
        assert code == ExitCode.ERROR and out == ""
        assert err.count("\n") == 1 and err.startswith("error: PostgreSQL at ") and says in err


# --- dracap up as a user runs it ----------------------------------------------------------


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRACAP_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _start_up(data_dir: Path, *extra: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "services.cli", "up", "--data-dir", str(data_dir)]
    command += ["--inventory", str(EXAMPLES), "--metrics-port", "0", *extra]
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env=_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for_ready(process: subprocess.Popen[str], timeout: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith(READY_LINE):
            return lines
    process.kill()
    raise AssertionError("dracap up did not get ready:\n" + "".join(lines))


def _stop(process: subprocess.Popen[str]) -> str:
    process.send_signal(signal.SIGINT)
    try:
        rest, _ = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    assert process.returncode == 0, rest
    return rest


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *argv],
        cwd=ROOT,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_dracap_up_stops_cleanly_and_resumes(tmp_path: Path) -> None:
    data_dir = tmp_path / "dracap"
    manifest = tmp_path / "claim.yaml"
    manifest.write_text(TRAIN_SMALL)

    process = _start_up(data_dir)
    try:
        lines = _wait_for_ready(process, 45)
        assert any("inventory:" in line and "loaded" in line for line in lines)
        connection = json.loads((data_dir / "connection.json").read_text())
        assert connection["nats_url"].startswith("nats://127.0.0.1:")
        applied = _cli("claim", "apply", "-f", str(manifest), "--wait", "--data-dir", str(data_dir))
        assert applied.returncode == 0, applied.stderr + applied.stdout
    finally:
        rest = _stop(process)
    assert "stopped" in rest
    assert not (data_dir / "postgres" / "postmaster.pid").exists()

    process = _start_up(data_dir)
    try:
        lines = _wait_for_ready(process, 45)
        assert any("inventory: already loaded" in line for line in lines)
        got = _cli(
            "claim",
            "get",
            "train-small",
            "-n",
            "tenant-a",
            "-o",
            "json",
            "--data-dir",
            str(data_dir),
        )
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout)["dracap"]["phase"] == "ready"
    finally:
        _stop(process)


def test_dracap_up_is_secure_unless_told_insecure_and_then_says_so(tmp_path: Path) -> None:
    data_dir = tmp_path / "dracap"
    process = _start_up(data_dir)
    try:
        text = "".join(_wait_for_ready(process, 45))
        connection = json.loads((data_dir / "connection.json").read_text())
        assert connection["creds"].endswith("operator-operator.nk")
        assert "INSECURE" not in text and "access      credentials in" in text
    finally:
        _stop(process)
    process = _start_up(data_dir, "--insecure")
    try:
        text = "".join(_wait_for_ready(process, 45))
        assert text.count("INSECURE") >= 2  # the warning at start and the banner's line
        assert json.loads((data_dir / "connection.json").read_text())["creds"] is None
        listed = _cli("claim", "list", "-n", "tenant-a", "--data-dir", str(data_dir))
        assert listed.returncode == 0, listed.stderr
    finally:
        _stop(process)


def _sessions(admin_url: str) -> dict[str, bool]:
    """Every client session of the server but this one's: user -> whether a superuser."""

    async def users() -> dict[str, bool]:
        connection = await asyncpg.connect(admin_url)
        try:
            rows = await connection.fetch(
                "SELECT DISTINCT a.usename, r.rolsuper FROM pg_stat_activity a "
                "JOIN pg_roles r ON r.rolname = a.usename "
                "WHERE a.backend_type = 'client backend' AND a.pid <> pg_backend_pid()"
            )
            return {row[0]: row[1] for row in rows}
        finally:
            await connection.close()

    return asyncio.run(users())


def _login(url: str) -> tuple[str, bool]:
    """Log in with ``url``: the session's user, and whether it may update events."""

    async def check() -> tuple[str, bool]:
        connection = await asyncpg.connect(url)
        try:
            user: str = await connection.fetchval("SELECT session_user")
            may: bool = await connection.fetchval("SELECT has_table_privilege('events', 'UPDATE')")
            return user, may
        finally:
            await connection.close()

    return asyncio.run(check())


def test_dracap_up_connects_each_service_as_its_own_database_user(tmp_path: Path) -> None:
    data_dir = tmp_path / "dracap"
    process = _start_up(data_dir)
    try:
        lines = _wait_for_ready(process, 45)
        admin_url = json.loads((data_dir / "connection.json").read_text())["database_url"]
        users_file = data_dir / "database-users.json"
        assert stat.S_IMODE(users_file.stat().st_mode) == 0o600
        users = json.loads(users_file.read_text())
        kinds = ("claims", "reservation", "relay", "snapshots", "enforcement")
        expected = {f"dracap_{kind}_login" for kind in kinds}
        expected |= {"dracap_readonly_login"}
        sessions = _sessions(admin_url)
        assert expected <= set(sessions)
        assert not [u for u in sessions if u.startswith("dracap_node_")], "agents have no login"
        # the superuser provisioned and left: nothing dracap up runs (health probe
        # included) is connected as it (finding 11)
        assert not [user for user, superuser in sessions.items() if superuser]
        relay = users["services"]["relay"]
        own = url_as(admin_url, relay["user"], relay["password"])
        assert _login(own) == ("dracap_relay_login", False)
        with pytest.raises(asyncpg.InvalidPasswordError):
            _login(url_as(admin_url, relay["user"], "not-the-password"))
        with pytest.raises(asyncpg.InvalidPasswordError):
            _login(url_as(admin_url, relay["user"], None))
    finally:
        rest = _stop(process)
    passwords = [u["password"] for u in users["services"].values()]
    assert "nodes" not in users  # node agents have no database user
    logs = "".join(lines) + rest + (data_dir / "postgres.log").read_text()
    logs += (data_dir / "connection.json").read_text()
    assert not [p for p in passwords if p in logs]
