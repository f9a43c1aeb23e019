"""The README's first screen (issue 34 item 6): a command table naming every `shellrl` command, a
table of contents whose links all reach a heading, no path outside the repository, and the
LICENSE file that pyproject.toml's `license` names."""

from __future__ import annotations

import re
import tomllib

from cli.main import build_parser
from tests.helpers.processes import REPO

README = (REPO / "README.md").read_text()


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces
    to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_the_command_table_comes_before_the_first_section_and_names_every_command():
    top = README.split("\n## ", 1)[0]
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # noqa: SLF001 (argparse's own)
    missing = [name for name in commands if f"`shellrl {name}" not in top]
    assert not missing, f"README's command table lacks: {missing}"
    assert "`make run`" in top and "`make test`" in top and "**Contents:**" in top


def test_every_link_of_the_contents_reaches_a_heading():
    headings = {anchor(h) for h in re.findall(r"^#{2,3} (.+)$", README, flags=re.M)}
    contents = README.split("**Contents:**", 1)[1].split("\n\n", 1)[0]
    links = re.findall(r"\]\(#([^)]+)\)", contents)
    assert len(links) >= 10
    assert [link for link in links if link not in headings] == []


def test_readme_and_docs_point_at_nothing_outside_the_repository():
    """A clone has no ../shared nor /work/ (docs/checks.md, design-notes.md, sglang.md and
    terminal-rewards.md pointed there)."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    pages += sorted((REPO / "deploy").glob("**/*.md"))
    outside = [
        f"{page.relative_to(REPO)}:{n}"
        for page in pages
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if "../shared" in line or "/work/" in line
    ]
    assert len(pages) > 5
    assert outside == []


def test_license_file_is_the_apache_license_pyproject_names():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text.splitlines()[0] and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
