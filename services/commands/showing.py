"""What ``dracap claim`` and ``dracap apply``/``get``/``delete`` both show.

A claim's table (one row per share, :data:`CLAIM_HEADER`) and :func:`emit`, the ``-o
table|json|yaml`` choice of both, every text escaped for a terminal
(:mod:`services.runtime.ground.printable`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, Final

from services.runtime.ground.printable import json_text, yaml_text

__all__ = ["CLAIM_HEADER", "claim_rows", "emit"]


def _consumed(share: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in (share.get("consumed") or {}).items()) or "-"


def claim_rows(views: Sequence[dict[str, Any]]) -> list[list[str]]:
    """One row per share (a claim without shares gets one row)."""
    rows = []
    for view in views:
        first = [
            view.get("namespace", ""),
            view.get("name", ""),
            view.get("phase", ""),
            view.get("node") or "-",
        ]
        shares = view.get("shares") or [{}]
        for i, share in enumerate(shares):
            device = "/".join(share[k] for k in ("pool", "device") if share.get(k)) or "-"
            lead = first if i == 0 else ["", "", "", ""]
            rows.append(
                [
                    *lead,
                    device,
                    _consumed(share),
                    share.get("share_id") or "-",
                    (view.get("reason") or "") if i == 0 else "",
                ]
            )
    return rows


CLAIM_HEADER: Final = [
    "NAMESPACE",
    "NAME",
    "PHASE",
    "NODE",
    "DEVICE",
    "CONSUMED",
    "SHARE",
    "REASON",
]


def emit(output: str, data: Any, render_table: Callable[[], str]) -> None:
    """``data`` as JSON or YAML, or the table ``render_table`` gives, each escaped for a
    terminal (:mod:`services.runtime.ground.printable`)."""
    if output == "json":
        print(json_text(json.dumps(data, indent=2)))
    elif output == "yaml":
        sys.stdout.write(yaml_text(data))
    else:
        print(render_table())
    sys.stdout.flush()
