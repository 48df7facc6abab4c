"""deploy/kubernetes: the kustomize base, its overlays and the DRA examples.

No cluster and no kustomize binary are needed: :func:`render` is a small renderer for the
subset of kustomize these manifests use, and nothing more:

* ``resources``: files (every YAML document in them) and directories (their own
  ``kustomization.yaml``, rendered first);
* ``components``: directories whose ``kustomization.yaml`` is a ``Component``: after the
  resources, each adds its own resources and applies its patches to everything so far;
* ``namespace``: set on every namespaced object (the cluster-scoped kinds the overlays
  carry are ``Namespace`` and RBAC's cluster roles and bindings, whose subjects the
  overlays name with their namespace themselves, as kustomize does not; a kind the
  renderer does not know fails :func:`test_every_kind_is_one_the_renderer_knows`);
* ``images``: ``newName`` / ``newTag`` of the containers whose image is ``name``;
* ``patches`` with ``path``: strategic-merge patches that name their target by kind and
  name; maps merge, ``null`` deletes a key, lists of maps with a ``name`` merge by name
  (containers, env, volumes, volume mounts; as kustomize, the patch's items come first, in
  its order, then the target's others), every other list is replaced.

Where ``kubectl`` is installed, :func:`test_the_renderer_agrees_with_kubectl_kustomize`
checks that ``kubectl kustomize`` renders every overlay to the same objects, so a patch
outside this subset fails there. Every rendered object and every example validates
against the Kubernetes 1.34 schemas (``kubernetes-validate``, strict: an unknown field is
an error); the Prometheus Operator's objects and the CloudNativePG ``Cluster`` of the
production overlay, which it has no schema for, are checked field by field. Every
Secret, ConfigMap, key and ServiceAccount a pod reads (the NATS StatefulSet's too) is
rendered or in a template of what is created first. What makes ``overlays/production``
a production topology is checked in ``tests/unit/test_production_topology.py``. Every
container's command parses with dracap's own command line, and every DRA example (a
template's claim as a claim) loads with dracap's manifest loader with the
DRAConsumableCapacity gate on and is refused with it off.

Each standalone overlay has a Kubernetes-mode twin (``overlays/<name>-driver``: the
overlay plus the ``driver`` component). The twins are checked to change nothing of their
overlay but the agent's DaemonSet, to grant exactly the RBAC verbs the bridge and the
agents use (and a token to no other pod), and to mount only the kubelet's directories
the plugin needs, at the paths the kubelet knows.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from events.features import FeatureGates
from events.manifests import ManifestError, load_paths
from services import cli
from services.enforcement.discovery import load_config
from services.runtime.ground import metrics
from services.runtime.ground.settings import ServiceKind
from services.runtime.ops import slos

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
#: standalone overlays, and each one in Kubernetes mode (the ``driver`` component added)
STANDALONE = {"dev": "dev-driver", "production": "production-driver"}
OVERLAYS = {name: KUBE / "overlays" / name for pair in STANDALONE.items() for name in pair}
DRIVER_COMPONENT = KUBE / "driver"
EXAMPLES = KUBE / "examples"
SECRETS = KUBE / "secrets.template.yaml"
VERSION = "1.34"

Obj = dict[str, Any]

CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
KNOWN_KINDS = CLUSTER_SCOPED | {
    "ConfigMap",
    "DaemonSet",
    "Deployment",
    "Job",
    "NetworkPolicy",
    "PodDisruptionBudget",
    "PrometheusRule",
    "Service",
    "ServiceAccount",
    "ServiceMonitor",
    "StatefulSet",
    "Cluster",
}
WORKLOADS = {"Deployment", "DaemonSet", "Job"}
MONITORING = "monitoring.coreos.com/v1"
CNPG = "postgresql.cnpg.io/v1"
#: what production adds to the Secrets of SECRETS (created first as well)
PRODUCTION_SECRETS = OVERLAYS["production"] / "secrets.template.yaml"


# --- the renderer ---------------------------------------------------------------------


def _documents(path: Path) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _merge(base: Any, patch: Any) -> Any:
    """A strategic merge of ``patch`` into ``base``, for the subset the module names."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = _merge(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
        return out
    named = (
        isinstance(base, list)
        and isinstance(patch, list)
        and all(isinstance(item, dict) and "name" in item for item in base + patch)
    )
    if named:
        by_name = {old["name"]: old for old in base}
        patched = [
            _merge(by_name[item["name"]], item) if item["name"] in by_name else copy.deepcopy(item)
            for item in patch
        ]
        names = {item["name"] for item in patch}
        return patched + [copy.deepcopy(old) for old in base if old["name"] not in names]
    return copy.deepcopy(patch)


def _pod_spec(obj: Obj) -> Obj | None:
    if obj["kind"] in WORKLOADS:
        return obj["spec"]["template"]["spec"]
    if obj["kind"] == "Pod":
        return obj["spec"]
    return None


def _containers(obj: Obj) -> list[Obj]:
    spec = _pod_spec(obj)
    if spec is None:
        return []
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def _kustomization(directory: Path, kind: str) -> Obj:
    kustomization: Obj = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert kustomization.get("kind", "Kustomization") == kind, f"{directory}: not a {kind}"
    allowed = {"apiVersion", "kind", "resources", "patches"}
    if kind == "Kustomization":
        allowed |= {"namespace", "images", "components"}
    assert set(kustomization) <= allowed, (
        f"{directory}: the renderer lacks {set(kustomization) - allowed}"
    )
    return kustomization


def _resources(directory: Path, kustomization: Obj) -> list[Obj]:
    objects: list[Obj] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        objects += render(path) if path.is_dir() else _documents(path)
    return objects


