"""docs/ARCHITECTURE.md lists every module of the package, and only modules that exist; and every other
file of the package that git tracks (C++ kernels, the web page's files, assets), and only those."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "tokenmill"
OTHER_FILE_SECTIONS = ("## C++ CPU kernels", "## Other files in the package")


def test_the_map_names_every_module_and_no_other() -> None:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    listed = set(re.findall(r"^\| `([\w/]+\.py)` \|", text, flags=re.MULTILINE))
    present = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")}
    assert present - listed == set(), "modules missing from docs/ARCHITECTURE.md's module table"
    assert listed - present == set(), "docs/ARCHITECTURE.md lists modules that do not exist"


def tracked_files_besides_modules() -> set[str]:
    """The package's files that git tracks and that are not Python (a fetched or built file is untracked)."""
    try:
        run = subprocess.run(
            ["git", "ls-files", "-z", "--", "tokenmill"], cwd=ROOT, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs a git checkout")
    files = {str(Path(name).relative_to("tokenmill")) for name in run.stdout.split("\0") if name}
    return {name for name in files if not name.endswith((".py", ".pyc")) and "__pycache__" not in name}


def listed_besides_modules(text: str) -> set[str]:
    """The first cells of the rows of the sections that name the package's other files: a file, or a
    folder (ending in ``/``) that stands for every file under it."""
    listed: set[str] = set()
    for heading in OTHER_FILE_SECTIONS:
        assert heading in text, f"docs/ARCHITECTURE.md has no section {heading!r}"
        section = text.split(heading, 1)[1].split("\n## ", 1)[0]
        listed |= set(re.findall(r"^\| `([\w./-]+)` \|", section, flags=re.MULTILINE))
    return listed


def test_the_map_names_every_other_package_file_and_no_other() -> None:
    listed = listed_besides_modules((ROOT / "docs" / "ARCHITECTURE.md").read_text())
    present = tracked_files_besides_modules()
    folders = {name for name in listed if name.endswith("/")}

    def named(path: str) -> bool:
        return path in listed or any(path.startswith(folder) for folder in folders)

    missing = {path for path in present if not named(path)}
    assert missing == set(), "files missing from docs/ARCHITECTURE.md's C++ kernel and other-file tables"
    stale = {name for name in listed - folders if name not in present}
    stale |= {folder for folder in folders if not any(path.startswith(folder) for path in present)}
    assert stale == set(), "docs/ARCHITECTURE.md names package files that git does not track"
