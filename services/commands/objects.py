"""``dracap apply``, ``dracap get`` and ``dracap delete``: their command lines.

What each kind is and how objects are applied is :mod:`services.claims.objects`'s (the
stack applies ``dracap up``'s inventory with the same :func:`~services.claims.objects.
apply_objects`); here: reading the flags, printing what was done, the exit code.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

from services.claims.objects import KINDS, REFUSED, Kind, apply_objects, kind_of, read_objects
from services.commands.showing import CLAIM_HEADER, claim_rows, emit
from services.exitcodes import CommandError, ExitCode
from services.runtime.bus.apiclient import ApiClient
from services.runtime.bus.endpoints import add_endpoint_arguments, endpoints_from_args
from services.runtime.ground.printable import table

__all__ = ["register"]


# --- apply -----------------------------------------------------------------------------------


async def _apply(api: ApiClient, args: argparse.Namespace) -> int:
    done = await apply_objects(api, args.objects, args.namespace, ", ".join(args.filename))
    rows = [a._asdict() for a in done]
    emit(args.output, rows, lambda: "\n".join(a.line() for a in done))
    refused = [REFUSED[a.result] for a in done if a.result in REFUSED]
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
