"""What an operator lets each tenant do: the ``dracap.io/`` annotations and their defaults. Pure.

The operator names the tenancy rules on the objects it already writes (the seed of
``dracap up --inventory``, ``deploy/examples``), as annotations under ``dracap.io/``;
``docs/tenancy.md`` is the operator's page. Every key here is checked when a manifest
is loaded (:func:`check_annotations`, called by :func:`events.manifests.load_documents`),
so a typo is refused naming the annotation instead of silently granting the default.

Namespace (read once, when the seed is loaded, into a :class:`NamespacePolicy`, which
the admin endpoint ``namespaces.access`` records as ``NamespaceAccessSet``):

==================================== =========== ============================================
annotation                           default     meaning
==================================== =========== ============================================
``dracap.io/device-classes``         ``*``       the DeviceClasses the namespace may use
``dracap.io/opaque-config-classes``  (none)      the classes whose requests may carry opaque
                                                 driver configuration (``spec.devices.config``)
``dracap.io/max-claims``             (no quota)  live claims the namespace may hold at once
``dracap.io/max-requests-per-claim`` 32          requests per claim (upstream's limit, at most)
==================================== =========== ============================================

plus the upstream label ``resource.kubernetes.io/admin-access: "true"`` (adminAccess).
Lists are comma-separated; ``*`` means every class.

DeviceClass (read by the allocator and the tenant's device view from the class as
recorded, so a re-applied class takes effect at once):

========================================= ========= ==========================================
annotation                                default   meaning
========================================= ========= ==========================================
``dracap.io/shared-across-namespaces``    ``allow`` ``deny``: a device the class selects holds
                                                    shares of one namespace at a time
``dracap.io/tenant-attributes``           (none)    device attributes a tenant may read
                                                    (``claims.devices``); a name without a
                                                    domain belongs to the device's driver
``dracap.io/placement``                   ``first-  which eligible device a share goes to:
                                          fit``     ``first-fit``, ``binpack``, ``spread`` or
                                                    ``fragmentation-aware``
                                                    (``docs/placement.md``)
``dracap.io/not-started-timeout``         (none)    how long a Ready claim of the class may
                                                    go unused (no consumer reserved it, no
                                                    traffic seen) before the action below;
                                                    ``90s``, ``5m``, ``2h`` or seconds
``dracap.io/not-started-action``          ``release`` ``release`` the claim, or mark it
                                                    ``stall``-ed (kept, shown to operators)
``dracap.io/enforcement-retry-window``    ``10m``   how long a share whose limit fails with
                                                    a retryable error is tried again (with
                                                    back-off) before its claim fails
========================================= ========= ==========================================
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

import msgspec

from events import model
from events.errors import ValidationError
from events.fieldchecks import (
    QUALIFIED_NAME_RULE,
    REQUESTS_MAX,
    is_dns_label,
    is_dns_subdomain,
    is_qualified_name,
    split_qualified_name,
)

__all__ = [
    "DEVICE_CLASSES",
    "MAX_CLAIMS",
    "MAX_REQUESTS_PER_CLAIM",
    "OPAQUE_CONFIG_CLASSES",
    "PLACEMENT",
    "PLACEMENTS",
    "SHARED_ACROSS_NAMESPACES",
    "TENANT_ATTRIBUTES",
    "NamespacePolicy",
    "allow_list",
    "attribute_allowed",
    "check_annotations",
    "check_policy",
    "class_allowed",
    "namespace_object",
    "namespace_policy",
    "placement",
    "shared_across_namespaces",
    "tenant_attributes",
]

PREFIX: Final = "dracap.io/"
DEVICE_CLASSES: Final = "dracap.io/device-classes"
OPAQUE_CONFIG_CLASSES: Final = "dracap.io/opaque-config-classes"
MAX_CLAIMS: Final = "dracap.io/max-claims"
MAX_REQUESTS_PER_CLAIM: Final = "dracap.io/max-requests-per-claim"
SHARED_ACROSS_NAMESPACES: Final = "dracap.io/shared-across-namespaces"
TENANT_ATTRIBUTES: Final = "dracap.io/tenant-attributes"
PLACEMENT: Final = "dracap.io/placement"
#: The placement policies a class may name; the first is the default (upstream's order).
PLACEMENTS: Final = ("first-fit", "binpack", "spread", "fragmentation-aware")
NOT_STARTED_TIMEOUT: Final = "dracap.io/not-started-timeout"
NOT_STARTED_ACTION: Final = "dracap.io/not-started-action"
RETRY_WINDOW: Final = "dracap.io/enforcement-retry-window"
#: The retry window of a class that sets none (seconds).
DEFAULT_RETRY_WINDOW_S: Final = 600.0
#: What happens to a claim that stays unused past its class's timeout; the first is the default.
NOT_STARTED_ACTIONS: Final = ("release", "stall")
_DURATION_UNITS: Final = {"s": 1, "m": 60, "h": 3600}
#: The longest not-started timeout (30 days): a larger one is a typo, not a policy.
MAX_NOT_STARTED_S: Final = 30 * 86400

_NAMESPACE_KEYS: Final = (DEVICE_CLASSES, OPAQUE_CONFIG_CLASSES, MAX_CLAIMS, MAX_REQUESTS_PER_CLAIM)
_CLASS_KEYS: Final = (
    SHARED_ACROSS_NAMESPACES,
    TENANT_ATTRIBUTES,
    PLACEMENT,
    NOT_STARTED_TIMEOUT,
    NOT_STARTED_ACTION,
    RETRY_WINDOW,
)
_SHARING: Final = ("allow", "deny")
_CLASS_LIST_RULE: Final = "must be '*' or a DeviceClass name"


class NamespacePolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a namespace may do: the ``namespaces.access`` request and its reply.

    ``classes`` / ``opaque_config_classes``: DeviceClass names or ``"*"``;
    ``max_claims``: live claims at once (``None``: no quota); ``max_requests_per_claim``:
    requests in one claim (``None``: upstream's 32).
    """

    namespace: str
    classes: list[str]
    admin_access: bool = False
    opaque_config_classes: list[str] = []
    max_claims: int | None = None
    max_requests_per_claim: int | None = None


