"""``dracap claim``, ``devices``, ``policy``, ``class`` and ``node``: the claims API, by hand.

The CLI holds no state and never touches PostgreSQL: every command is one or a few
NATS request/reply calls to the claims API (``names.api(namespace, op)``) or the admin
API (``names.admin(op)``), the subjects of :class:`events.subjects.BusNames`; payloads
are in ``docs/services.md``. Replies are JSON, ``{"ok": true, ...}`` or ``{"ok": false,
"error": {"code", "field", "rule", "message"}}``;
:class:`~services.runtime.bus.apiclient.ApiClient` turns the second form into an
``ApiError``, whose ``code`` picks the exit code (:mod:`services.exitcodes`):
``invalid`` -> 2, ``not_found`` -> 3, ``rejected`` / ``conflict`` -> 4. A server that
does not answer (no ``dracap up`` running, wrong prefix) is exit code 1.

Where the API is
----------------
``--nats URL``, else ``DRACAP_NATS_URL``, else the ``nats_url`` of
``<data-dir>/connection.json`` written by ``dracap up`` (``--data-dir``, default
``.dracap``). The subject prefix comes from ``--prefix``, else ``connection.json``, else
``dracap``. Every command resolves its servers this way
(:mod:`services.runtime.bus.endpoints`).

Size
----
The API takes at most :data:`~events.manifests.MAX_MANIFEST_BYTES` (256 KiB) per claim.
``claim apply`` checks each claim it is about to send against that limit (exit 2, naming
the claim and its size, before anything is sent), and a request larger than the
server's ``max_payload`` is exit 2 too.

Commands
--------
``claim apply -f FILE [-n NS] [--wait]`` decodes the file locally (a file that cannot be
read or decoded is exit 2 before anything is sent) and applies each ResourceClaim in
it; ``--wait`` then follows the claim until it is ready (or rejected, failed). ``claim get``,
``claim list``, ``claim delete`` map one-to-one onto API calls. ``claim watch [NAME]``
asks the API for a change subject, subscribes, prints the current state and then every
change until Ctrl-C or ``--timeout``. ``devices`` prints one row per device and
capacity: total, consumed, free, shares and tenants (the operator's view, admin API);
``devices -n NS`` is the tenant's view (tenant API ``claims.devices``): only devices of
classes the namespace may use, total and free, and the attributes those classes
allow-list. ``devices --policies`` lists each device capacity's request policy with
the device policy version it came with, and every live share with the version (and
so the policy) it was granted under (admin API ``policies.list``). ``policy set
--driver D --device POOL/X --capacity C [--default Q] [--min Q] [--step Q] [--max Q]
[--values Q,Q,..] [--none] [--replace]`` changes one device capacity's request policy
(``--pool P --device X`` names the device too): only the fields given change (``patch``
of admin API ``policies.set``; ``--default`` rises to a new ``--min`` above it), or with
``--replace`` the flags are the whole policy (``--default`` defaults to ``--min``). It
is a new policy version for the device, printed with the resulting policy; shares
granted earlier keep theirs. ``class set-mode
CLASS consumable|whole-device|disabled`` sets how new claims of a DeviceClass are
decided (admin API ``deviceclasses.mode``; a mode outside these three is exit 2 naming
the argument); ``class remove CLASS`` removes a DeviceClass (admin API
``deviceclasses.remove``): new claims of it are refused, allocated ones keep running.
All take ``-o table|json|yaml``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any, Final

from events.catalog import CLASS_MODES, ENFORCEMENT_LEVELS
from events.state import TERMINAL_PHASES
from services.claims.objects import claim_manifest
from services.commands.showing import CLAIM_HEADER, claim_rows, emit
from services.exitcodes import CommandError, ExitCode
from services.runtime.bus.apiclient import ApiClient
from services.runtime.bus.endpoints import add_endpoint_arguments, endpoints_from_args
from services.runtime.ground.printable import json_text, table, yaml_text
from services.runtime.ground.waiting import wait_for

__all__ = ["read_claims", "register"]


# --- rendering -----------------------------------------------------------------------------


DEVICE_HEADER: Final = [
    "NODE",
    "DRIVER",
    "POOL/DEVICE",
    "CAPACITY",
    "TOTAL",
    "CONSUMED",
    "FREE",
    "SHARES",
    "TENANTS",
]


TENANT_DEVICE_HEADER: Final = [
    "NODE",
    "DRIVER",
    "POOL/DEVICE",
    "CLASSES",
    "CAPACITY",
    "TOTAL",
    "FREE",
    "ATTRIBUTES",
]


def tenant_device_rows(devices: Sequence[dict[str, Any]]) -> list[list[str]]:
    """One row per device and capacity name, as a tenant sees them."""
    rows = []
    for d in devices:
        capacity = d.get("capacity") or {"-": {}}
        attributes = ",".join(f"{k}={v}" for k, v in (d.get("attributes") or {}).items()) or "-"
        for i, (name, c) in enumerate(sorted(capacity.items())):
            lead = (
                [
                    d.get("node") or "-",
                    d["driver"],
                    f"{d['pool']}/{d['device']}",
                    ",".join(d.get("classes") or []),
                ]
                if i == 0
                else ["", "", "", ""]
            )
            tail = [attributes] if i == 0 else [""]
            rows.append([*lead, name, *(str(c.get(k, "-")) for k in ("total", "free")), *tail])
    return rows


def device_rows(devices: Sequence[dict[str, Any]]) -> list[list[str]]:
    """One row per device and capacity name."""
    rows = []
    for d in devices:
        capacity = d.get("capacity") or {"-": {}}
        tenants = ",".join(d.get("tenants") or []) or "-"
        for i, (name, c) in enumerate(sorted(capacity.items())):
            lead = (
                [d.get("node") or "-", d["driver"], f"{d['pool']}/{d['device']}"]
                if i == 0
                else ["", "", ""]
            )
            tail = [str(d.get("shares", 0)), tenants] if i == 0 else ["", ""]
            rows.append(
                [*lead, name, *(str(c.get(k, "-")) for k in ("total", "consumed", "free")), *tail]
            )
    return rows


def emit_claims(output: str, views: list[dict[str, Any]], *, single: bool) -> None:
    data: Any = views[0] if single and views else views
    emit(output, data, lambda: table(CLAIM_HEADER, claim_rows(views)))


# --- commands ------------------------------------------------------------------------------


def read_claims(path: str, namespace: str | None) -> list[tuple[str, bytes]]:
    """``(namespace, JSON manifest)`` of every ResourceClaim in ``path`` ('-': stdin)."""
    from events import model  # the manifest loader (and the CEL parser): only to read files
    from events.manifests import ManifestError, load_documents

    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CommandError(f"{path}: cannot read: {exc}", ExitCode.BAD_INPUT) from exc
    try:
        objects = load_documents(text, path, check=False)
    except ManifestError as exc:
        raise CommandError(str(exc), ExitCode.BAD_INPUT) from exc
    claims = []
    for obj in objects:
        if not isinstance(obj, model.ResourceClaim):
            raise CommandError(
                f"{path}: {type(obj).__name__} {obj.metadata.name}: only ResourceClaims can "
                "be applied with `claim apply`; `dracap apply -f` applies every kind",
                ExitCode.BAD_INPUT,
            )
        claims.append(claim_manifest(obj, namespace, path))
    if not claims:
        raise CommandError(f"{path}: no ResourceClaim found", ExitCode.BAD_INPUT)
    return claims


async def _apply(api: ApiClient, args: argparse.Namespace) -> int:
    views = []
    for namespace, manifest in args.claims:
        view = (await api.claims(namespace, "apply", manifest))["claim"]
        if args.wait and not view.get("ready") and view.get("phase") not in TERMINAL_PHASES:
            view = await wait_ready(api, namespace, view["name"], args.timeout)
        views.append(view)
    emit_claims(args.output, views, single=len(views) == 1)
    if any(v.get("phase") == "rejected" for v in views):
        return ExitCode.REJECTED
    if args.wait and not all(v.get("ready") for v in views):
        return ExitCode.ERROR
    return ExitCode.OK


async def wait_ready(api: ApiClient, namespace: str, name: str, within_s: float) -> dict[str, Any]:
    """The claim's view once it is Ready or terminal, or the last one seen after ``within_s``."""
    last: dict[str, Any] = {}
    async with contextlib.aclosing(follow(api, namespace, name, within_s)) as views:
        async for view in views:
            last = view
            if view.get("ready") or view.get("phase") in TERMINAL_PHASES:
                break
    return last


