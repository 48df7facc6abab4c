"""Safe output: every terminal format escapes what a tenant wrote; JSON and YAML stay data."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
import yaml

from services.commands import claim as claims_command
from services.commands.querying import emit as query_emit
from services.replay.history import Step
from services.replay.render import timeline_table, to_yaml
from services.runtime.ground.printable import json_text, printable, table, yaml_text

#: What a hostile tenant puts in a name or reason: ESC (colour, title, cursor), BEL, CR
#: (overwrite the line), a C1 CSI, DEL, a right-to-left override, a newline.
HOSTILE = "x\x1b[31m\x1b]0;pwned\x07\rOK\x9b2J\x7f\u202eevil\nfake line"
RAW = ("\x1b", "\x07", "\r", "\x9b", "\x7f", "\u202e")


def _clean(text: str) -> None:
    for char in RAW:
        assert char not in text, (char, text)


def test_printable_escapes_control_characters_and_keeps_the_rest() -> None:
    shown = printable(HOSTILE)
    _clean(shown)
    assert "\n" not in shown
    assert shown == "x\\x1b[31m\\x1b]0;pwned\\x07\\rOK\\x9b2J\\x7f\\u202eevil\\nfake line"
    assert printable("déjà vu: team-a/train") == "déjà vu: team-a/train"
    assert printable(42) == "42"


def test_json_text_is_the_same_json_without_raw_controls() -> None:
    data = {"reason": HOSTILE, "name": "é", "emoji": "\U0001f600"}
    for encoded in (msgspec.json.encode(data), json.dumps(data, ensure_ascii=False)):
        text = json_text(encoded)
        _clean(text)
        assert json.loads(text) == data


def test_yaml_text_is_the_same_yaml_without_raw_controls() -> None:
    data = {"reason": HOSTILE, "list": [HOSTILE]}
    text = yaml_text(data)
    _clean(text)
    assert yaml.safe_load(text) == data


def test_the_table_escapes_every_cell() -> None:
    text = table(("NAME", "REASON"), [("a", HOSTILE)])
    _clean(text)
    assert len(text.splitlines()) == 2


# --- per command family --------------------------------------------------------------------


def _claim_view() -> dict[str, Any]:
    return {
        "namespace": "team-a",
        "name": "train",
        "phase": "rejected",
        "ready": False,
        "reason": HOSTILE,
        "node": None,
        "shares": [],
    }


@pytest.mark.parametrize("output", ["table", "json", "yaml"])
def test_claim_list_get_and_watch_escape_what_a_tenant_wrote(
    output: str, capsys: pytest.CaptureFixture[str]
) -> None:
    claims_command.emit_claims(output, [_claim_view()], single=False)
    claims_command._print_change(output, _claim_view(), header=True)
    out = capsys.readouterr().out
    _clean(out)
    if output == "json":
        first = out[: out.index("\n]") + 2]
        assert json.loads(first)[0]["reason"] == HOSTILE
    if output == "yaml":
        assert yaml.safe_load(out.split("---\n")[0])[0]["reason"] == HOSTILE


@pytest.mark.parametrize("output", ["table", "json", "csv"])
def test_audit_and_usage_escape_what_a_tenant_wrote(output: str) -> None:
    rows = [{"claim": "train", "reason": HOSTILE, "namespace": "team-a"}]
    text = query_emit(output, rows, ["namespace", "claim", "reason"])
    _clean(text)
    if output == "json":
        assert json.loads(text)[0]["reason"] == HOSTILE


def test_replay_timeline_escapes_what_a_tenant_wrote() -> None:
    step = Step(
        position=3,
        recorded_at="2026-01-01T00:00:00+00:00",
        type="claims.rejected",
        actor=f"tenant:{HOSTILE}@team-a",
        actor_kind="tenant",
        changes={"reason": (None, HOSTILE)},
        refused=None,
    )
    text = timeline_table(f"claim team-a/{HOSTILE}", [step])
    _clean(text.split("\n", 1)[1])  # the table; the title line is the caller's to print
    plain = msgspec.to_builtins({"steps": [step]})
    shown = to_yaml(plain)
    _clean(shown)
    assert yaml.safe_load(shown)["steps"][0]["actor"] == step.actor
