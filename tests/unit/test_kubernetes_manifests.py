"""deploy/kubernetes: the kustomize base, its overlays and the DRA examples.

No cluster and no kustomize binary are needed: :func:`render` is a small renderer for the
subset of kustomize these manifests use, and nothing more:

* ``resources``: files (every YAML document in them) and directories (their own
  ``kustomization.yaml``, rendered first);
* ``namespace``: set on every namespaced object (the only cluster-scoped kind the base
  and overlays carry is ``Namespace``; a kind the renderer does not know fails
  :func:`test_every_kind_is_one_the_renderer_knows`);
* ``images``: ``newName`` / ``newTag`` of the containers whose image is ``name``;
* ``patches`` with ``path``: strategic-merge patches that name their target by kind and
  name; maps merge, ``null`` deletes a key, lists of maps with a ``name`` merge by name
  (containers, env, volumes), every other list is replaced.

Where ``kubectl`` is installed, :func:`test_the_renderer_agrees_with_kubectl_kustomize`
checks that ``kubectl kustomize`` renders every overlay to the same objects, so a patch
outside this subset fails there. Every rendered object and every example validates
against the Kubernetes 1.34 schemas (``kubernetes-validate``, strict: an unknown field is
an error); the Prometheus Operator's objects, which it has no schema for, are checked
field by field. Every container's command parses with dracap's own command line, and
every DRA example (a template's claim as a claim) loads with dracap's manifest loader
with the DRAConsumableCapacity gate on and is refused with it off.
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
from services.runtime import metrics, slos

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = {"dev": KUBE / "overlays" / "dev", "production": KUBE / "overlays" / "production"}
EXAMPLES = KUBE / "examples"
SECRETS = KUBE / "secrets.template.yaml"
VERSION = "1.34"

Obj = dict[str, Any]

CLUSTER_SCOPED = {"Namespace"}
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
}
WORKLOADS = {"Deployment", "DaemonSet", "Job"}
MONITORING = "monitoring.coreos.com/v1"


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
        out_list = list(base)
        for item in patch:
            at = [i for i, old in enumerate(out_list) if old["name"] == item["name"]]
            if at:
                out_list[at[0]] = _merge(out_list[at[0]], item)
            else:
                out_list.append(copy.deepcopy(item))
        return out_list
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


def render(directory: Path) -> list[Obj]:
    """The objects ``kubectl kustomize directory`` renders (for the subset above)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    allowed = {"apiVersion", "kind", "resources", "namespace", "images", "patches"}
    assert set(kustomization) <= allowed, (
        f"{directory}: the renderer lacks {set(kustomization) - allowed}"
    )
    objects: list[Obj] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        objects += render(path) if path.is_dir() else _documents(path)
    for patch_ref in kustomization.get("patches", []):
        assert set(patch_ref) == {"path"}, patch_ref
        for patch in _documents(directory / patch_ref["path"]):
            key = (patch["kind"], patch["metadata"]["name"])
            at = [
                i for i, obj in enumerate(objects) if (obj["kind"], obj["metadata"]["name"]) == key
            ]
            assert len(at) == 1, f"patch target {key} not found once"
            objects[at[0]] = _merge(objects[at[0]], patch)
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
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert container[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}, probe


def test_replicas_and_disruption_budgets() -> None:
    base = {
        name: _one(_rendered("production"), "Deployment", f"dracap-{name}")
        for name in ("relay", "reclamation")
    }
    assert base["relay"]["spec"]["replicas"] == 1
    assert base["relay"]["spec"]["strategy"] == {"type": "Recreate"}
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
    production = _rendered("production")
    assert _one(production, "Deployment", "dracap-claims")["spec"]["replicas"] > 1
    assert _one(production, "Deployment", "dracap-reservation")["spec"]["replicas"] > 1


