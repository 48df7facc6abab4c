"""Inventory discovery and ResourceSlice publication (services/enforcement/discovery, publishing).

The sysfs tree ``tests/fixtures/sysfs/node-a`` mirrors a real one (class/net links into
devices/, ``device`` links to PCI functions, a virtio NIC, lo, a VLAN, a veth); tests copy
it into ``tmp_path`` (links kept) before changing it. NVML is replaced by a fake module.
"""

from __future__ import annotations

import logging
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kubernetes_validate
import msgspec
import pytest

from events import model
from events.catalog import ResourceSlicePublished, ResourceSliceWithdrawn
from events.envelopes import stream_of
from events.eventcodec import decode_event, encode_event
from events.fold import apply_event
from events.model import DeviceAttribute, ResourceSlice
from events.quantities import Quantity
from events.state import ClusterState
from events.validation import validate
from services.enforcement.discovery import (
    AgentConfig,
    ConfigError,
    DiscoveredDevice,
    GpuConfig,
    InventoryError,
    NetworkConfig,
    ScanResult,
    check_config,
    discover,
    discover_gpus,
    discover_network,
    import_nvml,
    load_config,
    load_static_inventory,
    sanitize_name,
)
from services.enforcement.publishing import Publisher, build_pool, pool_name, slice_name

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "sysfs" / "node-a"
EXAMPLE_CONFIG = ROOT / "deploy" / "agent-config.example.yaml"

Q = Quantity.parse


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    root = tmp_path / "sys"
    shutil.copytree(FIXTURE, root, symlinks=True)
    return root


def config(**changes: Any) -> AgentConfig:
    """The example configuration, with GPUs off unless asked and ``changes`` applied."""
    base = load_config(EXAMPLE_CONFIG)
    base = msgspec.structs.replace(base, gpu=GpuConfig(enabled=False))
    return msgspec.structs.replace(base, **changes)


def no_nvml() -> None:
    return None


