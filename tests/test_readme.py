"""The README stays a front page and the docs stay findable (issue 38, items 5 and 6).

The README holds what a newcomer reads first (what it is, the two commands, a first result, own
data, the methods table, where the docs are) in at most 12,000 characters; everything else is a
page of docs/, each listed in docs/index.md, each with its commands run by a test
(tests/test_readme_commands.py DOCS), and no relative link of the README or a page leads nowhere.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_readme_commands import DOCS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
#: Reference pages whose commands are examples, not a route a user follows.
REFERENCES = ("design.md", "config.md")


def test_the_readme_is_at_most_12000_characters():
    assert len(README.read_text()) <= 12_000


def test_the_readme_shows_the_two_commands_the_picture_and_the_index():
    readme = README.read_text()
    fenced = re.search(r"^```bash\n(.*?)^```", readme, re.S | re.M)
    assert fenced and [line.split("#")[0].strip() for line in fenced[1].splitlines()] == [
        "make quickstart",
        "make test",
    ]
    pictures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", readme)
    assert pictures, "the README shows no first result"
    for picture in pictures:
        assert (ROOT / picture).stat().st_size < 200_000, picture
    assert "(docs/index.md)" in readme


def test_every_docs_page_is_one_line_of_the_index():
    index = (ROOT / "docs" / "index.md").read_text()
    listed = re.findall(r"^- \[([\w.]+)\]\(([\w.]+)\): \S", index, re.M)
    assert all(name == link for name, link in listed)
    assert sorted(name for name, _ in listed) == sorted(p.name for p in PAGES if p.name != "index.md")


def test_every_docs_page_but_the_references_has_its_commands_run():
    pages = {p.name for p in PAGES if p.name not in REFERENCES}
    assert pages == {Path(doc).name for doc in DOCS if doc.startswith("docs/")}


def test_relative_links_lead_to_files():
    broken = []
    for page in [README, *PAGES]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path = target.split("#")[0]
            if path and not re.match(r"\w+:", path) and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []
