"""Inventory discovery: what devices this node has, described for a ResourceSlice.

The node agent publishes its node's devices as ResourceSlices
(:mod:`services.enforcement.publishing`). This module finds the devices and describes
each one as a :class:`DiscoveredDevice` (driver, DNS-label name, attributes, capacity
totals); the request policy and ``allowMultipleAllocations`` are added later, from the
agent's configuration (:class:`AgentConfig`, schema below, example in
``deploy/agent-config.example.yaml``). Three sources, merged per driver:

* **Network interfaces from sysfs** (``<root>/class/net/*``, ``root`` passed in so tests
  use fake trees). An interface with a ``device`` link is physical; ``lo`` is never
  published and other virtual links (veth, bridges, VLANs: no ``device`` link) only
  with ``network.includeVirtual``. ``include`` / ``exclude`` globs pick names. The
  ``speed`` file (Mb/s) becomes the ``bandwidth`` capacity in bit/s (``10000`` ->
  ``10G``). A speed that cannot be read (``EINVAL`` on a link that is down or virtual,
  ``-1``, ``0``, missing) takes ``network.defaultSpeed`` when configured; otherwise the
  interface is left out and the fact reported as a problem: publishing a guessed
  bandwidth would let the allocator hand out capacity the link may not have.
  Attributes: ``ifName``, ``mac`` (the ``address`` file), ``pciAddress`` (the PCI
  function the ``device`` link leads to, or its parent for virtio) and ``numaNode``
  (``numa_node`` of that function, when ``>= 0``).
* **GPUs through NVML** (``nvidia-ml-py``, module ``pynvml``), imported lazily: no
  library, no driver or no GPU means no GPUs, logged once per scan, never an error.
  Device ``gpu-<index>``; capacity ``memory`` = total memory rounded down to whole Mi
  (never more than the card has); attributes ``uuid``, ``productName``,
  ``cudaComputeCapability`` (version ``8.0.0``), ``driverVersion`` (version, numeric
  parts without leading zeros), ``pciAddress``, ``numaNode`` (from sysfs).
* **A static inventory file** for anything else: a YAML list of
  ``{driver, name, attributes, capacity}``; attribute values are plain scalars
  (string, int, bool) or the API's typed form (``{version: 1.2.3}``). A file that
  cannot be read or is malformed raises :class:`InventoryError`: a typo must not
  withdraw devices, so the caller skips that scan and keeps what it published.

Device names must be DNS labels. Interface names are lower-cased and every other
character becomes ``-`` (``eth0.100`` -> ``eth0-100``); a name that needed changing and
then collides with another device of the driver gets ``-`` plus six hex digits of a
hash of the original name. Names that were already valid never change.

Only :func:`discover` touches the outside world, and only by reading files and calling
NVML; everything else is pure.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import importlib
import logging
import re
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import msgspec
import yaml

from events import model
from events.fieldchecks import (
    ATTRIBUTE_VALUE_MAX_LENGTH,
    is_dns_label,
    is_dns_subdomain,
    is_qualified_name,
)
from events.model import DeviceAttribute
from events.quantities import Format, Quantity

__all__ = [
    "BANDWIDTH",
    "MEMORY",
    "AgentConfig",
    "ConfigError",
    "DeviceClassConfig",
    "DiscoveredDevice",
    "GpuConfig",
    "InventoryError",
    "NetworkConfig",
    "NvmlModule",
    "PolicyConfig",
    "ScanResult",
    "check_config",
    "discover",
    "discover_gpus",
    "discover_network",
    "load_config",
    "load_static_inventory",
    "sanitize_name",
]

log = logging.getLogger("dracap.inventory")

BANDWIDTH = "bandwidth"
MEMORY = "memory"

_MI = 1024**2
_LOOPBACK_TYPE = "772"  # ARPHRD_LOOPBACK
_PCI_ADDRESS = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_NOT_LABEL = re.compile(r"[^a-z0-9-]+")
_POOL_FIELDS = frozenset({"node", "driver", "driverShort"})


class InventoryError(ValueError):
    """The static inventory file cannot be read or is malformed; skip this scan."""


class ConfigError(ValueError):
    """The agent configuration breaks a rule; ``field`` is its path (``classes[0].driver``)."""

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(f"agent config: {field}: {rule}")
        self.field = field
        self.rule = rule


# --- configuration ---------------------------------------------------------------------


class _Config(msgspec.Struct, rename="camel", kw_only=True, forbid_unknown_fields=True):
    """camelCase keys, unknown keys rejected (a misspelt option must not pass silently)."""


class PolicyConfig(_Config):
    """A capacity's request policy: ``default`` plus ``min``/``step``/``max`` or ``validValues``.

    ``max`` (and ``validValues``) are cut down to what each device has: ``max`` to the
    largest ``min + k*step`` not above the device's capacity, values above it dropped.
    """

    default: Quantity | None = None
    min: Quantity | None = None
    step: Quantity | None = None
    max: Quantity | None = None
    valid_values: list[Quantity] | None = None


class DeviceClassConfig(_Config):
    """Sharing rules for the devices of ``driver`` whose names match ``devices``."""

    driver: str
    devices: list[str] = msgspec.field(default_factory=lambda: ["*"])
    allow_multiple_allocations: bool = False
    capacity: dict[str, PolicyConfig] = {}


class NetworkConfig(_Config):
    """Which interfaces become devices of ``driver``."""

    enabled: bool = True
    driver: str = "vnic.dracap.io"
    include: list[str] = msgspec.field(default_factory=lambda: ["*"])
    exclude: list[str] = []
    include_virtual: bool = False
    default_speed: Quantity | None = None  # bit/s, for links whose speed is unreadable


class GpuConfig(_Config):
    """NVML GPUs become devices of ``driver``."""

    enabled: bool = True
    driver: str = "gpu.dracap.io"


class AgentConfig(_Config):
    """The node agent's inventory configuration (``deploy/agent-config.example.yaml``).

    ``poolName`` is a template over ``{node}``, ``{driver}`` and ``{driverShort}`` (the
    driver's first DNS label); ``pools`` overrides it per driver. The first entry of
    ``classes`` whose driver and ``devices`` glob match a device gives its policy; a
    device no class matches is published exclusive (no sharing, no policy).
    """

    node_name: str = ""
    sysfs_root: str = "/sys"
    pool_name: str = "{node}-{driverShort}"
    pools: dict[str, str] = {}
    network: NetworkConfig = msgspec.field(default_factory=NetworkConfig)
    gpu: GpuConfig = msgspec.field(default_factory=GpuConfig)
    inventory_file: str | None = None
    classes: list[DeviceClassConfig] = []

    def pool_for(self, driver: str) -> str:
        """The pool this node publishes ``driver``'s devices in."""
        template = self.pools.get(driver, self.pool_name)
        short = driver.split(".", 1)[0]
        return template.format(node=self.node_name, driver=driver, driverShort=short)

    def class_for(self, driver: str, device: str) -> DeviceClassConfig | None:
        """The first class that matches ``device`` of ``driver``."""
        for cls in self.classes:
            if cls.driver == driver and any(fnmatch.fnmatchcase(device, g) for g in cls.devices):
                return cls
        return None


def load_config(path: str | Path, node_name: str | None = None) -> AgentConfig:
    """Read and check a YAML configuration; ``node_name`` overrides ``nodeName``."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(str(path), f"cannot be read: {exc}") from None
    try:
        config = model.convert(data, AgentConfig)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ConfigError(str(path), str(exc)) from None
    if node_name:
        config = msgspec.structs.replace(config, node_name=node_name)
    check_config(config)
    return config


def check_config(config: AgentConfig) -> None:
    """Raise :class:`ConfigError` for the first rule ``config`` breaks."""
    if not is_dns_subdomain(config.node_name):
        raise ConfigError("nodeName", "required: the node's name (a DNS subdomain)")
    for where, template in [("poolName", config.pool_name)] + [
        (f"pools[{d}]", t) for d, t in config.pools.items()
    ]:
        _check_pool_template(where, template)
    drivers = [("network.driver", config.network.driver), ("gpu.driver", config.gpu.driver)]
    drivers += [(f"classes[{i}].driver", c.driver) for i, c in enumerate(config.classes)]
    drivers += [(f"pools[{d}]", d) for d in config.pools]
    for where, driver in drivers:
        if not is_dns_subdomain(driver, 63):
            raise ConfigError(where, "must be a driver name (a DNS subdomain of at most 63)")
        pool = config.pool_for(driver)
        if len(pool) > 253 or not all(is_dns_subdomain(p) for p in pool.split("/")):
            raise ConfigError(
                where, f"gives pool name {pool!r}: must be DNS subdomains separated by '/'"
            )
    for i, cls in enumerate(config.classes):
        for name, policy in cls.capacity.items():
            _check_policy(f"classes[{i}].capacity[{name}]", name, policy, cls)


def _check_pool_template(where: str, template: str) -> None:
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as exc:
        raise ConfigError(where, f"not a valid template: {exc}") from None
    if not names <= _POOL_FIELDS:
        raise ConfigError(where, f"unknown field(s) {sorted(names - _POOL_FIELDS)}")
    if "node" not in names:
        raise ConfigError(where, "must contain {node}: pools of different nodes must differ")


def _check_policy(where: str, name: str, policy: PolicyConfig, cls: DeviceClassConfig) -> None:
    if not is_qualified_name(name):
        raise ConfigError(where, "a capacity name must be a C identifier (optionally domain/)")
    if not cls.allow_multiple_allocations:
        raise ConfigError(where, "a request policy needs allowMultipleAllocations: true")
    ranged = policy.min is not None or policy.step is not None or policy.max is not None
    if ranged and policy.valid_values is not None:
        raise ConfigError(where, "validValues and min/step/max are mutually exclusive")
    if ranged and policy.min is None:
        raise ConfigError(f"{where}.min", "required with step or max")
    if (ranged or policy.valid_values is not None) and policy.default is None:
        raise ConfigError(f"{where}.default", "required with min/step/max or validValues")


# --- discovered devices -------------------------------------------------------------------


class DiscoveredDevice(msgspec.Struct, frozen=True, kw_only=True):
    """One device as found: no policy yet. ``capacity`` holds the totals."""

    driver: str
    name: str
    attributes: dict[str, DeviceAttribute] = {}
    capacity: dict[str, Quantity] = {}
    source: str = ""


@dataclass
class ScanResult:
    """What one scan found: devices per driver (in name order) and what was left out."""

    devices: dict[str, list[DiscoveredDevice]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def _string(value: str) -> DeviceAttribute:
    return DeviceAttribute(string=value[:ATTRIBUTE_VALUE_MAX_LENGTH])


def sanitize_name(text: str) -> str:
    """``text`` as a DNS label: lower case, other characters ``-``, at most 63."""
    label = _NOT_LABEL.sub("-", text.lower()).strip("-")[:63].rstrip("-")
    return label or "device"


def _hashed(label: str, original: str) -> str:
    digest = hashlib.sha256(original.encode()).hexdigest()[:6]
    return f"{label[:56].rstrip('-')}-{digest}"


# --- network interfaces ------------------------------------------------------------------


def _read(path: Path) -> str | None:
    """A sysfs attribute's text, or ``None`` (missing, ``EINVAL``, a directory...)."""
    try:
        return path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read(path)
    try:
        return None if text is None else int(text)
    except ValueError:
        return None


def _pci_function(device_link: Path) -> Path | None:
    """The PCI function directory behind a ``device`` link (its parent for virtio)."""
    try:
        target = device_link.resolve(strict=True)
    except OSError:
        return None
    for candidate in (target, target.parent):
        if _PCI_ADDRESS.fullmatch(candidate.name):
            return candidate
    return None


def _locality(pci: Path | None) -> dict[str, DeviceAttribute]:
    if pci is None:
        return {}
    out = {"pciAddress": _string(pci.name)}
    numa = _read_int(pci / "numa_node")
    if numa is not None and numa >= 0:
        out["numaNode"] = DeviceAttribute(int_=numa)
    return out


def discover_network(root: Path, config: NetworkConfig) -> tuple[list[DiscoveredDevice], list[str]]:
    """Interfaces under ``<root>/class/net`` as devices, and what was left out (why)."""
    devices: list[DiscoveredDevice] = []
    problems: list[str] = []
    net = root / "class" / "net"
    try:
        entries = sorted(net.iterdir(), key=lambda p: p.name)
    except OSError as exc:
        return [], [f"{net}: cannot list interfaces: {exc}"]
    for entry in entries:
        name = entry.name
        if name == "lo" or _read(entry / "type") == _LOOPBACK_TYPE:
            continue
        if not _selected(name, config.include, config.exclude):
            continue
        physical = (entry / "device").exists()
        if not physical and not config.include_virtual:
            continue
        bandwidth = _link_speed(entry)
        if bandwidth is None:
            bandwidth = config.default_speed
            if bandwidth is None:
                problems.append(f"interface {name}: speed unreadable and no defaultSpeed; left out")
                continue
        attributes = {"ifName": _string(name)}
        mac = _read(entry / "address")
        if mac:
            attributes["mac"] = _string(mac)
        if physical:
            attributes |= _locality(_pci_function(entry / "device"))
        devices.append(
            DiscoveredDevice(
                driver=config.driver,
                name=name,
                attributes=attributes,
                capacity={BANDWIDTH: bandwidth},
                source=f"sysfs:{entry}",
            )
        )
    return devices, problems


def _selected(name: str, include: list[str], exclude: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, g) for g in include) and not any(
        fnmatch.fnmatchcase(name, g) for g in exclude
    )


