"""``dracap allocate``: run the allocator over manifest files, offline.

Reads Namespaces, DeviceClasses, ResourceSlices and ResourceClaims; claims that
already carry ``status.allocation`` are the allocated state (their admin-access
results consume nothing); every other claim is decided in the order given, each
seeing the ones before it. Nothing is written anywhere: this is the allocator as a
tool, for operators checking an inventory and for comparing with upstream.

Input handling (see ``docs/allocate.md``): a file that cannot be read or decoded, or
an invalid DeviceClass/ResourceSlice/Namespace, stops the run with exit code 2 and a
message naming file and field. A ResourceClaim that breaks an API rule is reported
as ``invalid`` with that rule, like any other claim the allocator cannot take.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import msgspec

from events import model
from events.errors import ValidationError
from events.features import ALL_GATES, DEFAULT_GATES, FeatureGates, parse_feature_gates
from events.inventory import Inventory
from events.manifests import ManifestError, dump_yaml, load_paths
from events.validation import validate
from services.exitcodes import ExitCode
from services.reservation.allocating import Allocator, grants_from_claim
from services.reservation.outcomes import Allocated, Invalid, Outcome
from services.runtime.ground.printable import json_text, printable


class ReportRow(msgspec.Struct, kw_only=True):
    claim: str
    outcome: str
    reason: str
    allocation: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET


def allocate_manifests(
    objects: Sequence[tuple[str, model.Manifest]],
    *,
    node: str | None = None,
    gates: FeatureGates = DEFAULT_GATES,
) -> list[tuple[model.ResourceClaim, Outcome]]:
    """Decide every unallocated claim of ``objects`` in order; claims see earlier ones."""
    classes: list[model.DeviceClass] = []
    slices: list[model.ResourceSlice] = []
    claims: list[model.ResourceClaim] = []
    namespaces: dict[str, model.Namespace] = {}
    for _, obj in objects:
        if isinstance(obj, model.DeviceClass):
            classes.append(obj)
        elif isinstance(obj, model.ResourceSlice):
            slices.append(obj)
        elif isinstance(obj, model.ResourceClaim):
            claims.append(obj)
        else:
            namespaces[obj.metadata.name] = obj
    allocator = Allocator(Inventory(classes, slices, gates=gates))
    pending: list[model.ResourceClaim] = []
    for claim in claims:
        if not _pending(claim):
            allocator.add_grants(
                grants_from_claim(claim, consumable_capacity=gates.consumable_capacity)
            )
        else:
            pending.append(claim)
    decisions: list[tuple[model.ResourceClaim, Outcome]] = []
    for claim in pending:
        ref = f"{claim.metadata.namespace}/{claim.metadata.name}"
        try:
            validate(claim, gates)
        except ValidationError as exc:
            decisions.append((claim, Invalid(claim=ref, reason=f"{exc.field}: {exc.rule}")))
            continue
        ns = namespaces.get(claim.metadata.namespace or "")
        outcome = allocator.allocate(
            claim,
            node=node,
            any_node=node is None,
            admin_access_allowed=ns is not None and ns.allows_admin_access,
        )
        if isinstance(outcome, Allocated):
            allocator.commit(outcome)
        decisions.append((claim, outcome))
    return decisions


def _pending(claim: model.ResourceClaim) -> bool:
    return claim.status is None or claim.status.allocation is None


def report_rows(decisions: Sequence[tuple[model.ResourceClaim, Outcome]]) -> list[ReportRow]:
    rows = []
    for _, outcome in decisions:
        if isinstance(outcome, Allocated):
            rows.append(
                ReportRow(
                    claim=outcome.claim,
                    outcome="allocated",
                    reason="",
                    allocation=model.to_builtins(outcome.allocation),
                )
            )
        else:
            kind = "invalid" if isinstance(outcome, Invalid) else "unschedulable"
            rows.append(ReportRow(claim=outcome.claim, outcome=kind, reason=outcome.reason))
    return rows


def with_status(claim: model.ResourceClaim, outcome: Outcome) -> model.ResourceClaim:
    """The claim with ``status.allocation`` filled when it was allocated."""
    if not isinstance(outcome, Allocated):
        return claim
    status = claim.status or model.ResourceClaimStatus()
    return msgspec.structs.replace(
        claim, status=msgspec.structs.replace(status, allocation=outcome.allocation)
    )


def render_table(rows: Sequence[ReportRow]) -> str:
    """The report as the table ``dracap allocate`` prints by default."""
    lines = [f"{'CLAIM':<32} {'OUTCOME':<14} DETAIL"]
    for row in rows:
        if row.outcome == "allocated" and isinstance(row.allocation, dict):
            results = row.allocation.get("devices", {}).get("results", [])
            detail = ", ".join(
                f"{r['request']}->{r['pool']}/{r['device']}"
                + (
                    " (" + ",".join(f"{k}={v}" for k, v in r["consumedCapacity"].items()) + ")"
                    if r.get("consumedCapacity")
                    else ""
                )
                for r in results
            )
        else:
            detail = row.reason
        lines.append(f"{printable(row.claim):<32} {row.outcome:<14} {printable(detail)}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        gates = parse_feature_gates(args.feature_gates or "")
    except ValidationError as exc:
        print(f"error: {printable(exc)}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    try:
        objects = load_paths(args.filename, check=False)
        for source, obj in objects:
            if isinstance(obj, model.ResourceClaim) and _pending(obj):
                continue  # decided below: a broken claim is reported as invalid
            try:
                validate(obj, ALL_GATES)
            except ValidationError as exc:
                raise ManifestError(source, None, exc.field, exc.rule, obj=exc.obj) from exc
    except ManifestError as exc:
        print(f"error: {printable(exc)}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    decisions = allocate_manifests(objects, node=args.node, gates=gates)
    if args.output == "json":
        rows = report_rows(decisions)
        sys.stdout.write(json_text(msgspec.json.encode({"results": rows})) + "\n")
    elif args.output == "yaml":
        sys.stdout.write(dump_yaml([with_status(claim, outcome) for claim, outcome in decisions]))
    else:
        print(render_table(report_rows(decisions)))
    return ExitCode.OK


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "allocate",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    parser.add_argument(
        "-f",
        "--filename",
        action="append",
        required=True,
        metavar="PATH",
        help="a manifest file or a directory of them (repeatable)",
    )
    parser.add_argument("--node", help="allocate for this node (default: the first that fits)")
    parser.add_argument(
        "--feature-gates",
        default="",
        metavar="NAME=BOOL,...",
        help="Kubernetes DRA feature gates (DRAConsumableCapacity defaults to true)",
    )
    parser.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table")
    parser.set_defaults(func=run)
