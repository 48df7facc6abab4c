"""The field rules every ``resource.k8s.io/v1`` object shares: limits, name formats,
metadata, selectors, CEL, opaque configuration and node selectors. Pure.

The limits are Kubernetes 1.34's (``dra-semantics.md`` §2); the name formats are the
API machinery's (DNS labels and subdomains, qualified names, C identifiers, semantic
versions). A :class:`Checker` carries one object's reference and the feature gates
through its checks and raises the first problem as
:class:`~events.errors.ValidationError`; the ``check_*`` functions are the pieces the
validation of each kind (:mod:`events.validation`, :mod:`events.slicevalidation`)
is made of.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import msgspec

from events import model
from events.errors import ValidationError
from events.features import FeatureGates
from events.quantities import Quantity
from events.selectors import selector_problem

__all__ = [
    "ALLOCATION_CONFIG_MAX",
    "ALLOCATION_MODES",
    "ATTRIBUTES_AND_CAPACITY_MAX",
    "ATTRIBUTE_VALUE_MAX_LENGTH",
    "BINDING_CONDITIONS_MAX",
    "CEL_EXPRESSION_MAX_LENGTH",
    "CONFIG_MAX",
    "CONFIG_SOURCES",
    "CONSTRAINTS_MAX",
    "DEVICES_MAX",
    "DNS_LABEL_MAX_LENGTH",
    "DNS_LABEL_RULE",
    "DNS_SUBDOMAIN_MAX_LENGTH",
    "DNS_SUBDOMAIN_RULE",
    "DOMAIN_MAX_LENGTH",
    "DRIVER_NAME_MAX_LENGTH",
    "FIRST_AVAILABLE_MAX",
    "LABEL_VALUE_MAX_LENGTH",
    "NODE_SELECTOR_OPERATORS",
    "OPAQUE_PARAMETERS_MAX_BYTES",
    "POOL_NAME_MAX_LENGTH",
    "QUALIFIED_ID_MAX_LENGTH",
    "QUALIFIED_NAME_RULE",
    "REQUESTS_MAX",
    "RESERVED_FOR_MAX",
    "RESULTS_MAX",
    "SELECTORS_MAX",
    "TAINTS_MAX",
    "TOLERATIONS_MAX",
    "UUID_PATTERN",
    "VALID_VALUES_MAX",
    "Checker",
    "check_api_version",
    "check_cel",
    "check_label",
    "check_metadata",
    "check_node_selector",
    "check_opaque",
    "check_selectors",
    "is_c_identifier",
    "is_dns_label",
    "is_dns_subdomain",
    "is_fully_qualified_name",
    "is_qualified_name",
    "is_semver",
    "keyed",
    "split_qualified_name",
]

# --- limits (Kubernetes 1.34, resource.k8s.io/v1) ----------------------------------------

DEVICES_MAX = 128
ATTRIBUTES_AND_CAPACITY_MAX = 32
ATTRIBUTE_VALUE_MAX_LENGTH = 64
QUALIFIED_ID_MAX_LENGTH = 32
DOMAIN_MAX_LENGTH = 63
DRIVER_NAME_MAX_LENGTH = 63
POOL_NAME_MAX_LENGTH = 253
DNS_LABEL_MAX_LENGTH = 63
DNS_SUBDOMAIN_MAX_LENGTH = 253
REQUESTS_MAX = 32
RESULTS_MAX = 32
SELECTORS_MAX = 32
CONSTRAINTS_MAX = 32
CONFIG_MAX = 32
ALLOCATION_CONFIG_MAX = 64
FIRST_AVAILABLE_MAX = 8
TOLERATIONS_MAX = 16
TAINTS_MAX = 4
BINDING_CONDITIONS_MAX = 4
RESERVED_FOR_MAX = 256
VALID_VALUES_MAX = 10
CEL_EXPRESSION_MAX_LENGTH = 10 * 1024
OPAQUE_PARAMETERS_MAX_BYTES = 10 * 1024
LABEL_VALUE_MAX_LENGTH = 63

ALLOCATION_MODES = (model.ALLOCATION_MODE_EXACT_COUNT, model.ALLOCATION_MODE_ALL)
CONFIG_SOURCES = ("FromClass", "FromClaim")
NODE_SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")

# --- name formats ------------------------------------------------------------------------

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
UUID_PATTERN = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
# Semantic Versioning 2.0.0 (https://semver.org/#backusnaur-form-grammar).
_NUMERIC = r"(0|[1-9][0-9]*)"
_PRE_ID = r"(0|[1-9][0-9]*|[0-9]*[A-Za-z-][0-9A-Za-z-]*)"
_SEMVER = re.compile(
    rf"{_NUMERIC}\.{_NUMERIC}\.{_NUMERIC}"
    rf"(-{_PRE_ID}(\.{_PRE_ID})*)?"
    r"(\+[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?"
)

DNS_LABEL_RULE = (
    "must be a DNS label: at most 63 lowercase alphanumerics or '-', alphanumeric at both ends"
)
DNS_SUBDOMAIN_RULE = (
    "must be a DNS subdomain: at most 253 lowercase alphanumerics, '-' or '.', "
    "alphanumeric at both ends of every label"
)
QUALIFIED_NAME_RULE = (
    "must be a C identifier of at most 32 characters, optionally prefixed by a DNS "
    "subdomain of at most 63 characters and '/'"
)


def is_dns_label(name: str) -> bool:
    """RFC 1123 label: at most 63 lowercase alphanumerics or ``-``."""
    return len(name) <= DNS_LABEL_MAX_LENGTH and _DNS_LABEL.fullmatch(name) is not None


def is_dns_subdomain(name: str, max_length: int = DNS_SUBDOMAIN_MAX_LENGTH) -> bool:
    """RFC 1123 subdomain: dot-separated labels, at most ``max_length`` characters."""
    return len(name) <= max_length and _DNS_SUBDOMAIN.fullmatch(name) is not None


def is_c_identifier(name: str) -> bool:
    """``[A-Za-z_][A-Za-z0-9_]*`` of at most 32 characters (the id of a QualifiedName)."""
    return len(name) <= QUALIFIED_ID_MAX_LENGTH and _C_IDENTIFIER.fullmatch(name) is not None


def is_qualified_name(name: str) -> bool:
    """``<id>`` or ``<domain>/<id>``: a device attribute or capacity name."""
    domain, sep, ident = name.rpartition("/")
    if sep and not is_dns_subdomain(domain, DOMAIN_MAX_LENGTH):
        return False
    return is_c_identifier(ident)


def is_fully_qualified_name(name: str) -> bool:
    """``<domain>/<id>``: a QualifiedName whose domain is spelled out."""
    return "/" in name and is_qualified_name(name)


def is_semver(text: str) -> bool:
    """A Semantic Versioning 2.0.0 version (no leading ``v``)."""
    return _SEMVER.fullmatch(text) is not None


def split_qualified_name(name: str, driver: str) -> tuple[str, str]:
    """``(domain, id)`` of a QualifiedName; a name without a domain belongs to ``driver``."""
    domain, sep, ident = name.rpartition("/")
    return (domain, ident) if sep else (driver, name)


# --- plumbing ------------------------------------------------------------------------------

Sized = Sequence[Any] | Mapping[str, Any]


class Checker:
    """Carries the object reference and the gates through the checks of one object."""

    def __init__(self, ref: str, gates: FeatureGates) -> None:
        self.ref = ref
        self.gates = gates

    def fail(self, field: str, rule: str) -> NoReturn:
        raise ValidationError(self.ref, field, rule)

    def gated(self, field: str, value: object, enabled: bool, gate: str) -> None:
        if value is not None and not enabled:
            self.fail(field, f"forbidden: requires feature gate {gate}")

    def at_most(self, field: str, items: Sized | None, limit: int) -> None:
        if items is not None and len(items) > limit:
            self.fail(field, f"must have at most {limit} entries, got {len(items)}")

    def dns_label(self, field: str, name: str) -> None:
        if not name:
            self.fail(field, "required")
        if not is_dns_label(name):
            self.fail(field, DNS_LABEL_RULE)

    def dns_subdomain(self, field: str, name: str, max_length: int = 253) -> None:
        if not name:
            self.fail(field, "required")
        if len(name) > max_length:
            self.fail(field, f"must be at most {max_length} characters")
        if not is_dns_subdomain(name, max_length):
            self.fail(field, DNS_SUBDOMAIN_RULE)

    def driver(self, field: str, name: str) -> None:
        self.dns_subdomain(field, name, DRIVER_NAME_MAX_LENGTH)

    def pool_name(self, field: str, name: str) -> None:
        if not name:
            self.fail(field, "required")
        if len(name) > POOL_NAME_MAX_LENGTH:
            self.fail(field, f"must be at most {POOL_NAME_MAX_LENGTH} characters")
        if not all(is_dns_subdomain(part) for part in name.split("/")):
            self.fail(field, "must be one or more DNS subdomains separated by '/'")

    def qualified_name(self, field: str, name: str) -> None:
        if not name:
            self.fail(field, "required")
        if not is_qualified_name(name):
            self.fail(field, QUALIFIED_NAME_RULE)

    def fully_qualified_name(self, field: str, name: str) -> None:
        self.qualified_name(field, name)
        if "/" not in name:
            self.fail(field, "must be a fully qualified name: a domain is required")

    def not_negative(self, field: str, quantity: Quantity) -> None:
        if quantity.sign() < 0:
            self.fail(field, "must not be negative")


def keyed(path: str, key: str) -> str:
    """``path[key]``: a map entry's field path."""
    return f"{path}[{key}]"