def _link_speed(entry: Path) -> Quantity | None:
    """``speed`` (Mb/s) in bit/s, or ``None`` when it is unreadable or not positive."""
    mbps = _read_int(entry / "speed")
    if mbps is None or mbps <= 0:
        return None
    return Quantity.from_int(mbps * 1_000_000)


# --- GPUs (NVML) -------------------------------------------------------------------------


class NvmlModule(Protocol):
    """The part of ``pynvml`` (``nvidia-ml-py``) discovery calls."""

    NVMLError: type[Exception]

    def nvmlInit(self) -> None: ...  # noqa: N802 (NVML's names)
    def nvmlShutdown(self) -> None: ...  # noqa: N802
    def nvmlDeviceGetCount(self) -> int: ...  # noqa: N802
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...  # noqa: N802
    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes: ...  # noqa: N802
    def nvmlDeviceGetName(self, handle: Any) -> str | bytes: ...  # noqa: N802
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...  # noqa: N802
    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]: ...  # noqa: N802
    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any: ...  # noqa: N802
    def nvmlSystemGetDriverVersion(self) -> str | bytes: ...  # noqa: N802


def import_nvml() -> NvmlModule | None:
    """``pynvml`` when ``nvidia-ml-py`` is installed, else ``None``."""
    try:
        return cast(NvmlModule, importlib.import_module("pynvml"))
    except ImportError:
        return None


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _semver(text: str) -> str | None:
    """``535.104.05`` -> ``535.104.5``; ``None`` when it is not three numbers."""
    parts = text.strip().split(".")
    if len(parts) == 2:
        parts.append("0")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    return ".".join(str(int(p)) for p in parts)


