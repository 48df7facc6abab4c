"""Every database function version is a file of its own, and migrations only name them.

The rule of :mod:`migrations.sqlfiles`: no migration holds a function's SQL or patches
another migration's text; each version file under ``migrations/functions/<name>/`` is
installed by some migration (by name and revision), and each version a migration names
exists. ``tests/integration/test_migration_functions.py`` checks what they install.
"""

from __future__ import annotations

import re
from pathlib import Path

from migrations import sqlfiles

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = ROOT / "migrations" / "versions"
_NAMED = re.compile(r'(?:install|function_sql)\(\s*"(\w+)",\s*("\d{4}"|revision)\s*\)')
_LOOP = re.compile(
    r'for name in (\w+|\(.*?\)):\s*(?:install\(name, ("\d{4}"|revision)\)|op\.execute\(_installed)',
    re.S,
)
_REVISION = re.compile(r'^revision: str = "(\d{4})"', re.M)


def _named() -> set[tuple[str, str]]:
    """(name, revision) of every version a migration installs, directly or in a loop."""
    named: set[tuple[str, str]] = set()
    for path in sorted(VERSIONS.glob("0*.py")):
        text = path.read_text()
        own = _REVISION.search(text)
        assert own, path.name
        calls = [(f'"{n}"', v) for n, v in _NAMED.findall(text)] + _LOOP.findall(text)
        for names, version in calls:
            if re.fullmatch(r"\w+", names):  # a tuple constant of the module
                names = re.search(rf"^{names} = \((.*?)\n\)", text, re.S | re.M).group(1)
            for name in re.findall(r'"(dracap_\w+)"', names):
                named.add(
                    (name, own.group(1) if version in ("revision", "") else version.strip('"'))
                )
    return named


def test_no_migration_holds_or_patches_function_sql() -> None:
    for path in sorted(VERSIONS.glob("0*.py")):
        text = path.read_text()
        assert not re.search(r"CREATE (OR REPLACE )?FUNCTION", text), path.name
        for call in re.findall(r"\.replace\(([^\n]*)", text):  # quoting helpers only
            assert "'\"" in call or "chr(39)" in call, f"{path.name}: .replace({call} patches text"


def test_every_version_file_is_installed_and_every_named_version_exists() -> None:
    files = {(p.parent.name, p.stem) for p in sqlfiles.FUNCTIONS.glob("*/*.sql")}
    named = _named() - {("dracap_payload_checks", "0011")}  # generated (its own test)
    assert named - files == set(), "a migration names a version that has no file"
    assert files - named == set(), "a version file no migration installs"
