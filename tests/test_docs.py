"""The design is in the repository: every document and section the code and the docs
cite exists, and nothing cites a file a person who clones the repository does not have."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# "docs/behaviour.md §3", "behaviour.md §3" (inside docs/), "docs/storage.md"
_CITE = re.compile(r"(?:docs/)?\b([a-z][a-z0-9_-]*\.md)(?:\s+§\s*(\d+))?")
# files that existed only outside the repository
_FOREIGN = re.compile(r"\bSPEC\s*§|\b(?:SPEC|DESIGN|STACK|CONVENTIONS)\.md\b|\.\./shared|shared/seeds")


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    names = set(out.stdout.split())
    # and files not committed yet (a working tree under review)
    extra = subprocess.run(
        ["git", "ls-files", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True
    )
    names |= set(extra.stdout.split())
    return [ROOT / n for n in sorted(names) if n.endswith((".py", ".md", ".toml")) and (ROOT / n).exists()]


def _sections(doc: Path) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^## (\d+)\. ", doc.read_text(encoding="utf-8"), re.M)}


@pytest.mark.unit
def test_every_cited_document_and_section_exists():
    problems = []
    for path in _tracked_text_files():
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(ROOT)
        if path.name == "test_docs.py":
            continue
        for m in _FOREIGN.finditer(text):
            problems.append(f"{rel}: cites {m.group(0)!r}, which is not in the repository")
        for m in _CITE.finditer(text):
            name, section = m.group(1), m.group(2)
            if name in ("README.md",):
                target = ROOT / name
            else:
                target = ROOT / "docs" / name
                if not target.exists() and (ROOT / name).exists():
                    target = ROOT / name
                if not target.exists() and (path.parent / name).exists():
                    target = path.parent / name
            if not target.exists():
                problems.append(f"{rel}: cites {m.group(0)!r}; no such file")
            elif section and section not in _sections(target):
                problems.append(f"{rel}: cites {m.group(0)!r}; {target.name} has no section {section}")
    assert problems == [], "\n".join(problems)


@pytest.mark.unit
def test_markdown_links_point_at_files_that_exist():
    problems = []
    for path in _tracked_text_files():
        if path.suffix != ".md":
            continue
        for m in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8")):
            link = m.group(1)
            if "://" in link or link.startswith("mailto:"):
                continue
            if not (path.parent / link).exists():
                problems.append(f"{path.relative_to(ROOT)}: link to {link} points nowhere")
    assert problems == [], "\n".join(problems)


@pytest.mark.unit
def test_the_readme_layout_names_every_package_module():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    layout = readme[readme.index("## Layout") :]
    missing = []
    for module in sorted((ROOT / "deltamq").rglob("*.py")):
        if module.name == "__init__.py" or module.name.startswith("_"):
            continue
        if module.stem not in layout:
            missing.append(str(module.relative_to(ROOT)))
    assert missing == [], f"README's Layout section does not mention {missing}"