async def follow(
    api: ApiClient, namespace: str, name: str | None, within_s: float | None
) -> AsyncGenerator[dict[str, Any], None]:
    """The current view(s), then each change, for ``within_s`` seconds (None: forever)."""
    async with api.claim_changes(namespace, name) as queue:
        if name is None:
            current = (await api.claims(namespace, "list"))["claims"]
        else:
            current = [(await api.claims(namespace, "get", {"name": name}))["claim"]]
        seen: dict[tuple[str, str], dict[str, Any]] = {}
        for view in current:
            seen[(view["namespace"], view["name"])] = view
            yield view
        deadline = None if within_s is None else time.monotonic() + within_s
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            try:
                view = await wait_for(queue.get(), left)
            except TimeoutError:
                return
            key = (view.get("namespace", namespace), view.get("name", ""))
            if seen.get(key) != view:
                seen[key] = view
                yield view


async def _watch(api: ApiClient, args: argparse.Namespace) -> int:
    header = args.output == "table"
    views = follow(api, args.namespace or "default", args.name, args.timeout)
    async with contextlib.aclosing(views):
        async for view in views:
            _print_change(args.output, view, header)
            header = False
    return ExitCode.OK


def _print_change(output: str, view: dict[str, Any], header: bool) -> None:
    if output == "json":
        print(json_text(json.dumps(view)), flush=True)
    elif output == "yaml":
        sys.stdout.write("---\n" + yaml_text(view))
        sys.stdout.flush()
    else:
        text = table(CLAIM_HEADER, claim_rows([view]))
        print(text if header else text.split("\n", 1)[1], flush=True)


