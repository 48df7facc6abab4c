"""Reading and writing manifest files: YAML or JSON text to validated model objects.

This is the edge where operator- and tenant-written text enters dracap. Loading is
three steps, each of which can fail with one error type, :class:`ManifestError`:

1. **Parse** the text: multi-document YAML, or JSON (a single object, a ``kind: List``
   or a ``<Kind>List`` with ``items``). Empty documents are skipped.
2. **Decode** each document by its ``kind`` into the Struct of :data:`events.model.KINDS`
   after checking ``apiVersion`` (``resource.k8s.io/v1`` for DRA kinds, ``v1`` for
   Namespace). msgspec's type errors and quantity syntax errors are translated into
   Kubernetes field paths (``spec.pool.generation``).
3. **Validate** the object with :func:`events.validation.validate` under the caller's
   feature gates.

A :class:`ManifestError` is a :class:`~events.errors.ValidationError` whose object part
names the file, the document (1-based, counted as in the file, empty ones included),
the item of a List when there is one, and the object (``Kind name``) when it could be
read, so a CLI can print one line that points straight at the problem. Reading files
is the only I/O here and it is synchronous and local; nothing talks to a network.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import msgspec
import yaml

from events import model
from events.errors import QuantityError, ValidationError
from events.features import DEFAULT_GATES, FeatureGates
from events.validation import validate

__all__ = ["MANIFEST_SUFFIXES", "ManifestError", "dump_yaml", "load_documents", "load_paths"]

MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")

_API_VERSIONS: dict[str, str] = {
    "DeviceClass": model.API_VERSION,
    "ResourceSlice": model.API_VERSION,
    "ResourceClaim": model.API_VERSION,
    "Namespace": "v1",
}

_MSGSPEC_PATH = re.compile(r"^(?P<rule>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_MISSING_FIELD = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")


class ManifestError(ValidationError):
    """A manifest file, or one document in it, cannot be read, decoded or validated."""

    def __init__(
        self,
        source: str,
        document: int | None,
        field: str,
        rule: str,
        *,
        item: int | None = None,
        obj: str | None = None,
    ) -> None:
        where = source
        if document is not None:
            where += f" document {document}"
        if item is not None:
            where += f" item {item}"
        if obj:
            where += f" ({obj})"
        super().__init__(where, field, rule)
        self.source = source
        self.document = document
        self.item = item
        self.object = obj


# --- parsing -------------------------------------------------------------------------------


def _parse(text: str, source: str) -> list[Any]:
    """The documents of ``text``: JSON when it starts like JSON, YAML otherwise."""
    if text.lstrip().startswith(("{", "[")):
        try:
            return [json.loads(text)]
        except json.JSONDecodeError as exc:
            raise ManifestError(
                source, 1, f"line {exc.lineno} column {exc.colno}", f"invalid JSON: {exc.msg}"
            ) from exc
    try:
        return list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1} column {mark.column + 1}" if mark else "(unknown position)"
        problem = getattr(exc, "problem", None) or str(exc)
        raise ManifestError(source, None, where, f"invalid YAML: {problem}") from exc


def _items(documents: list[Any]) -> Iterator[tuple[int, int | None, Any]]:
    """``(document, item, data)`` for every object, Lists flattened, empty ones skipped."""
    for index, data in enumerate(documents, start=1):
        if data is None:
            continue
        if isinstance(data, list):  # a bare JSON array of objects
            for item, entry in enumerate(data):
                yield index, item, entry
        elif _is_list(data):
            for item, entry in enumerate(data.get("items") or []):
                yield index, item, entry
        else:
            yield index, None, data


def _is_list(data: Any) -> bool:
    kind = data.get("kind") if isinstance(data, dict) else None
    return isinstance(kind, str) and kind.endswith("List") and "items" in data


# --- decoding ------------------------------------------------------------------------------


def _describe(data: dict[str, Any]) -> str | None:
    kind = data.get("kind")
    meta = data.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    namespace = meta.get("namespace") if isinstance(meta, dict) else None
    if not isinstance(kind, str):
        return None
    if isinstance(name, str) and isinstance(namespace, str) and namespace:
        return f"{kind} {namespace}/{name}"
    return f"{kind} {name}" if isinstance(name, str) else kind


def _msgspec_field(message: str) -> tuple[str, str]:
    """Split ``"<rule> - at `$.a.b[0]`"`` into ``("a.b[0]", rule)``."""
    match = _MSGSPEC_PATH.match(message)
    assert match is not None  # the pattern matches every string
    rule, path = match["rule"], (match["path"] or "").lstrip(".")
    missing = _MISSING_FIELD.match(rule)
    if missing:
        path = f"{path}.{missing['field']}" if path else missing["field"]
        rule = "required"
    return path or "<root>", rule


def _decode(data: Any, fail: _Fail) -> model.Manifest:
    if not isinstance(data, dict):
        fail("<root>", f"must be an object, got {type(data).__name__}")
    kind = data.get("kind")
    if not isinstance(kind, str) or not kind:
        fail("kind", "required")
    if kind not in model.KINDS:
        fail("kind", f"unknown kind {kind!r}; expected one of {', '.join(sorted(model.KINDS))}")
    api_version = data.get("apiVersion")
    if api_version != _API_VERSIONS[kind]:
        fail("apiVersion", f"must be {_API_VERSIONS[kind]} for {kind}, got {api_version!r}")
    try:
        return model.convert(data, model.KINDS[kind])
    except msgspec.ValidationError as exc:
        field, rule = _msgspec_field(str(exc))
        cause = exc.__cause__ or exc.__context__
        bad = cause.text if isinstance(cause, QuantityError) else None
        fail(_resolve_keys(data, field, bad), str(cause) if bad is not None else rule)


_SEGMENT = re.compile(r"\[\d+\]|\[\.\.\.\]|[^.\[]+")


def _resolve_keys(data: Any, field: str, bad: str | None) -> str:
    """Replace msgspec's ``[...]`` map keys by the real key when the data pins it down.

    A candidate path must exist in ``data`` up to its parent (the last segment may be
    a missing field); for a quantity error its value must also be the bad text.
    """
    if "[...]" not in field:
        return field
    segments = _SEGMENT.findall(field)

    def walk(node: Any, rest: list[str], done: str) -> list[str]:
        if not rest:
            return [done] if bad is None or node == bad else []
        head, tail = rest[0], rest[1:]
        if head == "[...]" and isinstance(node, dict):
            return [p for k in node for p in walk(node[k], tail, f"{done}[{k}]")]
        if head.startswith("[") and isinstance(node, list):
            index = int(head[1:-1])
            return walk(node[index], tail, done + head) if index < len(node) else []
        if isinstance(node, dict) and head in node:
            return walk(node[head], tail, f"{done}.{head}" if done else head)
        if not tail and bad is None and isinstance(node, dict):
            return [f"{done}.{head}" if done else head]
        return []

    found = walk(data, segments, "")
    return found[0] if len(found) == 1 else field


class _Fail:
    """Raises a :class:`ManifestError` located at one document/item of one file."""

    def __init__(self, source: str, document: int, item: int | None, data: Any) -> None:
        self.source, self.document, self.item = source, document, item
        self.obj = _describe(data) if isinstance(data, dict) else None

    def __call__(self, field: str, rule: str) -> NoReturn:
        raise ManifestError(self.source, self.document, field, rule, item=self.item, obj=self.obj)


# --- public API ----------------------------------------------------------------------------


def load_documents(
    text: str, source: str, gates: FeatureGates = DEFAULT_GATES, *, check: bool = True
) -> list[model.Manifest]:
    """Parse, decode and (with ``check``) validate every object in ``text``.

    ``source`` names the text in errors.
    """
    objects: list[model.Manifest] = []
    for document, item, data in _items(_parse(text, source)):
        fail = _Fail(source, document, item, data)
        obj = _decode(data, fail)
        if check:
            try:
                validate(obj, gates)
            except ValidationError as exc:
                fail(exc.field, exc.rule)
        objects.append(obj)
    return objects


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        found = (p for p in path.rglob("*") if p.is_file() and p.suffix in MANIFEST_SUFFIXES)
        return sorted(found, key=lambda p: p.relative_to(path).parts)
    return [path]


def load_paths(
    paths: Sequence[str | os.PathLike[str]],
    gates: FeatureGates = DEFAULT_GATES,
    *,
    check: bool = True,
) -> list[tuple[str, model.Manifest]]:
    """Load files and directories (recursively, sorted; .yaml/.yml/.json files only).

    Returns ``(source file, object)`` pairs in reading order.
    """
    loaded: list[tuple[str, model.Manifest]] = []
    for given in paths:
        for file in _files(Path(given)):
            source = str(file)
            try:
                text = file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ManifestError(source, None, "<file>", f"cannot read: {exc}") from exc
            loaded.extend((source, obj) for obj in load_documents(text, source, gates, check=check))
    return loaded


def dump_yaml(objs: Sequence[model.Manifest]) -> str:
    """Multi-document YAML of ``objs`` in their Kubernetes shape (canonical quantities)."""
    return yaml.safe_dump_all(
        [model.to_builtins(obj) for obj in objs], sort_keys=False, default_flow_style=False
    )
