"""The docs point only at what the repository holds, and state figures with the command behind them.

A user reads README.md and docs/ on a fresh clone: a link to a file that is not there, or a
reference to the founders' private design notes (which are not in the repository), sends them
nowhere.
"""

import glob
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKDOWN = sorted(
  [os.path.join(REPO, "README.md")]
  + glob.glob(os.path.join(REPO, "docs", "*.md"))
  + glob.glob(os.path.join(REPO, "colabs", "*.md"))
  + glob.glob(os.path.join(REPO, "launch", "*.md"))
  + glob.glob(os.path.join(REPO, "knitjax", "**", "*.md"), recursive=True)
)
SOURCES = MARKDOWN + sorted(
  glob.glob(os.path.join(REPO, "knitjax", "**", "*.py"), recursive=True)
  + glob.glob(os.path.join(REPO, "configs", "**", "*.py"), recursive=True)
  + glob.glob(os.path.join(REPO, "colabs", "*.ipynb"))
)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_OUTSIDE = re.compile(r"DESIGN\.md|NOTES\.md|\.\./shared/")


def _rel(path):
  return os.path.relpath(path, REPO)


@pytest.mark.parametrize("path", MARKDOWN, ids=_rel)
def test_relative_links_resolve(path):
  with open(path, encoding="utf-8") as f:
    text = f.read()
  broken = []
  for target in _LINK.findall(text):
    if re.match(r"[a-z]+:", target) or target.startswith("#"):
      continue  # a URL or an anchor in the same page
    file_part = target.split("#", 1)[0]
    if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(path), file_part))):
      broken.append(target)
  assert not broken, f"{_rel(path)} links to files that are not in the repository: {broken}"


def test_nothing_points_at_notes_outside_the_repository():
  hits = []
  for path in SOURCES:
    with open(path, encoding="utf-8") as f:
      for n, line in enumerate(f, 1):
        if _OUTSIDE.search(line):
          hits.append(f"{_rel(path)}:{n}: {line.strip()[:100]}")
  assert not hits, "references to design notes that are not in the repository:\n" + "\n".join(hits)


def test_the_glossary_defines_the_words_the_readme_names():
  with open(os.path.join(REPO, "docs", "glossary.md"), encoding="utf-8") as f:
    glossary = f.read()
  for word in (
    "group",
    "class",
    "mini-batch",
    "gen version",
    "consume version",
    "architectural staleness",
    "storage unit",
    "consumer",
  ):
    assert f"| {word}" in glossary, word