async def _get(api: ApiClient, args: argparse.Namespace) -> int:
    reply = await api.claims(args.namespace or "default", "get", {"name": args.name})
    if args.output == "table":
        emit_claims(args.output, [reply["claim"]], single=True)
    else:  # the ResourceClaim as the API server would show it, dracap's view under "dracap"
        emit(args.output, reply["object"], lambda: "")
    return ExitCode.OK


async def _list(api: ApiClient, args: argparse.Namespace) -> int:
    views = (await api.claims(args.namespace or "default", "list"))["claims"]
    emit_claims(args.output, views, single=False)
    return ExitCode.OK


async def _delete(api: ApiClient, args: argparse.Namespace) -> int:
    namespace = args.namespace or "default"
    phase = (await api.claims(namespace, "delete", {"name": args.name})).get("phase")
    if args.output == "table":
        print(f"resourceclaim {namespace}/{args.name} deleted")
    else:
        done = {"namespace": namespace, "name": args.name, "deleted": True, "phase": phase}
        emit(args.output, done, str)
    return ExitCode.OK


async def _reserve(api: ApiClient, args: argparse.Namespace) -> int:
    return await _reservation(api, args, "reserve")


async def _unreserve(api: ApiClient, args: argparse.Namespace) -> int:
    return await _reservation(api, args, "unreserve")


async def _reservation(api: ApiClient, args: argparse.Namespace, op: str) -> int:
    namespace = args.namespace or "default"
    body = {"name": args.name, "consumer": args.consumer}
    if args.uid is not None:
        body["uid"] = args.uid
    reply = await api.claims(namespace, op, body)
    done = {k: reply[k] for k in ("applied", "unchanged", "reserved_for")}
    verb = "reserved" if op == "reserve" else "unreserved"
    state = "unchanged" if reply["unchanged"] else verb
    text = f"resourceclaim {namespace}/{args.name} {state} for {args.consumer}"
    emit(args.output, done, lambda: text)
    return ExitCode.OK


