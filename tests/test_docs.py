"""The documentation keeps up with the code: every relative link in README.md and docs/ reaches an existing file
and heading, the full job spec example validates, and every dependency in pyproject.toml has its reason."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib
import yaml
from conftest import REPO

from clusterfit.spec import validate_spec

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    anchors, seen = set(), {}
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", text, flags=re.M):
        slug = _slug(heading)
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_reach_a_file_and_a_heading(page: Path) -> None:
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no such heading")
    assert not broken, broken


def test_the_full_spec_example_validates() -> None:
    text = (REPO / "docs" / "spec.md").read_text()
    example = re.search(r"## The full example.*?```yaml\n(.*?)```", text, flags=re.S)
    assert example, "docs/spec.md has no full example"
    validate_spec(yaml.safe_load(example.group(1)))


def test_every_dependency_has_its_reason() -> None:
    # pyproject.toml itself, not the installed metadata, which a stale editable install leaves behind
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *(d for extra in project["optional-dependencies"].values() for d in extra)]
    reasons = (REPO / "docs" / "dependencies.md").read_text().lower()
    names = {re.split(r"[\[<>=!~ ;]", dependency)[0].lower() for dependency in declared}
    assert not [name for name in sorted(names) if f"| {name}" not in reasons and f", {name}" not in reasons]