# --- metadata ------------------------------------------------------------------------------


def check_metadata(
    c: Checker, meta: model.ObjectMeta, *, namespaced: bool, label_name: bool
) -> None:
    if not meta.name:
        c.fail("metadata.name", "required")
    if label_name:
        c.dns_label("metadata.name", meta.name)
    else:
        c.dns_subdomain("metadata.name", meta.name)
    if namespaced:
        if not meta.namespace:
            c.fail("metadata.namespace", "required")
        c.dns_label("metadata.namespace", meta.namespace)
    elif meta.namespace:
        c.fail("metadata.namespace", "must not be set: the object is cluster-scoped")
    if meta.generation is not None and meta.generation < 0:
        c.fail("metadata.generation", "must be greater than or equal to 0")
    for key, value in (meta.labels or {}).items():
        check_label(c, keyed("metadata.labels", key), key, value)


def check_label(c: Checker, field: str, key: str, value: str) -> None:
    prefix, sep, name = key.rpartition("/")
    if sep and not is_dns_subdomain(prefix):
        c.fail(field, "the prefix of a label key must be a DNS subdomain")
    if len(name) > LABEL_VALUE_MAX_LENGTH or not _LABEL_NAME.fullmatch(name):
        c.fail(field, "a label key must be a name of at most 63 alphanumerics, '-', '_' or '.'")
    if value and (len(value) > LABEL_VALUE_MAX_LENGTH or not _LABEL_NAME.fullmatch(value)):
        c.fail(field, "a label value must be empty or at most 63 alphanumerics, '-', '_' or '.'")