def class_allowed(classes: Iterable[str], name: str) -> bool:
    """Whether ``name`` is in ``classes`` (``"*"``: every class)."""
    return any(c == "*" or c == name for c in classes)


# --- checking --------------------------------------------------------------------------------


def check_policy(policy: NamespacePolicy, ref: str = "namespaces.access") -> None:
    """Raise :class:`ValidationError` naming the first field of ``policy`` that is not usable."""
    if not is_dns_label(policy.namespace):
        raise ValidationError(ref, "namespace", f"must be a DNS label ({policy.namespace!r})")
    for field in ("classes", "opaque_config_classes"):
        for i, name in enumerate(getattr(policy, field)):
            if name != "*" and not is_dns_subdomain(name):
                raise ValidationError(ref, f"{field}[{i}]", f"{_CLASS_LIST_RULE} ({name!r})")
    if policy.max_claims is not None and policy.max_claims < 0:
        raise ValidationError(ref, "max_claims", "must be 0 or more (null: no quota)")
    limit = policy.max_requests_per_claim
    if limit is not None and not 1 <= limit <= REQUESTS_MAX:
        raise ValidationError(
            ref, "max_requests_per_claim", f"must be between 1 and {REQUESTS_MAX}, got {limit}"
        )


def check_annotations(obj: model.Manifest) -> None:
    """Raise :class:`ValidationError` for a ``dracap.io/`` annotation ``obj`` may not carry."""
    if isinstance(obj, model.Namespace):
        namespace_policy(obj)
    elif isinstance(obj, model.DeviceClass):
        ref = model.object_ref(obj)
        annotations = _ours(obj.metadata, _CLASS_KEYS, ref)
        sharing = annotations.get(SHARED_ACROSS_NAMESPACES)
        if sharing is not None and sharing not in _SHARING:
            raise ValidationError(
                ref, _field(SHARED_ACROSS_NAMESPACES), f"must be allow or deny, got {sharing!r}"
            )
        chosen = annotations.get(PLACEMENT)
        if chosen is not None and chosen not in PLACEMENTS:
            raise ValidationError(
                ref, _field(PLACEMENT), f"must be one of {', '.join(PLACEMENTS)}, got {chosen!r}"
            )
        timeout = annotations.get(NOT_STARTED_TIMEOUT)
        if timeout is not None and parse_duration(timeout) is None:
            raise ValidationError(
                ref,
                _field(NOT_STARTED_TIMEOUT),
                f"must be a duration from 1s to 720h (90s, 5m, 2h, or seconds), got {timeout!r}",
            )
        window = annotations.get(RETRY_WINDOW)
        if window is not None and parse_duration(window) is None:
            raise ValidationError(
                ref,
                _field(RETRY_WINDOW),
                f"must be a duration from 1s to 720h (90s, 5m, 2h, or seconds), got {window!r}",
            )
        action = annotations.get(NOT_STARTED_ACTION)
        if action is not None and action not in NOT_STARTED_ACTIONS:
            raise ValidationError(
                ref,
                _field(NOT_STARTED_ACTION),
                f"must be one of {', '.join(NOT_STARTED_ACTIONS)}, got {action!r}",
            )
        for i, name in enumerate(_split(annotations.get(TENANT_ATTRIBUTES))):
            if not is_qualified_name(name):
                raise ValidationError(
                    ref, _field(TENANT_ATTRIBUTES), f"entry {i} ({name!r}) {QUALIFIED_NAME_RULE}"
                )
    else:
        _ours(obj.metadata, (), model.object_ref(obj))