def discover_gpus(
    config: GpuConfig, root: Path, nvml: Callable[[], NvmlModule | None] = import_nvml
) -> list[DiscoveredDevice]:
    """GPUs NVML sees; none (logged) without the library, the driver or a GPU."""
    lib = nvml()
    if lib is None:
        log.info("no GPUs: nvidia-ml-py (pynvml) is not installed")
        return []
    try:
        lib.nvmlInit()
    except Exception as exc:  # NVMLError, or OSError-like failures loading libnvidia-ml
        log.info("no GPUs: NVML unavailable (%s)", exc)
        return []
    try:
        driver_version = _nvml_optional(lib, lib.nvmlSystemGetDriverVersion)
        count = lib.nvmlDeviceGetCount()
        gpus = [_gpu(lib, config, root, index, driver_version) for index in range(count)]
        return [g for g in gpus if g is not None]
    except lib.NVMLError as exc:
        log.warning("no GPUs: NVML failed: %s", exc)
        return []
    finally:
        with contextlib.suppress(lib.NVMLError):
            lib.nvmlShutdown()


def _nvml_optional(lib: NvmlModule, call: Callable[[], Any]) -> Any:
    try:
        return call()
    except lib.NVMLError:
        return None


def _gpu(
    lib: NvmlModule, config: GpuConfig, root: Path, index: int, driver_version: Any
) -> DiscoveredDevice | None:
    try:
        handle = lib.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(lib.nvmlDeviceGetUUID(handle))
        total = int(lib.nvmlDeviceGetMemoryInfo(handle).total)
    except lib.NVMLError as exc:
        log.warning("GPU %d left out: NVML failed: %s", index, exc)
        return None
    attributes = {"uuid": _string(uuid)}
    name = _nvml_optional(lib, lambda: lib.nvmlDeviceGetName(handle))
    if name is not None:
        attributes["productName"] = _string(_text(name))
    cc = _nvml_optional(lib, lambda: lib.nvmlDeviceGetCudaComputeCapability(handle))
    if cc is not None:
        attributes["cudaComputeCapability"] = DeviceAttribute(version=f"{cc[0]}.{cc[1]}.0")
    version = _semver(_text(driver_version)) if driver_version is not None else None
    if version is not None:
        attributes["driverVersion"] = DeviceAttribute(version=version)
    pci = _nvml_optional(lib, lambda: lib.nvmlDeviceGetPciInfo(handle))
    if pci is not None:
        attributes |= _gpu_locality(root, _text(pci.busId))
    memory = Quantity.from_int(total // _MI * _MI, Format.BINARY_SI)
    return DiscoveredDevice(
        driver=config.driver,
        name=f"gpu-{index}",
        attributes=attributes,
        capacity={MEMORY: memory},
        source=f"nvml:{index}",
    )


def _gpu_locality(root: Path, bus_id: str) -> dict[str, DeviceAttribute]:
    """NVML's ``00000000:3B:00.0`` as sysfs spells it (``0000:3b:00.0``), plus NUMA."""
    domain, _, rest = bus_id.lower().partition(":")
    address = f"{domain[-4:]}:{rest}"
    if not _PCI_ADDRESS.fullmatch(address):
        return {}
    out = _locality(root / "bus" / "pci" / "devices" / address)
    out.setdefault("pciAddress", _string(address))
    return out


# --- static inventory file ---------------------------------------------------------------


class StaticDevice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One entry of the static inventory file."""

    driver: str
    name: str
    attributes: dict[str, str | bool | int | DeviceAttribute] = {}
    capacity: dict[str, Quantity] = {}


def load_static_inventory(path: str | Path) -> list[DiscoveredDevice]:
    """The devices of a static inventory file; :class:`InventoryError` if it is broken."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise InventoryError(f"{path}: cannot be read: {exc}") from None
    if data is None:
        return []
    try:
        entries = model.convert(data, list[StaticDevice])
    except (msgspec.ValidationError, ValueError) as exc:
        raise InventoryError(f"{path}: {exc}") from None
    return [_static(path, i, e) for i, e in enumerate(entries)]


def _static(path: str | Path, i: int, entry: StaticDevice) -> DiscoveredDevice:
    where = f"{path}: [{i}]"
    if not is_dns_subdomain(entry.driver, 63):
        raise InventoryError(f"{where}.driver: must be a DNS subdomain of at most 63")
    if not is_dns_label(entry.name):
        raise InventoryError(f"{where}.name: must be a DNS label")
    attributes: dict[str, DeviceAttribute] = {}
    for key, value in entry.attributes.items():
        if isinstance(value, DeviceAttribute):
            attributes[key] = value
        elif isinstance(value, bool):
            attributes[key] = DeviceAttribute(bool_=value)
        elif isinstance(value, int):
            attributes[key] = DeviceAttribute(int_=value)
        else:
            attributes[key] = DeviceAttribute(string=value)
    return DiscoveredDevice(
        driver=entry.driver,
        name=entry.name,
        attributes=attributes,
        capacity=dict(entry.capacity),
        source=f"static:{path}",
    )


# --- the whole scan ----------------------------------------------------------------------


def discover(
    config: AgentConfig,
    *,
    sysfs_root: str | Path | None = None,
    nvml: Callable[[], NvmlModule | None] = import_nvml,
) -> ScanResult:
    """Scan every configured source; raises :class:`InventoryError` for a broken file."""
    root = Path(sysfs_root if sysfs_root is not None else config.sysfs_root)
    found: list[DiscoveredDevice] = []
    problems: list[str] = []
    if config.network.enabled:
        nics, nic_problems = discover_network(root, config.network)
        found += nics
        problems += nic_problems
    if config.gpu.enabled:
        found += discover_gpus(config.gpu, root, nvml)
    if config.inventory_file:
        found += load_static_inventory(config.inventory_file)
    inventory = ScanResult(problems=problems)
    for driver, devices in _by_driver(found).items():
        inventory.devices[driver] = _named(devices, inventory.problems)
    for problem in inventory.problems:
        log.warning("inventory: %s", problem)
    return inventory


def _by_driver(devices: list[DiscoveredDevice]) -> Mapping[str, list[DiscoveredDevice]]:
    out: dict[str, list[DiscoveredDevice]] = {}
    for device in devices:
        out.setdefault(device.driver, []).append(device)
    return out


def _named(devices: list[DiscoveredDevice], problems: list[str]) -> list[DiscoveredDevice]:
    """DNS-label names, unique within the driver; sorted by name."""
    exact = {d.name for d in devices if is_dns_label(d.name)}
    taken: set[str] = set()
    out: list[DiscoveredDevice] = []
    for device in devices:
        name = device.name
        if name not in exact:
            name = sanitize_name(name)
            if name in exact or name in taken:
                name = _hashed(name, device.name)
        if name in taken:
            problems.append(
                f"{device.driver} device {device.name!r} ({device.source}): "
                "duplicate name; left out"
            )
            continue
        taken.add(name)
        out.append(msgspec.structs.replace(device, name=name) if name != device.name else device)
    return sorted(out, key=lambda d: d.name)
