"""The docs a newcomer reads: a README read in minutes, links that lead somewhere, and lists that agree
with the code they describe."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

from batchfleet.config import ENV_PREFIX, Config
from supervisor import classify
from supervisor.classify import CLASSES

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 150
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code (a link inside code is an example)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub makes for the headings of `page`: lowercased, punctuation dropped, spaces
    to hyphens; a repeated heading gets -1, -2 ..."""
    out: set[str] = set()
    for heading in re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M),
                              flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n, candidate = 0, slug
        while candidate in out:
            n += 1
            candidate = f"{slug}-{n}"
        out.add(candidate)
    return out


def test_the_readme_is_at_most_150_lines() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move detail into docs/*.md")


def test_every_relative_link_in_the_readme_and_docs_points_at_a_file_that_exists() -> None:
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading in {dest.name})")
    assert broken == []


def class_rows(text: str) -> list[str]:
    """The first cells of a markdown table's rows that name a class, in order."""
    return [c for c in re.findall(r"^\| ([a-z][a-z-]*) \|", text, flags=re.M) if c != "class"]


def test_the_supervisor_docs_list_the_classes_classify_knows_in_the_order_it_checks_them() -> None:
    text = (ROOT / "docs" / "supervisor.md").read_text()
    listed = class_rows(text.split("## Seeing: classes", 1)[1].split("\n## ", 1)[0])
    assert sorted(listed) == sorted(str(c) for c in CLASSES)
    assert listed == class_rows(classify.__doc__ or "")  # the order classify's docstring says it checks


def test_the_readme_names_the_procfile_s_supervisor_command_and_lists_no_server_classes() -> None:
    readme = (ROOT / "README.md").read_text()
    (command,) = re.findall(r"^supervisor: (.+)$", (ROOT / "Procfile").read_text(), flags=re.M)
    assert command.startswith("supervisor watch")
    assert "supervisor run" not in readme  # the Procfile runs `supervisor watch`
    assert not [c for c in CLASSES if c not in ("down", "idle", "hung") and str(c) in readme], \
        "README lists server classes: link docs/supervisor.md instead"


def test_docs_config_md_lists_every_setting_config_reads_and_no_other() -> None:
    rows = re.findall(r"^\| (.+?) \|", (ROOT / "docs" / "config.md").read_text(), flags=re.M)
    documented = {name for row in rows for name in re.findall(r"`(BATCHFLEET_[A-Z0-9_]+)`", row)}
    settings = {ENV_PREFIX + f.name.upper() for f in fields(Config)}
    assert sorted(settings - documented) == [], "settings docs/config.md does not list"
    assert sorted(documented - settings) == [], "docs/config.md lists what Config does not read"
