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
apply`` runs.

Get and delete
--------------
``get`` prints a table (``-o table``), or the objects as the log holds them (``-o
yaml|json``: one object when a name is given, else a ``List``), with dracap's own view
under the key ``dracap`` (a class's mode, a namespace's live claims, a claim's phase and
shares); applying that output again records nothing new. A name that does not exist is
exit 3.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, NamedTuple

from services.claims.command import CLAIM_HEADER, claim_manifest, claim_rows, emit
from services.exitcodes import CommandError, ExitCode
from services.runtime.bus.apiclient import ApiClient, ApiError
from services.runtime.bus.endpoints import add_endpoint_arguments, endpoints_from_args
from services.runtime.ground.printable import table

__all__ = ["KINDS", "Applied", "Kind", "apply_objects", "kind_of", "read_objects", "register"]

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
_REFUSED: Final = {
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
        tail = f": {self.reason}" if self.reason and self.result in _REFUSED else ""
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


async def _apply(api: ApiClient, args: argparse.Namespace) -> int:
    done = await apply_objects(api, args.objects, args.namespace, ", ".join(args.filename))
    rows = [a._asdict() for a in done]
    emit(args.output, rows, lambda: "\n".join(a.line() for a in done))
    refused = [_REFUSED[a.result] for a in done if a.result in _REFUSED]
    return refused[0] if refused else ExitCode.OK


# --- get -------------------------------------------------------------------------------------

_ADMIN_GET: Final = {
    "DeviceClass": "deviceclasses.get",
    "ResourceSlice": "slices.get",
    "Namespace": "namespaces.get",
}


def _class_rows(objects: Sequence[dict[str, Any]]) -> str:
    rows = []
    for obj in objects:
        view = obj.get("dracap") or {}
        selectors = len((obj.get("spec") or {}).get("selectors") or [])
        rows.append(
            [
                obj["metadata"]["name"],
                view.get("mode", "-"),
                view.get("min_enforcement", "-"),
                str(selectors),
            ]
        )
    return table(["NAME", "MODE", "MIN-ENFORCEMENT", "SELECTORS"], rows)


def _slice_rows(objects: Sequence[dict[str, Any]]) -> str:
    rows = []
    for obj in objects:
        spec = obj.get("spec") or {}
        rows.append(
            [
                obj["metadata"]["name"],
                spec.get("nodeName") or "-",
                spec.get("driver", "-"),
                (spec.get("pool") or {}).get("name", "-"),
                str(len(spec.get("devices") or [])),
            ]
        )
    return table(["NAME", "NODE", "DRIVER", "POOL", "DEVICES"], rows)


def _namespace_rows(objects: Sequence[dict[str, Any]]) -> str:
    from events import tenancy  # turns the annotations back into the policy they ask for
    from events.model import Namespace, convert

    rows = []
    for obj in objects:
        policy = tenancy.namespace_policy(convert(obj, Namespace))
        rows.append(
            [
                policy.namespace,
                ",".join(policy.classes) or "-",
                "yes" if policy.admin_access else "no",
                ",".join(policy.opaque_config_classes) or "-",
                "-" if policy.max_claims is None else str(policy.max_claims),
                str((obj.get("dracap") or {}).get("live_claims", 0)),
            ]
        )
    header = ["NAME", "CLASSES", "ADMIN-ACCESS", "OPAQUE-CONFIG", "MAX-CLAIMS", "LIVE-CLAIMS"]
    return table(header, rows)


_TABLES: Final[dict[str, Callable[[Sequence[dict[str, Any]]], str]]] = {
    "DeviceClass": _class_rows,
    "ResourceSlice": _slice_rows,
    "Namespace": _namespace_rows,
}


def _emit_objects(
    output: str, objects: list[dict[str, Any]], single: bool, render: Callable[[], str]
) -> None:
    data: Any = objects[0] if single else {"apiVersion": "v1", "kind": "List", "items": objects}
    emit(output, data, render)


async def _get(api: ApiClient, args: argparse.Namespace) -> int:
    kind: Kind = args.kind
    single = args.name is not None
    if kind.name == "ResourceClaim":
        namespace = args.namespace or "default"
        if single:
            reply = await api.claims(namespace, "get", {"name": args.name})
            views, objects = [reply["claim"]], [reply["object"]]
        else:
            reply = await api.claims(namespace, "list", {"objects": args.output != "table"})
            views, objects = reply["claims"], reply.get("objects", [])
        _emit_objects(args.output, objects, single, lambda: table(CLAIM_HEADER, claim_rows(views)))
        return ExitCode.OK
    body = {"name": args.name} if single else {}
    objects = (await api.admin(_ADMIN_GET[kind.name], body))["objects"]
    _emit_objects(args.output, objects, single, lambda: _TABLES[kind.name](objects))
    return ExitCode.OK


# --- delete ----------------------------------------------------------------------------------


async def _delete(api: ApiClient, args: argparse.Namespace) -> int:
    kind: Kind = args.kind
    namespace = None
    if kind.name == "DeviceClass":
        await api.admin("deviceclasses.remove", {"name": args.name})
        note = "new claims of it are refused; allocated ones keep running"
    elif kind.name == "Namespace":
        await api.admin("namespaces.get", {"name": args.name})  # not found: exit 3
        await api.admin("namespaces.access", {"namespace": args.name, "classes": []})
        note = "its access is withdrawn; its live claims keep running"
    elif kind.name == "ResourceClaim":
        namespace = args.namespace or "default"
        reply = await api.claims(namespace, "delete", {"name": args.name})
        note = f"phase {reply.get('phase')}"
    else:
        raise CommandError(
            "resourceslices cannot be deleted here: a node's agent publishes and withdraws "
            "its node's slices; apply a slice again to change it",
            ExitCode.BAD_INPUT,
        )
    who = f"{namespace}/{args.name}" if namespace else args.name
    done = {"kind": kind.name, "name": args.name, "namespace": namespace, "deleted": True}
    emit(args.output, done, lambda: f"{kind.prefix}/{who} deleted ({note})")
    return ExitCode.OK


# --- the commands ----------------------------------------------------------------------------


async def _run_async(args: argparse.Namespace) -> int:
    endpoints = endpoints_from_args(args)
    async with ApiClient.connect(endpoints.nats(), endpoints.prefix, endpoints.credential()) as api:
        action: Callable[[ApiClient, argparse.Namespace], Awaitable[int]] = args.action
        return await action(api, args)


def run(args: argparse.Namespace) -> int:
    """Entry point of the three commands (bad input is exit 2 before any connection)."""
    try:
        if args.action is _apply:
            args.objects = read_objects(args.filename)
        else:
            args.kind = kind_of(args.kind)
        return asyncio.run(_run_async(args))
    except KeyboardInterrupt:
        return ExitCode.OK


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-n", "--namespace", help="the namespace of claims (default: the object's, else default)"
    )
    parser.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table")
    add_endpoint_arguments(parser, nats=True)
    parser.set_defaults(func=run)


def register(sub: Any) -> None:
    apply = sub.add_parser("apply")
    apply.add_argument(
        "-f",
        "--filename",
        action="append",
        required=True,
        metavar="FILE|DIR|-",
        help="YAML/JSON manifests; a directory: its .yaml/.yml/.json files; '-': stdin "
        "(repeatable)",
    )
    _common(apply)
    apply.set_defaults(action=_apply)

    kinds = ", ".join(k.names[0] for k in KINDS.values())
    get = sub.add_parser("get")
    get.add_argument("kind", metavar="KIND", help=kinds)
    get.add_argument("name", metavar="NAME", nargs="?", help="one object (default: every one)")
    _common(get)
    get.set_defaults(action=_get)

    delete = sub.add_parser("delete")
    delete.add_argument("kind", metavar="KIND", help=kinds)
    delete.add_argument("name", metavar="NAME")
    _common(delete)
    delete.set_defaults(action=_delete)
