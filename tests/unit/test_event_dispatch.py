"""What an event means is read through ``events.transitions``, not by event class.

A consumer that tests ``isinstance(event, SomeCatalogEvent)`` writes its own copy of
what the event means, and copies drift (issue 26: the SLO metrics and ``dracap report``
disagreed, audit and billing each kept the staleness rule). This test counts, with the
AST, every ``isinstance`` whose class argument names a catalog event class (directly,
in a tuple or union, or through a module-level alias) in ``services/``, and holds each
module to the dispatches it has left: the ones that read an event's *payload* (the
manifest a claim was submitted with, the allocation an agent enforces, the rule a
rejection names) or check what a writer may append (the agent's report kinds), which
no transition replaces.

A new dispatch fails here: match on a transition (``events.transitions.meaning``,
``events_meaning`` for a set of event classes picked once), or, when the module
really reads a payload, raise its allowance in the same change and say why.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: module -> the isinstance dispatches on catalog events it may keep, and why
ALLOWED: dict[str, int] = {
    "services/enforcement/reports.py": 7,  # the kinds an agent may report (a writer's rights)
    "services/enforcement/service.py": 4,  # slices and retries a report carries
    "services/enforcement/decisions.py": 3,  # the allocation to enforce, a release
    "services/audit/records.py": 2,  # a rejection's summary, a refused append's text
    "services/replay/history.py": 2,  # a claim's manifest and allocation, as the log has them
    "services/runtime/store/recorded.py": 2,  # the same, read for the views
    "services/billing/usage.py": 1,  # the manifest's classes
    "services/claims/adminwrites.py": 1,  # the slices the write itself publishes
    "services/claims/apiwrites.py": 1,  # the classes its own admission names (the premise)
    "services/report/panels.py": 1,  # the rule a rejection names
    "services/reservation/rounds.py": 1,  # the bindings the round itself writes
}


def _catalog_classes() -> set[str]:
    tree = ast.parse((ROOT / "events/catalog.py").read_text())
    return {node.name for node in tree.body if isinstance(node, ast.ClassDef)}


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def dispatches(root: Path = ROOT) -> Counter[str]:
    """``isinstance`` calls on catalog event classes per module of ``services/``."""
    classes = _catalog_classes()
    files = sorted((root / "services").rglob("*.py"))
    trees = {path: ast.parse(path.read_text()) for path in files}
    aliases: dict[str, set[str]] = {}
    for _ in range(2):  # an alias of aliases
        for tree in trees.values():
            for node in tree.body:
                if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                    target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                    named = _names(node.value)
                    hit = (named & classes).union(*(aliases.get(n, set()) for n in named))
                    if isinstance(target, ast.Name) and hit:
                        aliases[target.id] = hit
    counts: Counter[str] = Counter()
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "isinstance"
                and len(node.args) == 2
            ):
                named = _names(node.args[1])
                if named & classes or any(n in aliases for n in named):
                    counts[str(path.relative_to(root))] += 1
    return counts


def test_consumers_read_transitions_not_event_classes() -> None:
    counts = dispatches()
    over = {m: n for m, n in counts.items() if n > ALLOWED.get(m, 0)}
    assert not over, f"isinstance on catalog events (read events.transitions instead): {over}"


def test_the_count_sees_a_dispatch(tmp_path: Path) -> None:
    """The counter itself: a dispatch through an alias counts, one on a transition not."""
    (tmp_path / "events").mkdir()
    (tmp_path / "services").mkdir()
    (tmp_path / "events" / "catalog.py").write_text((ROOT / "events/catalog.py").read_text())
    (tmp_path / "services" / "probe.py").write_text(
        "from events.catalog import NodeFenced\n"
        "from events.transitions import NodeFencedOff\n"
        "NODE_WIDE = (NodeFenced,)\n"
        "def f(e, t):\n"
        "    return isinstance(e, NODE_WIDE) or isinstance(t, NodeFencedOff)\n"
    )
    assert dispatches(tmp_path) == Counter({"services/probe.py": 1})


#: consumers that learn what an event did from its transitions and the fold's journal
#: (``ClusterState.phase_changes`` / ``share_changes``) alone: no field of the event read
JOURNAL_READERS: tuple[str, ...] = (
    "services/runtime/ops/slos.py",
    "services/runtime/ops/holdings.py",
)


def event_reads(path: Path) -> list[str]:
    """Where ``path`` reads a field of an event: ``event.x``, ``envelope.event.x`` or
    ``getattr(event, ...)`` (handing the event itself on, to ``meaning``, is not one)."""

    def is_event(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id in ("event", "ev")) or (
            isinstance(node, ast.Attribute) and node.attr == "event"
        )

    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and is_event(node.value):
            out.append(f"{path.name}:{node.lineno} .{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and node.args
            and is_event(node.args[0])
        ):
            out.append(f"{path.name}:{node.lineno} getattr")
    return out


def test_the_slo_fold_and_the_held_gauge_read_no_event_field() -> None:
    """They once worked out which claims and shares an event names (its ``namespace``,
    ``name``, ``share_id``) and walked a fenced node's shares themselves: the fold says
    which ones it moved, once."""
    found = [hit for module in JOURNAL_READERS for hit in event_reads(ROOT / module)]
    assert not found, f"read the fold's journal or the transitions instead: {found}"


def test_the_event_field_reads_are_seen(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f(event, env, state):\n"
        "    meaning(event)\n"
        "    return getattr(event, 'share_id'), env.event.name, state.share_changes()\n"
    )
    assert event_reads(probe) == ["probe.py:3 getattr", "probe.py:3 .name"]