def _patch(directory: Path, kustomization: Obj, objects: list[Obj]) -> None:
    """Apply the strategic-merge patches of ``kustomization`` to ``objects`` in place."""
    for patch_ref in kustomization.get("patches", []):
        assert set(patch_ref) == {"path"}, patch_ref
        for patch in _documents(directory / patch_ref["path"]):
            key = (patch["kind"], patch["metadata"]["name"])
            at = [
                i for i, obj in enumerate(objects) if (obj["kind"], obj["metadata"]["name"]) == key
            ]
            assert len(at) == 1, f"patch target {key} not found once"
            objects[at[0]] = _merge(objects[at[0]], patch)


def render(directory: Path) -> list[Obj]:
    """The objects ``kubectl kustomize directory`` renders (for the subset above)."""
    kustomization = _kustomization(directory, "Kustomization")
    objects = _resources(directory, kustomization)
    for component in kustomization.get("components", []):
        path = directory / component
        component_kustomization = _kustomization(path, "Component")
        objects += _resources(path, component_kustomization)
        _patch(path, component_kustomization, objects)
    _patch(directory, kustomization, objects)
    for image in kustomization.get("images", []):
        for obj in objects:
            for container in _containers(obj):
                name, _, tag = container["image"].partition(":")
                if name == image["name"]:
                    tag = image.get("newTag", tag)
                    container["image"] = image.get("newName", name) + (f":{tag}" if tag else "")
    if "namespace" in kustomization:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = kustomization["namespace"]
    return objects


def _key(obj: Obj) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def _rendered(overlay: str) -> list[Obj]:
    return render(OVERLAYS[overlay])


def _by_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [obj for obj in objects if obj["kind"] == kind]


