"""Reading and writing manifest files: YAML or JSON text to validated model objects.

This is the edge where operator- and tenant-written text enters dracap. Loading is
three steps, each of which can fail with one error type, :class:`ManifestError`:

1. **Parse** the text: JSON (a single object, a ``kind: List`` or a ``<Kind>List`` with
   ``items``) when it is one JSON value, else multi-document YAML (JSON objects
   separated by ``---`` are YAML too, as ``kubectl`` reads them). Empty documents are
   skipped. YAML goes through libyaml (``yaml.CSafeLoader``) where PyYAML has it. A
   document nested deeper than :data:`~events.nesting.MAX_MANIFEST_DEPTH` (64) levels is
   refused, naming the field where it goes too deep and the limit — JSON text before it
   is parsed (:func:`events.nesting.too_deep`), so no parser recurses into it.
2. **Decode** each document by its ``kind`` into the Struct of :data:`events.model.KINDS`
   after checking ``apiVersion`` (``resource.k8s.io/v1`` for DRA kinds, ``v1`` for
   Namespace). msgspec's type errors and quantity syntax errors are translated into
   Kubernetes field paths (``spec.pool.generation``).
3. **Validate** the object with :func:`events.validation.validate` under the caller's
   feature gates, and its ``dracap.io/`` annotations with
   :func:`events.tenancy.check_annotations`.

A :class:`ManifestError` is a :class:`~events.errors.ValidationError` whose object part
names the file, the document (1-based, counted as in the file, empty ones included),
the item of a List when there is one, and the object (``Kind name``) when it could be
read, so a CLI can print one line that points straight at the problem. Reading files
is the only I/O here and it is synchronous and local; nothing talks to a network.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NoReturn

import msgspec
import yaml

from events import model
from events.errors import QuantityError, ValidationError
from events.features import DEFAULT_GATES, FeatureGates
from events.nesting import depth_rule, too_deep, too_deep_value
from events.tenancy import check_annotations
from events.validation import validate

__all__ = [
    "MANIFEST_SUFFIXES",
    "MAX_MANIFEST_BYTES",
    "Check",
    "ManifestError",
    "dump_yaml",
    "load_documents",
    "load_paths",
]

MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")
#: Largest manifest of one object the claims API accepts (``claims.apply``; NATS' default
#: max_payload is 1 MiB); the CLI checks it before sending.
MAX_MANIFEST_BYTES: Final = 256 * 1024

_API_VERSIONS: dict[str, str] = {
    "DeviceClass": model.API_VERSION,
    "ResourceSlice": model.API_VERSION,
    "ResourceClaim": model.API_VERSION,
    "Namespace": "v1",
}

_STR_TAG: Final = "tag:yaml.org,2002:str"
#: A document may build this many nodes before aliases are held against it, and then no
#: more than this many times the nodes it really holds.
_ALIAS_FLOOR: Final = 100_000
_ALIAS_RATIO: Final = 10
_MAP_TAG: Final = "tag:yaml.org,2002:map"
_SEQ_TAG: Final = "tag:yaml.org,2002:seq"


if TYPE_CHECKING:  # the stubs type both alike; the pure one is the one they describe fully
    _SafeLoader = yaml.SafeLoader
else:
    _SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _ManifestLoader(_SafeLoader):
    """PyYAML's safe loader on libyaml (``CSafeLoader``; the pure one where PyYAML lacks it).

    Manifests are trees of string-keyed maps, sequences and strings; those are built
    here in one pass, and every other node (numbers, booleans, timestamps, merge keys,
    tags) goes through the safe constructor as before: about a third less time on a large
    inventory file than PyYAML's general constructor (``benchmarks/allocate.py``).
    """

    def construct_document(self, node: yaml.Node) -> Any:
        self._built = 0
        self._distinct: set[int] = set()
        try:
            return self._plain(node)
        except RecursionError:  # a recursive alias: the safe constructor handles it
            return super().construct_document(node)
        finally:
            self.constructed_objects.clear()
            self.recursive_objects.clear()

    def _plain(self, node: yaml.Node) -> Any:
        self._count(node)
        tag = node.tag
        if tag == _STR_TAG:
            return node.value
        if tag == _MAP_TAG and all(key.tag == _STR_TAG for key, _ in node.value):
            return {key.value: self._plain(value) for key, value in node.value}
        if tag == _SEQ_TAG:
            return [self._plain(item) for item in node.value]
        return self.construct_object(node, deep=True)

    def _count(self, node: yaml.Node) -> None:
        """Refuse a document that aliases expand far beyond what it holds (a "YAML bomb").

        An alias is built again each time it is used, so ten anchors that each repeat
        the previous one ten times would build ten billion nodes from a few hundred bytes.
        """
        self._built += 1
        self._distinct.add(id(node))
        if self._built > _ALIAS_FLOOR and self._built > _ALIAS_RATIO * len(self._distinct):
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"aliases expand the document past {_ALIAS_RATIO} times its own size",
                node.start_mark,
            )


_DUMPER: type[yaml.SafeDumper] | type[yaml.CSafeDumper] = getattr(
    yaml, "CSafeDumper", yaml.SafeDumper
)

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
    """The documents of ``text``: JSON when it parses as JSON, YAML otherwise.

    Text that starts like JSON but is not one JSON value (JSON objects separated by
    ``---``, say) is YAML's to read; when neither reads it, the error of the parser that
    got further into the text is reported (JSON's on a tie: the text looks like JSON).
    """
    json_error: json.JSONDecodeError | None = None
    if text.lstrip().startswith(("{", "[")):
        deep = too_deep(text)  # before a parser recurses into it
        if deep is not None:
            raise ManifestError(source, 1, deep, depth_rule())
        try:
            return [json.loads(text)]
        except json.JSONDecodeError as exc:
            json_error = exc
    try:
        with _collector_paused():
            documents = list(yaml.load_all(text, Loader=_ManifestLoader))
    except RecursionError:
        raise ManifestError(source, None, "<root>", depth_rule()) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        if json_error is not None and (mark is None or mark.index <= json_error.pos):
            raise ManifestError(
                source,
                1,
                f"line {json_error.lineno} column {json_error.colno}",
                f"invalid JSON: {json_error.msg}",
            ) from json_error
        where = f"line {mark.line + 1} column {mark.column + 1}" if mark else "(unknown position)"
        problem = getattr(exc, "problem", None) or str(exc)
        raise ManifestError(source, None, where, f"invalid YAML: {problem}") from exc
    return documents


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """No cyclic garbage collection while a parser builds a (cycle-free) document tree.

    The collector would walk the growing tree again and again: a third of the time of
    a large file. It is switched back on at the end, unless it was off already.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


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


#: What :func:`load_documents` validates: every object (True), none (False), or the
#: objects of these kinds (``dracap apply`` leaves claims to admission, which records
#: the rejection of an invalid one).
Check = bool | tuple[type[model.Manifest], ...]


def _checked(obj: model.Manifest, check: Check) -> bool:
    return check if isinstance(check, bool) else isinstance(obj, check)


def load_documents(
    text: str, source: str, gates: FeatureGates = DEFAULT_GATES, *, check: Check = True
) -> list[model.Manifest]:
    """Parse, decode and (with ``check``) validate every object in ``text``.

    ``source`` names the text in errors.
    """
    objects: list[model.Manifest] = []
    for document, item, data in _items(_parse(text, source)):
        fail = _Fail(source, document, item, data)
        deep = too_deep_value(data)  # a YAML document (JSON was checked as text), or an
        if deep is not None:  # alias that refers to itself: as deep as it goes
            fail(deep, depth_rule())
        obj = _decode(data, fail)
        if _checked(obj, check):
            try:
                validate(obj, gates)
                check_annotations(obj)
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
    check: Check = True,
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
    return yaml.dump_all(
        [model.to_builtins(obj) for obj in objs],
        Dumper=_DUMPER,
        sort_keys=False,
        default_flow_style=False,
    )
