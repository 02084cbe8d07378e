"""docs/ARCHITECTURE.md lists every module of the package, and only modules that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "tokenmill"


def test_the_map_names_every_module_and_no_other() -> None:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    listed = set(re.findall(r"^\| `([\w/]+\.py)` \|", text, flags=re.MULTILINE))
    present = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")}
    assert present - listed == set(), "modules missing from docs/ARCHITECTURE.md's module table"
    assert listed - present == set(), "docs/ARCHITECTURE.md lists modules that do not exist"
