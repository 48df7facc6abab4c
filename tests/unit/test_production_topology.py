"""deploy/kubernetes/overlays/production: a control plane that survives losing a machine.

The overlay is rendered as ``tests/unit/test_kubernetes_manifests.py`` renders every
overlay (and there compared with ``kubectl kustomize`` and validated against the 1.34
schemas); this module checks what makes it a production topology (issue 29):

* every dracap Deployment runs two replicas or more, spread over nodes (at most one
  more on a node than on another: ``DoNotSchedule``), with a PodDisruptionBudget whose
  selector matches its pods and that keeps one of them running through a drain;
* NATS is a StatefulSet of three nats-servers, routed to every peer through its
  headless Service, JetStream on a persistent volume that bounds its store, the
  accounts of ``dracap auth init`` included, never two on one node, a budget that keeps
  the quorum; and the very nats-server version of the image accepts the configuration
  (``-t``) with a real ``accounts.conf``;
* PostgreSQL is a CloudNativePG ``Cluster`` of three instances on distinct nodes with
  quorum synchronous replication that never gives durability up (``dataDurability:
  required``), its owner's Secret naming its owner;
* each dracap container's environment — the ConfigMaps it reads whole, its own
  variables and the production template's Secret — loads with dracap's own
  :func:`~services.runtime.ground.settings.load_settings`: every NATS server of the
  StatefulSet, the stream on as many replicas as there are servers, and each service
  kind's database URL naming both of the Cluster's Services with
  ``target_session_attrs=read-write``, as the documented ``dracap db logins --url-host``
  writes them.

Each check is a function that raises ``AssertionError``; each has a test that breaks a
loaded manifest and sees the check fail. What only a real cluster shows (the operator
accepting the Cluster, pods scheduled, a failover) is said in docs/operations.md.
"""

from __future__ import annotations

import copy
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from events.quantities import parse_quantity
from services.brokerauth import Installation, init_auth
from services.runtime.bus.credentials import AuthDir
from services.runtime.ground.settings import ServiceKind, load_settings
from services.runtime.store.dbroles import url_as
from services.runtime.store.logins import _with_host
from tests.fixtures.replicas import nats_binary
from tests.unit.test_kubernetes_manifests import (
    PRODUCTION_SECRETS,
    Obj,
    _by_kind,
    _containers,
    _documents,
    _one,
    _rendered,
)

OVERLAY = "production"
NATS = "nats"
POSTGRES = "dracap-postgresql"
HOSTNAME = "kubernetes.io/hostname"


def _objects() -> list[Obj]:
    return copy.deepcopy(_rendered(OVERLAY))


def _caught(check: Callable[[list[Obj]], None], mutate: Callable[[list[Obj]], Any]) -> None:
    """``check`` passes on the rendered overlay and fails once ``mutate`` broke it."""
    objects = _objects()
    check(objects)
    mutate(objects)
    with pytest.raises(AssertionError):
        check(objects)


def _only(items: list[Any], what: str) -> Any:
    assert len(items) == 1, f"{len(items)} {what}"
    return items[0]


