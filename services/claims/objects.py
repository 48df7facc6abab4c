"""``dracap apply``, ``dracap get`` and ``dracap delete``: the control plane's objects by kind.

As kubectl does, ``dracap apply -f FILE|DIR|-`` sends each object of its files where its
``kind`` belongs, and ``dracap get KIND [NAME]`` / ``dracap delete KIND NAME`` take a
kind by its name, plural or short name, in any case:

=============  =====================  ===================  ===================  ===================
kind           names                  apply                get                  delete
=============  =====================  ===================  ===================  ===================
DeviceClass    deviceclass(es), dc    deviceclasses.apply  deviceclasses.get    deviceclasses.remove
                                                                                (new claims refused,
                                                                                allocated ones run)
Namespace      namespace(s), ns       namespaces.access    namespaces.get       namespaces.access
                                      (its ``dracap.io/``                       with nothing allowed
                                      annotations)                              (live claims run)
ResourceSlice  resourceslice(s),      slices.apply         slices.get           refused: its node's
               slice(s)                                                         agent withdraws it
ResourceClaim  resourceclaim(s),      claims.apply (the    claims.get,          claims.delete
               claim(s)               claim's namespace)   claims.list
=============  =====================  ===================  ===================  ===================

The first three are the admin API's (operators' credentials); claims go on their
namespace's tenant subject, so a tenant's credentials apply, get and delete the claims
of their own namespace with these commands too.

Apply
-----
Every file is read and every object but a claim is checked (schema, feature gates,
``dracap.io/`` annotations) before anything is sent: a bad object anywhere is one line
naming file, document and field, exit 2, and nothing is applied. Claims are checked by
admission, which records an invalid one as rejected, as ``dracap claim apply`` does.
Objects are sent kind by kind in the order a claim needs them — DeviceClasses,
Namespaces, ResourceSlices, then ResourceClaims — and in file order within a kind;
classes and slices in batches (one request per 512 KiB). Each object gets one line,
``KIND/NAME applied|unchanged`` (a claim: its phase, and the reason when rejected); an
admin write equal to what the log holds appends nothing. ``-n NS`` is the namespace of
claims that name none (else ``default``). Exit 4 when a claim was rejected.

``dracap up`` loads its inventory with :func:`apply_objects`, the function ``dracap
apply`` runs. The three command lines (flags, printing, exit codes) are
:mod:`services.commands.objects`'s; this module is what they and the stack share.

Get and delete
--------------
``get`` prints a table (``-o table``), or the objects as the log holds them (``-o
yaml|json``: one object when a name is given, else a ``List``), with dracap's own view
under the key ``dracap`` (a class's mode, a namespace's live claims, a claim's phase and
shares); applying that output again records nothing new. A name that does not exist is
exit 3.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, NamedTuple

from services.exitcodes import CommandError, ExitCode
from services.runtime.bus.apiclient import ApiClient, ApiError

__all__ = [
    "KINDS",
    "REFUSED",
    "Applied",
    "Kind",
    "apply_objects",
    "claim_manifest",
    "kind_of",
    "read_objects",
]

#: The largest batch of DeviceClasses or ResourceSlices sent in one request (the admin
#: API takes 1 MiB; NATS' default max_payload is 1 MiB too).
BATCH_BYTES: Final = 512 * 1024


class Kind(NamedTuple):
    """A kind ``dracap apply/get/delete`` know (see the module docstring)."""

    name: str
    names: tuple[str, ...]  #: what ``get``/``delete`` accept for it (lower case)
    prefix: str  #: how its lines name it (``deviceclass/NAME``)
    order: int  #: when ``apply`` sends it


KINDS: Final = {
    "DeviceClass": Kind("DeviceClass", ("deviceclass", "deviceclasses", "dc"), "deviceclass", 0),
    "Namespace": Kind("Namespace", ("namespace", "namespaces", "ns"), "namespace", 1),
    "ResourceSlice": Kind(
        "ResourceSlice", ("resourceslice", "resourceslices", "slice", "slices"), "resourceslice", 2
    ),
    "ResourceClaim": Kind(
        "ResourceClaim", ("resourceclaim", "resourceclaims", "claim", "claims"), "resourceclaim", 3
    ),
}
_BY_NAME: Final = {name: kind for kind in KINDS.values() for name in kind.names}


def kind_of(text: str) -> Kind:
    """The kind ``text`` names; :class:`CommandError` (exit 2) listing the known ones."""
    kind = _BY_NAME.get(text.lower()) or _BY_NAME.get(text.lower().split(".", 1)[0])
    if kind is None:
        known = ", ".join(k.names[0] for k in KINDS.values())
        raise CommandError(f"KIND: must be one of {known}; got {text!r}", ExitCode.BAD_INPUT)
    return kind


#: What a claim's apply may answer instead of a phase (the API's error codes), and the
#: exit code of each; ``rejected`` is also the phase of a claim admission refused.
REFUSED: Final = {
    "rejected": ExitCode.REJECTED,
    "conflict": ExitCode.REJECTED,
    "forbidden": ExitCode.REJECTED,
    "invalid": ExitCode.BAD_INPUT,
    "too_large": ExitCode.BAD_INPUT,
}


class Applied(NamedTuple):
    """What ``apply`` did with one object."""

    kind: str
    name: str
    result: str  #: applied, unchanged, or a claim's phase
    namespace: str | None = None
    reason: str | None = None

    def line(self) -> str:
        who = f"{self.namespace}/{self.name}" if self.namespace else self.name
        tail = f": {self.reason}" if self.reason and self.result in REFUSED else ""
        return f"{KINDS[self.kind].prefix}/{who} {self.result}{tail}"


# --- apply -----------------------------------------------------------------------------------


def read_objects(paths: Sequence[str]) -> list[Any]:
    """Every object of ``paths`` (files, directories, ``-``: stdin), in reading order,
    every kind but ResourceClaim checked; :class:`CommandError` (exit 2) at the first
    that cannot be read, decoded or accepted."""
    import sys

    from events import model  # the loader and the CEL parser: only for the files
    from events.manifests import ManifestError, load_documents, load_paths

    checked = (model.DeviceClass, model.ResourceSlice, model.Namespace)
    objects: list[Any] = []
    try:
        for path in paths:
            if path == "-":
                objects += load_documents(sys.stdin.read(), "<stdin>", check=checked)
            else:
                objects += [obj for _, obj in load_paths([path], check=checked)]
    except ManifestError as exc:
        raise CommandError(str(exc), ExitCode.BAD_INPUT) from exc
    if not objects:
        raise CommandError(f"{', '.join(paths)}: no object found", ExitCode.BAD_INPUT)
    return objects


def _batches(manifests: Sequence[bytes]) -> list[bytes]:
    """``manifests`` (JSON objects) as JSON ``List`` s of at most :data:`BATCH_BYTES`."""
    out: list[bytes] = []
    batch: list[bytes] = []
    size = 0
    for manifest in manifests:
        if batch and size + len(manifest) > BATCH_BYTES:
            out.append(_list(batch))
            batch, size = [], 0
        batch.append(manifest)
        size += len(manifest) + 1
    if batch:
        out.append(_list(batch))
    return out


def _list(items: Sequence[bytes]) -> bytes:
    return b'{"apiVersion":"v1","kind":"List","items":[' + b",".join(items) + b"]}"


async def _apply_batched(
    api: ApiClient, op: str, kind: str, objects: Sequence[Any]
) -> list[Applied]:
    from events import model

    done: list[Applied] = []
    for batch in _batches([model.encode_json(obj) for obj in objects]):
        reply = await api.admin(op, batch)
        done += [Applied(kind, name, "applied") for name in reply["applied"]]
        done += [Applied(kind, name, "unchanged") for name in reply["unchanged"]]
    return done


async def apply_objects(
    api: ApiClient, objects: Sequence[Any], namespace: str | None = None, source: str = "-"
) -> list[Applied]:
    """Apply ``objects`` in the order of the module docstring; what happened to each."""
    import msgspec

    from events import tenancy

    by_kind: dict[str, list[Any]] = {}
    for obj in objects:
        by_kind.setdefault(type(obj).__name__, []).append(obj)
    done: list[Applied] = []
    if by_kind.get("DeviceClass"):
        done += await _apply_batched(
            api, "deviceclasses.apply", "DeviceClass", by_kind["DeviceClass"]
        )
    for ns in by_kind.get("Namespace", ()):  # annotations: events.tenancy, docs/tenancy.md
        policy = tenancy.namespace_policy(ns)
        reply = await api.admin("namespaces.access", msgspec.to_builtins(policy))
        result = "unchanged" if reply.get("unchanged") else "applied"
        done.append(Applied("Namespace", policy.namespace, result))
    if by_kind.get("ResourceSlice"):
        done += await _apply_batched(api, "slices.apply", "ResourceSlice", by_kind["ResourceSlice"])
    for claim in by_kind.get("ResourceClaim", ()):
        ns, manifest = claim_manifest(claim, namespace, source)
        try:
            view = (await api.claims(ns, "apply", manifest))["claim"]
        except ApiError as exc:  # refused (recorded as rejected, or not at all): the next
            reason = str(exc).removeprefix(f"{exc.code}: ")
            done.append(Applied("ResourceClaim", claim.metadata.name, exc.code, ns, reason))
            continue
        done.append(Applied("ResourceClaim", view["name"], view["phase"], ns, view.get("reason")))
    return done


def claim_manifest(claim: Any, namespace: str | None, source: str) -> tuple[str, bytes]:
    """``(namespace, JSON manifest)`` of a ResourceClaim ``claim`` (its namespace:
    ``namespace``, else its own, else ``default``); :class:`CommandError` (exit 2) when it
    is larger than the API takes, before anything is sent."""
    import msgspec

    from events import model
    from events.manifests import MAX_MANIFEST_BYTES

    ns = namespace or claim.metadata.namespace or "default"
    if claim.metadata.namespace is None:
        meta = msgspec.structs.replace(claim.metadata, namespace=ns)
        claim = msgspec.structs.replace(claim, metadata=meta)
    manifest = model.encode_json(claim)
    if len(manifest) > MAX_MANIFEST_BYTES:
        raise CommandError(
            f"{source}: ResourceClaim {ns}/{claim.metadata.name}: {len(manifest)} bytes; "
            f"a claim must be at most {MAX_MANIFEST_BYTES} bytes "
            f"({MAX_MANIFEST_BYTES // 1024} KiB, the API's limit)",
            ExitCode.BAD_INPUT,
        )
    return ns, manifest