# --- privileges -----------------------------------------------------------------------


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
    env = {var["name"]: var for var in container["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    args = container["args"]
    assert args[args.index("--node") + 1] == "$(NODE_NAME)"
    assert args[args.index("--enforcer") + 1] == "tc"
    host_paths = [v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v]
    assert host_paths == ["/var/lib/dracap-agent"]  # its checkpoint, nothing of the host else
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


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_no_kubernetes_api_access_is_granted(overlay: str) -> None:
    objects = _rendered(overlay)
    rbac = {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}
    assert not rbac & {obj["kind"] for obj in objects}
    accounts = {sa["metadata"]["name"] for sa in _by_kind(objects, "ServiceAccount")}
    assert all(
        sa["automountServiceAccountToken"] is False for sa in _by_kind(objects, "ServiceAccount")
    )
    for obj in objects:
        spec = _pod_spec(obj)
        if spec is not None:
            assert spec["serviceAccountName"] in accounts
            assert spec["automountServiceAccountToken"] is False


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_network_policies_allow_nats_postgresql_dns_and_the_monitoring_namespace_only(
    overlay: str,
) -> None:
    policies = _by_kind(_rendered(overlay), "NetworkPolicy")
    egress_ports, ingress_from = set(), []
    for policy in policies:
        for rule in policy["spec"].get("egress", []):
            egress_ports |= {(p["protocol"], p["port"]) for p in rule["ports"]}
        for rule in policy["spec"].get("ingress", []):
            ingress_from += rule["from"]
            assert rule["ports"] == [{"protocol": "TCP", "port": "metrics"}]
    assert egress_ports == {("TCP", 4222), ("TCP", 5432), ("UDP", 53), ("TCP", 53)}
    assert ingress_from == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    deny = _one(policies, "NetworkPolicy", "dracap-default-deny")
    assert deny["spec"]["policyTypes"] == ["Ingress", "Egress"] and "egress" not in deny["spec"]


# --- secrets --------------------------------------------------------------------------


def test_every_secret_key_the_manifests_read_is_in_the_template_and_is_a_placeholder() -> None:
    template = {s["metadata"]["name"]: s["stringData"] for s in _documents(SECRETS)}
    for obj in _documents(SECRETS):
        kubernetes_validate.validate(obj, VERSION, strict=True)
    for values in template.values():
        assert all("REPLACE" in value for value in values.values())
    for overlay in sorted(OVERLAYS):
        objects = _rendered(overlay)
        assert not _by_kind(objects, "Secret"), "Secrets are created by the operator, not applied"
        for obj in objects:
            spec = _pod_spec(obj)
            if spec is None:
                continue
            for container in _containers(obj):
                for var in container.get("env", []):
                    ref = var.get("valueFrom", {}).get("secretKeyRef")
                    if ref:
                        assert ref["key"] in template[ref["name"]], ref
            for volume in spec.get("volumes", []):
                if "secret" in volume:
                    secret = volume["secret"]
                    keys = [item["key"] for item in secret.get("items", [])]
                    assert set(keys) <= set(template[secret["secretName"]]), keys
    (agent,) = _by_kind(_rendered("dev"), "DaemonSet")
    args = agent["spec"]["template"]["spec"]["containers"][0]["args"]
    creds = Path(args[args.index("--creds") + 1].replace("$(NODE_NAME)", "node-a")).name
    assert creds in template["dracap-nats"]


# --- the DRA examples -----------------------------------------------------------------

GATED = {
    "resourceslices.yaml": ("allowMultipleAllocations:", "requestPolicy:"),
    "workload.yaml": ("capacity:",),
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
    pod = next(obj for _, obj in _examples() if obj["kind"] == "Pod")
    claims = {c["name"]: c for c in pod["spec"]["resourceClaims"]}
    names = {obj["metadata"]["name"] for obj in dra}
    assert all(
        (c.get("resourceClaimName") or c.get("resourceClaimTemplateName")) in names
        for c in claims.values()
    )
    assert {c["name"] for c in pod["spec"]["containers"][0]["resources"]["claims"]} == set(claims)