def _selects(selector: Obj, labels: dict[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}, selector
    return bool(selector["matchLabels"]) and selector["matchLabels"].items() <= labels.items()


# --- every Deployment: two or more, spread, budgeted ------------------------------------


def _check_deployments(objects: list[Obj]) -> None:
    budgets = _by_kind(objects, "PodDisruptionBudget")
    deployments = _by_kind(objects, "Deployment")
    assert deployments
    for deployment in deployments:
        name, spec = deployment["metadata"]["name"], deployment["spec"]
        labels = spec["template"]["metadata"]["labels"]
        replicas = spec["replicas"]
        assert replicas >= 2, f"{name}: {replicas} replica(s)"
        assert spec.get("strategy", {}).get("type", "RollingUpdate") == "RollingUpdate", name
        budget = _only([b for b in budgets if _selects(b["spec"]["selector"], labels)], name)
        kept = budget["spec"].get("minAvailable")
        if kept is None:
            kept = replicas - budget["spec"]["maxUnavailable"]
        assert 1 <= kept < replicas, f"{name}: its budget keeps {kept} of {replicas}"
        spread = spec["template"]["spec"].get("topologySpreadConstraints", [])
        on_nodes = [
            c
            for c in spread
            if c["topologyKey"] == HOSTNAME
            and c["whenUnsatisfiable"] == "DoNotSchedule"
            and c["maxSkew"] == 1
            and _selects(c["labelSelector"], labels)
        ]
        assert on_nodes, f"{name}: not spread over nodes"


def test_every_deployment_runs_two_or_more_spread_over_nodes_with_a_budget() -> None:
    objects = _objects()
    _check_deployments(objects)
    names = {d["metadata"]["name"] for d in _by_kind(objects, "Deployment")}
    assert names == {
        f"dracap-{n}"
        for n in (
            "claims",
            "reservation",
            "relay",
            "reclamation",
            "snapshots",
            "enforcement",
            "audit",
            "billing",
        )
    }


def test_in_kubernetes_mode_only_the_bridge_runs_alone() -> None:
    """``production-driver`` adds the bridge, one replica (docs/kubernetes.md: a restarted
    bridge lists every claim again); every other Deployment is production's."""
    objects = copy.deepcopy(_rendered("production-driver"))
    bridge = _one(objects, "Deployment", "dracap-kubernetes-bridge")
    assert bridge["spec"]["replicas"] == 1
    _check_deployments([obj for obj in objects if obj is not bridge])
    with pytest.raises(AssertionError):
        _check_deployments(objects)


def _deployment(name: str) -> Callable[[list[Obj]], Obj]:
    return lambda objects: _one(objects, "Deployment", name)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: _deployment("dracap-relay")(o)["spec"].update(replicas=1),
        lambda o: _deployment("dracap-snapshots")(o)["spec"].update(strategy={"type": "Recreate"}),
        lambda o: _one(o, "PodDisruptionBudget", "dracap-audit")["spec"].update(
            selector={"matchLabels": {"app.kubernetes.io/component": "billing"}}
        ),
        lambda o: _one(o, "PodDisruptionBudget", "dracap-claims")["spec"].update(minAvailable=3),
        lambda o: _deployment("dracap-billing")(o)["spec"]["template"]["spec"].pop(
            "topologySpreadConstraints"
        ),
        lambda o: _deployment("dracap-enforcement")(o)["spec"]["template"]["spec"][
            "topologySpreadConstraints"
        ][0].update(whenUnsatisfiable="ScheduleAnyway"),
    ],
    ids=["one-replica", "recreate", "budget-selector", "budget-blocks", "no-spread", "soft"],
)
def test_a_deployment_that_would_not_survive_a_node_is_caught(
    mutate: Callable[[list[Obj]], Any],
) -> None:
    _caught(_check_deployments, mutate)


# --- NATS -------------------------------------------------------------------------------


def _nats_config(objects: list[Obj]) -> str:
    return str(_one(objects, "ConfigMap", "nats-config")["data"]["nats.conf"])


def _setting(config: str, pattern: str) -> str:
    found = re.search(pattern, config, re.MULTILINE | re.DOTALL)
    assert found, f"nats.conf has no {pattern!r}"
    return found.group(1)


def _decimal_bytes(text: str) -> int:
    """A nats-server size (``18G``): decimal units, as nats-server reads them."""
    number, unit = re.fullmatch(r"(\d+)([KMGT]?)", text).groups()  # type: ignore[union-attr]
    return int(number) * 1000 ** ("KMGT".index(unit) + 1 if unit else 0)


