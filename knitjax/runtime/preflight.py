"""Checks of the work directory that need no devices: they run before any mesh or compile.

A run that cannot write its checkpoints, or whose newest checkpoint is already past the
requested number of steps, is refused here with one sentence instead of after minutes of
compiling.
"""

from __future__ import annotations

import uuid

from knitjax import workdir as wd
from knitjax.config import Config


def checkpoint_steps(workdir: str) -> list[int]:
  """Train steps of the finished checkpoints in ``workdir/checkpoints`` (orbax temp folders
  of an interrupted save have non-integer names and are not counted)."""
  folder = wd.path(workdir, "checkpoints")
  if not folder.is_dir():
    return []
  return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


def check_workdir(config: Config, workdir: str) -> None:
  """Raises ValueError (one sentence) unless ``workdir`` can hold this run.

  Checks that it is (or can become) a writable folder (a local one or a cloud URL such as
  ``gs://bucket/run``, by writing and deleting a small file) and that its newest checkpoint is
  not past ``config.runtime.steps``.
  """
  if not workdir:
    raise ValueError("--workdir is empty; give a folder for checkpoints and metrics.")
  root = wd.path(workdir)
  probe = root / f".knitjax-write-check-{uuid.uuid4().hex}"
  try:
    is_file = root.exists() and not root.is_dir()
    if not is_file:
      root.mkdir(parents=True, exist_ok=True)
      probe.write_text("")
      probe.unlink()
  except ImportError as e:  # e.g. fsspec's "Install gcsfs to access Google Storage"
    raise ValueError(
      f"--workdir {workdir} needs a storage library that is missing ({e}); for gs:// run "
      "pip install -e '.[gcs]'."
    ) from None
  except OSError as e:
    raise ValueError(f"--workdir {workdir} is not writable ({e.strerror or e}).") from None
  except Exception as e:  # noqa: BLE001 (cloud clients raise their own types, e.g. HttpError)
    raise ValueError(f"--workdir {workdir} is not writable ({type(e).__name__}: {e}).") from None
  if is_file:
    raise ValueError(f"--workdir {workdir} is a file, not a folder.")
  steps = checkpoint_steps(workdir)
  if steps and steps[-1] > config.runtime.steps:
    raise ValueError(
      f"--workdir {workdir} holds a checkpoint at step {steps[-1]}, past "
      f"config.runtime.steps={config.runtime.steps}; raise steps to continue, or use a new workdir."
    )
