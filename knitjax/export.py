"""Export a checkpoint as a Hugging Face folder:
``python -m knitjax.export --config configs/<x>.py --workdir DIR --out FOLDER [--overwrite]``.

Restores the newest intact checkpoint of ``DIR`` and writes its policy with
`knitjax.models.hf.save_hf_params`: ``config.json`` and safetensors in Hugging Face format. LoRA
adapters are merged into the base weights (``W + (alpha / r)·A·B``), so the folder holds the
plain model; it loads as ``config.init_from`` (knitjax writes no tokenizer.json: a task with its
own tokenizer trains on it).

A workdir that is missing, a file, or holds no checkpoint is refused in one sentence (nothing is
created). ``FOLDER`` must be new or empty, unless ``--overwrite`` asks to replace it: files of an
older export (another shard count's ``model.safetensors.index.json``) would otherwise mix with the
new ones. ``--overwrite`` replaces only a previous export (a folder holding nothing but
``config.json`` and safetensors files): the whole folder is removed, so a folder with anything
else in it (a run, a user's notes) is refused. ``FOLDER`` may not be the workdir, hold it or lie
inside it (compared as real paths, links resolved), nor be a symlink. The folder is written whole
beside its place (a sibling ``.FOLDER.tmp-<pid>``) and then renamed into it, so a failed or
stopped export leaves the old folder as it was.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys

from absl import flags, logging
from ml_collections import config_flags

from knitjax import cli

# Flags only when run as a command: the library function can be imported beside another entry
# point (both define --config).
if __name__ == "__main__":
  _CONFIG = config_flags.DEFINE_config_file("config", None, "The run's config file.")
  _WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir (its checkpoints).")
  _OUT = flags.DEFINE_string("out", None, "The Hugging Face folder to write (new or empty).")
  _OVERWRITE = flags.DEFINE_bool(
    "overwrite", False, "Replace --out whole if it already holds files."
  )
  _DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Stored dtype.")
  flags.mark_flags_as_required(["config", "workdir", "out"])


# What `hf.save_hf_params` may have written into an earlier export (any shard count): the only
# names --overwrite removes, since it removes the folder whole.
_EXPORT_FILE = re.compile(
  r"config\.json|model\.safetensors|model\.safetensors\.index\.json"
  r"|model-\d{5}-of-\d{5}\.safetensors"
)


def check_out(out: str, *, overwrite: bool, workdir: str | None = None) -> None:
  """Raises ValueError (one sentence naming ``out``) unless an export may be written there:
  a new or empty folder (a previous export with ``overwrite``) whose parent this process can
  write, that is not a symlink and neither is, holds nor lies inside ``workdir``."""
  from etils import epath

  from knitjax import workdir as wd
  from knitjax.runtime.preflight import check_writable

  if not out:
    raise ValueError("--out is empty; give the folder to write.")
  path = os.path.abspath(out)
  if os.path.islink(path):
    # the swap would replace the link, not the folder it points to
    raise ValueError(f"--out {out} is a symlink; give the real folder it points to, or a new one.")
  if workdir and not wd.is_remote(workdir):
    real, run = os.path.realpath(path), os.path.realpath(workdir)
    common = os.path.commonpath([real, run])
    if common in (real, run):
      how = "is" if real == run else "holds" if common == real else "lies inside"
      raise ValueError(
        f"--out {out} {how} the workdir {workdir}; choose a folder outside the run, which an "
        "export must not replace."
      )
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"--out {out} is a file, not a folder.")
  names = sorted(os.listdir(path)) if os.path.isdir(path) else []
  if names and not overwrite:
    raise ValueError(
      f"--out {out} is not empty (it holds {_shown(names)}); pass --overwrite to replace it "
      "whole, or choose a new folder."
    )
  if others := [
    n for n in names if not (_EXPORT_FILE.fullmatch(n) and os.path.isfile(os.path.join(path, n)))
  ]:
    raise ValueError(
      f"--out {out} holds {_shown(others)}, which no export wrote; --overwrite replaces only a "
      "previous export (config.json and safetensors files), so choose a new folder."
    )
  if os.path.isdir(path) and not os.access(path, os.W_OK):
    raise ValueError(f"--out {out} is not writable (permission denied).")
  parent = os.path.dirname(path)
  check_writable(
    epath.Path(parent), f"--out {out} cannot be created: its folder {parent}", create=True
  )


def _shown(names: list[str]) -> str:
  return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def export(
  config, workdir: str, out: str, *, dtype: str = "float32", overwrite: bool = False
) -> dict:
  """Writes the newest checkpoint's policy (adapters merged) to ``out``; returns what it wrote.

  Raises:
    ValueError: (one sentence) the workdir holds no checkpoint, or ``out`` is not a new or empty
      folder (a previous export with ``overwrite``), is a symlink, is or holds or lies inside the
      workdir, or cannot be written.
  """
  import jax
  import ml_dtypes
  import numpy as np

  from knitjax.runtime import builder
  from knitjax.runtime.preflight import check_checkpoint_workdir

  if config.vision is not None:
    raise ValueError("knitjax.export writes text decoders; config.vision is set (a VLM).")
  check_checkpoint_workdir(workdir)
  check_out(out, overwrite=overwrite, workdir=workdir)
  mesh = builder.build_mesh(config)
  _, learner = builder.build_learner(config, mesh, workdir)
  learner.restore()
  step = learner.version // config.admission.minibatches
  from knitjax.models import hf

  stored = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
  path = os.path.abspath(out)
  tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
  try:
    with jax.set_mesh(mesh):
      hf.save_hf_params(learner.policy_params, config.model, tmp, dtype=stored)
    if jax.process_index() == 0:
      _swap_in(tmp, path)
  except OSError as e:
    from knitjax import workdir as wd

    raise wd.write_error(out, e) from None
  finally:
    shutil.rmtree(tmp, ignore_errors=True)  # a failed or stopped export leaves no temp folder
    learner.close()
  return {"step": step, "checkpoint": True, "out": out, "dtype": dtype}


def _swap_in(tmp: str, path: str) -> None:
  """Puts the folder ``tmp`` in the place of ``path``: renamed into it when ``path`` is missing
  or empty; otherwise the old folder is renamed aside first and removed once the new is in."""
  if os.path.isdir(path) and not os.listdir(path):
    os.rmdir(path)
  if not os.path.exists(path):
    os.rename(tmp, path)
    return
  old = f"{tmp}.old"
  os.rename(path, old)
  try:
    os.rename(tmp, path)
  except OSError:
    os.rename(old, path)  # put the old folder back
    raise
  shutil.rmtree(old, ignore_errors=True)


def main(argv):
  del argv
  cli.quiet_libraries()
  from knitjax.config import from_config_dict

  try:
    config = from_config_dict(_CONFIG.value)
  except (OSError, ValueError) as e:
    sys.exit(f"error: {cli.one_line(e)}")
  cli.request_cpu_devices(config.mesh.cpu_devices)
  try:
    out = export(config, _WORKDIR.value, _OUT.value, dtype=_DTYPE.value, overwrite=_OVERWRITE.value)
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f"error: {e}")
  logging.info("export: %s", out)
  print(json.dumps(out))


def _stopped(how: str) -> str:
  return f"stopped by {how}; {_OUT.value} was not changed (rerun the same command)."


if __name__ == "__main__":
  cli.run(main, stopped=_stopped)