def _check_nats(objects: list[Obj]) -> None:
    sts = _one(objects, "StatefulSet", NATS)
    spec, pod = sts["spec"], sts["spec"]["template"]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["replicas"] == 3, spec["replicas"]
    assert spec["podManagementPolicy"] == "Parallel"  # none is ready before the others
    headless = _one(objects, "Service", spec["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"].get("publishNotReadyAddresses") is True
    assert _selects({"matchLabels": headless["spec"]["selector"]}, labels)
    ports = {p["name"]: p["port"] for p in headless["spec"]["ports"]}
    (container,) = pod["containers"]
    config_path = Path(container["command"][container["command"].index("--config") + 1])
    config = _nats_config(objects)
    # every server is routed to every other (and to itself, which it ignores)
    routes = set(_setting(config, r"^\s*routes:\s*\[(.*?)\]").split())
    peers = f"{NATS}-{{}}.{spec['serviceName']}:{ports['cluster']}"
    assert routes == {"nats-route://" + peers.format(i) for i in range(spec["replicas"])}
    assert _setting(config, r"^\s*cluster\s*\{.*?^\s*listen:\s*\S+:(\d+)$") == str(ports["cluster"])
    assert _setting(config, r"^listen:\s*\S+:(\d+)$") == str(ports["client"])
    assert _setting(config, r"^\s*cluster\s*\{.*?^\s*name:\s*(\S+)$")
    # each server is named after its pod
    assert _setting(config, r"^server_name:\s*\$(\w+)$") == "SERVER_NAME"
    env = {var["name"]: var for var in container["env"]}
    assert env["SERVER_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # JetStream on the persistent volume, its store bounded below the volume's size
    store = _setting(config, r"^\s*jetstream\s*\{.*?^\s*store_dir:\s*(\S+)$")
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert store in mounts, f"the store {store} is on no volume"
    (claim,) = [c for c in spec["volumeClaimTemplates"] if c["metadata"]["name"] == mounts[store]]
    size = parse_quantity(claim["spec"]["resources"]["requests"]["storage"]).nanos // 10**9
    stored = _decimal_bytes(_setting(config, r"^\s*max_file_store:\s*(\S+)$"))
    assert stored < size, (stored, size)
    # the accounts of `dracap auth init`, beside the configuration
    included = _setting(config, r'^include\s+"([^"]+)"$')
    (volume,) = [v for v in pod["volumes"] if v["name"] == mounts[str(config_path.parent)]]
    files = {
        item["path"]: source["configMap"]["name"]
        for source in volume["projected"]["sources"]
        for item in source["configMap"]["items"]
    }
    assert files == {config_path.name: "nats-config", included: "dracap-nats-accounts"}
    # never two servers on one node; a drain takes one at a time (two keep the quorum)
    anti = pod.get("affinity", {}).get("podAntiAffinity", {})
    rule = _only(anti.get("requiredDuringSchedulingIgnoredDuringExecution", []), "rule")
    assert rule["topologyKey"] == HOSTNAME and _selects(rule["labelSelector"], labels)
    (budget,) = [
        b
        for b in _by_kind(objects, "PodDisruptionBudget")
        if _selects(b["spec"]["selector"], labels)
    ]
    assert budget["spec"] == {"maxUnavailable": 1, "selector": budget["spec"]["selector"]}
    assert pod["automountServiceAccountToken"] is False


def test_nats_is_three_servers_routed_to_each_other_with_jetstream_on_a_volume() -> None:
    _check_nats(_objects())


def _replace_in_config(old: str, new: str) -> Callable[[list[Obj]], None]:
    def mutate(objects: list[Obj]) -> None:
        data = _one(objects, "ConfigMap", "nats-config")["data"]
        assert old in data["nats.conf"]
        data["nats.conf"] = data["nats.conf"].replace(old, new)

    return mutate


def _nats_pod(objects: list[Obj]) -> Obj:
    return _one(objects, "StatefulSet", NATS)["spec"]["template"]["spec"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: _one(o, "StatefulSet", NATS)["spec"].update(replicas=2),
        _replace_in_config("    nats-route://nats-2.nats-cluster:6222\n", ""),
        _replace_in_config("nats-1.nats-cluster:6222", "nats-1.nats:6222"),
        _replace_in_config("store_dir: /data", "store_dir: /tmp"),
        _replace_in_config("max_file_store: 18G", "max_file_store: 30G"),
        _replace_in_config('include "accounts.conf"', ""),
        lambda o: _nats_pod(o).pop("affinity"),
        lambda o: _one(o, "PodDisruptionBudget", NATS)["spec"].update(maxUnavailable=2),
        lambda o: _one(o, "Service", "nats-cluster")["spec"].pop("publishNotReadyAddresses"),
    ],
    ids=[
        "two-servers",
        "route-missing",
        "route-elsewhere",
        "store-not-on-volume",
        "store-past-volume",
        "no-accounts",
        "same-node",
        "budget-loses-quorum",
        "peers-unresolved",
    ],
)
def test_a_nats_cluster_that_would_lose_data_or_quorum_is_caught(
    mutate: Callable[[list[Obj]], Any],
) -> None:
    _caught(_check_nats, mutate)


def _nats_version(binary: Path) -> str:
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, check=True)
    return done.stdout.strip().removeprefix("nats-server: v")


