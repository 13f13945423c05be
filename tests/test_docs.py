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


# The nouns a reader meets in docs/architecture.md (STYLE.md: every one in the glossary).
ARCHITECTURE_NOUNS = (
  "trajectory", "sample", "prompt stream", "rollout contract", "sampler",
  "continuous engine", "slot", "lane", "payload", "metadata", "storage unit", "storage limits",
  "admission index", "offer", "release", "consumer plan", "on-demand access", "feed", "preparer",
  "centralized baseline", "training layout", "padded row", "packed row", "shared-prompt unit",
  "fixed spans", "packed units", "tree mask", "encoder dedup", "Learner", "run state",
  "weight sync", "adopt", "stage", "wire format", "weight shards", "response mask",
  "colocated execution", "disaggregated execution", "rollout thread", "depth bound",
  "version clock", "topology", "trainer processes", "leader", "follower", "announcement",
  "coordination service", "pulse", "layer", "simulator", "VLM", "evaluation", "record codec",
  "fault point", "adapter", "frozen base",
)  # fmt: skip


def test_the_glossary_defines_the_nouns_of_the_architecture():
  with open(os.path.join(REPO, "docs", "glossary.md"), encoding="utf-8") as f:
    rows = [line for line in f if line.startswith("| ")]
  defined = {row.split("|")[1].strip() for row in rows}
  missing = [word for word in ARCHITECTURE_NOUNS if word not in defined]
  assert not missing, f"docs/glossary.md lacks a row for {missing}"
  # One table: a blank line inside it would turn the rows after it into plain text.
  with open(os.path.join(REPO, "docs", "glossary.md"), encoding="utf-8") as f:
    table = f.read().split("| word | meaning |", 1)[1]
  assert "\n\n|" not in table


def _readme_commands() -> list[list[str]]:
  """Every ``python -m knitjax...`` command in README.md, split into words."""
  import shlex

  with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
    text = f.read()
  found = re.findall(r"python -m (knitjax[\w.]*)([^`\n&]*)", text)
  return [["python", "-m", module, *shlex.split(rest)] for module, rest in found]


def test_the_readme_commands_name_real_modules_configs_and_fields():
  """Each README command's module exists, its --config file loads with its variant, and each
  --config.x=y override names a field of that config: a newcomer's copy-paste gets past flag
  parsing (running them all is the benchmarks' and CI's job)."""
  import importlib.util

  commands = _readme_commands()
  assert len(commands) >= 10, commands
  for words in commands:
    assert importlib.util.find_spec(words[2]) is not None, words
    if "--config" not in words:
      continue
    path, _, arg = words[words.index("--config") + 1].partition(":")
    if path.startswith("<"):
      continue  # a placeholder the text explains
    assert os.path.exists(os.path.join(REPO, path)), words
    spec = importlib.util.spec_from_file_location("readme_config", os.path.join(REPO, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(arg or None)
    for w in words:
      if w.startswith("--config.") and "=" in w:
        node = config
        for key in w[len("--config.") : w.index("=")].split("."):
          assert key in node, f"{' '.join(words)}: {w} names no field"
          node = node[key]


def test_the_config_reference_is_current():
  from lab import config_doc

  with open(os.path.join(REPO, "docs", "config.md")) as f:
    page = f.read()
  assert page == config_doc.render(), "docs/config.md is stale: python -m lab.config_doc > it"
