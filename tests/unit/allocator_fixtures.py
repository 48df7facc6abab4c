"""Small builders for allocator tests: inventories and claims from compact descriptions."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from events import model
from events.features import DEFAULT_GATES, FeatureGates
from events.inventory import Inventory
from services.reservation.allocating import Allocator, grants_from_claim
from services.reservation.outcomes import Allocated, Outcome

DRIVER = "gpu.test.io"
CLASS = "gpu.test.io"


def device(
    name: str,
    capacity: Mapping[str, Any] | None = None,
    *,
    shared: bool = True,
    attributes: Mapping[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A device; capacity values are a quantity string or (value, policy dict)."""
    doc: dict[str, Any] = {"name": name}
    if shared:
        doc["allowMultipleAllocations"] = True
    if capacity:
        caps: dict[str, Any] = {}
        for cname, spec in capacity.items():
            if isinstance(spec, tuple):
                caps[cname] = {"value": spec[0], "requestPolicy": spec[1]}
            else:
                caps[cname] = {"value": spec}
        doc["capacity"] = caps
    if attributes:
        attrs = {}
        for aname, value in attributes.items():
            if isinstance(value, bool):
                attrs[aname] = {"bool": value}
            elif isinstance(value, int):
                attrs[aname] = {"int": value}
            else:
                attrs[aname] = {"string": value}
        doc["attributes"] = attrs
    doc.update(extra)
    return doc


def slice_(
    devices: Sequence[dict[str, Any]],
    *,
    node: str | None = "node-a",
    pool: str | None = None,
    driver: str = DRIVER,
    name: str | None = None,
    count: int = 1,
    generation: int = 1,
    **spec_extra: Any,
) -> model.ResourceSlice:
    pool = pool or f"{node or 'all'}-pool"
    spec: dict[str, Any] = {
        "driver": driver,
        "pool": {"name": pool, "generation": generation, "resourceSliceCount": count},
        "devices": list(devices),
    }
    if node is None:
        spec["allNodes"] = True
    else:
        spec["nodeName"] = node
    spec.update(spec_extra)
    doc = {
        "apiVersion": model.API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {"name": name or f"{pool}-{next(_names)}"},
        "spec": spec,
    }
    return model.convert(doc, model.ResourceSlice)


_names = itertools.count()


def device_class(
    name: str = CLASS,
    selectors: Sequence[str] = (),
    driver: str = DRIVER,
    *,
    annotations: Mapping[str, str] | None = None,
    **spec: Any,
) -> model.DeviceClass:
    exprs = [f'device.driver == "{driver}"', *selectors]
    metadata: dict[str, Any] = {"name": name}
    if annotations:
        metadata["annotations"] = dict(annotations)
    doc = {
        "apiVersion": model.API_VERSION,
        "kind": "DeviceClass",
        "metadata": metadata,
        "spec": {"selectors": [{"cel": {"expression": e}} for e in exprs], **spec},
    }
    return model.convert(doc, model.DeviceClass)


def request(
    name: str = "r",
    capacity: Mapping[str, str] | None = None,
    *,
    cls: str = CLASS,
    count: int | None = None,
    mode: str | None = None,
    admin: bool = False,
    selectors: Sequence[str] = (),
) -> dict[str, Any]:
    exact: dict[str, Any] = {"deviceClassName": cls}
    if capacity is not None:
        exact["capacity"] = {"requests": dict(capacity)}
    if count is not None:
        exact["count"] = count
    if mode is not None:
        exact["allocationMode"] = mode
    if admin:
        exact["adminAccess"] = True
    if selectors:
        exact["selectors"] = [{"cel": {"expression": e}} for e in selectors]
    return {"name": name, "exactly": exact}


def first_available(name: str, *subs: dict[str, Any]) -> dict[str, Any]:
    options = []
    for sub in subs:
        option = {"name": sub["name"], **sub["exactly"]}
        options.append(option)
    return {"name": name, "firstAvailable": options}


def claim(
    *requests: dict[str, Any],
    name: str | None = None,
    namespace: str = "tenant-a",
    constraints: Sequence[dict[str, Any]] = (),
    status: dict[str, Any] | None = None,
) -> model.ResourceClaim:
    devices: dict[str, Any] = {"requests": list(requests)}
    if constraints:
        devices["constraints"] = list(constraints)
    doc: dict[str, Any] = {
        "apiVersion": model.API_VERSION,
        "kind": "ResourceClaim",
        "metadata": {"name": name or f"claim-{next(_names)}", "namespace": namespace},
        "spec": {"devices": devices},
    }
    if status is not None:
        doc["status"] = status
    return model.convert(doc, model.ResourceClaim)


def allocator(
    slices: Sequence[model.ResourceSlice],
    classes: Sequence[model.DeviceClass] | None = None,
    *,
    gates: FeatureGates = DEFAULT_GATES,
    allocated: Sequence[model.ResourceClaim] = (),
    class_modes: Mapping[str, str] | None = None,
) -> Allocator:
    inventory = Inventory(
        classes if classes is not None else [device_class()],
        slices,
        gates=gates,
        class_modes=class_modes,
    )
    alloc = Allocator(inventory)
    for c in allocated:
        alloc.add_grants(grants_from_claim(c, consumable_capacity=gates.consumable_capacity))
    return alloc


def decide(
    alloc: Allocator,
    c: model.ResourceClaim,
    *,
    node: str | None = None,
    admin_ok: bool = False,
    commit: bool = True,
) -> Outcome:
    out = alloc.allocate(c, node=node, any_node=node is None, admin_access_allowed=admin_ok)
    if commit and isinstance(out, Allocated):
        alloc.commit(out)
    return out


def picked(out: Outcome) -> list[tuple[str, str, dict[str, str] | None]]:
    """(request, device, consumedCapacity) per result, quantities canonical."""
    assert isinstance(out, Allocated), out
    results = out.allocation.devices.results if out.allocation.devices else None
    return [
        (
            r.request,
            r.device,
            {k: str(v) for k, v in r.consumed_capacity.items()} if r.consumed_capacity else None,
        )
        for r in results or []
    ]