def test_the_images_nats_server_accepts_the_configuration(tmp_path: Path) -> None:
    """``nats-server -t`` of the image's version, on nats.conf and a real accounts.conf."""
    binary = nats_binary()
    if binary is None:
        pytest.skip("no nats-server binary")
    objects = _objects()
    (container,) = _nats_pod(objects)["containers"]
    assert container["image"] == f"nats:{_nats_version(binary)}-alpine", (
        "the image's nats-server is not the version whose parsing is tested here"
    )
    auth = AuthDir(tmp_path / "auth")
    init_auth(auth, Installation(namespaces={"tenant-a": ["alice"]}, nodes=["node-a"]))
    config = tmp_path / "nats.conf"
    config.write_text(_nats_config(objects))
    (tmp_path / "accounts.conf").write_text(auth.accounts.read_text())
    done = subprocess.run(
        [str(binary), "-t", "--config", str(config)],
        capture_output=True,
        text=True,
        env={"SERVER_NAME": "nats-0"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (tmp_path / "accounts.conf").write_text("accounts: {broken")
    refused = subprocess.run(
        [str(binary), "-t", "--config", str(config)],
        capture_output=True,
        text=True,
        env={"SERVER_NAME": "nats-0"},
    )
    assert refused.returncode != 0  # -t does read the included accounts


# --- PostgreSQL ---------------------------------------------------------------------------


def _check_postgres(objects: list[Obj], created: list[Obj]) -> None:
    cluster = _one(objects, "Cluster", POSTGRES)
    spec = cluster["spec"]
    assert spec["instances"] >= 3, spec["instances"]
    synchronous = spec["postgresql"]["synchronous"]
    # quorum commit to at least one standby, never relaxed when standbys are away
    assert synchronous["method"] == "any"
    assert 1 <= synchronous["number"] <= spec["instances"] - 2, synchronous
    assert synchronous.get("dataDurability", "required") == "required"
    affinity = spec["affinity"]
    assert affinity["enablePodAntiAffinity"] is True
    assert (affinity["podAntiAffinityType"], affinity["topologyKey"]) == ("required", HOSTNAME)
    assert spec.get("enablePDB", True) is True
    # the NetworkPolicy `dracap-to-postgresql` reaches the instances by this label
    policy = _one(objects, "NetworkPolicy", "dracap-to-postgresql")
    (rule,) = policy["spec"]["egress"]
    (to,) = rule["to"]
    assert to["podSelector"]["matchLabels"].items() <= spec["inheritedMetadata"]["labels"].items()
    # the owner: the database's, may create roles (the migration, `dracap db logins`),
    # its password the Secret created first, whose user name is the owner's
    initdb = spec["bootstrap"]["initdb"]
    owner = _only([r for r in spec["managed"]["roles"] if r["name"] == initdb["owner"]], "owner")
    assert owner["createrole"] is True and owner["login"] is True
    assert not owner.get("superuser") and spec.get("enableSuperuserAccess") is False
    assert owner["passwordSecret"] == initdb["secret"]
    (secret,) = [
        s
        for s in created
        if s["kind"] == "Secret" and s["metadata"]["name"] == owner["passwordSecret"]["name"]
    ]
    assert secret["type"] == "kubernetes.io/basic-auth"
    assert secret["stringData"]["username"] == initdb["owner"]


def test_postgresql_is_three_instances_with_synchronous_replication() -> None:
    _check_postgres(_objects(), _documents(PRODUCTION_SECRETS))


def _synchronous(objects: list[Obj]) -> Obj:
    return _one(objects, "Cluster", POSTGRES)["spec"]["postgresql"]["synchronous"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: _one(o, "Cluster", POSTGRES)["spec"].update(instances=2),
        lambda o: _synchronous(o).update(dataDurability="preferred"),
        lambda o: _synchronous(o).update(number=0),
        lambda o: _synchronous(o).update(number=2),  # a lost standby would stop writes
        lambda o: _one(o, "Cluster", POSTGRES)["spec"]["affinity"].update(
            podAntiAffinityType="preferred"
        ),
        lambda o: _one(o, "Cluster", POSTGRES)["spec"]["inheritedMetadata"].update(labels={}),
        lambda o: _one(o, "Cluster", POSTGRES)["spec"]["bootstrap"]["initdb"].update(owner="app"),
    ],
    ids=["two", "preferred", "asynchronous", "all-standbys", "same-node", "unlabelled", "owner"],
)
def test_a_postgresql_that_could_lose_an_acknowledged_commit_is_caught(
    mutate: Callable[[list[Obj]], Any],
) -> None:
    _caught(lambda objects: _check_postgres(objects, _documents(PRODUCTION_SECRETS)), mutate)


# --- what the services are told ---------------------------------------------------------


def _environment(objects: list[Obj], container: Obj, created: list[Obj]) -> dict[str, str]:
    """``container``'s environment as the kubelet makes it: the ConfigMaps it reads whole,
    then its own variables, from the production template's Secrets."""
    config_maps = {c["metadata"]["name"]: c["data"] for c in _by_kind(objects, "ConfigMap")}
    secrets = {s["metadata"]["name"]: s["stringData"] for s in created if s["kind"] == "Secret"}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env |= config_maps[source["configMapRef"]["name"]]
    for var in container.get("env", []):
        ref = var.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            env[var["name"]] = secrets[ref["name"]][ref["key"]]
        elif "value" in var:
            env[var["name"]] = var["value"]
    return env


def _hosts(url: str) -> list[str]:
    return urlsplit(url).netloc.rpartition("@")[2].split(",")


def _check_environment(objects: list[Obj], created: list[Obj]) -> None:
    sts = _one(objects, "StatefulSet", NATS)
    headless = _one(objects, "Service", sts["spec"]["serviceName"])
    client = {p["name"]: p["port"] for p in headless["spec"]["ports"]}["client"]
    servers = {
        f"nats://{NATS}-{i}.{headless['metadata']['name']}:{client}"
        for i in range(sts["spec"]["replicas"])
    }
    cluster = _one(objects, "Cluster", POSTGRES)
    database = cluster["spec"]["bootstrap"]["initdb"]["database"]
    wanted_hosts = [f"{POSTGRES}-rw:5432", f"{POSTGRES}-r:5432"]
    kinds = {kind.name: kind for kind in ServiceKind}
    for obj in objects:
        for container in _containers(obj):
            if container["image"].split(":")[0] != "dracap":
                continue
            name = f"{obj['metadata']['name']}/{container['name']}"
            env = _environment(objects, container, created)
            settings = load_settings(env)
            assert set(settings.nats_url.split(",")) == servers, name
            assert settings.stream_replicas == sts["spec"]["replicas"], name
            assert settings.failover_timeout_s > 0 and settings.nats_ping_interval_s > 0
            urls = [env[v] for v in env if v.startswith("DRACAP_DATABASE_URL")]
            own = [v for v in env if v.startswith("DRACAP_DATABASE_URL_")]
            for variable in own:  # the URL the service connects with is its kind's
                kind = kinds[variable.removeprefix("DRACAP_DATABASE_URL_")]
                assert settings.for_service(kind).database_url == env[variable]
            for url in urls:
                parts = urlsplit(url)
                assert _hosts(url) == wanted_hosts, (name, url)
                assert parts.path == f"/{database}", (name, url)
                assert parse_qs(parts.query) == {"target_session_attrs": ["read-write"]}, name


def test_every_service_is_told_every_nats_server_and_every_database_host() -> None:
    _check_environment(_objects(), _documents(PRODUCTION_SECRETS))


def _database_secret(created: list[Obj]) -> dict[str, str]:
    (secret,) = [s for s in created if s["metadata"]["name"] == "dracap-database"]
    return secret["stringData"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o, c: _one(o, "ConfigMap", "dracap-endpoints")["data"].update(
            DRACAP_NATS_URL="nats://nats:4222"
        ),
        lambda o, c: _one(o, "ConfigMap", "dracap-endpoints")["data"].pop("DRACAP_STREAM_REPLICAS"),
        lambda o, c: _database_secret(c).update(
            claims="postgresql://u:p@dracap-postgresql-rw:5432/dracap?target_session_attrs=read-write"
        ),
        lambda o, c: _database_secret(c).update(
            relay=_database_secret(c)["relay"].partition("?")[0]
        ),
        lambda o, c: _one(o, "Deployment", "dracap-audit")["spec"]["template"]["spec"][
            "containers"
        ][0].pop("envFrom"),
    ],
    ids=["one-server", "stream-on-one", "one-host", "any-session", "no-settings"],
)
def test_a_service_told_a_single_server_is_caught(
    mutate: Callable[[list[Obj], list[Obj]], Any],
) -> None:
    objects, created = _objects(), copy.deepcopy(_documents(PRODUCTION_SECRETS))
    mutate(objects, created)
    with pytest.raises(AssertionError):
        _check_environment(objects, created)


def test_db_logins_writes_the_templates_urls() -> None:
    """The command the template and docs/operations.md give writes URLs of that form:
    the administrator's URL's query kept, the hosts the services reach."""
    template = _database_secret(_documents(PRODUCTION_SECRETS))
    documented = PRODUCTION_SECRETS.read_text()
    hosts = _setting(documented, r"--url-host (\S+)$")
    admin = _setting(documented, r"DRACAP_DATABASE_URL='([^']+)'")
    written = url_as(_with_host(admin, hosts), "dracap_claims_login", "secret")
    assert _hosts(written) == _hosts(template["claims"])
    assert urlsplit(written)[2:] == urlsplit(template["claims"])[2:]
    docs = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    assert f"--url-host {hosts}" in docs
