"""How deep JSON goes, found without recursion; and how deep dracap lets it go.

A tenant allowed opaque driver configuration chooses the shape of its ``parameters``:
a 5 KB claim can nest 2,450 levels deep. Every parser and encoder dracap uses (msgspec,
``json``, PyYAML's representer) recurses once per level and stops at Python's recursion
limit (1,000 frames, the caller's frames included) with a ``RecursionError``. So depth
is bounded twice, and both bounds live here:

* **Input** (:data:`MAX_MANIFEST_DEPTH`, 64): :func:`events.manifests.load_documents`
  refuses a manifest nested deeper, naming the field where it goes too deep and the
  limit (:func:`too_deep` on JSON text before it is parsed, :func:`too_deep_value` on
  a parsed YAML document). No real claim needs more than about ten levels.
* **Stored events** (:data:`MAX_STORED_DEPTH`, 128): an event written before the input
  limit (or by anyone who bypassed it) may be deeper. Every reader of stored events
  decodes it through :func:`bounded`: a value that would sit deeper than 128 levels is
  kept as a JSON *string* holding its exact text, so nothing deeper is ever built as
  Python objects and everything downstream (the fold, snapshots, hashing, diffs, YAML,
  tables) stays far from the recursion limit. It is deterministic — it depends on the
  stored bytes only — so every reader (live state, snapshots, replay, the bus, a file)
  folds the same state. Events of at most 128 levels (every event admitted since the
  input limit) decode exactly as before.

The scanner (:func:`_scan`) is iterative: a regular expression finds the next bracket,
quote or comma, a string is skipped whole, and a list keeps the open containers. It
costs a pass of Python over the brackets of a payload, so :func:`shallow` (two
``bytes.count`` calls: a value with at most N opening brackets cannot be deeper than N)
decides first whether it is needed at all; a typical event never reaches it.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

__all__ = [
    "MAX_MANIFEST_DEPTH",
    "MAX_STORED_DEPTH",
    "bounded",
    "depth",
    "depth_rule",
    "shallow",
    "too_deep",
    "too_deep_value",
]

#: The deepest manifest admission takes (levels; the document itself is level 1).
MAX_MANIFEST_DEPTH: Final = 64
#: The deepest value a reader of stored events builds; deeper ones stay JSON text.
MAX_STORED_DEPTH: Final = 128
#: Path segments named in an error before the rest is left out.
_SHOWN_SEGMENTS: Final = 8

_TOKEN: Final = re.compile(rb'[\[\]{}",:]')
_STRING_END: Final = re.compile(rb'(?:[^"\\]|\\.)*"', re.S)
_STRING: Final = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_NOT_BRACKETS: Final = bytes(b for b in range(256) if b not in b"[]{}")


def depth_rule(limit: int = MAX_MANIFEST_DEPTH) -> str:
    """The rule a too-deep manifest breaks, as an error states it."""
    return f"must not be nested deeper than {limit} levels"


def shallow(data: bytes | str, limit: int) -> bool:
    """Whether ``data`` surely nests at most ``limit`` levels (cheap: it has no more
    opening brackets than that; ``False`` only means "look closer")."""
    if isinstance(data, str):
        return data.count("{") + data.count("[") <= limit
    return data.count(b"{") + data.count(b"[") <= limit


class _Frame:
    """An open container while scanning: where it starts, its kind, its current key/index."""

    __slots__ = ("index", "key", "object", "start")

    def __init__(self, start: int, is_object: bool) -> None:
        self.start = start
        self.object = is_object
        self.key: str | None = None
        self.index = 0

    def segment(self) -> str:
        return (self.key or "?") if self.object else f"[{self.index}]"


def _scan(data: bytes, limit: int, *, cut: bool) -> tuple[bytes | None, list[str] | None]:
    """One pass over ``data`` (JSON): with ``cut``, the text with every container that
    opens deeper than ``limit`` replaced by a JSON string of its text; else the path of
    the first such container (``None`` for either: nothing is that deep)."""
    frames: list[_Frame] = []
    pieces: list[bytes] = []
    done = 0  # bytes of data already in pieces
    pos = 0
    size = len(data)
    deep_from: int | None = None  # where the container being cut opened
    while pos < size:
        found = _TOKEN.search(data, pos)
        if found is None:
            break
        at = found.start()
        char = data[at]
        pos = at + 1
        if char == 0x22:  # '"': skip the string; a key if a ':' follows
            end = _STRING_END.match(data, pos)
            if end is None:
                break  # unterminated: the parser will say so
            pos = end.end()
            if frames and frames[-1].object and deep_from is None and not cut:
                rest = data[pos : pos + 64].lstrip()
                if rest.startswith(b":"):
                    frames[-1].key = _text(data[at:pos])
        elif char in (0x5B, 0x7B):  # '[' '{'
            frames.append(_Frame(at, char == 0x7B))
            if len(frames) > limit and deep_from is None:
                if not cut:
                    return None, [f.segment() for f in frames[:-1]]
                deep_from = at
        elif char in (0x5D, 0x7D):  # ']' '}'
            if not frames:
                break
            frame = frames.pop()
            if deep_from is not None and frame.start == deep_from:
                pieces.append(data[done:deep_from])
                pieces.append(json.dumps(_text_of(data[deep_from:pos])).encode())
                done = pos
                deep_from = None
        elif char == 0x2C and frames and not frames[-1].object:  # ',' in an array
            frames[-1].index += 1
    if not cut or not pieces:
        return None, None
    pieces.append(data[done:])
    return b"".join(pieces), None


def _text(quoted: bytes) -> str:
    try:
        value = json.loads(quoted)
    except ValueError:
        return quoted.decode("utf-8", "replace").strip('"')
    return value if isinstance(value, str) else str(value)


def _text_of(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def _path(segments: list[str]) -> str:
    shown = segments[:_SHOWN_SEGMENTS]
    out = ""
    for segment in shown:
        out += segment if segment.startswith("[") or not out else f".{segment}"
    if len(segments) > len(shown):
        out += f"... ({len(segments) - len(shown)} more levels)"
    return out or "<root>"


def too_deep(text: bytes | str, limit: int = MAX_MANIFEST_DEPTH) -> str | None:
    """The field (Kubernetes notation) of the first value of the JSON ``text`` that is
    nested deeper than ``limit`` levels, or ``None``."""
    data = text.encode() if isinstance(text, str) else text
    if shallow(data, limit) or depth(data) <= limit:
        return None
    _, segments = _scan(data, limit, cut=False)
    return None if segments is None else _path(segments)


def too_deep_value(value: Any, limit: int = MAX_MANIFEST_DEPTH) -> str | None:
    """:func:`too_deep` of parsed data (dicts, lists, scalars), walked without recursion."""
    stack: list[tuple[Any, int, list[str]]] = [(value, 1, [])]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, dict):
            children: list[tuple[str, Any]] = [(str(k), v) for k, v in node.items()]
        elif isinstance(node, list | tuple):
            children = [(f"[{i}]", v) for i, v in enumerate(node)]
        else:
            continue
        if depth > limit:
            return _path(path)
        for segment, child in reversed(children):
            if isinstance(child, dict | list | tuple):
                stack.append((child, depth + 1, [*path, segment]))
    return None


def depth(data: bytes) -> int:
    """How many levels the JSON ``data`` nests (its strings left out, then one pass over
    its brackets: a few milliseconds for a 100 KB slice with 10,000 of them)."""
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    level = deepest = 0
    for char in brackets:
        if char == 0x5B or char == 0x7B:  # '[' '{'
            level += 1
            if level > deepest:
                deepest = level
        else:
            level -= 1
    return deepest


def bounded(payload: bytes, limit: int = MAX_STORED_DEPTH) -> bytes:
    """``payload`` (JSON) with every value nested deeper than ``limit`` kept as a JSON
    string of its text (the module docstring); unchanged when nothing is that deep."""
    if shallow(payload, limit) or depth(payload) <= limit:
        return payload
    cut, _ = _scan(payload, limit, cut=True)
    return payload if cut is None else cut
