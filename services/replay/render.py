"""Text output of the forensic replay commands: tables, JSON, YAML, and a progress line.

YAML is written by :func:`to_yaml` (block style, strings JSON-quoted — valid YAML 1.2),
so ``-o yaml`` needs no YAML library; it walks the data with a stack of its own, not by
recursion, so no depth of a stored value can stop it. The progress line goes to stderr
only when it is a terminal (:func:`progress_for`), and is erased when the work is done.

Text a tenant can influence (claim and share names, reasons, a refused event's detail,
opaque configuration) goes through :mod:`services.runtime.ground.printable` in every format:
each table cell and YAML string, with its control characters escaped.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

import msgspec

from services.replay.history import Change, Step
from services.runtime.ground.printable import json_text, table

__all__ = ["Progress", "diff_table", "progress_for", "state_table", "timeline_table", "to_yaml"]


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return json_text(msgspec.json.encode(str(value)))  # JSON escapes are YAML's too


_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]*")


def _key(key: Any) -> str:
    text = str(key)
    if _PLAIN_KEY.fullmatch(text) and text not in ("true", "false", "null", "yes", "no"):
        return text
    return _scalar(text)


def to_yaml(value: Any, indent: int = 0) -> str:
    """Block-style YAML of plain data (dicts, lists, scalars), walked without recursion.

    A list item that is a mapping or list starts on the item's line (``- key: value``):
    the first line written for it takes ``- `` in place of its indentation.
    """
    if not isinstance(value, dict | list | tuple) or not value:
        return _leaf(value)
    lines: list[str] = []
    lead: str | None = None  # what replaces the indentation of the next line written
    stack: list[tuple[Iterator[tuple[str | None, Any]], int]] = [(_items(value), indent)]
    while stack:
        items, level = stack[-1]
        item = next(items, None)
        if item is None:
            stack.pop()
            continue
        key, child = item
        pad = "  " * level
        nested = isinstance(child, dict | list | tuple) and bool(child)
        if key is not None:  # a mapping's entry
            text = f"{pad}{_key(key)}:" if nested else f"{pad}{_key(key)}: {_leaf(child)}"
        elif nested:  # a list item holding a container: its first line follows "- "
            lead = (lead or pad) + "- "
            stack.append((_items(child), level + 1))
            continue
        else:
            text = f"{pad}- {_leaf(child)}"
        if lead is not None:
            text, lead = lead + text.lstrip(" "), None
        lines.append(text)
        if nested:
            stack.append((_items(child), level + 1))
    return "\n".join(lines)


def _items(value: Any) -> Iterator[tuple[str | None, Any]]:
    if isinstance(value, dict):
        return iter(list(value.items()))
    return iter([(None, v) for v in value])


def _leaf(value: Any) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list | tuple):
        return "[]"
    return _scalar(value)


def _amounts(values: dict[str, Any] | None) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted((values or {}).items())) or "-"


def state_table(view: dict[str, Any]) -> str:
    """Devices, shares, claims and nodes of a state view as four tables."""
    devices = []
    for key, d in view["devices"].items():
        devices.append(
            (
                key,
                d.get("node") or "-",
                _amounts(d.get("total")),
                _amounts(d.get("consumed")),
                d.get("live_shared", 0),
                d.get("exclusive_share") or "-",
                d.get("unhealthy") or "-",
            )
        )
    shares = [
        (
            sid,
            "/".join(s["claim"]),
            s["request"],
            f"{s['driver']}/{s['pool']}/{s['device']}",
            s["state"],
            _amounts(s.get("consumed")),
            s.get("node") or "-",
        )
        for sid, s in view["shares"].items()
    ]
    claims = [
        (
            key,
            c["phase"],
            c.get("node") or "-",
            c.get("allocation_version", 0),
            len(c.get("share_ids", [])),
        )
        for key, c in view["claims"].items()
    ]
    nodes = [
        (
            name,
            n.get("lease", "live"),
            n.get("leased_epoch", 0),
            n.get("expired_epoch", 0),
            n.get("fenced_epoch", 0),
            len(n.get("live_shares", [])),
        )
        for name, n in view["nodes"].items()
    ]
    parts = [
        f"state at position {view['position']}",
        "",
        "DEVICES",
        table(("DEVICE", "NODE", "TOTAL", "CONSUMED", "SHARES", "EXCLUSIVE", "UNHEALTHY"), devices),
        "",
        "SHARES",
        table(("SHARE", "CLAIM", "REQUEST", "DEVICE", "STATE", "CONSUMED", "NODE"), shares),
        "",
        "CLAIMS",
        table(("CLAIM", "PHASE", "NODE", "ALLOCATION", "SHARES"), claims),
        "",
        "NODES",
        table(("NODE", "LEASE", "LEASED", "EXPIRED", "FENCED", "LIVE SHARES"), nodes),
    ]
    return "\n".join(parts)


def _short(value: Any, width: int = 40) -> str:
    text = value if isinstance(value, str) else msgspec.json.encode(value).decode()
    return text if len(text) <= width else text[: width - 3] + "..."


def _changes(fields: dict[str, tuple[Any, Any]], limit: int = 6) -> str:
    parts = [f"{k}: {_short(a)} -> {_short(b)}" for k, (a, b) in list(fields.items())[:limit]]
    if len(fields) > limit:
        parts.append(f"(+{len(fields) - limit} more)")
    return "; ".join(parts) or "(named, unchanged)"


def timeline_table(what: str, steps: Sequence[Step]) -> str:
    """One line per step: position, time, event type, actor, what changed."""
    rows = [
        (
            s.position,
            s.recorded_at,
            s.type,
            s.actor,
            f"REFUSED ({s.refused}): skipped" if s.refused else _changes(s.changes),
        )
        for s in steps
    ]
    return f"timeline of {what}: {len(steps)} event(s)\n" + table(
        ("POSITION", "RECORDED", "EVENT", "ACTOR", "CHANGED"), rows
    )


def diff_table(a: int, b: int, changes: Sequence[Change]) -> str:
    """One line per changed key (fields of a changed one listed)."""
    rows = [(c.section, c.key, c.kind, _changes(c.fields) if c.fields else "") for c in changes]
    return f"from position {a} to {b}: {len(changes)} change(s)\n" + table(
        ("SECTION", "KEY", "CHANGE", "FIELDS"), rows
    )


class Progress:
    """``done / total`` on one terminal line, at most every 0.2 s."""

    def __init__(self, stream: TextIO, what: str, unit: str) -> None:
        self.stream, self.what, self.unit = stream, what, unit
        self._shown = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self._shown < 0.2 and done < total:
            return
        self._shown = now
        scale, suffix = (1 << 20, " MiB") if self.unit == "bytes" else (1, "")
        pct = 100.0 * done / total if total else 100.0
        self.stream.write(
            f"\r{self.what}: {done / scale:,.0f}/{total / scale:,.0f}{suffix} ({pct:.0f}%)\033[K"
        )
        self.stream.flush()

    def close(self) -> None:
        """Erase the line."""
        if self._shown:
            self.stream.write("\r\033[K")
            self.stream.flush()


def progress_for(what: str, unit: str) -> Progress | None:
    """A :class:`Progress` on stderr when it is a terminal, else ``None``."""
    return Progress(sys.stderr, what, unit) if sys.stderr.isatty() else None


def call(progress: Progress | None) -> Callable[[int, int], None] | None:
    """The callable to hand to a reader (``None`` without a terminal)."""
    return progress