def _one(objects: list[Obj], kind: str, name: str) -> Obj:
    found = [obj for obj in objects if obj["kind"] == kind and obj["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name)
    return found[0]


# --- rendering and schemas ------------------------------------------------------------


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_the_renderer_agrees_with_kubectl_kustomize(overlay: str) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl on this machine: the renderer is not compared with kustomize")
    done = subprocess.run(
        [kubectl, "kustomize", str(OVERLAYS[overlay])], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    theirs = {_key(obj): obj for obj in yaml.safe_load_all(done.stdout) if obj}
    ours = {_key(obj): obj for obj in _rendered(overlay)}
    assert sorted(ours) == sorted(theirs)
    for key, obj in ours.items():
        assert obj == theirs[key], key


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_every_kind_is_one_the_renderer_knows(overlay: str) -> None:
    kinds = {obj["kind"] for obj in _rendered(overlay)}
    assert kinds <= KNOWN_KINDS, kinds - KNOWN_KINDS
    namespace = yaml.safe_load((OVERLAYS[overlay] / "kustomization.yaml").read_text())["namespace"]
    assert [ns["metadata"]["name"] for ns in _by_kind(_rendered(overlay), "Namespace")] == [
        namespace
    ]


def _validate(obj: Obj) -> None:
    if obj["apiVersion"] == MONITORING:
        _check_monitoring(obj)
    elif obj["apiVersion"] == CNPG:
        _check_postgres_cluster(obj)
    else:
        kubernetes_validate.validate(obj, VERSION, strict=True)


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_every_rendered_object_validates_against_the_1_34_schemas(overlay: str) -> None:
    for obj in _rendered(overlay):
        _validate(obj)


def _examples() -> list[tuple[str, Obj]]:
    return [
        (path.name, obj) for path in sorted(EXAMPLES.glob("*.yaml")) for obj in _documents(path)
    ]


@pytest.mark.parametrize(
    ("file", "obj"), _examples(), ids=lambda v: v if isinstance(v, str) else v["kind"]
)
def test_every_example_validates_against_the_1_34_schemas(file: str, obj: Obj) -> None:
    kubernetes_validate.validate(obj, VERSION, strict=True)


def test_the_validation_is_strict() -> None:
    """An unknown field fails: the checks above are not vacuous."""
    deployment = copy.deepcopy(_one(_rendered("dev"), "Deployment", "dracap-claims"))
    deployment["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSION, strict=True)
    slice_ = next(obj for _, obj in _examples() if obj["kind"] == "ResourceSlice")
    slice_ = copy.deepcopy(slice_)
    slice_["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"]["validRanges"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(slice_, VERSION, strict=True)


# --- the Prometheus Operator's objects ------------------------------------------------


def _metric_families() -> set[str]:
    """Every family dracap registers, and the gauges its SLO tracker serves when started."""
    return {family.name for family in metrics.REGISTRY.collect()} | set(slos.GAUGE_NAMES)


def _check_monitoring(obj: Obj) -> None:
    assert set(obj) == {"apiVersion", "kind", "metadata", "spec"}, obj["kind"]
    if obj["kind"] == "ServiceMonitor":
        spec = obj["spec"]
        assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
        assert spec["selector"]["matchLabels"] and spec["endpoints"]
        for endpoint in spec["endpoints"]:
            assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme"}
            assert endpoint["path"] == "/metrics" and isinstance(endpoint["port"], str)
        return
    assert obj["kind"] == "PrometheusRule", obj["kind"]
    families = _metric_families()
    for group in obj["spec"]["groups"]:
        assert set(group) <= {"name", "interval", "rules"} and group["rules"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "record", "expr", "for", "labels", "annotations"}
            assert ("alert" in rule) != ("record" in rule)
            assert isinstance(rule["expr"], str) and rule["expr"].strip()
            if "for" in rule:
                assert re.fullmatch(r"\d+[smh]", rule["for"])
            if "alert" in rule:
                assert rule["labels"]["severity"] in {"warning", "critical"}
                assert rule["annotations"]["summary"]
                page, _, anchor = rule["annotations"]["runbook_url"].partition("#")
                assert anchor and f"\n## {anchor.replace('-', ' ')}" in (
                    "\n" + (ROOT / page).read_text().lower()
                ), rule["annotations"]["runbook_url"]
            for name in re.findall(r"\bdracap_[a-z_]+", rule["expr"]):
                family = re.sub(r"_(total|bucket|sum|count)$", "", name)
                assert family in families, f"{rule.get('alert')}: {name} is not exported"


# --- the CloudNativePG operator's Cluster ----------------------------------------------

#: the fields of a postgresql.cnpg.io/v1 Cluster the production overlay may use, each
#: with the type (or the values) the operator's CRD gives it; anything else is refused
#: (the CRD's schema is not vendored here: these are checked field by field, as the
#: Prometheus Operator's objects are)
CNPG_FIELDS: dict[str, Any] = {
    "instances": int,
    "inheritedMetadata": {"labels": dict, "annotations": dict},
    "postgresql": {
        "parameters": dict,
        "synchronous": {
            "method": {"any", "first"},
            "number": int,
            "dataDurability": {"required", "preferred"},
            "maxStandbyNamesFromCluster": int,
        },
    },
    "minSyncReplicas": int,
    "maxSyncReplicas": int,
    "bootstrap": {"initdb": {"database": str, "owner": str, "secret": {"name": str}}},
    "managed": {"roles": list},
    "enableSuperuserAccess": bool,
    "storage": {"size": str, "storageClass": str},
    "affinity": {
        "enablePodAntiAffinity": bool,
        "podAntiAffinityType": {"preferred", "required"},
        "topologyKey": str,
    },
    "enablePDB": bool,
    "resources": dict,
}
#: the fields of one entry of ``spec.managed.roles``
CNPG_ROLE_FIELDS: dict[str, Any] = {
    "name": str,
    "ensure": {"present", "absent"},
    "login": bool,
    "createrole": bool,
    "createdb": bool,
    "superuser": bool,
    "inherit": bool,
    "inRoles": list,
    "passwordSecret": {"name": str},
}


def _check_fields(value: Any, shape: Any, where: str) -> None:
    if isinstance(shape, dict):
        assert isinstance(value, dict), where
        unknown = set(value) - set(shape)
        assert not unknown, f"{where}: fields the CRD does not have: {unknown}"
        for key, item in value.items():
            _check_fields(item, shape[key], f"{where}.{key}")
    elif isinstance(shape, set):
        assert value in shape, f"{where}: {value!r} is none of {sorted(shape)}"
    else:
        assert isinstance(value, shape), f"{where}: not a {shape.__name__}"
        assert shape is bool or not isinstance(value, bool), f"{where}: a bool"


def _check_postgres_cluster(obj: Obj) -> None:
    assert obj["kind"] == "Cluster", obj["kind"]
    assert set(obj) == {"apiVersion", "kind", "metadata", "spec"}
    _check_fields(obj["spec"], CNPG_FIELDS, "spec")
    for role in obj["spec"].get("managed", {}).get("roles", []):
        _check_fields(role, CNPG_ROLE_FIELDS, "spec.managed.roles[]")
    spec = obj["spec"]
    # the operator refuses the deprecated fields beside the synchronous stanza
    legacy = {"minSyncReplicas", "maxSyncReplicas"} & set(spec)
    assert not (legacy and "synchronous" in spec.get("postgresql", {})), legacy


def test_a_cluster_field_the_operator_does_not_know_is_refused() -> None:
    cluster = copy.deepcopy(_one(_rendered("production"), "Cluster", "dracap-postgresql"))
    _check_postgres_cluster(cluster)
    for mutate in (
        lambda c: c["spec"]["postgresql"]["synchronous"].update(dataDurability="strict"),
        lambda c: c["spec"].update(instance=3),
        lambda c: c["spec"].update(minSyncReplicas=1),  # beside the synchronous stanza
        lambda c: c["spec"]["managed"]["roles"][0].update(createRole=True),
    ):
        broken = copy.deepcopy(cluster)
        mutate(broken)
        with pytest.raises(AssertionError):
            _check_postgres_cluster(broken)


def test_the_monitoring_objects_select_the_metrics_service() -> None:
    objects = _rendered("production")
    service = _one(objects, "Service", "dracap-metrics")
    monitor = _one(objects, "ServiceMonitor", "dracap")
    labels = service["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {port["name"] for port in service["spec"]["ports"]}
    assert {endpoint["port"] for endpoint in monitor["spec"]["endpoints"]} <= ports
    rule = _one(objects, "PrometheusRule", "dracap")
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert {"DracapTargetDown", "DracapDeadLetters", "DracapRelayLag"} <= alerts
    assert f'service="{service["metadata"]["name"]}"' in next(
        r["expr"]
        for g in rule["spec"]["groups"]
        for r in g["rules"]
        if r.get("alert") == "DracapTargetDown"
    )


def test_a_rule_naming_a_metric_dracap_does_not_export_is_refused() -> None:
    rule = copy.deepcopy(_one(_rendered("dev"), "PrometheusRule", "dracap"))
    rule["spec"]["groups"][0]["rules"][0]["expr"] = "dracap_no_such_thing_total > 0"
    with pytest.raises(AssertionError, match="not exported"):
        _check_monitoring(rule)


# --- what the containers run ----------------------------------------------------------

_REFERENCE = re.compile(r"\$\(([A-Z_]+)\)")
#: Values of the downward API and configuration variables, for parsing the arguments.
SAMPLE = {"NODE_NAME": "node-a", "HOST_IP": "10.0.0.5", "POD_NAME": "dracap-reclamation-0"}


def _dracap_containers() -> list[tuple[str, Obj]]:
    out = []
    for overlay in sorted(OVERLAYS):
        for obj in _rendered(overlay):
            for container in _containers(obj):
                if container["image"].split(":")[0] == "dracap":
                    out.append((f"{overlay}/{obj['metadata']['name']}", container))
    return out


def _argv(container: Obj) -> list[str]:
    assert "command" not in container, "the image's entrypoint is dracap: give args only"
    env = {var["name"] for var in container.get("env", [])}
    words = []
    for word in container["args"]:
        for name in _REFERENCE.findall(word):
            assert name in env, f"$({name}) is not an environment variable of the container"
        words.append(_REFERENCE.sub(lambda m: SAMPLE[m.group(1)], str(word)))
    return words


@pytest.mark.parametrize(
    ("name", "container"),
    _dracap_containers(),
    ids=lambda v: v if isinstance(v, str) else v["name"],
)
def test_every_container_command_parses_with_dracaps_command_line(
    name: str, container: Obj
) -> None:
    argv = _argv(container)
    args = cli.build_parser(argv).parse_args(argv)
    assert callable(args.func), name


def _metrics_port(argv: list[str]) -> int | None:
    return int(argv[argv.index("--metrics-port") + 1]) if "--metrics-port" in argv else None


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_every_service_is_probed_on_its_metrics_port_and_requests_resources(overlay: str) -> None:
    objects = _rendered(overlay)
    for obj in objects:
        for container in _containers(obj):
            requests = container["resources"]["requests"]
            assert {"cpu", "memory"} <= set(requests), obj["metadata"]["name"]
            assert container["resources"]["limits"]["memory"]
            if obj["kind"] == "Job":
                continue
            argv = _argv(container)
            port = _metrics_port(argv)
            (declared,) = container["ports"]
            assert declared == {"name": "metrics", "containerPort": port}
            expected_addr = "$(HOST_IP)" if obj["kind"] == "DaemonSet" else "0.0.0.0"
            assert container["args"][container["args"].index("--metrics-addr") + 1] == expected_addr
            # alive on /healthz (the start too), ready on /readyz: real endpoints, never
            # /metrics (which answers whatever the process's state)
            paths = {
                "startupProbe": "/healthz",
                "readinessProbe": "/readyz",
                "livenessProbe": "/healthz",
            }
            for probe, path in paths.items():
                assert container[probe]["httpGet"] == {"path": path, "port": "metrics"}, probe


def test_the_probed_paths_are_the_ones_the_metrics_port_serves() -> None:
    """The paths the probes ask are the ones :mod:`services.runtime.ops.health` serves."""
    from services.runtime.ground.metrics import METRICS_PATHS

    served = METRICS_PATHS | {"/healthz", "/readyz"}
    for overlay in sorted(OVERLAYS):
        for obj in _rendered(overlay):
            for container in _containers(obj):
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    if probe in container:
                        assert container[probe]["httpGet"]["path"] in served, (overlay, probe)


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_audit_and_billing_run_as_the_ledger(overlay: str) -> None:
    """``dracap audit`` and ``dracap usage`` get an answer in a cluster: both subscribers
    run, as the ledger's database login and NATS credential, with their own accounts."""
    objects = _rendered(overlay)
    for name, command in (("audit", "audit"), ("billing", "usage")):
        deployment = _one(objects, "Deployment", f"dracap-{name}")
        (container,) = _containers(deployment)
        argv = _argv(container)
        assert argv[:2] == [command, "serve"]
        assert _arg(argv, "--creds") == "/etc/dracap/nats/ledger.nk"
        assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == f"dracap-{name}"
        _one(objects, "ServiceAccount", f"dracap-{name}")
        env = {var["name"]: var["valueFrom"] for var in container["env"]}
        assert env["DRACAP_DATABASE_URL_LEDGER"]["secretKeyRef"]["key"] == "ledger"


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_the_agent_tolerates_device_taints_and_is_node_critical(overlay: str) -> None:
    """GPU and NIC nodes are usually tainted; an evicted agent loses its node's lease."""
    spec = _one(_rendered(overlay), "DaemonSet", "dracap-agent")["spec"]["template"]["spec"]
    assert spec["priorityClassName"] == "system-node-critical"
    keys = {t["key"]: t for t in spec["tolerations"]}
    assert {"nvidia.com/gpu", "amd.com/gpu"} <= keys.keys()
    # no effect named: NoSchedule and NoExecute taints of the key are both tolerated
    assert all(t["operator"] == "Exists" and "effect" not in t for t in keys.values())


def test_replicas_and_disruption_budgets() -> None:
    """The base runs one relay and one snapshot writer, never two side by side; every
    budget lets a drain go on. (The production overlay runs two of every Deployment:
    tests/unit/test_production_topology.py.)"""
    base = {
        name: _one(render(KUBE / "base"), "Deployment", f"dracap-{name}")
        for name in ("relay", "reclamation", "snapshots")
    }
    for one in ("relay", "snapshots"):
        assert base[one]["spec"]["replicas"] == 1
        assert base[one]["spec"]["strategy"] == {"type": "Recreate"}
    assert base["reclamation"]["spec"]["replicas"] == 2
    for overlay in sorted(OVERLAYS):
        objects = _rendered(overlay)
        budgets = _by_kind(objects, "PodDisruptionBudget")
        for deployment in _by_kind(objects, "Deployment"):
            labels = deployment["spec"]["template"]["metadata"]["labels"]
            (budget,) = [
                b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()
            ]
            assert ("minAvailable" in budget["spec"]) != ("maxUnavailable" in budget["spec"])
            if budget["spec"].get("minAvailable"):
                assert deployment["spec"]["replicas"] > budget["spec"]["minAvailable"], (
                    f"{overlay}: {budget['metadata']['name']} would block every drain"
                )


# --- privileges -----------------------------------------------------------------------


def _driver_mode(overlay: str) -> bool:
    return overlay not in STANDALONE


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


#: the kubelet's directories the agent needs in Kubernetes mode, and nothing of it else
REGISTRATION_DIR = "/var/lib/kubelet/plugins_registry"
PLUGINS_DIR = "/var/lib/kubelet/plugins"
CDI_DIR = "/var/run/cdi"
CHECKPOINT_DIR = "/var/lib/dracap-agent"
NODE_KEY_DIR = "/etc/dracap/node-credentials"  # the node's own NATS key, put there by provisioning
SUN_PATH_MAX = 107  #: a Unix socket's path, without its terminating NUL


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_the_agent_gets_exactly_what_tc_needs(overlay: str) -> None:
    objects = _rendered(overlay)
    (agent,) = _by_kind(objects, "DaemonSet")
    spec = agent["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True
    assert not {"hostPID", "hostIPC"} & set(spec)
    (container,) = spec["containers"]
    context = container["securityContext"]
    assert context["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN"]}
    assert context["allowPrivilegeEscalation"] is False and "privileged" not in context
    assert context["readOnlyRootFilesystem"] is True
    assert "privileged" not in spec.get("securityContext", {})
    env = {var["name"]: var for var in container["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    args = container["args"]
    assert _arg(args, "--node") == "$(NODE_NAME)"
    assert _arg(args, "--enforcer") == "tc"
    host_paths = sorted(v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v)
    if _driver_mode(overlay):
        # its checkpoint, its node's key, the kubelet's registration directory, its own
        # plugin directory and the CDI specs: nothing of the host else
        assert host_paths == sorted(
            [
                CHECKPOINT_DIR,
                NODE_KEY_DIR,
                REGISTRATION_DIR,
                f"{PLUGINS_DIR}/{_agent_driver()}",
                CDI_DIR,
            ]
        )
    else:  # its checkpoint and its node's key, nothing of the host else
        assert host_paths == sorted([CHECKPOINT_DIR, NODE_KEY_DIR])
    for obj in objects:
        if obj is agent:
            continue
        for other in _containers(obj):
            assert other["securityContext"]["capabilities"] == {"drop": ["ALL"]}
            assert _pod_spec(obj)["securityContext"]["runAsNonRoot"] is True  # type: ignore[index]


def test_the_agents_configuration_loads(tmp_path: Path) -> None:
    config_map = _one(_rendered("dev"), "ConfigMap", "dracap-agent-config")
    path = tmp_path / "config.yaml"
    path.write_text(config_map["data"]["config.yaml"])
    config = load_config(path, node_name="node-a")
    assert config.node_name == "node-a"


def _agent_driver() -> str:
    """The driver the DaemonSet's agent serves: its configuration's network driver."""
    config_map = _one(_rendered("dev"), "ConfigMap", "dracap-agent-config")
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    assert config["network"]["enabled"] and not config["gpu"]["enabled"]
    return str(config["network"]["driver"])


@pytest.mark.parametrize("overlay", sorted(STANDALONE.values()))
def test_the_kubelet_plugin_is_reachable_by_the_kubelet(overlay: str) -> None:
    """The agent's sockets and CDI specs are where the kubelet and the runtime look."""
    (agent,) = _by_kind(_rendered(overlay), "DaemonSet")
    spec = agent["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    args = container["args"]
    assert "--kubelet-plugin" in args
    registration = _arg(args, "--kubelet-registration-dir")
    plugins = _arg(args, "--kubelet-plugins-dir")
    cdi = _arg(args, "--cdi-dir")
    assert (registration, plugins, cdi) == (REGISTRATION_DIR, PLUGINS_DIR, CDI_DIR)
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounted = {
        mount["mountPath"]: volumes[mount["name"]]
        for mount in container["volumeMounts"]
        if "hostPath" in volumes[mount["name"]] and not mount.get("readOnly")
    }  # the node's directories it writes: sockets, CDI specs, its checkpoint
    driver = _agent_driver()
    for path in (registration, f"{plugins}/{driver}", cdi):
        # the agent tells the kubelet its sockets' paths: inside is outside
        assert mounted[path]["hostPath"]["path"] == path
    mounted = {path: volume["hostPath"]["type"] for path, volume in mounted.items()}
    assert mounted[registration] == "Directory"  # the kubelet's: never made by the agent
    assert mounted[f"{plugins}/{driver}"] == "DirectoryOrCreate"
    assert mounted[cdi] == "DirectoryOrCreate"
    assert plugins not in mounted, "the other plugins' sockets are not the agent's"
    for socket in (f"{registration}/{driver}-reg.sock", f"{plugins}/{driver}/dra.sock"):
        assert len(socket.encode()) <= SUN_PATH_MAX, socket
    assert spec["automountServiceAccountToken"] is True


def _rules(role: Obj) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule  # no resourceNames etc.
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


#: Kubernetes mode's grants: exactly the calls the bridge and the agents make
GRANTS = {
    "dracap-kubernetes-bridge": {
        ("resource.k8s.io", "resourceclaims"): {"get", "list", "watch"},
        ("resource.k8s.io", "resourceclaims/status"): {"get", "patch", "update"},
    },
    "dracap-agent": {
        ("resource.k8s.io", "resourceclaims"): {"get"},
        ("resource.k8s.io", "resourceslices"): {
            "get",
            "list",
            "watch",
            "create",
            "update",
            "patch",
            "delete",
        },
    },
}


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_kubernetes_api_access_is_exactly_what_each_mode_uses(overlay: str) -> None:
    objects = _rendered(overlay)
    namespace = yaml.safe_load((OVERLAYS[overlay] / "kustomization.yaml").read_text())["namespace"]
    assert not {"Role", "RoleBinding"} & {obj["kind"] for obj in objects}
    grants = GRANTS if _driver_mode(overlay) else {}
    roles = {role["metadata"]["name"]: _rules(role) for role in _by_kind(objects, "ClusterRole")}
    assert roles == grants
    bindings = _by_kind(objects, "ClusterRoleBinding")
    assert sorted(b["metadata"]["name"] for b in bindings) == sorted(grants)
    for binding in bindings:
        name = binding["metadata"]["name"]
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": name,
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": name, "namespace": namespace}
        ]
    accounts = {sa["metadata"]["name"] for sa in _by_kind(objects, "ServiceAccount")}
    assert all(
        sa["automountServiceAccountToken"] is False for sa in _by_kind(objects, "ServiceAccount")
    )
    for obj in objects:
        spec = _pod_spec(obj)
        if spec is not None:
            assert spec["serviceAccountName"] in accounts
            # a pod gets a token exactly when its account is granted something
            assert spec["automountServiceAccountToken"] is (spec["serviceAccountName"] in grants)


def test_the_documented_grants_are_the_granted_ones() -> None:
    rows = re.findall(
        r"^ *\| (?:`([a-z-]+)`)? *\| `([a-z/]+)` \| ([a-z, ]+) \|",
        (ROOT / "docs" / "kubernetes.md").read_text(),
        re.MULTILINE,
    )
    documented: dict[str, dict[tuple[str, str], set[str]]] = {}
    account = ""
    for name, resource, verbs in rows:
        account = name or account
        documented.setdefault(account, {})[("resource.k8s.io", resource)] = set(verbs.split(", "))
    assert documented == GRANTS


@pytest.mark.parametrize("overlay", sorted(STANDALONE.values()))
def test_the_bridge_is_one_per_cluster_with_the_claims_apis_role(overlay: str) -> None:
    objects = _rendered(overlay)
    bridge = _one(objects, "Deployment", "dracap-kubernetes-bridge")
    assert bridge["spec"]["replicas"] == 1
    assert bridge["spec"]["strategy"] == {"type": "Recreate"}
    (container,) = bridge["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[:2] == ["serve", "kubernetes-bridge"]
    drivers = {args[i + 1] for i, word in enumerate(args) if word == "--driver"}
    classes = [obj for _, obj in _examples() if obj["kind"] == "DeviceClass"]
    expressions = [s["cel"]["expression"] for c in classes for s in c["spec"]["selectors"]]
    assert drivers == {m for e in expressions for m in re.findall(r'device\.driver == "(.+?)"', e)}
    assert _agent_driver() in drivers
    (claims,) = _one(objects, "Deployment", "dracap-claims")["spec"]["template"]["spec"][
        "containers"
    ]
    assert container["env"] == claims["env"]  # the claims API's database user and NATS
    assert _arg(args, "--creds") == _arg(claims["args"], "--creds")


@pytest.mark.parametrize(("standalone", "driver"), sorted(STANDALONE.items()))
def test_kubernetes_mode_changes_nothing_of_the_standalone_overlay_but_the_agent(
    standalone: str, driver: str
) -> None:
    before = {_key(obj): obj for obj in _rendered(standalone)}
    after = {_key(obj): obj for obj in _rendered(driver)}
    added = {_key(obj) for obj in _component_objects()}
    namespace = yaml.safe_load((OVERLAYS[driver] / "kustomization.yaml").read_text())["namespace"]
    added = {(kind, "" if kind in CLUSTER_SCOPED else namespace, name) for kind, _, name in added}
    assert set(after) == set(before) | added and not set(before) & added
    changed = {key for key in before if before[key] != after[key]}
    assert changed == {("DaemonSet", namespace, "dracap-agent")}
    images = {c["image"] for obj in after.values() for c in _containers(obj)}
    assert images == {c["image"] for obj in before.values() for c in _containers(obj)}
    assert len(images) == 1, images


def _component_objects() -> list[Obj]:
    """The objects the ``driver`` component adds (its resources, unpatched)."""
    return _resources(DRIVER_COMPONENT, _kustomization(DRIVER_COMPONENT, "Component"))


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_network_policies_allow_only_what_each_mode_talks_to(overlay: str) -> None:
    policies = _by_kind(_rendered(overlay), "NetworkPolicy")
    egress_ports, ingress_from = set(), []
    for policy in policies:
        for rule in policy["spec"].get("egress", []):
            egress_ports |= {(p["protocol"], p["port"]) for p in rule["ports"]}
        for rule in policy["spec"].get("ingress", []):
            ingress_from += rule["from"]
            assert rule["ports"] == [{"protocol": "TCP", "port": "metrics"}]
    wanted = {("TCP", 4222), ("TCP", 5432), ("UDP", 53), ("TCP", 53)}
    if _driver_mode(overlay):
        # the API server (443 on the Service, usually 6443 where policies see it): the bridge's
        bridge = _one(policies, "NetworkPolicy", "dracap-kubernetes-bridge")
        selector = bridge["spec"]["podSelector"]["matchLabels"]
        assert selector["app.kubernetes.io/component"] == "kubernetes-bridge"
        wanted |= {("TCP", 443), ("TCP", 6443)}
    assert egress_ports == wanted
    assert ingress_from == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    deny = _one(policies, "NetworkPolicy", "dracap-default-deny")
    assert deny["spec"]["policyTypes"] == ["Ingress", "Egress"] and "egress" not in deny["spec"]


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_each_service_connects_as_its_own_kinds_database_user(overlay: str) -> None:
    """A service reads its kind's URL (``DRACAP_DATABASE_URL_<KIND>``, the Secret's key of
    that kind); only the migration Job has the owner's, and the node agents none at all
    (they reach the log through the enforcement service). The snapshot writer runs as
    ``dracap_snapshots``' user, the one role besides the app role that writes snapshots."""
    kinds = {kind.name: kind.value for kind in ServiceKind}
    for obj in _rendered(overlay):
        for container in _containers(obj):
            refs = [
                (var["name"], var["valueFrom"]["secretKeyRef"])
                for var in container.get("env", [])
                if var.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == "dracap-database"
            ]
            if obj["kind"] == "Job":
                assert [(n, r["key"]) for n, r in refs] == [("DRACAP_DATABASE_URL", "owner")]
                continue
            if obj["metadata"]["name"] == "dracap-agent":
                assert refs == [] and not any("DATABASE" in v["name"] for v in container["env"])
                continue
            ((name, ref),) = refs
            kind = name.removeprefix("DRACAP_DATABASE_URL_")
            assert kinds.get(kind) == ref["key"], (obj["metadata"]["name"], name, ref)
    (snapshots,) = _containers(_one(_rendered(overlay), "Deployment", "dracap-snapshots"))
    assert _argv(snapshots)[:2] == ["replay", "snapshot"]
    assert "--once" not in snapshots["args"]
    assert [var["name"] for var in snapshots["env"]] == ["DRACAP_DATABASE_URL_SNAPSHOTS"]


# --- secrets --------------------------------------------------------------------------


#: the Secrets and ConfigMaps created before an overlay is applied, by (kind, name)
Created = dict[tuple[str, str], dict[str, str]]


def _created_first(overlay: str) -> Created:
    """The Secrets and ConfigMaps the operator creates before applying ``overlay``
    (``(kind, name)``: their keys and placeholder values): ../secrets.template.yaml, and
    for production its own template besides (whose ``dracap-database`` replaces the
    common one, with the same keys)."""
    paths = [SECRETS]
    if overlay.startswith("production"):
        paths.append(PRODUCTION_SECRETS)
    created: Created = {}
    for path in paths:
        for obj in _documents(path):
            kubernetes_validate.validate(obj, VERSION, strict=True)
            key = (obj["kind"], obj["metadata"]["name"])
            values = obj.get("stringData", obj.get("data", {}))
            if key in created:
                assert set(values) == set(created[key]), (path.name, key)
            created[key] = values
    return created


def _any_pod_spec(obj: Obj) -> Obj | None:
    """A pod template's spec: the workloads' and the StatefulSets' (NATS)."""
    if obj["kind"] == "StatefulSet":
        return obj["spec"]["template"]["spec"]  # type: ignore[no-any-return]
    return _pod_spec(obj)


def _check_references(objects: list[Obj], created: Created) -> None:
    """Every Secret, ConfigMap and key a pod reads exists: rendered (ConfigMaps) or
    created first (the templates), and every pod's ServiceAccount is rendered."""
    have = {(obj["kind"], obj["metadata"]["name"]): obj.get("data", {}) for obj in objects}
    have |= created
    accounts = {obj["metadata"]["name"] for obj in _by_kind(objects, "ServiceAccount")}

    def read(kind: str, name: str, keys: list[str]) -> None:
        assert (kind, name) in have, f"{kind} {name} is neither rendered nor created first"
        assert set(keys) <= set(have[kind, name]), (kind, name, keys)

    for obj in objects:
        spec = _any_pod_spec(obj)
        if spec is None:
            continue
        assert spec["serviceAccountName"] in accounts, obj["metadata"]["name"]
        for container in list(spec.get("initContainers", [])) + list(spec["containers"]):
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    read("ConfigMap", source["configMapRef"]["name"], [])
                if "secretRef" in source:
                    read("Secret", source["secretRef"]["name"], [])
            for var in container.get("env", []):
                for field, kind in (("secretKeyRef", "Secret"), ("configMapKeyRef", "ConfigMap")):
                    ref = var.get("valueFrom", {}).get(field)
                    if ref:
                        read(kind, ref["name"], [ref["key"]])
        sources = []
        for volume in spec.get("volumes", []):
            sources += [volume, *volume.get("projected", {}).get("sources", [])]
        for source in sources:
            if "secret" in source:
                secret = source["secret"]
                name = secret.get("secretName", secret.get("name"))
                read("Secret", name, [item["key"] for item in secret.get("items", [])])
            if "configMap" in source:
                config_map = source["configMap"]
                keys = [item["key"] for item in config_map.get("items", [])]
                read("ConfigMap", config_map["name"], keys)


def test_every_secret_key_the_manifests_read_is_in_the_template_and_is_a_placeholder() -> None:
    for overlay in sorted(OVERLAYS):
        created = _created_first(overlay)
        for (kind, name), values in created.items():
            for key, value in values.items():
                if (name, key) != ("dracap-postgresql-owner", "username"):  # the Cluster's owner
                    assert "REPLACE" in value, (kind, name, key)
        objects = _rendered(overlay)
        assert not _by_kind(objects, "Secret"), "Secrets are created by the operator, not applied"
        _check_references(objects, created)
    template = {s["metadata"]["name"]: s["stringData"] for s in _documents(SECRETS)}
    assert not [k for k in template["dracap-nats"] if k.startswith("agent")], (
        "an agent's key in the Secret every agent pod could be given"
    )


@pytest.mark.parametrize(
    "mutate",
    [
        lambda spec: spec["volumes"][0]["projected"]["sources"][1]["configMap"].update(
            name="nats-accounts"
        ),
        lambda spec: spec["containers"][0]["env"].append(
            {"name": "X", "valueFrom": {"secretKeyRef": {"name": "dracap-nats", "key": "x.nk"}}}
        ),
        lambda spec: spec.update(serviceAccountName="default"),
    ],
    ids=["configmap", "secret-key", "service-account"],
)
def test_a_reference_to_nothing_is_caught(mutate: Any) -> None:
    objects = copy.deepcopy(_rendered("production"))
    _check_references(objects, _created_first("production"))
    mutate(_one(objects, "StatefulSet", "nats")["spec"]["template"]["spec"])
    with pytest.raises(AssertionError):
        _check_references(objects, _created_first("production"))


# --- the DRA examples -----------------------------------------------------------------

GATED = {
    "resourceslices.yaml": ("allowMultipleAllocations:", "requestPolicy:"),
    "workload.yaml": ("capacity:",),
    "inference.yaml": ("capacity:",),
}


def test_the_gated_fields_of_the_examples_are_marked() -> None:
    for file, fields in GATED.items():
        for line in (EXAMPLES / file).read_text().splitlines():
            if line.strip().startswith(fields):
                assert line.endswith("# DRAConsumableCapacity"), f"{file}: {line.strip()}"
    docs = (ROOT / "docs" / "operations.md").read_text()
    for field in ("allowMultipleAllocations", "requestPolicy", "capacity.requests"):
        assert field in docs.split("## Kubernetes", 1)[1].split("\n## ", 1)[0], field


def test_the_dra_examples_load_with_the_gate_on_and_are_refused_with_it_off(tmp_path: Path) -> None:
    dra = [obj for _, obj in _examples() if obj["apiVersion"].startswith("resource.k8s.io/")]
    assert {obj["kind"] for obj in dra} == {
        "DeviceClass",
        "ResourceSlice",
        "ResourceClaim",
        "ResourceClaimTemplate",
    }
    # dracap loads claims, not templates: a template's claim is loaded as the claim a Pod
    # would get from it
    loadable = [
        {**obj, "kind": "ResourceClaim", "spec": obj["spec"]["spec"]}
        if obj["kind"] == "ResourceClaimTemplate"
        else obj
        for obj in dra
    ]
    path = tmp_path / "dra.yaml"
    path.write_text(yaml.safe_dump_all(loadable))
    assert len(load_paths([str(path)])) == len(loadable)
    for obj in loadable:  # every one of them uses a gated field
        one = tmp_path / "one.yaml"
        one.write_text(yaml.safe_dump(obj))
        with pytest.raises(ManifestError):
            load_paths([str(one)], FeatureGates(consumable_capacity=False))
    pods = [obj for _, obj in _examples() if obj["kind"] == "Pod"]
    assert len(pods) == 2
    for pod in pods:
        claims = {c["name"]: c for c in pod["spec"]["resourceClaims"]}
        names = {
            (obj["kind"], obj["metadata"]["name"])
            for obj in dra
            if obj["metadata"].get("namespace") == pod["metadata"]["namespace"]
        }
        for claim in claims.values():
            ref = (
                ("ResourceClaim", claim["resourceClaimName"])
                if "resourceClaimName" in claim
                else ("ResourceClaimTemplate", claim["resourceClaimTemplateName"])
            )
            assert ref in names, ref
        used = {c["name"] for c in pod["spec"]["containers"][0]["resources"]["claims"]}
        assert used == set(claims)


def _node_key_problems(agent: dict[str, Any]) -> list[str]:
    """Why the agent DaemonSet's pods could read a key other than their own node's."""
    spec = agent["spec"]["template"]["spec"]
    problems = [
        f"volume {v['name']} mounts Secret {v['secret']['secretName']}"
        for v in spec.get("volumes", [])
        if "secret" in v
    ]
    (container,) = [c for c in spec["containers"] if c["name"] == "agent"]
    creds = _arg(container["args"], "--creds")
    if "$(" in creds:
        problems.append(f"--creds {creds} is chosen per pod: every node's key is at hand")
    mounts = [
        m for m in container.get("volumeMounts", []) if creds.startswith(m["mountPath"] + "/")
    ]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    if not mounts or "hostPath" not in volumes.get(mounts[-1]["name"], {}):
        problems.append(f"--creds {creds} is not on a directory of the pod's own node")
    return problems


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_an_agent_pod_can_read_its_own_nodes_key_only(overlay: str) -> None:
    """The agent's key comes from its node (hostPath), not from a Secret that would hold
    every node's key for every agent pod (base/agent.yaml, Credentials)."""
    for agent in _by_kind(_rendered(overlay), "DaemonSet"):
        assert _node_key_problems(agent) == [], (overlay, _node_key_problems(agent))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda spec: spec["volumes"].append(
            {"name": "all", "secret": {"secretName": "dracap-nats"}}
        ),
        lambda spec: spec["containers"][0]["args"].__setitem__(
            spec["containers"][0]["args"].index("--creds") + 1,
            "/etc/dracap/nats/agent-$(NODE_NAME).nk",
        ),
        lambda spec: [
            v.update(secret={"secretName": "dracap-nats"}, hostPath=None)
            for v in spec["volumes"]
            if v["name"] == "nats"
        ],
    ],
    ids=["secret-volume", "per-pod-path", "key-from-secret"],
)
def test_an_agent_reading_other_nodes_keys_is_caught(mutate: Any) -> None:
    (agent,) = _by_kind(copy.deepcopy(_rendered("dev")), "DaemonSet")
    mutate(agent["spec"]["template"]["spec"])
    for volume in agent["spec"]["template"]["spec"]["volumes"]:
        if volume.get("hostPath", "") is None:
            del volume["hostPath"]
    assert _node_key_problems(agent)


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_each_pod_mounts_only_its_own_broker_key(overlay: str) -> None:
    """A pod that mounts the broker's Secret names the keys it mounts, and its ``--creds``
    file is one of them: no pod can read another service's seed (the agents' keys are not
    in it: :func:`test_an_agent_pod_can_read_its_own_nodes_key_only`)."""
    for obj in _rendered(overlay):
        spec = _pod_spec(obj)
        if spec is None:
            continue
        for volume in spec.get("volumes", []):
            secret = volume.get("secret")
            if not secret or secret["secretName"] != "dracap-nats":
                continue
            paths = {item["path"] for item in secret.get("items", [])}
            assert paths, (overlay, obj["metadata"]["name"], "mounts every key")
            for container in _containers(obj):
                argv = _argv(container)
                if "--creds" in argv:
                    creds = Path(_arg(argv, "--creds")).name
                    assert creds.replace("$(NODE_NAME)", "node-a") in {
                        p.replace("$(NODE_NAME)", "node-a") for p in paths
                    }, (overlay, obj["metadata"]["name"], creds, paths)