@pytest.fixture
def inventory_log(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> pytest.LogCaptureFixture:
    """caplog for ``dracap.inventory``; import-linter's run (test_architecture) disables
    loggers that already exist, so switch it back on for this test."""
    monkeypatch.setattr(logging.getLogger("dracap.inventory"), "disabled", False)
    caplog.set_level("INFO", logger="dracap.inventory")
    return caplog


def s(text: str) -> DeviceAttribute:
    return DeviceAttribute(string=text)


def check_slices(slices: Iterable[ResourceSlice]) -> None:
    """dracap's validation and the official 1.34 schema (strict) both accept each slice."""
    for obj in slices:
        validate(obj)
        kubernetes_validate.validate(model.to_builtins(obj), "1.34.0", strict=True)


def set_speed(root: Path, ifname: str, mbps: int) -> None:
    (root / "class" / "net" / ifname / "speed").write_text(f"{mbps}\n")


def remove_nic(root: Path, ifname: str) -> None:
    (root / "class" / "net" / ifname).unlink()


# --- network interfaces ------------------------------------------------------------------


def test_physical_nics_with_attributes(sysfs: Path) -> None:
    devices, problems = discover_network(sysfs, NetworkConfig())
    by_name = {d.name: d for d in devices}
    assert sorted(by_name) == ["eth0", "eth1"]
    eth0 = by_name["eth0"]
    assert eth0.driver == "vnic.dracap.io"
    assert eth0.capacity == {"bandwidth": Q("10G")}
    assert eth0.capacity["bandwidth"].canonical() == "10G"
    assert eth0.attributes == {
        "ifName": s("eth0"),
        "mac": s("0c:42:a1:00:00:01"),
        "pciAddress": s("0000:3a:00.0"),
        "numaNode": DeviceAttribute(int_=0),
    }
    assert by_name["eth1"].capacity["bandwidth"].canonical() == "25G"
    assert by_name["eth1"].attributes["numaNode"] == DeviceAttribute(int_=1)
    # ens5 reports speed -1: without a defaultSpeed it is left out, and said so.
    assert problems == ["interface ens5: speed unreadable and no defaultSpeed; left out"]


def test_unreadable_speed_takes_the_default_and_virtio_reports_its_pci_parent(
    sysfs: Path,
) -> None:
    devices, problems = discover_network(sysfs, NetworkConfig(default_speed=Q("1G")))
    ens5 = {d.name: d for d in devices}["ens5"]
    assert problems == []
    assert ens5.capacity == {"bandwidth": Q("1G")}
    # device -> virtio1, whose parent is the PCI function; numa_node -1 is left out.
    assert ens5.attributes["pciAddress"] == s("0000:00:05.0")
    assert "numaNode" not in ens5.attributes


def test_einval_on_speed_counts_as_unreadable(sysfs: Path) -> None:
    speed = sysfs / "class" / "net" / "eth1" / "speed"
    speed.unlink()
    speed.mkdir()  # reading it raises an OSError, as EINVAL on a down link does
    devices, problems = discover_network(sysfs, NetworkConfig())
    assert [d.name for d in devices] == ["eth0"]
    assert any(p.startswith("interface eth1:") for p in problems)


def test_virtual_links_only_when_configured_and_never_lo(sysfs: Path) -> None:
    plain, _ = discover_network(sysfs, NetworkConfig())
    assert {d.name for d in plain} == {"eth0", "eth1"}
    virtual, problems = discover_network(sysfs, NetworkConfig(include_virtual=True))
    assert {d.name for d in virtual} == {"eth0", "eth1", "veth1a2b"}
    veth = {d.name: d for d in virtual}["veth1a2b"]
    assert set(veth.attributes) == {"ifName", "mac"}  # no device link: no PCI, no NUMA
    assert any("eth0.100" in p for p in problems)  # a VLAN has no speed of its own
    with_default, _ = discover_network(
        sysfs, NetworkConfig(include_virtual=True, default_speed=Q("1G"))
    )
    assert {d.name for d in with_default} == {"eth0", "eth1", "ens5", "eth0.100", "veth1a2b"}


def test_include_and_exclude_globs(sysfs: Path) -> None:
    cfg = NetworkConfig(include=["eth*"], exclude=["eth1"], include_virtual=True)
    devices, _ = discover_network(sysfs, cfg)
    assert [d.name for d in devices] == ["eth0"]  # eth0.100 has no speed, eth1 excluded


def test_missing_class_net_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    devices, problems = discover_network(tmp_path, NetworkConfig())
    assert devices == []
    assert len(problems) == 1


def test_interface_names_become_dns_labels_without_collisions(sysfs: Path) -> None:
    cfg = config(
        network=NetworkConfig(include_virtual=True, default_speed=Q("1G")),
    )
    inventory = discover(cfg, sysfs_root=sysfs, nvml=no_nvml)
    names = [d.name for d in inventory.devices["vnic.dracap.io"]]
    assert names == ["ens5", "eth0", "eth0-100", "eth1", "veth1a2b"]
    vlan = inventory.devices["vnic.dracap.io"][2]
    assert vlan.attributes["ifName"] == s("eth0.100")  # the real name stays an attribute
    check_slices(Publisher(cfg).update(inventory).pools[0].published)


def test_sanitized_name_that_collides_gets_a_hash_suffix(sysfs: Path) -> None:
    # eth0-100 already exists as a valid name: the sanitized eth0.100 must not take it.
    real = sysfs / "devices" / "virtual" / "net" / "eth0-100"
    shutil.copytree(sysfs / "devices" / "virtual" / "net" / "veth1a2b", real)
    (sysfs / "class" / "net" / "eth0-100").symlink_to("../../devices/virtual/net/eth0-100")
    cfg = config(network=NetworkConfig(include_virtual=True, default_speed=Q("1G")))
    names = [
        d.name for d in discover(cfg, sysfs_root=sysfs, nvml=no_nvml).devices["vnic.dracap.io"]
    ]
    assert "eth0-100" in names
    hashed = [n for n in names if n.startswith("eth0-100-")]
    assert len(hashed) == 1
    assert len(hashed[0]) == len("eth0-100-") + 6


@pytest.mark.parametrize(
    ("text", "label"),
    [
        ("eth0", "eth0"),
        ("eth0.100", "eth0-100"),
        ("Wlan0@If3", "wlan0-if3"),
        ("br_int", "br-int"),
        ("--", "device"),
        ("x" * 80, "x" * 63),
    ],
)
def test_sanitize_name(text: str, label: str) -> None:
    assert sanitize_name(text) == label


# --- GPUs ----------------------------------------------------------------------------------


class FakeNvmlError(Exception):
    pass


class FakeNvml:
    """Enough of pynvml for discovery: two A100s, one without compute capability."""

    NVMLError: type[Exception] = FakeNvmlError

    def __init__(self, *, init_fails: bool = False, memory: int = 40 * 1024**3) -> None:
        self.init_fails = init_fails
        self.memory = memory
        self.shutdown = False

    def nvmlInit(self) -> None:  # noqa: N802
        if self.init_fails:
            raise FakeNvmlError("Driver Not Loaded")

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.shutdown = True

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:  # noqa: N802
        return f"GPU-2f6a3c1e-8a34-4d0b-9c6e-0a1b2c3d4e5{handle}"

    def nvmlDeviceGetName(self, handle: int) -> bytes:  # noqa: N802
        return b"NVIDIA A100-SXM4-40GB"  # older bindings return bytes

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(total=self.memory, free=self.memory, used=0)

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:  # noqa: N802
        if handle == 1:
            raise FakeNvmlError("Not Supported")
        return (8, 0)

    def nvmlDeviceGetPciInfo(self, handle: int) -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(busId=f"00000000:3B:0{handle}.0")

    def nvmlSystemGetDriverVersion(self) -> str:  # noqa: N802
        return "535.104.05"


def test_nvml_absent_means_no_gpus(
    monkeypatch: pytest.MonkeyPatch, inventory_log: pytest.LogCaptureFixture, sysfs: Path
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    assert import_nvml() is None
    assert discover_gpus(GpuConfig(), sysfs) == []
    assert "not installed" in inventory_log.text
    inventory = discover(config(gpu=GpuConfig()), sysfs_root=sysfs)
    assert "gpu.dracap.io" not in inventory.devices


def test_nvml_without_driver_means_no_gpus(
    inventory_log: pytest.LogCaptureFixture, sysfs: Path
) -> None:
    assert discover_gpus(GpuConfig(), sysfs, lambda: FakeNvml(init_fails=True)) == []
    assert "Driver Not Loaded" in inventory_log.text


def test_gpus_from_nvml(sysfs: Path) -> None:
    fake = FakeNvml(memory=40 * 1024**3 + 12345)  # not a whole Mi: rounded down
    gpus = discover_gpus(GpuConfig(), sysfs, lambda: fake)
    assert fake.shutdown
    assert [g.name for g in gpus] == ["gpu-0", "gpu-1"]
    gpu0, gpu1 = gpus
    assert gpu0.capacity["memory"].canonical() == "40Gi"
    assert gpu0.attributes == {
        "uuid": s("GPU-2f6a3c1e-8a34-4d0b-9c6e-0a1b2c3d4e50"),
        "productName": s("NVIDIA A100-SXM4-40GB"),
        "cudaComputeCapability": DeviceAttribute(version="8.0.0"),
        "driverVersion": DeviceAttribute(version="535.104.5"),
        "pciAddress": s("0000:3b:00.0"),
        "numaNode": DeviceAttribute(int_=0),  # read from <root>/bus/pci/devices
    }
    assert "cudaComputeCapability" not in gpu1.attributes
    assert gpu1.attributes["pciAddress"] == s("0000:3b:01.0")
    assert "numaNode" not in gpu1.attributes  # not in the fake sysfs


def test_gpu_policy_is_cut_to_the_card(sysfs: Path) -> None:
    cfg = config(gpu=GpuConfig(), network=NetworkConfig(enabled=False))
    fake = FakeNvml(memory=24 * 1024**3)  # a 24Gi card under a policy written for 40Gi
    changes = Publisher(cfg).update(discover(cfg, sysfs_root=sysfs, nvml=lambda: fake))
    (pool,) = changes.pools
    assert pool.pool == "node-a-gpus"
    check_slices(pool.published)
    device = pool.published[0].spec.devices[0]  # type: ignore[index]
    policy = device.capacity["memory"].request_policy  # type: ignore[index]
    assert device.allow_multiple_allocations is True
    assert policy is not None
    assert policy.valid_range is not None
    assert policy.default == Q("5Gi")
    assert (policy.valid_range.min, policy.valid_range.step) == (Q("5Gi"), Q("5Gi"))
    assert policy.valid_range.max == Q("20Gi")  # largest 5Gi + k*5Gi <= 24Gi


# --- static inventory ----------------------------------------------------------------------


STATIC = """\
- driver: fpga.example.com
  name: fpga-0
  attributes:
    model: u280
    slot: 3
    reconfigurable: true
    shellVersion: {version: 2.1.0}
  capacity:
    lanes: 16
- driver: vnic.dracap.io
  name: eth0          # clashes with the discovered eth0
  capacity:
    bandwidth: 1G
"""


def test_static_inventory_file(tmp_path: Path, sysfs: Path) -> None:
    path = tmp_path / "inventory.yaml"
    path.write_text(STATIC)
    fpga, _ = load_static_inventory(path)
    assert fpga.attributes == {
        "model": s("u280"),
        "slot": DeviceAttribute(int_=3),
        "reconfigurable": DeviceAttribute(bool_=True),
        "shellVersion": DeviceAttribute(version="2.1.0"),
    }
    assert fpga.capacity == {"lanes": Q("16")}
    cfg = config(inventory_file=str(path))
    inventory = discover(cfg, sysfs_root=sysfs, nvml=no_nvml)
    assert [d.name for d in inventory.devices["fpga.example.com"]] == ["fpga-0"]
    vnics = inventory.devices["vnic.dracap.io"]
    assert [d.name for d in vnics] == ["eth0", "eth1"]
    assert all(d.source.startswith("sysfs:") for d in vnics)  # the discovered one wins
    assert any("duplicate name" in p for p in inventory.problems)
    changes = Publisher(cfg).update(inventory)
    fpga_pool = next(p for p in changes.pools if p.driver == "fpga.example.com")
    assert fpga_pool.pool == "node-a-fpga"
    # No class matches fpga.example.com: published exclusive, without a policy.
    (device,) = fpga_pool.published[0].spec.devices or []
    assert device.allow_multiple_allocations is None
    check_slices(s for p in changes.pools for s in p.published)


@pytest.mark.parametrize(
    "text",
    [
        "- {driver: fpga.example.com, name: FPGA_0}",
        "- {driver: Bad_Driver, name: fpga-0}",
        "- {driver: fpga.example.com, name: fpga-0, colour: red}",
        "- {driver: fpga.example.com, name: fpga-0, capacity: {lanes: lots}}",
        "- {driver: fpga.example.com, name: fpga-0, attributes: {speed: 1.5}}",
        "{driver: fpga.example.com}",
        "- [unbalanced",
    ],
)
def test_broken_static_file_raises(tmp_path: Path, text: str) -> None:
    path = tmp_path / "inventory.yaml"
    path.write_text(text)
    with pytest.raises(InventoryError):
        load_static_inventory(path)


def test_missing_static_file_raises(tmp_path: Path, sysfs: Path) -> None:
    cfg = config(inventory_file=str(tmp_path / "absent.yaml"))
    with pytest.raises(InventoryError):
        discover(cfg, sysfs_root=sysfs, nvml=no_nvml)


# --- publication ---------------------------------------------------------------------------


def test_policy_and_sharing_come_from_the_config(sysfs: Path) -> None:
    cfg = config()
    changes = Publisher(cfg).update(discover(cfg, sysfs_root=sysfs, nvml=no_nvml))
    assert changes.changed
    (pool,) = changes.pools
    (rslice,) = pool.published
    check_slices([rslice])
    assert rslice.metadata.name == "node-a-vnic.dracap.io-0"
    assert rslice.spec.node_name == "node-a"
    assert (rslice.spec.pool.name, rslice.spec.pool.generation) == ("node-a-vnics", 1)
    assert rslice.spec.pool.resource_slice_count == 1
    eth0, eth1 = rslice.spec.devices or []
    assert eth0.allow_multiple_allocations is True
    policy0 = eth0.capacity["bandwidth"].request_policy  # type: ignore[index]
    policy1 = eth1.capacity["bandwidth"].request_policy  # type: ignore[index]
    assert policy0 is not None
    assert policy1 is not None
    assert policy0.default == Q("1G")
    # validValues above the 10G link are dropped; the 25G link keeps them all.
    assert [v.canonical() for v in policy0.valid_values or []] == [
        "100M",
        "500M",
        "1G",
        "2G",
        "5G",
        "10G",
    ]
    assert (policy1.valid_values or [])[-1] == Q("25G")


def test_class_order_and_globs_pick_the_policy(sysfs: Path) -> None:
    cfg = config()
    exclusive = msgspec.convert(
        {"driver": "vnic.dracap.io", "devices": ["eth1"]},
        type=type(cfg.classes[0]),
    )
    cfg = msgspec.structs.replace(cfg, classes=[exclusive, *cfg.classes])
    changes = Publisher(cfg).update(discover(cfg, sysfs_root=sysfs, nvml=no_nvml))
    devices = {d.name: d for d in changes.pools[0].published[0].spec.devices or []}
    assert devices["eth0"].allow_multiple_allocations is True
    assert devices["eth1"].allow_multiple_allocations is None
    assert devices["eth1"].capacity["bandwidth"].request_policy is None  # type: ignore[index]
    check_slices(changes.pools[0].published)


def test_device_whose_policy_cannot_fit_is_left_out(sysfs: Path) -> None:
    set_speed(sysfs, "eth1", 100)  # 100M: the default 1G is above the link
    cfg = config()
    changes = Publisher(cfg).update(discover(cfg, sysfs_root=sysfs, nvml=no_nvml))
    names = [d.name for d in changes.pools[0].published[0].spec.devices or []]
    assert names == ["eth0"]
    assert any("eth1" in p and "default" in p for p in changes.problems)


def test_generation_increases_only_on_change(sysfs: Path) -> None:
    cfg = config()
    publisher = Publisher(cfg)
    first = publisher.update(discover(cfg, sysfs_root=sysfs, nvml=no_nvml))
    assert first.changed
    assert publisher.generation("vnic.dracap.io") == 1
    again = publisher.update(discover(cfg, sysfs_root=sysfs, nvml=no_nvml))
    assert not again.changed
    assert again.events() == []
    assert publisher.generation("vnic.dracap.io") == 1
    set_speed(sysfs, "eth1", 100000)
    changed = publisher.update(discover(cfg, sysfs_root=sysfs, nvml=no_nvml))
    assert changed.changed
    (rslice,) = changed.pools[0].published
    assert rslice.spec.pool.generation == 2
    assert publisher.generation("vnic.dracap.io") == 2
    check_slices(publisher.published)


def test_generation_survives_a_restart_through_the_log(sysfs: Path) -> None:
    cfg = config()
    inventory = discover(cfg, sysfs_root=sysfs, nvml=no_nvml)
    published = Publisher(cfg).update(inventory)
    state = fold(published.events())
    restarted = Publisher(cfg, previous=state.slices.values())
    assert restarted.generation("vnic.dracap.io") == 1
    assert not restarted.plan(inventory).changed
    set_speed(sysfs, "eth0", 25000)
    changes = restarted.plan(discover(cfg, sysfs_root=sysfs, nvml=no_nvml))
    assert changes.pools[0].generation == 2
    # plan() records nothing until commit().
    assert restarted.generation("vnic.dracap.io") == 1
    restarted.commit(changes)
    assert restarted.generation("vnic.dracap.io") == 2


def test_disappeared_device_is_republished_without_it_and_empty_pool_withdrawn(
    sysfs: Path,
) -> None:
    cfg = config()
    publisher = Publisher(cfg)
    state = fold(publisher.update(discover(cfg, sysfs_root=sysfs, nvml=no_nvml)).events())
    remove_nic(sysfs, "eth1")
    changes = publisher.update(discover(cfg, sysfs_root=sysfs, nvml=no_nvml))
    (rslice,) = changes.pools[0].published
    assert [d.name for d in rslice.spec.devices or []] == ["eth0"]
    assert rslice.spec.pool.generation == 2
    assert changes.pools[0].withdrawn == ()
    state = fold(changes.events(), state)
    assert not state.devices[("vnic.dracap.io", "node-a-vnics", "eth1")].present
    remove_nic(sysfs, "eth0")
    gone = publisher.update(discover(cfg, sysfs_root=sysfs, nvml=no_nvml))
    assert gone.events() == [ResourceSliceWithdrawn(name="node-a-vnic.dracap.io-0")]
    state = fold(gone.events(), state)
    assert state.slices == {}
    assert publisher.published == []
    assert not publisher.update(discover(cfg, sysfs_root=sysfs, nvml=no_nvml)).changed


def devices_of(driver: str, count: int) -> ScanResult:
    found = [
        DiscoveredDevice(driver=driver, name=f"dev-{i:03d}", capacity={"lanes": Q("4")})
        for i in range(count)
    ]
    return ScanResult(devices={driver: found})


def test_big_pools_are_cut_into_slices_of_128_and_shrink_cleanly() -> None:
    cfg = config()
    publisher = Publisher(cfg)
    big = publisher.update(devices_of("fpga.example.com", 300))
    (pool,) = big.pools
    assert [len(s.spec.devices or []) for s in pool.published] == [128, 128, 44]
    assert {s.spec.pool.resource_slice_count for s in pool.published} == {3}
    assert [s.metadata.name for s in pool.published] == [
        "node-a-fpga.example.com-0",
        "node-a-fpga.example.com-1",
        "node-a-fpga.example.com-2",
    ]
    check_slices(pool.published)
    state = fold(big.events())
    small = publisher.update(devices_of("fpga.example.com", 100))
    (pool,) = small.pools
    assert [len(s.spec.devices or []) for s in pool.published] == [100]
    assert pool.published[0].spec.pool.resource_slice_count == 1
    assert pool.withdrawn == ("node-a-fpga.example.com-1", "node-a-fpga.example.com-2")
    events = small.events()
    assert isinstance(events[0], ResourceSlicePublished)  # publications first
    assert all(isinstance(e, ResourceSliceWithdrawn) for e in events[1:])
    state = fold(events, state)
    assert sorted(state.slices) == ["node-a-fpga.example.com-0"]
    present = [k for k, d in state.devices.items() if d.present]
    assert len(present) == 100


def test_slices_of_other_owners_are_left_alone(sysfs: Path) -> None:
    cfg = config()
    theirs = build_pool(config(node_name="node-b"), "vnic.dracap.io", [], 7)
    operator = ResourceSlice(
        metadata=model.ObjectMeta(name="hand-made"),
        spec=model.ResourceSliceSpec(
            driver="vnic.dracap.io",
            node_name="node-a",
            pool=model.ResourcePool(name="manual", generation=3, resource_slice_count=1),
        ),
    )
    publisher = Publisher(cfg, previous=[*theirs, operator])
    assert publisher.published == []
    changes = publisher.update(discover(cfg, sysfs_root=sysfs, nvml=no_nvml))
    assert all(isinstance(e, ResourceSlicePublished) for e in changes.events())


def test_events_round_trip_through_the_catalog(sysfs: Path) -> None:
    cfg = config()
    publisher = Publisher(cfg)
    events = publisher.update(discover(cfg, sysfs_root=sysfs, nvml=no_nvml)).events()
    remove_nic(sysfs, "eth0")
    remove_nic(sysfs, "eth1")
    events += publisher.update(discover(cfg, sysfs_root=sysfs, nvml=no_nvml)).events()
    assert [type(e) for e in events] == [ResourceSlicePublished, ResourceSliceWithdrawn]
    for event in events:
        assert decode_event(encode_event(event)) == event
        assert stream_of(event) == "slice:node-a-vnic.dracap.io-0"


def fold(events: Iterable[Any], state: ClusterState | None = None) -> ClusterState:
    state = state if state is not None else ClusterState()
    for event in events:
        state = apply_event(state, event, state.position + 1)
    return state


# --- configuration -------------------------------------------------------------------------


def test_example_config_loads() -> None:
    cfg = load_config(EXAMPLE_CONFIG)
    assert cfg.node_name == "node-a"
    assert pool_name(cfg, "gpu.dracap.io") == "node-a-gpus"
    assert pool_name(cfg, "fpga.example.com") == "node-a-fpga"
    assert load_config(EXAMPLE_CONFIG, node_name="node-b").node_name == "node-b"


@pytest.mark.parametrize(
    ("yaml_text", "field"),
    [
        ("nodeName: ''", "nodeName"),
        ("nodeName: Node_A", "nodeName"),
        ("nodeName: a\npoolName: '{driverShort}'", "poolName"),
        ("nodeName: a\npoolName: '{node}-{color}'", "poolName"),
        ("nodeName: a\npoolName: '{node'", "poolName"),
        ("nodeName: a\npoolName: '{node}_{driverShort}'", "network.driver"),
        ("nodeName: a\npools: {Bad: '{node}'}", "pools[Bad]"),
        ("nodeName: a\nnetwork: {driver: NIC}", "network.driver"),
        ("nodeName: a\nnetwork: {speed: 1G}", None),  # unknown key
        (
            "nodeName: a\nclasses: [{driver: x.io, capacity: {bw: {default: 1}}}]",
            "classes[0].capacity[bw]",
        ),
        (
            "nodeName: a\nclasses: [{driver: x.io, allowMultipleAllocations: true,"
            " capacity: {bw: {default: 1, min: 1, validValues: [1]}}}]",
            "classes[0].capacity[bw]",
        ),
        (
            "nodeName: a\nclasses: [{driver: x.io, allowMultipleAllocations: true,"
            " capacity: {bw: {default: 1, step: 1}}}]",
            "classes[0].capacity[bw].min",
        ),
        (
            "nodeName: a\nclasses: [{driver: x.io, allowMultipleAllocations: true,"
            " capacity: {bw: {min: 1}}}]",
            "classes[0].capacity[bw].default",
        ),
    ],
)
def test_config_errors_name_the_field(tmp_path: Path, yaml_text: str, field: str | None) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    if field is not None:
        assert info.value.field == field


def test_slice_names_stay_within_the_limit() -> None:
    assert slice_name("node-a", "gpu.dracap.io", 0) == "node-a-gpu.dracap.io-0"
    long = slice_name("n" * 250, "gpu.dracap.io", 3)
    assert len(long) <= 253
    assert long != slice_name("n" * 250, "gpu.dracap.io", 4)
    check_config(config())
