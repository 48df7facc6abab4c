"""Making the API server hold exactly a node's desired ResourceSlices for one driver.

:func:`sync_slices` reads the slices the server has for (driver, node) — and, when known,
the pool — and compares them with the desired ones by name, labels and spec, with the
pool's ``generation`` and ``resourceSliceCount`` left out of the comparison:

* **Nothing differs** (same names, same content, one generation, the right count): nothing
  is written, the generation stays. A resync after a restart is free.
* **Anything differs**: every desired slice is written at generation ``g + 1``, where ``g``
  is the highest generation among the server's slices of the pool (0 when there are none),
  with ``resourceSliceCount`` = the number of desired slices; names the server lacks are
  created, the others replaced at the resourceVersion just read. Then the slices no longer
  desired are deleted, at their resourceVersion. Writing the new generation first and
  deleting after means a scheduler never sees a pool with fewer slices than it says it has
  at the newest generation (it ignores older generations of a pool).

The caller's ``generation`` and ``resourceSliceCount`` in ``desired`` are ignored; the
server's slices decide the generation, so it survives restarts of the writer without a
store of its own.

A 409 (someone else wrote a slice between the read and the write, or a name was taken
meanwhile) starts the sync over with a fresh read, up to ``attempts`` times; then the last
:class:`~services.runtime.kube.errors.Conflict` is raised. Other errors are raised as they
come (a retryable one to the caller, which owns the retry policy).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Final

import msgspec

from events import model
from events.model import ObjectMeta, ResourcePool, ResourceSlice
from services.runtime.kube.client import KubeApi
from services.runtime.kube.errors import Conflict, NotFound

__all__ = ["SYNC_ATTEMPTS", "SliceSync", "sync_slices"]

#: Fresh reads after a 409 before the conflict is raised.
SYNC_ATTEMPTS: Final = 5


class SliceSync(msgspec.Struct, frozen=True):
    """What one sync did: the pool's generation after it and the names written."""

    generation: int
    created: tuple[str, ...] = ()
    replaced: tuple[str, ...] = ()
    deleted: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.created or self.replaced or self.deleted)


def _shape(resource_slice: ResourceSlice) -> Any:
    """What is compared: labels and spec, without the pool's generation and slice count."""
    spec = model.to_builtins(resource_slice.spec)
    spec["pool"] = {"name": resource_slice.spec.pool.name}
    return (resource_slice.metadata.labels or {}, spec)


def _check(desired: Sequence[ResourceSlice], driver: str, node: str) -> str | None:
    pools = {s.spec.pool.name for s in desired}
    if len(pools) > 1:
        raise ValueError(f"spec.pool.name: the desired slices name {len(pools)} pools, not one")
    names = [s.metadata.name for s in desired]
    if len(set(names)) != len(names) or not all(names):
        raise ValueError("metadata.name: every desired slice needs a name of its own")
    for s in desired:
        if s.spec.driver != driver:
            raise ValueError(f"{s.metadata.name}: spec.driver must be {driver}")
        if s.spec.node_name != node:
            raise ValueError(f"{s.metadata.name}: spec.nodeName must be {node}")
    return next(iter(pools), None)


def _at(
    resource_slice: ResourceSlice, generation: int, count: int, version: str | None
) -> ResourceSlice:
    meta = resource_slice.metadata
    spec = resource_slice.spec
    return msgspec.structs.replace(
        resource_slice,
        metadata=ObjectMeta(
            name=meta.name,
            labels=meta.labels,
            annotations=meta.annotations,
            resource_version=version,
        ),
        spec=msgspec.structs.replace(
            spec,
            pool=ResourcePool(
                name=spec.pool.name, generation=generation, resource_slice_count=count
            ),
        ),
    )


async def sync_slices(
    api: KubeApi,
    driver: str,
    node: str,
    desired: Sequence[ResourceSlice],
    *,
    pool: str | None = None,
    attempts: int = SYNC_ATTEMPTS,
) -> SliceSync:
    """Make the server hold exactly ``desired`` for ``driver``'s pool on ``node``.

    ``pool`` names the pool when ``desired`` is empty (else every slice of the driver on
    the node is withdrawn); with slices, it is their ``spec.pool.name``.
    """
    pool = _check(desired, driver, node) or pool
    last: Conflict | None = None
    for _ in range(max(1, attempts)):
        try:
            return await _sync_once(api, driver, node, pool, desired)
        except Conflict as exc:
            last = exc
    assert last is not None
    raise last


async def _sync_once(
    api: KubeApi, driver: str, node: str, pool: str | None, desired: Sequence[ResourceSlice]
) -> SliceSync:
    listed = await api.list_slices(driver=driver, node=node)
    current = {s.metadata.name: s for s in listed.items if pool is None or s.spec.pool.name == pool}
    generations = {s.spec.pool.generation for s in current.values()}
    counts = {s.spec.pool.resource_slice_count for s in current.values()}
    generation = max(generations, default=0)
    wanted = {s.metadata.name: s for s in desired}
    unchanged = (
        current.keys() == wanted.keys()
        and len(generations) <= 1
        and counts <= {len(desired)}
        and all(_shape(current[name]) == _shape(s) for name, s in wanted.items())
    )
    if unchanged:
        return SliceSync(generation=generation)
    generation += 1
    created: list[str] = []
    replaced: list[str] = []
    for name, s in sorted(wanted.items()):
        have = current.get(name)
        if have is None:
            await api.create_slice(_at(s, generation, len(desired), None))
            created.append(name)
        else:
            version = have.metadata.resource_version
            try:
                await api.replace_slice(_at(s, generation, len(desired), version))
            except NotFound as exc:  # deleted since the read: read again
                raise Conflict(f"resourceslice {name} vanished: {exc}") from exc
            replaced.append(name)
    deleted: list[str] = []
    for name in sorted(current.keys() - wanted.keys()):
        have = current[name]
        with contextlib.suppress(NotFound):  # gone already: what was wanted
            await api.delete_slice(
                name, resource_version=have.metadata.resource_version, uid=have.metadata.uid
            )
        deleted.append(name)
    return SliceSync(
        generation=generation,
        created=tuple(created),
        replaced=tuple(replaced),
        deleted=tuple(deleted),
    )
