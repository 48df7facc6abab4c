"""The deployment files: docker-compose.yml and the Dockerfile (no Docker engine needed).

The compose file validates against the Compose Specification's JSON schema; every
long-running service has a health check and a restart policy; every dracap command it
runs parses with dracap's own command line (so a renamed flag breaks this test, not a
deployment); the Dockerfile builds from the project's own files and runs unprivileged.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from services import cli

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "tests" / "fixtures" / "compose" / "compose-spec.json"
_DEFAULT = re.compile(r"\$\{[A-Z_]+:-([^}]*)\}")


def _compose() -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert isinstance(doc, dict)
    return doc


def test_the_compose_file_follows_the_compose_specification() -> None:
    schema = json.loads(SCHEMA.read_text())  # draft-07, whatever its $schema URI says
    jsonschema.Draft7Validator(schema).validate(_compose())


def test_every_service_has_a_health_check_and_one_shots_do_not_restart() -> None:
    services = _compose()["services"]
    for name, service in services.items():
        assert "healthcheck" in service, f"{name} has no health check"
        restart = service.get("restart", "no")
        one_shot = any(
            dep.get("condition") == "service_completed_successfully"
            for other in services.values()
            for dep_name, dep in (other.get("depends_on") or {}).items()
            if dep_name == name
        )
        assert restart == ("no" if one_shot else "unless-stopped"), name


def test_every_dracap_service_is_healthy_when_its_readyz_says_so() -> None:
    """A dracap container with a metrics port is healthy when ``/readyz`` on that port
    answers 200 (its checks pass), not when ``/metrics`` answers (it always does)."""
    for name, service in _compose()["services"].items():
        command = [str(word) for word in service.get("command", [])]
        if (
            not str(service.get("image", "")).startswith("dracap")
            or "--metrics-port" not in command
        ):
            continue
        port = command[command.index("--metrics-port") + 1]
        test = " ".join(service["healthcheck"]["test"])
        assert f"http://127.0.0.1:{port}/readyz" in test, name


def _dracap_commands() -> list[tuple[str, list[str]]]:
    out = []
    for name, service in _compose()["services"].items():
        if str(service.get("image", "")).startswith("dracap"):
            argv = [_DEFAULT.sub(r"\1", str(word)) for word in service["command"]]
            out.append((name, argv))
    return out


@pytest.mark.parametrize(("name", "argv"), _dracap_commands(), ids=lambda v: str(v)[:20])
def test_every_dracap_command_of_the_compose_file_exists(name: str, argv: list[str]) -> None:
    parser = cli.build_parser(argv)
    args = parser.parse_args(argv)
    assert callable(args.func), name


def test_the_image_is_built_from_the_projects_files_and_runs_unprivileged() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = re.findall(r"^COPY (?!--from)(\S+)", dockerfile, re.M)
    assert copied and all((ROOT / path).exists() for path in copied)
    assert re.search(r"^USER dracap$", dockerfile, re.M)
    assert 'ENTRYPOINT ["dracap"]' in dockerfile


def test_the_image_builds_where_a_docker_engine_answers() -> None:
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "info"], capture_output=True).returncode:
        pytest.skip("no Docker engine on this machine: the image build is not tried here")
    built = subprocess.run(
        [docker, "build", "-q", "-t", "dracap:test", str(ROOT)], capture_output=True, text=True
    )
    assert built.returncode == 0, built.stderr[-2000:]
    ran = subprocess.run(
        [docker, "run", "--rm", "dracap:test", "serve", "--help"], capture_output=True, text=True
    )
    assert ran.returncode == 0 and "relay" in ran.stdout


PROMETHEUS = ROOT / "deploy" / "prometheus"


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return promtool


def test_the_rules_pass_promtool_and_their_unit_tests() -> None:
    promtool = _promtool()
    checked = subprocess.run(
        [promtool, "check", "rules", "rules.yaml"], cwd=PROMETHEUS, capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run(
        [promtool, "test", "rules", "rules.test.yaml"],
        cwd=PROMETHEUS,
        capture_output=True,
        text=True,
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    rules = yaml.safe_load((PROMETHEUS / "rules.yaml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load((PROMETHEUS / "rules.test.yaml").read_text())["tests"]
    cases = [case for test in tests for case in test["alert_rule_test"]]
    fired = {c["alertname"] for c in cases if c["exp_alerts"]}
    quiet = {c["alertname"] for c in cases if not c["exp_alerts"]}
    assert alerts <= quiet, f"never tested quiet: {alerts - quiet}"
    assert alerts <= fired, f"never tested firing: {alerts - fired}"


def test_the_kubernetes_rule_carries_the_same_groups() -> None:
    monitoring = ROOT / "deploy" / "kubernetes" / "base" / "monitoring.yaml"
    [rule] = [
        doc
        for doc in yaml.safe_load_all(monitoring.read_text())
        if doc and doc.get("kind") == "PrometheusRule"
    ]
    assert (
        rule["spec"]["groups"] == yaml.safe_load((PROMETHEUS / "rules.yaml").read_text())["groups"]
    )


def test_the_dashboard_parses_and_uses_only_recorded_series_that_exist() -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dracap.json").read_text())
    assert dashboard["uid"] == "dracap" and dashboard["panels"]
    recorded = {
        r["record"]
        for g in yaml.safe_load((PROMETHEUS / "rules.yaml").read_text())["groups"]
        for r in g["rules"]
        if "record" in r
    }
    for panel in dashboard["panels"]:
        assert panel["title"] and panel["targets"], panel.get("title")
        for target in panel["targets"]:
            for name in re.findall(r"\bdracap:[a-z_0-9:]+", target["expr"]):
                assert name in recorded, f"{panel['title']}: {name} is not a recording rule"


def test_every_file_the_compose_file_mounts_exists() -> None:
    for name, service in _compose()["services"].items():
        for volume in service.get("volumes", []):
            source = str(volume).split(":", 1)[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which is missing"
    scraped = yaml.safe_load((ROOT / "deploy" / "compose" / "prometheus.yml").read_text())
    targets = {t.split(":")[0] for job in scraped["scrape_configs"] for c in job["static_configs"]
               for t in c["targets"]}  # fmt: skip
    services = _compose()["services"]
    long_running = {n for n, s in services.items() if str(s.get("image", "")).startswith("dracap")
                    and "--metrics-port" in s.get("command", [])}  # fmt: skip
    assert long_running - {"agent"} <= targets, "every dracap service is scraped"
    for name in long_running:
        assert "0.0.0.0" in services[name]["command"], f"{name}'s metrics bind to loopback"
