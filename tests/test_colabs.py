"""The notebooks in colabs/ run top to bottom, without a Jupyter kernel, and stay output-free.

Each notebook runs in its own Python subprocess so that the XLA_FLAGS it sets take effect before
JAX starts (this pytest process has its own 8 fake devices). The runner executes the code cells
in order in one namespace; IPython-only lines (``%pip``, ``!git``) become ``pass``.
"""

import glob
import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "colabs", "*.ipynb")))
QUICKSTART_STEPS = 12

_MAGIC = re.compile(r"^(\s*)[%!].*$", re.MULTILINE)

# Runs argv[1]'s code cells in order in one namespace, as a kernel would.
_RUNNER = r"""
import json, re, sys
nb = json.load(open(sys.argv[1]))
ns = {"__name__": "__main__"}
for i, cell in enumerate(nb["cells"]):
  if cell["cell_type"] == "code":
    src = re.sub(r"^(\s*)[%!].*$", r"\1pass", "".join(cell["source"]), flags=re.MULTILINE)
    exec(compile(src, f"{sys.argv[1]} cell {i}", "exec"), ns)
"""


def _code(cell: dict) -> str:
  return _MAGIC.sub(r"\1pass", "".join(cell["source"]))


def _execute(path: str, tmp_path, **env_overrides: str) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the notebook sets its own
  env.update(
    PYTHONPATH=os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p),
    KNITJAX_REPO=REPO,
    MPLBACKEND="Agg",
    JAX_PLATFORMS="cpu",
    TMPDIR=str(tmp_path),  # the notebooks' tempfile.mkdtemp workdirs land here
    **env_overrides,
  )
  proc = subprocess.run(
    [sys.executable, "-c", _RUNNER, path],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, f"{os.path.basename(path)} failed:\n{proc.stderr[-4000:]}"
  return proc


def _number(pattern: str, text: str) -> float:
  m = re.search(pattern, text)
  assert m, f"no match for {pattern!r} in:\n{text[-3000:]}"
  return float(m.group(1))


def _check_quickstart(proc, tmp_path) -> None:
  out = proc.stdout
  assert _number(r"metrics rows: (\d+)", out) == QUICKSTART_STEPS
  first = _number(r"mean reward, first 5 steps: ([\d.]+)", out)
  last = _number(r"mean reward, last 10 steps: ([\d.]+)", out)
  assert 0.0 <= first <= 1.0 and 0.0 <= last <= 1.0
  (metrics,) = glob.glob(str(tmp_path / "knitjax_quickstart_*" / "metrics.jsonl"))
  with open(metrics) as f:
    rows = [json.loads(line) for line in f]
  assert [r["step"] for r in rows] == list(range(1, QUICKSTART_STEPS + 1))
  assert rows[-1]["version"] == QUICKSTART_STEPS  # colocated, one mini-batch per train step
  assert all(r["staleness_mean"] == 0 and r["arch_staleness_mean"] == 0 for r in rows)
  assert round(sum(r["reward_mean"] for r in rows[:5]) / 5, 3) == first


def _check_admission(proc, tmp_path) -> None:
  out = proc.stdout
  # docs/admission.md's worked example, plus two math groups of the next step.
  assert "minibatch: mini-batches released at arrivals [2, 4, 7, 8, 10]" in out
  assert "train_batch: mini-batches released at arrivals [8, 8, 8, 8]" in out
  assert "greedy: mini-batches released at arrivals [2, 4, 6, 9, 10]" in out
  lines = out.splitlines()
  header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["policy", "offered"])
  stats = {line.split()[0]: line.split()[1:] for line in lines[header + 1 : header + 4]}
  # offered, released_minibatches, quota_violations, bound_violations, violations, stalls, waiting
  assert stats["minibatch"][:6] == ["10", "5", "0", "0", "0", "0"]
  assert stats["train_batch"][:6] == ["10", "4", "0", "0", "0", "0"]
  assert stats["greedy"][:6] == ["10", "5", "1", "0", "1", "1"]
  assert "m5 into mini-batch 2: False" in out and "c6 into mini-batch 2: True" in out
  assert 0.0 < _number(r"throughput gain at depth 1: ([\d.]+)x", out) < 10.0
  assert glob.glob(str(tmp_path / "knitjax_staleness_*" / "staleness.json"))


_CHECKS = {"quickstart.ipynb": _check_quickstart, "admission.ipynb": _check_admission}


def test_every_notebook_has_a_check():
  assert sorted(os.path.basename(p) for p in NOTEBOOKS) == sorted(_CHECKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_is_clean_nbformat4(path):
  with open(path) as f:
    nb = json.load(f)
  assert nb["nbformat"] == 4 and nb["nbformat_minor"] >= 4
  assert nb["metadata"]["kernelspec"]["name"] == "python3"
  assert nb["metadata"]["kernelspec"]["language"] == "python"
  ids = [c.get("id") for c in nb["cells"]]
  assert len(set(ids)) == len(ids)
  for cell in nb["cells"]:
    assert cell["cell_type"] in ("code", "markdown")
    assert isinstance(cell["metadata"], dict)
    assert isinstance(cell["source"], list) and all(isinstance(s, str) for s in cell["source"])
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,64}", cell["id"])
    if cell["cell_type"] == "code":
      assert cell["outputs"] == [] and cell["execution_count"] is None, "clear outputs"
      compile(_code(cell), f"{path} {cell['id']}", "exec")
    else:
      assert "outputs" not in cell
  assert [c["cell_type"] for c in nb["cells"]].count("code") >= 3


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tmp_path):
  proc = _execute(path, tmp_path, KNITJAX_COLAB_STEPS=str(QUICKSTART_STEPS))
  _CHECKS[os.path.basename(path)](proc, tmp_path)
