"""The ``dracap.io/`` annotations (events.tenancy) and the tenant's view of devices."""

from __future__ import annotations

from typing import Any

import pytest

from events import catalog as c
from events.errors import ValidationError
from events.inventory import build_inventory
from events.manifests import ManifestError, dump_yaml, load_documents
from events.model import Namespace, ObjectMeta
from events.state import NamespaceState
from events.tenancy import (
    NamespacePolicy,
    check_policy,
    namespace_object,
    namespace_policy,
    shared_across_namespaces,
    tenant_attributes,
)
from services.claims.views import tenant_device_views
from services.commands.claim import tenant_device_rows
from tests.unit.allocator_fixtures import claim, device, device_class, request, slice_
from tests.unit.decision_fixtures import Log, allocator_of


def _namespace(annotations: dict[str, str] | None = None, **labels: str) -> Namespace:
    meta = ObjectMeta(name="tenant-a", annotations=annotations, labels=labels or None)
    return Namespace(metadata=meta)


def test_a_namespace_without_annotations_gets_the_defaults() -> None:
    assert namespace_policy(_namespace()) == NamespacePolicy(
        namespace="tenant-a",
        classes=["*"],
        admin_access=False,
        opaque_config_classes=[],
        max_claims=None,
        max_requests_per_claim=None,
    )


def test_a_namespace_names_its_policy_in_annotations() -> None:
    ns = _namespace(
        {
            "dracap.io/device-classes": "b.io, a.io",
            "dracap.io/opaque-config-classes": "a.io",
            "dracap.io/max-claims": "0",
            "dracap.io/max-requests-per-claim": "32",
            "example.com/other": "not ours: ignored",
        },
        **{"resource.kubernetes.io/admin-access": "true"},
    )
    assert namespace_policy(ns) == NamespacePolicy(
        namespace="tenant-a",
        classes=["a.io", "b.io"],
        admin_access=True,
        opaque_config_classes=["a.io"],
        max_claims=0,
        max_requests_per_claim=32,
    )


@pytest.mark.parametrize(
    ("annotations", "key", "rule"),
    [
        ({"dracap.io/max-claims": "-1"}, "dracap.io/max-claims", "whole number 0 or more"),
        ({"dracap.io/max-claims": "ten"}, "dracap.io/max-claims", "got 'ten'"),
        (
            {"dracap.io/max-requests-per-claim": "33"},
            "dracap.io/max-requests-per-claim",
            "between 1 and 32",
        ),
        (
            {"dracap.io/opaque-config-classes": "Not A Class"},
            "dracap.io/opaque-config-classes",
            "must be '*' or a DeviceClass name",
        ),
        ({"dracap.io/max-claim": "3"}, "dracap.io/max-claim", "unknown dracap annotation"),
        (
            {"dracap.io/tenant-attributes": "model"},
            "dracap.io/tenant-attributes",
            "unknown dracap annotation here",
        ),
    ],
    ids=["negative-quota", "quota-not-a-number", "above-32", "bad-class", "typo", "class-key"],
)
def test_a_bad_namespace_annotation_is_refused_naming_it(
    annotations: dict[str, str], key: str, rule: str
) -> None:
    with pytest.raises(ValidationError) as err:
        namespace_policy(_namespace(annotations))
    assert err.value.field == f"metadata.annotations[{key}]"
    assert rule in err.value.rule


CLASS_YAML = """
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata:
  name: gpu.test.io
  annotations: {ANNOTATIONS}
spec: {}
"""


def _load_class(annotations: str) -> Any:
    return load_documents(CLASS_YAML.replace("{ANNOTATIONS}", annotations), "classes.yaml")


def test_class_annotations_are_read() -> None:
    [dclass] = _load_class(
        '{"dracap.io/shared-across-namespaces": deny, '
        '"dracap.io/tenant-attributes": "model, gpu.test.io/uuid"}'
    )
    assert not shared_across_namespaces(dclass)
    assert tenant_attributes(dclass) == ("model", "gpu.test.io/uuid")
    [plain] = _load_class("{}")
    assert shared_across_namespaces(plain) and tenant_attributes(plain) == ()


@pytest.mark.parametrize(
    ("annotations", "key", "rule"),
    [
        (
            '{"dracap.io/shared-across-namespaces": "maybe"}',
            "dracap.io/shared-across-namespaces",
            "must be allow or deny, got 'maybe'",
        ),
        (
            '{"dracap.io/tenant-attributes": "model, not an attribute"}',
            "dracap.io/tenant-attributes",
            "entry 1 ('not an attribute') must be a C identifier",
        ),
        ('{"dracap.io/max-claims": "3"}', "dracap.io/max-claims", "unknown dracap annotation"),
    ],
    ids=["sharing-value", "attribute-name", "namespace-key"],
)
def test_a_bad_class_annotation_is_refused_when_loaded(
    annotations: str, key: str, rule: str
) -> None:
    with pytest.raises(ManifestError) as err:
        _load_class(annotations)
    assert err.value.field == f"metadata.annotations[{key}]"
    assert rule in err.value.rule
    assert "classes.yaml" in str(err.value)


