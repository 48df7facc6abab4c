"""The kubelet's protocols: the committed stubs are a fresh generation of ``protos/``,
and the ``.proto`` files carry the kubelet's names and field numbers (the wire contract).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from services.runtime.kubeletplugin.api import (
    dra_health_v1alpha1_pb2,
    dra_v1_pb2,
    generate,
    pluginregistration_pb2,
)


def test_the_committed_stubs_equal_a_fresh_generation(tmp_path: Path) -> None:
    fresh = generate.generate(tmp_path)
    assert sorted(fresh) == sorted(generate.generated_names())
    for name, data in fresh.items():
        committed = (generate.PACKAGE_DIR / name).read_bytes()
        assert committed == data, (
            f"{name} is stale: python -m services.runtime.kubeletplugin.api.generate"
        )


def test_the_check_mode_reports_drift(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    copy = tmp_path / "package"
    copy.mkdir()
    for name in generate.generated_names():
        (copy / name).write_bytes((generate.PACKAGE_DIR / name).read_bytes())
    monkeypatch.setattr(generate, "PACKAGE_DIR", copy)
    assert generate.main(["--check"]) == 0
    (copy / "dra_v1_pb2.py").write_text("# edited by hand\n")
    assert generate.main(["--check"]) == 1
    assert generate.main([]) == 0  # rewrites it
    assert generate.main(["--check"]) == 0


SERVICES = [
    (
        pluginregistration_pb2,
        "pluginregistration.Registration",
        ["GetInfo", "NotifyRegistrationStatus"],
    ),
    (
        dra_v1_pb2,
        "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin",
        ["NodePrepareResources", "NodeUnprepareResources"],
    ),
    (dra_health_v1alpha1_pb2, "v1alpha1.DRAResourceHealth", ["NodeWatchResources"]),
]


@pytest.mark.parametrize(("module", "service", "methods"), SERVICES)
def test_services_and_methods_have_the_kubelets_names(
    module: object, service: str, methods: list[str]
) -> None:
    package, name = service.rsplit(".", 1)
    descriptor = module.DESCRIPTOR  # type: ignore[attr-defined]
    assert descriptor.package == package
    assert descriptor.services_by_name[name].full_name == service
    assert sorted(descriptor.services_by_name[name].methods_by_name) == sorted(methods)


# name[] marks a repeated field (a map is a repeated entry)
FIELDS = [
    (
        pluginregistration_pb2.PluginInfo,
        [("type", 1), ("name", 2), ("endpoint", 3), ("supported_versions[]", 4)],
    ),
    (pluginregistration_pb2.RegistrationStatus, [("plugin_registered", 1), ("error", 2)]),
    (pluginregistration_pb2.InfoRequest, []),
    (pluginregistration_pb2.RegistrationStatusResponse, []),
    (dra_v1_pb2.Claim, [("namespace", 1), ("uid", 2), ("name", 3)]),
    (dra_v1_pb2.NodePrepareResourcesRequest, [("claims[]", 1)]),
    (dra_v1_pb2.NodePrepareResourcesResponse, [("claims[]", 1)]),
    (dra_v1_pb2.NodePrepareResourceResponse, [("devices[]", 1), ("error", 2)]),
    (
        dra_v1_pb2.Device,
        [("request_names[]", 1), ("pool_name", 2), ("device_name", 3), ("cdi_device_ids[]", 4)],
    ),
    (dra_v1_pb2.NodeUnprepareResourcesRequest, [("claims[]", 1)]),
    (dra_v1_pb2.NodeUnprepareResourcesResponse, [("claims[]", 1)]),
    (dra_v1_pb2.NodeUnprepareResourceResponse, [("error", 1)]),
    (dra_health_v1alpha1_pb2.NodeWatchResourcesRequest, []),
    (dra_health_v1alpha1_pb2.NodeWatchResourcesResponse, [("devices[]", 1)]),
    (dra_health_v1alpha1_pb2.DeviceIdentifier, [("pool_name", 1), ("device_name", 2)]),
    (
        dra_health_v1alpha1_pb2.DeviceHealth,
        [("device", 1), ("health", 2), ("last_updated_time", 3)],
    ),
]


@pytest.mark.parametrize(("message", "fields"), FIELDS, ids=lambda m: getattr(m, "__name__", ""))
def test_messages_have_the_kubelets_field_numbers(
    message: type, fields: list[tuple[str, int]]
) -> None:
    descriptor: Descriptor = message.DESCRIPTOR  # type: ignore[attr-defined]
    assert [(f.name + "[]" * f.is_repeated, f.number) for f in descriptor.fields] == fields


def test_the_claim_maps_are_keyed_by_string_and_the_health_enum_numbered() -> None:
    for reply in (
        dra_v1_pb2.NodePrepareResourcesResponse,
        dra_v1_pb2.NodeUnprepareResourcesResponse,
    ):
        entry = reply.DESCRIPTOR.fields_by_name["claims"].message_type
        assert entry.GetOptions().map_entry
        assert entry.fields_by_name["key"].type == FieldDescriptor.TYPE_STRING
    status = dra_health_v1alpha1_pb2.DESCRIPTOR.enum_types_by_name["HealthStatus"]
    assert [(v.name, v.number) for v in status.values] == [
        ("UNKNOWN", 0),
        ("HEALTHY", 1),
        ("UNHEALTHY", 2),
    ]
    time = dra_health_v1alpha1_pb2.DeviceHealth.DESCRIPTOR.fields_by_name["last_updated_time"]
    assert time.type == FieldDescriptor.TYPE_INT64
