"""docs/architecture.md maps every module: each module file of the three packages has its row
(its path in a row's first cell, or a folder row such as `gguf/` that names it), and every file a
first cell names exists, so an added, renamed or deleted module fails here until the map follows.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = {  # the doc's section heading -> the package's source root
    "packages/paged-kernels/src/paged_kernels/": ROOT / "packages/paged-kernels/src/paged_kernels",
    "packages/paged-engine/src/paged_engine/": ROOT / "packages/paged-engine/src/paged_engine",
    "packages/paged-server/src/paged_server/": ROOT / "packages/paged-server/src/paged_server",
}
CODE = re.compile(r"`([^`]+)`")


def _rows() -> dict[str, list[tuple[str, str]]]:
    """Each package's table rows as (first cell, whole row), by the `###` section they sit in."""
    rows: dict[str, list[tuple[str, str]]] = {heading: [] for heading in PACKAGES}
    section = None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("### "):
            section = next((h for h in PACKAGES if line[4:].startswith(h)), None)
        elif section is not None and line.startswith("| `"):
            rows[section].append((line.split(" | ")[0], line))
    return rows


def _named_files(cell: str) -> list[str]:
    """The module paths a first cell names: a bare file name sits in the folder of the path
    before it (`structured_output/backend.py`, `llguidance_backend.py`)."""
    out, folder = [], ""
    for name in CODE.findall(cell):
        if not name.endswith(".py") or "*" in name:  # `models/*.py`: the family tables'
            continue
        if "/" in name:
            folder = name.rsplit("/", 1)[0] + "/"
            out.append(name)
        else:
            out.append(folder + name)
    return out


def _modules(src: Path) -> list[str]:
    return sorted(str(p.relative_to(src)) for p in src.rglob("*.py") if p.name != "__init__.py")


def test_every_module_has_a_row() -> None:
    missing = []
    for heading, rows in _rows().items():
        named = {f for cell, _ in rows for f in _named_files(cell)}
        folder_rows = [
            (folder, row)
            for cell, row in rows
            for folder in CODE.findall(cell)
            if folder.endswith("/")
        ]
        for module in _modules(PACKAGES[heading]):
            if module in named:
                continue
            folder, _, stem = module.rpartition("/")
            stem = stem.removesuffix(".py")
            word = re.compile(rf"\b{re.escape(stem)}\b")
            if not any(f == folder + "/" and word.search(row) for f, row in folder_rows):
                missing.append(f"{heading}{module}")
    assert missing == [], f"modules docs/architecture.md does not map: {missing}"


def test_every_mapped_file_exists() -> None:
    stale = [
        f"{heading}{name}"
        for heading, rows in _rows().items()
        for cell, _ in rows
        for name in _named_files(cell)
        if not (PACKAGES[heading] / name).is_file()
    ]
    assert stale == [], f"docs/architecture.md maps files that do not exist: {stale}"
