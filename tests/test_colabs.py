"""The notebooks in colabs/ run top to bottom as written, install cell included, and stay clean.

test_notebook_runs executes each notebook without a Jupyter kernel, the way Colab would:

* Its install cell really runs. The ``repo_url`` fixture commits this checkout's files, as they
  are on disk (tracked and untracked, not ignored), to a git repository in a temp folder, and
  ``KNITJAX_REPO=file://...`` makes that the notebook's ``REPO_URL``: the cell ``git clone``s it
  and ``pip install``s the clone with the JAX build it picks (plain ``jax``, since the test sets
  ``JAX_PLATFORMS=cpu``).
* It runs in a fresh venv (``python -m venv --system-site-packages --without-pip``), in its own
  process, so the XLA_FLAGS it sets take effect before JAX starts. To keep CI short (about 6 s of
  pip per notebook instead of downloading jax, jaxlib, flax, ...), a ``.pth`` file adds this
  interpreter's site-packages to the venv (``--system-site-packages`` alone would add only the
  base interpreter's, not those of the venv CI runs in): pip finds every requirement installed
  and only builds and installs knitjax, with this interpreter's pip. knitjax itself is not
  importable there until the notebook installs it (the editable install's import hook is not
  loaded), and the test checks that the notebook imported it from the venv.
* IPython lines become what IPython turns them into, ``get_ipython().system(cmd)`` for ``!cmd``
  and ``get_ipython().run_line_magic("pip", args)`` for ``%pip args``; ``_Shell`` implements
  those two as IPython does (``{expr}`` expanded in the caller's namespace, ``%pip`` is
  ``<this python> -m pip``, in a shell), except that a command that fails raises
  ``CalledProcessError`` (IPython only prints it), so a broken install line fails the test.

Run as a script, this file is that runner: ``python tests/test_colabs.py NOTEBOOK``.
"""

import glob
import json
import os
import re
import shlex
import shutil
import site
import string
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "colabs", "*.ipynb")))
QUICKSTART_STEPS = 12

# A line of IPython: `!cmd` or `%magic args`, after any indentation.
_IPYTHON_LINE = re.compile(r"^([ \t]*)(!|%(\w+))(.*)$", re.MULTILINE)


def _translate(source: str) -> str:
  """Returns a cell's source with its `!` and `%pip` lines as IPython's transformer writes them."""

  def call(m: re.Match) -> str:
    indent, _, magic, rest = m.groups()
    if magic is None:
      return f"{indent}get_ipython().system({rest.strip()!r})"
    if magic != "pip":
      raise ValueError(
        f"unsupported IPython magic %{magic} in {m.group(0).strip()!r}: "
        "the test runner knows `!cmd` and `%pip`"
      )
    return f"{indent}get_ipython().run_line_magic('pip', {rest.strip()!r})"

  return _IPYTHON_LINE.sub(call, source)


class _EvalFormatter(string.Formatter):
  """IPython's `{expr}` expansion: each field is a Python expression in the namespace."""

  def get_field(self, field_name, args, kwargs):
    return eval(field_name, kwargs), field_name


class _Shell:
  """What `get_ipython()` does for `!cmd` and `%pip`, except that a failing command raises."""

  def system(self, cmd: str) -> None:
    self._run(self._expand(cmd, sys._getframe(1)))

  def run_line_magic(self, name: str, line: str) -> None:
    assert name == "pip", name  # _translate refuses other magics
    self._run(f"{shlex.quote(sys.executable)} -m pip {self._expand(line, sys._getframe(1))}")

  @staticmethod
  def _expand(text: str, frame) -> str:
    return _EvalFormatter().vformat(text, (), {**frame.f_globals, **frame.f_locals})

  @staticmethod
  def _run(cmd: str) -> None:
    print(f"$ {cmd}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    subprocess.run(cmd, shell=True, check=True)


def _run_notebook(path: str) -> None:
  """Runs a notebook's code cells in order in one namespace, as a kernel would."""
  with open(path) as f:
    nb = json.load(f)
  shell = _Shell()
  ns = {"__name__": "__main__", "get_ipython": lambda: shell}
  for cell in nb["cells"]:
    if cell["cell_type"] == "code":
      exec(compile(_translate("".join(cell["source"])), f"{path} {cell['id']}", "exec"), ns)


@pytest.fixture(scope="module")
def repo_url(tmp_path_factory) -> str:
  """A file:// URL of a git repository holding this checkout's files as they are on disk."""
  snapshot = tmp_path_factory.mktemp("knitjax_snapshot")
  listed = subprocess.run(
    ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
    cwd=REPO,
    capture_output=True,
    check=True,
  ).stdout.decode()
  for name in filter(None, listed.split("\0")):
    if os.path.isfile(os.path.join(REPO, name)):  # not a tracked file deleted in the work tree
      os.makedirs(os.path.dirname(snapshot / name), exist_ok=True)
      shutil.copy2(os.path.join(REPO, name), snapshot / name)
  config = ("user.name=test", "user.email=test@example.com", "commit.gpgsign=false")
  git = ["git"] + [arg for c in config for arg in ("-c", c)]
  for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "snapshot"]):
    subprocess.run(git + args, cwd=snapshot, check=True)
  return snapshot.as_uri()