def _field(key: str) -> str:
    return f"metadata.annotations[{key}]"


def _ours(meta: model.ObjectMeta, known: tuple[str, ...], ref: str) -> dict[str, str]:
    """The object's ``dracap.io/`` annotations; one it may not carry is refused."""
    out: dict[str, str] = {}
    for key, value in (meta.annotations or {}).items():
        if not key.startswith(PREFIX):
            continue
        if key not in known:
            allowed = ", ".join(known) or "none"
            raise ValidationError(
                ref, _field(key), f"unknown dracap annotation here; known: {allowed}"
            )
        out[key] = value
    return out


def _split(value: str | None) -> list[str]:
    return [part.strip() for part in (value or "").split(",") if part.strip()]


# --- reading ---------------------------------------------------------------------------------


def namespace_policy(ns: model.Namespace) -> NamespacePolicy:
    """The policy a seed Namespace asks for; :class:`ValidationError` names a bad annotation."""
    ref = model.object_ref(ns)
    annotations = _ours(ns.metadata, _NAMESPACE_KEYS, ref)
    lists: dict[str, list[str]] = {}
    for key, default in ((DEVICE_CLASSES, "*"), (OPAQUE_CONFIG_CLASSES, "")):
        names = _split(annotations.get(key, default))
        for name in names:
            if name != "*" and not is_dns_subdomain(name):
                raise ValidationError(ref, _field(key), f"{_CLASS_LIST_RULE} ({name!r})")
        lists[key] = sorted(set(names))
    numbers: dict[str, int | None] = {}
    for key, low, high in ((MAX_CLAIMS, 0, None), (MAX_REQUESTS_PER_CLAIM, 1, REQUESTS_MAX)):
        numbers[key] = _number(annotations.get(key), low, high, ref, key)
    return NamespacePolicy(
        namespace=ns.metadata.name,
        classes=lists[DEVICE_CLASSES],
        admin_access=ns.allows_admin_access,
        opaque_config_classes=lists[OPAQUE_CONFIG_CLASSES],
        max_claims=numbers[MAX_CLAIMS],
        max_requests_per_claim=numbers[MAX_REQUESTS_PER_CLAIM],
    )