async def _devices(api: ApiClient, args: argparse.Namespace) -> int:
    if args.policies:
        if args.namespace:
            raise CommandError("--policies is the operator's view: no -n", ExitCode.BAD_INPUT)
        listed = (await api.admin("policies.list"))["devices"]
        emit(args.output, listed, lambda: table(POLICY_HEADER, policy_rows(listed)))
        return ExitCode.OK
    if args.namespace:  # the tenant's view, on the tenant's own subject
        mine = (await api.claims(args.namespace, "devices"))["devices"]
        emit(args.output, mine, lambda: table(TENANT_DEVICE_HEADER, tenant_device_rows(mine)))
        return ExitCode.OK
    devices = (await api.admin("devices.list"))["devices"]
    emit(args.output, devices, lambda: table(DEVICE_HEADER, device_rows(devices)))
    return ExitCode.OK


POLICY_HEADER: Final = ("DEVICE", "VERSION", "CAPACITY", "POLICY", "SHARE", "CLAIM", "CONSUMED")


def policy_rows(devices: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Per device: its policies now (``vN now``), then each live share (``vN``)."""
    rows = []
    for d in devices:
        name = f"{d['pool']}/{d['device']}"
        for p in d["policies"]:
            rows.append([name, f"v{p['version']} now", p["capacity"], p["policy"], "-", "-", "-"])
            name = ""
        for share in d["shares"]:
            for capacity, policy in sorted(share["policies"].items()):
                consumed = share["consumed"].get(capacity, "-")
                rows.append(
                    [
                        "",
                        f"v{share['policy_version']}",
                        capacity,
                        policy,
                        share["share_id"],
                        share["claim"],
                        consumed,
                    ]
                )
    return rows


def pool_and_device(pool: str | None, device: str) -> tuple[str, str]:
    """``--pool P --device X`` or ``--device P/X`` (as ``dracap devices`` prints it)."""
    named_pool, slash, name = device.rpartition("/")
    if slash and (pool is None or pool == named_pool) and named_pool and name:
        return named_pool, name
    if not slash and pool:
        return pool, device
    raise CommandError(
        f"--device {device!r}: give POOL/DEVICE (as `dracap devices` prints it), or --pool "
        "and the device's name",
        ExitCode.BAD_INPUT,
    )


def policy_of(args: argparse.Namespace) -> tuple[str, dict[str, Any] | None]:
    """The ``policies.set`` field the flags of ``policy set`` give: ``("patch", fields)``
    (only the fields given change), or with ``--replace`` ``("policy", requestPolicy)``
    (the whole policy; ``None``: ``--none``)."""
    flags = (args.default, args.min, args.step, args.max, args.values)
    if args.none:
        if any(v is not None for v in flags) or args.replace:
            raise CommandError("--none takes no other policy flag", ExitCode.BAD_INPUT)
        return "policy", None
    if not any(v is not None for v in flags):
        raise CommandError(
            "give --default, --min, --step, --max, --values or --none", ExitCode.BAD_INPUT
        )
    values = None if args.values is None else [v.strip() for v in args.values.split(",")]
    if values is not None and (not all(values) or any(v is not None for v in flags[1:4])):
        raise CommandError(
            "--values: a comma-separated list, without --min, --step or --max (a policy has "
            "validValues or a validRange)",
            ExitCode.BAD_INPUT,
        )
    if not args.replace:
        patch = dict(zip(("default", "min", "step", "max"), flags[:4], strict=True))
        patch["values"] = values
        return "patch", {k: v for k, v in patch.items() if v is not None}
    policy: dict[str, Any] = {}
    if args.default is not None:
        policy["default"] = args.default
    if values is not None:
        policy["validValues"] = values
    if args.min is not None:
        policy.setdefault("default", args.min)  # validRange needs one; min is always valid
        policy["validRange"] = {"min": args.min}
        for flag in ("step", "max"):
            if getattr(args, flag) is not None:
                policy["validRange"][flag] = getattr(args, flag)
    elif args.step is not None or args.max is not None:
        raise CommandError("--replace: --step and --max need --min", ExitCode.BAD_INPUT)
    return "policy", policy


async def _set_policy(api: ApiClient, args: argparse.Namespace) -> int:
    field, value = args.policy
    change = {
        "driver": args.driver,
        "pool": args.pool,
        "device": args.device,
        "capacity": args.capacity,
        field: value,
    }
    reply = await api.admin("policies.set", change)
    keys = ("applied", "unchanged", "policy_version", "policy", "request_policy")
    done = {k: reply.get(k) for k in keys}
    where = f"{args.driver}/{args.pool}/{args.device} {args.capacity}"
    state = "unchanged" if reply["unchanged"] else "set"
    emit(
        args.output,
        done,
        lambda: f"policy of {where} {state} (v{reply['policy_version']}): {reply['policy']}",
    )
    return ExitCode.OK


async def _set_mode(api: ApiClient, args: argparse.Namespace) -> int:
    request = {"name": args.name, "mode": args.mode}
    if args.min_enforcement is not None:
        request["min_enforcement"] = args.min_enforcement
    reply = await api.admin("deviceclasses.mode", request)
    done = {k: reply[k] for k in ("applied", "unchanged", "mode", "min_enforcement")}
    state = "unchanged" if reply["unchanged"] else "set"
    emit(
        args.output,
        done,
        lambda: (
            f"mode of DeviceClass {args.name} {state}: {reply['mode']} "
            f"(minimum enforcement {reply['min_enforcement']})"
        ),
    )
    return ExitCode.OK


CLASS_HEADER: Final = ("CLASS", "MODE", "MIN-ENFORCEMENT", "ROLLOUT")


async def _list_classes(api: ApiClient, args: argparse.Namespace) -> int:
    classes = (await api.admin("deviceclasses.list"))["classes"]
    rows = [[c["name"], c["mode"], c["min_enforcement"], c["rollout"]] for c in classes]
    emit(args.output, classes, lambda: table(CLASS_HEADER, rows))
    return ExitCode.OK


async def _remove_class(api: ApiClient, args: argparse.Namespace) -> int:
    reply = await api.admin("deviceclasses.remove", {"name": args.name})
    emit(
        args.output,
        {"applied": reply["applied"]},
        lambda: f"DeviceClass {args.name} removed (allocated claims keep running)",
    )
    return ExitCode.OK


NODE_HEADER: Final = ("NODE", "LEASE", "EPOCH", "BOOT", "RENEWED", "EXPIRES", "SHARES", "UNKNOWN")


def _seconds(value: float | None, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.1f}s{suffix}"


def node_rows(nodes: Sequence[dict[str, Any]]) -> list[list[str]]:
    """One row per node: lease state and age, epoch, boot id, live and unknown shares."""
    rows = []
    for n in nodes:
        expires = n["expires_in_s"]
        when = (
            "-"
            if expires is None
            else (f"in {expires:.1f}s" if expires >= 0 else f"{-expires:.1f}s ago")
        )
        rows.append(
            [
                n["node"],
                n["lease"],
                str(n["epoch"]),
                (n["boot_id"] or "-")[:8],
                _seconds(n["lease_age_s"], " ago"),
                when,
                str(n["live_shares"]),
                str(len(n["unknown_shares"])),
            ]
        )
    return rows


def node_detail(n: dict[str, Any]) -> str:
    """``dracap node get``: the row, then taints, the reason and each unknown share."""
    lines = [table(NODE_HEADER, node_rows([n]))]
    lines.append(f"boot id: {n['boot_id'] or '-'}")
    lines.append(f"taints:  {', '.join(n['taints']) or 'none'}")
    if n["reason"]:
        lines.append(f"reason:  {n['reason']}")
    if n["unknown_shares"]:
        lines.append("unknown shares (capacity held until the node is fenced or returns):")
        for share in n["unknown_shares"]:
            amounts = ", ".join(f"{k}={v}" for k, v in sorted(share["consumed"].items()))
            lines.append(f"  {share['share_id']}  {share['claim']}  {share['device']}  {amounts}")
    return "\n".join(lines)


async def _list_nodes(api: ApiClient, args: argparse.Namespace) -> int:
    nodes = (await api.admin("nodes.list"))["nodes"]
    emit(args.output, nodes, lambda: table(NODE_HEADER, node_rows(nodes)))
    return ExitCode.OK


async def _get_node(api: ApiClient, args: argparse.Namespace) -> int:
    node = (await api.admin("nodes.get", {"node": args.node}))["node"]
    emit(args.output, node, lambda: node_detail(node))
    return ExitCode.OK


async def _fence_node(api: ApiClient, args: argparse.Namespace) -> int:
    reply = await api.admin("nodes.fence", {"node": args.node, "reason": args.reason})
    done = {k: reply[k] for k in ("applied", "unchanged", "epoch")}
    state = "was already fenced" if reply["unchanged"] else "fenced"
    emit(
        args.output,
        done,
        lambda: f"node {args.node} {state} at epoch {reply['epoch']}; its shares are released",
    )
    return ExitCode.OK


async def _run_async(args: argparse.Namespace) -> int:
    endpoints = endpoints_from_args(args)
    credential = endpoints.credential()
    async with ApiClient.connect(endpoints.nats(), endpoints.prefix, credential) as api:
        code: int = await args.action(api, args)
        return code


def run(args: argparse.Namespace) -> int:
    """Entry point of every command here (a :class:`CommandError` is ``cli.main``'s to report)."""
    try:
        if getattr(args, "filename", None):  # bad input is exit 2 before any connection
            args.claims = read_claims(args.filename, args.namespace)
        if getattr(args, "action", None) is _set_policy:
            args.pool, args.device = pool_and_device(args.pool, args.device)
            args.policy = policy_of(args)
        if getattr(args, "action", None) is _set_mode and args.mode not in CLASS_MODES:
            raise CommandError(
                f"MODE: must be one of {', '.join(CLASS_MODES)}; got {args.mode!r}",
                ExitCode.BAD_INPUT,
            )
        level = getattr(args, "min_enforcement", None)
        if getattr(args, "action", None) is _set_mode and level not in (None, *ENFORCEMENT_LEVELS):
            raise CommandError(
                f"--min-enforcement: must be one of {', '.join(ENFORCEMENT_LEVELS)}; got {level!r}",
                ExitCode.BAD_INPUT,
            )
        return asyncio.run(_run_async(args))
    except KeyboardInterrupt:
        return ExitCode.OK


# --- registration --------------------------------------------------------------------------


def _common(parser: argparse.ArgumentParser, *, namespaced: bool = True) -> None:
    if namespaced:
        parser.add_argument("-n", "--namespace", help="the claim's namespace (default: default)")
    parser.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table")
    add_endpoint_arguments(parser, nats=True)
    parser.set_defaults(func=run)


def register(sub: Any) -> None:
    claim = sub.add_parser("claim")
    verbs = claim.add_subparsers(dest="verb", metavar="VERB", required=True)

    apply = verbs.add_parser("apply", help="submit the ResourceClaims of a file")
    apply.add_argument(
        "-f", "--filename", required=True, metavar="FILE", help="YAML/JSON; '-': stdin"
    )
    apply.add_argument("--wait", action="store_true", help="wait until each claim is Ready")
    apply.add_argument("--timeout", type=float, default=30.0, help="--wait limit in seconds")
    _common(apply)
    apply.set_defaults(action=_apply)

    for verb, action, text in (
        ("get", _get, "show one claim"),
        ("delete", _delete, "release a claim"),
    ):
        parser = verbs.add_parser(verb, help=text)
        parser.add_argument("name")
        _common(parser)
        parser.set_defaults(action=action)

    listing = verbs.add_parser("list", help="the claims of a namespace")
    _common(listing)
    listing.set_defaults(action=_list)

    for verb, action, text in (
        ("reserve", _reserve, "a consumer reserves a claim (status.reservedFor)"),
        ("unreserve", _unreserve, "a consumer gives its reservation of a claim up"),
    ):
        parser = verbs.add_parser(verb, help=text)
        parser.add_argument("name")
        parser.add_argument(
            "--for", dest="consumer", required=True, metavar="pod/NS/NAME", help="the consumer"
        )
        parser.add_argument(
            "--uid",
            help="the consumer's metadata.uid (status.reservedFor[].uid; default: one derived "
            "from the claim and the consumer's name)",
        )
        _common(parser)
        parser.set_defaults(action=action)

    watch = verbs.add_parser("watch", help="print claim states as they change (Ctrl-C stops)")
    watch.add_argument("name", nargs="?")
    watch.add_argument("--timeout", type=float, default=None, help="stop after this many seconds")
    _common(watch)
    watch.set_defaults(action=_watch)

    devices = sub.add_parser("devices")
    devices.add_argument(
        "-n",
        "--namespace",
        help="a tenant's view: the devices this namespace may use (tenant API); "
        "without it, every device (admin API)",
    )
    devices.add_argument(
        "--policies",
        action="store_true",
        help="request policies and the policy version each live share was granted under",
    )
    _common(devices, namespaced=False)
    devices.set_defaults(action=_devices)

    policy = sub.add_parser("policy")
    policy_verbs = policy.add_subparsers(dest="verb", metavar="VERB", required=True)
    setting = policy_verbs.add_parser(
        "set", help="a new request policy for one device capacity (a new policy version)"
    )
    setting.add_argument("--driver", required=True)
    setting.add_argument("--device", required=True, metavar="POOL/DEVICE", help="the device")
    setting.add_argument("--pool", help="the device's pool (or give --device POOL/DEVICE)")
    setting.add_argument("--capacity", required=True)
    for flag, text in (
        ("default", "the amount an absent request consumes"),
        ("min", "validRange.min: smaller requests are rounded up to it"),
        ("step", "validRange.step: amounts are min + k*step"),
        ("max", "validRange.max"),
        ("values", "validValues, comma-separated (instead of --min)"),
    ):
        setting.add_argument(f"--{flag}", metavar="Q", help=text)
    setting.add_argument("--none", action="store_true", help="remove the policy")
    setting.add_argument(
        "--replace",
        action="store_true",
        help="the flags are the whole new policy (default: only the fields given change; "
        "--default follows --min when it would fall below it)",
    )
    _common(setting, namespaced=False)
    setting.set_defaults(action=_set_policy)

    dclass = sub.add_parser("class")
    class_verbs = dclass.add_subparsers(dest="verb", metavar="VERB", required=True)
    mode = class_verbs.add_parser(
        "set-mode", help="how new claims of a class are decided (existing ones never change)"
    )
    mode.add_argument("name", metavar="CLASS")
    mode.add_argument("mode", metavar="MODE", help=" | ".join(CLASS_MODES))
    mode.add_argument(
        "--min-enforcement",
        metavar="LEVEL",
        help="the least enforcement a node must offer for new shares: "
        f"{' | '.join(ENFORCEMENT_LEVELS)} (default: keep the one in force)",
    )
    _common(mode, namespaced=False)
    mode.set_defaults(action=_set_mode)
    listing_classes = class_verbs.add_parser(
        "list", help="every DeviceClass with its mode and minimum enforcement"
    )
    _common(listing_classes, namespaced=False)
    listing_classes.set_defaults(action=_list_classes)
    removing = class_verbs.add_parser(
        "remove", help="remove a DeviceClass: new claims refused, allocated ones keep running"
    )
    removing.add_argument("name", metavar="CLASS")
    _common(removing, namespaced=False)
    removing.set_defaults(action=_remove_class)

    node = sub.add_parser("node")
    node_verbs = node.add_subparsers(dest="verb", metavar="VERB", required=True)
    listing_nodes = node_verbs.add_parser(
        "list", help="every node: lease, epoch, boot id, taints and unknown shares"
    )
    _common(listing_nodes, namespaced=False)
    listing_nodes.set_defaults(action=_list_nodes)
    getting = node_verbs.add_parser("get", help="one node, with its unknown shares")
    getting.add_argument("node", metavar="NODE")
    _common(getting, namespaced=False)
    getting.set_defaults(action=_get_node)
    fencing = node_verbs.add_parser(
        "fence",
        help="declare a node off: its shares are released, its agent's old epoch refused",
    )
    fencing.add_argument("node", metavar="NODE")
    fencing.add_argument("--reason", required=True, help="why (recorded with you as actor)")
    _common(fencing, namespaced=False)
    fencing.set_defaults(action=_fence_node)
