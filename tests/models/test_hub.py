"""`resolve_checkpoint`: local folders pass through; Hub ids resolve from a hub cache offline.

The cache is built exactly as huggingface_hub lays it out (`models--Org--Name/refs/main` holding
the commit hash, `snapshots/<hash>/<file>` symlinks into `blobs/<sha>`). huggingface_hub reads
HF_HOME / HF_HUB_CACHE / HF_HUB_OFFLINE when imported, so the environment-variable tests run in a
fresh subprocess; the others patch `huggingface_hub.constants`.
"""

import hashlib
import json
import os
import subprocess
import sys

import pytest

from knitjax.models import hub

COMMIT = "0123456789abcdef0123456789abcdef01234567"
FILES = {"config.json": b'{"model_type": "qwen2"}', "model.safetensors": b"weights"}


def _hub_cache(cache, repo_id="Org/Name", commit=COMMIT, ref="main"):
  """A huggingface_hub cache holding `repo_id` at `commit`, which `ref` points to."""
  repo = cache / f"models--{repo_id.replace('/', '--')}"
  (repo / "refs").mkdir(parents=True)
  (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
  snapshot = repo / "snapshots" / commit
  snapshot.mkdir(parents=True)
  (repo / "blobs").mkdir(exist_ok=True)
  for name, data in FILES.items():
    blob = hashlib.sha256(data).hexdigest()
    (repo / "blobs" / blob).write_bytes(data)
    os.symlink(os.path.join("..", "..", "blobs", blob), snapshot / name)
  return str(snapshot)


def _resolve_in_subprocess(init_from, env):
  code = (
    "import json, sys\n"
    "from knitjax.models import hub\n"
    "try:\n"
    "  print(json.dumps({'path': hub.resolve_checkpoint(sys.argv[1])}))\n"
    "except ValueError as e:\n"
    "  print(json.dumps({'error': str(e)}))\n"
  )
  clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
  out = subprocess.run(
    [sys.executable, "-c", code, init_from],
    env={**clean, **env},
    capture_output=True,
    text=True,
    check=True,
  )
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("variable", ["HF_HUB_CACHE", "HF_HOME"])
def test_offline_hub_id_resolves_to_the_cached_snapshot(tmp_path, variable):
  cache = tmp_path / "hub"
  snapshot = _hub_cache(cache)
  root = cache if variable == "HF_HUB_CACHE" else tmp_path  # HF_HOME holds hub/
  env = {variable: str(root), "HF_HUB_OFFLINE": "1"}
  assert _resolve_in_subprocess("Org/Name", env) == {"path": snapshot}
  got = _resolve_in_subprocess("Org/Name", env)["path"]
  with open(os.path.join(got, "config.json")) as f:
    assert json.load(f) == {"model_type": "qwen2"}
  # a missing id offline: one sentence saying what to do
  error = _resolve_in_subprocess("Org/Missing", env)["error"]
  assert error.startswith("Org/Missing@main is not in the Hugging Face cache ")
  assert "HF_HUB_OFFLINE is set; download it once online" in error
  assert error.count(". ") == 0 and error.endswith(".")


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
  from huggingface_hub import constants

  cache = tmp_path / "hub"
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  return cache


def test_revisions_resolve_offline(offline_cache):
  snapshot = _hub_cache(offline_cache)
  other = "fedcba9876543210fedcba9876543210fedcba98"
  tagged = _hub_cache(offline_cache, repo_id="Org/Tagged", commit=other, ref="v1")
  assert hub.resolve_checkpoint("Org/Name") == snapshot
  assert hub.resolve_checkpoint("Org/Name@main") == snapshot
  assert hub.resolve_checkpoint(f"Org/Name@{COMMIT}") == snapshot
  assert hub.resolve_checkpoint("Org/Tagged@v1") == tagged
  with pytest.raises(ValueError, match=r"^Org/Tagged@main is not in the Hugging Face cache"):
    hub.resolve_checkpoint("Org/Tagged")  # only the tag v1 is cached


def test_local_folder_passes_through(tmp_path, offline_cache):
  (tmp_path / "Org" / "Name").mkdir(parents=True)
  _hub_cache(offline_cache)
  assert hub.resolve_checkpoint(str(tmp_path)) == str(tmp_path)
  cwd = os.getcwd()
  os.chdir(tmp_path)
  try:  # an existing folder wins over a Hub id of the same spelling
    assert hub.resolve_checkpoint("Org/Name") == "Org/Name"
  finally:
    os.chdir(cwd)


@pytest.mark.parametrize(
  "bad",
  ["", "/no/such/folder", "./missing", "justaname", "a/b/c", "Org/Na--me", "Org/Name@", "Org/.x"],
)
def test_neither_folder_nor_hub_id_is_one_sentence(bad, offline_cache):
  with pytest.raises(ValueError, match=r"accepted: an existing checkpoint folder or a Hub id"):
    hub.resolve_checkpoint(bad)


def test_a_file_is_not_a_checkpoint(tmp_path, offline_cache):
  (tmp_path / "model.safetensors").write_bytes(b"x")
  with pytest.raises(ValueError, match=r"is a file, not a folder and not a Hub id"):
    hub.resolve_checkpoint(str(tmp_path / "model.safetensors"))


def test_network_failure_is_one_sentence(tmp_path, monkeypatch):
  import huggingface_hub
  from huggingface_hub import constants, errors

  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

  def unreachable(*args, **kwargs):
    raise errors.LocalEntryNotFoundError("An error happened while trying to locate the files")

  monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
  with pytest.raises(ValueError, match=r"^Org/Name@main could not be downloaded \(the Hub cannot"):
    hub.resolve_checkpoint("Org/Name")
