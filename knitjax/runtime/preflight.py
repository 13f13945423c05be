"""Checks of the work directory that need no devices: they run before any mesh or compile.

A run that cannot write its checkpoints, or whose newest checkpoint is already past the
requested number of steps, is refused here with one sentence instead of after minutes of
compiling.
"""

from __future__ import annotations

import os
import tempfile

from knitjax.config import Config


def checkpoint_steps(workdir: str) -> list[int]:
  """Train steps of the finished checkpoints in ``workdir/checkpoints`` (orbax temp folders
  of an interrupted save have non-integer names and are not counted)."""
  folder = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(folder):
    return []
  return sorted(int(n) for n in os.listdir(folder) if n.isdigit())


def check_workdir(config: Config, workdir: str) -> None:
  """Raises ValueError (one sentence) unless ``workdir`` can hold this run.

  Checks that it is (or can become) a writable folder and that its newest checkpoint is not
  past ``config.runtime.steps``.
  """
  if not workdir:
    raise ValueError("--workdir is empty; give a folder for checkpoints and metrics.")
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ValueError(f"--workdir {workdir} is a file, not a folder.")
  try:
    os.makedirs(workdir, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=workdir, prefix=".knitjax-write-check-"):
      pass
  except OSError as e:
    raise ValueError(f"--workdir {workdir} is not writable ({e.strerror or e}).") from None
  steps = checkpoint_steps(workdir)
  if steps and steps[-1] > config.runtime.steps:
    raise ValueError(
      f"--workdir {workdir} holds a checkpoint at step {steps[-1]}, past "
      f"config.runtime.steps={config.runtime.steps}; raise steps to continue, or use a new workdir."
    )