@pytest.mark.parametrize(
    ("policy", "field", "rule"),
    [
        (NamespacePolicy(namespace="Bad", classes=[]), "namespace", "DNS label"),
        (NamespacePolicy(namespace="a", classes=["*", "x y"]), "classes[1]", "DeviceClass"),
        (
            NamespacePolicy(namespace="a", classes=[], opaque_config_classes=["B"]),
            "opaque_config_classes[0]",
            "DeviceClass name",
        ),
        (NamespacePolicy(namespace="a", classes=[], max_claims=-1), "max_claims", "0 or more"),
        (
            NamespacePolicy(namespace="a", classes=[], max_requests_per_claim=0),
            "max_requests_per_claim",
            "between 1 and 32",
        ),
    ],
    ids=["namespace", "class", "opaque-class", "quota", "requests"],
)
def test_a_bad_access_request_names_its_field(
    policy: NamespacePolicy, field: str, rule: str
) -> None:
    with pytest.raises(ValidationError) as err:
        check_policy(policy)
    assert (err.value.field, rule in err.value.rule) == (field, True)


# --- the tenant's view of devices ---------------------------------------------------------------

GPU_ATTRIBUTES = {"model": "A100", "uuid": "GPU-1234", "numa": 1}


def _cluster() -> Any:
    gpus = device_class(
        "gpus.test.io", annotations={"dracap.io/tenant-attributes": "model,gpu.test.io/numa"}
    )
    nics = device_class("nics.test.io", driver="nic.test.io")
    log = Log(
        c.DeviceClassApplied(device_class=gpus, rollout="immediate"),
        c.DeviceClassApplied(device_class=nics, rollout="immediate"),
        c.ResourceSlicePublished(
            slice=slice_(
                [device("gpu-0", {"memory": "40Gi"}, attributes=GPU_ATTRIBUTES)], name="gpus"
            )
        ),
        c.ResourceSlicePublished(
            slice=slice_(
                [device("nic-0", {"bandwidth": "10G"}, attributes={"ifName": "eth0"})],
                driver="nic.test.io",
                pool="nics",
                name="nics",
            )
        ),
        c.NamespaceAccessSet(namespace="tenant-a", classes=["gpus.test.io"]),
        c.NamespaceAccessSet(namespace="tenant-b", classes=["*"]),
    )
    log.reserve(claim(request("gpu", {"memory": "10Gi"}, cls="gpus.test.io"), name="c1"))
    return log.state()


def test_a_tenant_sees_only_the_classes_it_may_use_and_allow_listed_attributes() -> None:
    state = _cluster()
    inventory = allocator_of(state).inventory
    [gpu] = tenant_device_views(state, inventory, state.namespaces["tenant-a"])
    assert (gpu.device, gpu.classes, gpu.node) == ("gpu-0", ["gpus.test.io"], "node-a")
    assert gpu.attributes == {"gpu.test.io/model": "A100", "gpu.test.io/numa": 1}
    assert {k: (v.total, v.free) for k, v in gpu.capacity.items()} == {"memory": ("40Gi", "30Gi")}
    assert not hasattr(gpu, "tenants") and not hasattr(gpu, "shares")


def test_a_class_without_an_allow_list_shows_no_attributes() -> None:
    state = _cluster()
    inventory = build_inventory(state)
    views = tenant_device_views(state, inventory, state.namespaces["tenant-b"])
    assert [(v.device, v.classes, v.attributes) for v in views] == [
        ("gpu-0", ["gpus.test.io"], {"gpu.test.io/model": "A100", "gpu.test.io/numa": 1}),
        ("nic-0", ["nics.test.io"], {}),
    ]


def test_a_namespace_without_access_sees_nothing() -> None:
    state = _cluster()
    inventory = build_inventory(state)
    assert tenant_device_views(state, inventory, None) == []
    assert tenant_device_views(state, inventory, NamespaceState(classes=[])) == []


def test_the_tenant_table_has_one_row_per_capacity() -> None:
    view = {
        "driver": "gpu.test.io",
        "pool": "p",
        "device": "gpu-0",
        "node": "node-a",
        "classes": ["gpus.test.io"],
        "capacity": {"memory": {"total": "40Gi", "free": "30Gi"}},
        "attributes": {"gpu.test.io/model": "A100"},
    }
    lead = ["node-a", "gpu.test.io", "p/gpu-0", "gpus.test.io"]
    assert tenant_device_rows([view]) == [
        [*lead, "memory", "40Gi", "30Gi", "gpu.test.io/model=A100"]
    ]


@pytest.mark.parametrize(
    "policy",
    [
        NamespacePolicy(namespace="a", classes=["*"]),
        NamespacePolicy(namespace="b", classes=[]),
        NamespacePolicy(
            namespace="c",
            classes=["gpu.example.com", "nic.example.com"],
            admin_access=True,
            opaque_config_classes=["*"],
            max_claims=0,
            max_requests_per_claim=4,
        ),
    ],
)
def test_the_namespace_an_access_record_prints_asks_for_that_record(
    policy: NamespacePolicy,
) -> None:
    obj = namespace_object(policy)
    assert namespace_policy(obj) == policy
    [loaded] = load_documents(dump_yaml([obj]), "printed")  # and it loads as it is
    assert namespace_policy(loaded) == policy  # type: ignore[arg-type]
