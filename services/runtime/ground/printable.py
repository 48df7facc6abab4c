"""Text for an operator's terminal: every string a tenant can influence, made harmless.

Tenants choose text that reaches an operator's screen: claim names, rejection reasons,
attribute names a CEL error echoes, opaque configuration, the detail of a refused
event. A terminal executes some characters instead of showing them — ESC starts a
control sequence (move the cursor, rewrite a line, change the window title, on some
terminals answer back), BEL rings, CR overwrites the line, C1 controls (U+0080-U+009F)
and bidirectional overrides reorder what is shown — so a tenant could hide or forge
what ``dracap claim list``, ``dracap audit`` or ``dracap replay timeline`` prints.

This module is the one place every renderer of dracap's commands goes through:

* :func:`printable` for text formats (timelines, one-line messages, CSV, plot labels),
  and :func:`table` — the one table renderer of every command — for each cell: every
  character Python does not call printable (``str.isprintable``: the Unicode categories
  Cc, Cf, Cs, Co, Cn, Zl, Zp and every space but U+0020) is written as an escape —
  ``\\n``, ``\\r``, ``\\t``, ``\\xNN``, ``\\uNNNN``, ``\\UNNNNNNNN``. A backslash is left
  as it is, so the escapes are for reading, not for decoding. A multi-line text is
  escaped line by line by whoever joins the lines (a tenant's newline must not start a
  line of its own);
* :func:`json_text` for JSON documents: the same characters as JSON ``\\uNNNN`` escapes
  (what ``json.dumps`` does by default; msgspec leaves DEL, C1 controls and other
  non-ASCII characters raw). The result is still valid JSON and decodes to the same data;
* :func:`yaml_text` for YAML documents: PyYAML with ``allow_unicode=False``, which writes
  such a string double-quoted with YAML's escapes (``"\\e[31m"``); it decodes to the
  same data.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Final

import yaml

__all__ = ["json_text", "printable", "table", "yaml_text"]

_NAMED: Final = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_NOT_JSON_SAFE: Final = re.compile(r"[^\x20-\x7e\n]")
_YAML_DUMPER: Final[type[yaml.SafeDumper] | type[yaml.CSafeDumper]] = getattr(
    yaml, "CSafeDumper", yaml.SafeDumper
)


def _escape(char: str) -> str:
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(value: Any) -> str:
    """``str(value)`` with every non-printable character escaped (module docstring)."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def _json_escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000  # a UTF-16 surrogate pair, as JSON writes characters above U+FFFF
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def json_text(document: str | bytes) -> str:
    """A JSON document with every character outside printable ASCII (newlines between
    tokens aside) as a ``\\uNNNN`` escape: the same data, nothing a terminal acts on."""
    text = document.decode() if isinstance(document, bytes) else document
    return _NOT_JSON_SAFE.sub(_json_escape, text)


def yaml_text(data: Any) -> str:
    """Block-style YAML of plain data in its given key order, every non-printable or
    non-ASCII character escaped by YAML (module docstring)."""
    return yaml.dump(
        data,
        Dumper=_YAML_DUMPER,
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=False,
    )


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns left-aligned, two spaces apart, every cell :func:`printable`."""
    lines = [[printable(c) for c in row] for row in [header, *rows]]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )
