"""Every command finds its servers the same way, and says in one line when it cannot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services import cli
from services.exitcodes import ExitCode
from services.runtime.bus import endpoints
from services.runtime.bus.endpoints import (
    ConnectionFileError,
    NoEndpoint,
    ServerUnavailable,
    reaching,
    resolve_endpoints,
)
from services.runtime.ground.settings import ServiceKind, Settings

SAVED = {"database_url": "postgresql://up/db", "nats_url": "nats://up:1", "prefix": "p"}
#: Nothing listens on port 1 of the loopback address.
DEAD_PG = "postgresql://postgres@127.0.0.1:1/x"
DEAD_NATS = "nats://127.0.0.1:1"


@pytest.fixture(autouse=True)
def _no_server_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DRACAP_DATABASE_URL", raising=False)
    monkeypatch.delenv("DRACAP_NATS_URL", raising=False)


def _save(data_dir: Path, content: object) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    text = content if isinstance(content, str) else json.dumps(content)
    (data_dir / "connection.json").write_text(text)


def test_flag_then_environment_then_connection_file(tmp_path: Path) -> None:
    _save(tmp_path, SAVED)
    saved = resolve_endpoints(tmp_path, env={})
    assert (saved.database(), saved.nats(), saved.prefix) == (
        "postgresql://up/db",
        "nats://up:1",
        "p",
    )
    env = {"DRACAP_DATABASE_URL": "postgresql://env/db", "DRACAP_NATS_URL": "nats://env:2"}
    from_env = resolve_endpoints(tmp_path, env=env)
    assert (from_env.database(), from_env.nats(), from_env.prefix) == (
        "postgresql://env/db",
        "nats://env:2",
        "p",
    )
    flags = resolve_endpoints(
        tmp_path, database_url="postgresql://f/db", nats_url="nats://f:3", prefix="q", env=env
    )
    assert (flags.database(), flags.nats(), flags.prefix) == (
        "postgresql://f/db",
        "nats://f:3",
        "q",
    )


def test_a_service_kinds_own_url_comes_right_after_the_flag(tmp_path: Path) -> None:
    _save(tmp_path, SAVED)
    env = {
        "DRACAP_DATABASE_URL": "postgresql://env/db",
        "DRACAP_DATABASE_URL_ENFORCEMENT": "postgresql://enforcement:pw@env/db",
    }
    base = Settings(app_role="dracap_app")
    own = resolve_endpoints(tmp_path, env=env, service=ServiceKind.ENFORCEMENT)
    settings = own.settings(base)
    assert (settings.database_url, settings.app_role) == ("postgresql://enforcement:pw@env/db", "")
    for other in (
        resolve_endpoints(tmp_path, env=env),
        resolve_endpoints(tmp_path, env=env, service=ServiceKind.READONLY),
    ):
        settings = other.settings(base)
        assert (settings.database_url, settings.app_role) == ("postgresql://env/db", "dracap_app")
    flag = resolve_endpoints(
        tmp_path, database_url="postgresql://f/db", env=env, service=ServiceKind.ENFORCEMENT
    )
    assert (flag.settings(base).database_url, flag.settings(base).app_role) == (
        "postgresql://f/db",
        "dracap_app",
    )


def test_a_service_kinds_login_file_comes_after_its_variable(tmp_path: Path) -> None:
    """`dracap db logins` writes <data-dir>/database/<kind>.url: the kind's own login,
    before the installation-wide URL; the flag and DRACAP_DATABASE_URL_<KIND> first."""
    (tmp_path / "database").mkdir()
    (tmp_path / "database" / "relay.url").write_text("postgresql://relay_login:pw@pg/db")
    env = {"DRACAP_DATABASE_URL": "postgresql://owner@pg/db"}
    base = Settings(app_role="dracap_app")
    own = resolve_endpoints(tmp_path, env=env, service=ServiceKind.RELAY).settings(base)
    assert (own.database_url, own.app_role) == ("postgresql://relay_login:pw@pg/db", "")
    other = resolve_endpoints(tmp_path, env=env, service=ServiceKind.CLAIMS).settings(base)
    assert other.database_url == "postgresql://owner@pg/db"
    variable = {**env, "DRACAP_DATABASE_URL_RELAY": "postgresql://v@pg/db"}
    assert resolve_endpoints(tmp_path, env=variable, service=ServiceKind.RELAY).database_url == (
        "postgresql://v@pg/db"
    )
    flag = resolve_endpoints(
        tmp_path, database_url="postgresql://f/db", env=env, service=ServiceKind.RELAY
    )
    assert (flag.database_url, flag.own_user) == ("postgresql://f/db", False)


def test_a_login_file_that_is_no_url_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "database").mkdir()
    (tmp_path / "database" / "reclamation.url").write_text("not a url")
    code = cli.main(["reclaim", "--data-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == ExitCode.BAD_INPUT and err.count("\n") == 1, err
    assert "reclamation.url" in err and "dracap db logins" in err


def test_a_service_without_a_url_is_told_of_db_logins(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["reclaim", "--data-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == ExitCode.ERROR and err.count("\n") == 1, err
    assert "dracap db logins" in err


def test_no_built_in_address(tmp_path: Path) -> None:
    found = resolve_endpoints(tmp_path / "none", env={})
    assert found.prefix == "dracap"
    with pytest.raises(NoEndpoint, match=r"--database-url.*DRACAP_DATABASE_URL.*connection\.json"):
        found.database()
    with pytest.raises(NoEndpoint, match=r"--nats.*DRACAP_NATS_URL"):
        found.nats()


def test_connection_file_is_read_only_when_needed(tmp_path: Path) -> None:
    _save(tmp_path, "{not json")
    given = resolve_endpoints(
        tmp_path, database_url="postgresql://f/db", nats_url="nats://f:3", prefix="q", env={}
    )
    assert given.database() == "postgresql://f/db"
    with pytest.raises(ConnectionFileError, match=r"connection\.json"):
        resolve_endpoints(tmp_path, env={})
    assert resolve_endpoints(tmp_path, saved=False, env={}).database_url is None


@pytest.mark.parametrize(
    "argv",
    [
        ["replay", "verify"],
        ["db", "current"],
        ["db", "upgrade"],
        ["claim", "get", "x"],
        ["devices"],
    ],
)
def test_every_command_reads_the_connection_file_of_data_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    # connection.json names servers that do not answer: each command must try exactly those
    _save(tmp_path, {**SAVED, "database_url": DEAD_PG, "nats_url": DEAD_NATS})
    assert cli.main([*argv, "--data-dir", str(tmp_path)]) == ExitCode.ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert "127.0.0.1:1" in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["replay", "verify"], ["db", "current"], ["devices"]])
def test_no_server_anywhere_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    assert cli.main([*argv, "--data-dir", str(tmp_path)]) == ExitCode.ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no " in err and "URL" in err


def test_an_unreadable_connection_file_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(tmp_path, "{not json")
    assert cli.main(["replay", "verify", "--data-dir", str(tmp_path)]) == ExitCode.BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "connection.json" in err


def test_reaching_names_the_server_without_its_password() -> None:
    with (
        pytest.raises(ServerUnavailable) as caught,
        reaching("PostgreSQL", "postgresql://u:s3cret@h/db"),
    ):
        raise ConnectionRefusedError(111, "Connect call failed")
    message = str(caught.value)
    assert message.startswith("PostgreSQL at postgresql://u:***@h/db: ")
    assert "s3cret" not in message
    with pytest.raises(KeyError), reaching("NATS", DEAD_NATS):  # a bug is not "unavailable"
        raise KeyError("x")


def test_redact() -> None:
    assert endpoints.redact("postgresql://u:pw@h:5432/db") == "postgresql://u:***@h:5432/db"
    assert endpoints.redact("postgresql://u@h/db") == "postgresql://u@h/db"
    assert endpoints.redact("nats://h:4222") == "nats://h:4222"


def test_the_nats_login_is_flag_then_variable_then_the_saved_one(tmp_path: Path) -> None:
    _save(tmp_path, {**SAVED, "creds": "/up/operator.creds"})
    env = {"DRACAP_NATS_CREDS": "/env.creds"}
    assert resolve_endpoints(tmp_path, creds="/flag.creds", env=env).creds == "/flag.creds"
    assert resolve_endpoints(tmp_path, env=env).creds == "/env.creds"
    assert resolve_endpoints(tmp_path, env={}).creds == "/up/operator.creds"
    # the saved login belongs to the saved server, not to another one named by a flag
    assert resolve_endpoints(tmp_path, nats_url="nats://other:2", env={}).creds is None
    assert resolve_endpoints(tmp_path, nats_url="nats://up:1", env={}).creds == "/up/operator.creds"