def _execute(path: str, tmp_path, repo_url: str, **env_overrides: str):
  """Runs the notebook in a fresh venv in tmp_path; returns the process and the venv's folder."""
  from lab import without_device_count  # here: the notebook's own run of this file has no lab

  venv = tmp_path / "venv"
  subprocess.run(
    [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True
  )
  (venv_site,) = glob.glob(str(venv / "lib" / "python3*" / "site-packages"))
  with open(os.path.join(venv_site, "test_colabs_parent.pth"), "w") as f:
    f.write("\n".join(site.getsitepackages()) + "\n")  # appended after the venv's own
  # The notebook sets its device count; a PYTHONPATH holding the checkout would skip the install.
  drop = ("PYTHONPATH", "VIRTUAL_ENV")
  env = {k: v for k, v in without_device_count(os.environ).items() if k not in drop}
  env.update(
    VIRTUAL_ENV=str(venv),
    PATH=os.pathsep.join([str(venv / "bin"), env.get("PATH", "")]),
    KNITJAX_REPO=repo_url,
    JAX_PLATFORMS="cpu",
    MPLBACKEND="Agg",
    PIP_DISABLE_PIP_VERSION_CHECK="1",
    TMPDIR=str(tmp_path),  # the notebooks' tempfile.mkdtemp workdirs land here
    **env_overrides,
  )
  proc = subprocess.run(
    [str(venv / "bin" / "python"), os.path.abspath(__file__), path],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, (
    f"{os.path.basename(path)} failed (exit {proc.returncode}):\n"
    f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
  )
  return proc, venv


def _number(pattern: str, text: str) -> float:
  m = re.search(pattern, text)
  assert m, f"no match for {pattern!r} in:\n{text[-3000:]}"
  return float(m.group(1))


def _check_install(out: str, tmp_path, venv, devices: int) -> None:
  """The install cell installed knitjax into the venv, with plain jax, and JAX runs on the CPU."""
  assert "cpu runtime: installing jax and knitjax from file://" in out
  m = re.search(r"^knitjax [\d.]+ from (.+)$", out, re.MULTILINE)
  assert m, out[-3000:]
  assert os.path.realpath(m.group(1)).startswith(os.path.realpath(venv) + os.sep), m.group(1)
  clone = os.path.realpath(tmp_path / "knitjax_repo")
  assert f"configs from {clone}; cpu runtime, JAX from 'jax'" in out
  cpus = ", ".join(f"CpuDevice(id={i})" for i in range(devices))
  assert re.search(rf"^JAX [\d.]+, backend cpu: \[{re.escape(cpus)}\]$", out, re.MULTILINE), out
  assert "WARNING" not in out


def _check_quickstart(out: str, tmp_path) -> None:
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


def _check_admission(out: str, tmp_path) -> None:
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


# Per notebook: its checks, and how many CPU devices JAX shows (the quickstart asks for 2).
_CHECKS = {"quickstart.ipynb": (_check_quickstart, 2), "admission.ipynb": (_check_admission, 1)}


def test_every_notebook_has_a_check():
  assert sorted(os.path.basename(p) for p in NOTEBOOKS) == sorted(_CHECKS)


def test_ipython_lines_run_as_ipython_runs_them(tmp_path):
  """`!` and `%pip` run in a shell with {expr} expanded; a failing one raises."""
  source = "if True:\n  !printf '%s,' {' '.join(words)} > {out}\n  %pip --version > {out}.pip\n"
  code = _translate(source)
  assert code.splitlines()[1:] == [
    "  get_ipython().system(" + repr("printf '%s,' {' '.join(words)} > {out}") + ")",
    "  get_ipython().run_line_magic('pip', '--version > {out}.pip')",
  ]
  shell = _Shell()
  ns = {"get_ipython": lambda: shell, "words": ["a b", "c"], "out": str(tmp_path / "out")}
  exec(compile(code, "cell", "exec"), ns)
  assert (tmp_path / "out").read_text() == "a,b,c,"
  assert f"(python {sys.version_info.major}.{sys.version_info.minor})" in (
    (tmp_path / "out.pip").read_text()
  )
  for broken in ("!false", f"%pip install -q --no-index {tmp_path / 'no_such_project'}"):
    with pytest.raises(subprocess.CalledProcessError):
      exec(compile(_translate(broken), "cell", "exec"), ns)
  with pytest.raises(ValueError, match="unsupported IPython magic %timeit"):
    _translate("%timeit f()")


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
      compile(_translate("".join(cell["source"])), f"{path} {cell['id']}", "exec")
    else:
      assert "outputs" not in cell
  assert [c["cell_type"] for c in nb["cells"]].count("code") >= 3


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tmp_path, repo_url):
  proc, venv = _execute(path, tmp_path, repo_url, KNITJAX_COLAB_STEPS=str(QUICKSTART_STEPS))
  check, devices = _CHECKS[os.path.basename(path)]
  _check_install(proc.stdout, tmp_path, venv, devices)
  check(proc.stdout, tmp_path)


if __name__ == "__main__":
  # A kernel does not have tests/ on its path (tests/lab would shadow the lab package).
  if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)
  _run_notebook(sys.argv[1])