def check_api_version(c: Checker, api_version: str) -> None:
    if api_version != model.API_VERSION:
        c.fail("apiVersion", f"must be {model.API_VERSION}")


# --- shared pieces -------------------------------------------------------------------------


def check_selectors(c: Checker, field: str, selectors: list[model.DeviceSelector] | None) -> None:
    c.at_most(field, selectors, SELECTORS_MAX)
    for i, selector in enumerate(selectors or ()):
        if selector.cel is None:
            c.fail(f"{field}[{i}].cel", "required")
        check_cel(c, f"{field}[{i}].cel.expression", selector.cel.expression)


def check_cel(c: Checker, field: str, expression: str) -> None:
    if not expression.strip():
        c.fail(field, "required")
    size = len(expression.encode())
    if size > CEL_EXPRESSION_MAX_LENGTH:
        c.fail(field, f"must be at most {CEL_EXPRESSION_MAX_LENGTH} bytes, got {size}")
    problem = selector_problem(expression, consumable_capacity=c.gates.consumable_capacity)
    if problem is not None:
        c.fail(field, problem)


def check_opaque(c: Checker, field: str, opaque: model.OpaqueDeviceConfiguration | None) -> None:
    if opaque is None:
        c.fail(field, "required: exactly one configuration type (opaque)")
    c.driver(f"{field}.driver", opaque.driver)
    if not isinstance(opaque.parameters, dict):
        c.fail(f"{field}.parameters", "must be a JSON object")
    size = len(msgspec.json.encode(opaque.parameters))
    if size > OPAQUE_PARAMETERS_MAX_BYTES:
        c.fail(f"{field}.parameters", f"must be at most {OPAQUE_PARAMETERS_MAX_BYTES} bytes")


def check_node_selector(c: Checker, field: str, selector: model.NodeSelector) -> None:
    if not selector.node_selector_terms:
        c.fail(f"{field}.nodeSelectorTerms", "must have at least one term")
    for i, term in enumerate(selector.node_selector_terms):
        path = f"{field}.nodeSelectorTerms[{i}]"
        for j, req in enumerate(term.match_expressions or ()):
            _node_requirement(c, f"{path}.matchExpressions[{j}]", req, fields=False)
        for j, req in enumerate(term.match_fields or ()):
            _node_requirement(c, f"{path}.matchFields[{j}]", req, fields=True)


def _node_requirement(
    c: Checker, field: str, req: model.NodeSelectorRequirement, *, fields: bool
) -> None:
    if not req.key:
        c.fail(f"{field}.key", "required")
    if fields and req.key != "metadata.name":
        c.fail(f"{field}.key", "must be metadata.name")
    if req.operator not in NODE_SELECTOR_OPERATORS:
        c.fail(f"{field}.operator", f"must be one of {', '.join(NODE_SELECTOR_OPERATORS)}")
    values = req.values or []
    if req.operator in ("In", "NotIn") and not values:
        c.fail(f"{field}.values", f"must be non-empty with operator {req.operator}")
    if req.operator in ("Exists", "DoesNotExist") and values:
        c.fail(f"{field}.values", f"must be empty with operator {req.operator}")
    if req.operator in ("Gt", "Lt") and (len(values) != 1 or not values[0].lstrip("-").isdigit()):
        c.fail(f"{field}.values", f"must be a single integer with operator {req.operator}")