def namespace_object(policy: NamespacePolicy) -> model.Namespace:
    """The Namespace whose labels and annotations ask for ``policy``: the inverse of
    :func:`namespace_policy` (``dracap get namespace -o yaml`` prints it, and applying it
    again records the same policy)."""
    annotations = {DEVICE_CLASSES: ",".join(policy.classes)}  # absent would mean "*"
    if policy.opaque_config_classes:
        annotations[OPAQUE_CONFIG_CLASSES] = ",".join(policy.opaque_config_classes)
    if policy.max_claims is not None:
        annotations[MAX_CLAIMS] = str(policy.max_claims)
    if policy.max_requests_per_claim is not None:
        annotations[MAX_REQUESTS_PER_CLAIM] = str(policy.max_requests_per_claim)
    labels = {model.ADMIN_ACCESS_LABEL: "true"} if policy.admin_access else None
    meta = model.ObjectMeta(name=policy.namespace, labels=labels, annotations=annotations)
    return model.Namespace(metadata=meta)


def _number(text: str | None, low: int, high: int | None, ref: str, key: str) -> int | None:
    if text is None:
        return None
    span = f"between {low} and {high}" if high is not None else f"{low} or more"
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        raise ValidationError(ref, _field(key), f"must be a whole number {span}, got {text!r}")
    return value


def _annotation(dclass: model.DeviceClass, key: str) -> str | None:
    return (dclass.metadata.annotations or {}).get(key)


def shared_across_namespaces(dclass: model.DeviceClass) -> bool:
    """Whether devices of ``dclass`` may hold shares of several namespaces (default yes)."""
    return _annotation(dclass, SHARED_ACROSS_NAMESPACES) != "deny"


def placement(dclass: model.DeviceClass) -> str:
    """The placement policy of ``dclass`` (default ``first-fit``; an unknown name: the default).

    Manifests are checked when loaded (:func:`check_annotations`), so an unknown name only
    reaches here from a log written by another version; it falls back to upstream's order.
    """
    chosen = _annotation(dclass, PLACEMENT)
    return chosen if chosen in PLACEMENTS else PLACEMENTS[0]


def parse_duration(text: str) -> float | None:
    """Seconds of ``90s`` / ``5m`` / ``2h`` / ``90`` (1 s to 30 days), else ``None``."""
    text = text.strip()
    unit = _DURATION_UNITS.get(text[-1:], 0)
    digits = text[:-1] if unit else text
    if not digits.isdigit() or len(digits) > 9:
        return None
    seconds = int(digits) * (unit or 1)
    return float(seconds) if 1 <= seconds <= MAX_NOT_STARTED_S else None


def not_started(dclass: model.DeviceClass) -> tuple[float, str] | None:
    """``(timeout seconds, action)`` of ``dclass``, or ``None`` when it sets no timeout."""
    text = _annotation(dclass, NOT_STARTED_TIMEOUT)
    seconds = parse_duration(text) if text is not None else None
    if seconds is None:
        return None
    action = _annotation(dclass, NOT_STARTED_ACTION)
    return seconds, action if action in NOT_STARTED_ACTIONS else NOT_STARTED_ACTIONS[0]


def retry_window(dclass: model.DeviceClass | None) -> float:
    """Seconds a retryable enforcement failure of ``dclass`` is retried (default 10 min)."""
    text = _annotation(dclass, RETRY_WINDOW) if dclass is not None else None
    seconds = parse_duration(text) if text is not None else None
    return DEFAULT_RETRY_WINDOW_S if seconds is None else seconds


def tenant_attributes(dclass: model.DeviceClass) -> tuple[str, ...]:
    """The attribute names tenants may read on devices of ``dclass`` (default none)."""
    return tuple(_split(_annotation(dclass, TENANT_ATTRIBUTES)))


def attribute_allowed(allowed: Mapping[tuple[str, str], None], name: str, driver: str) -> bool:
    """Whether attribute ``name`` of a device of ``driver`` is in ``allowed``.

    ``allowed`` holds ``(domain, id)`` pairs (:func:`allow_list`): ``model`` and
    ``gpu.dracap.io/model`` are the same attribute on a device of driver ``gpu.dracap.io``.
    """
    return split_qualified_name(name, driver) in allowed


def allow_list(names: Iterable[str], driver: str) -> dict[tuple[str, str], None]:
    """``(domain, id)`` of each allow-listed name, for devices of ``driver``."""
    return {split_qualified_name(name, driver): None for name in names}
