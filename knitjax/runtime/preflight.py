"""Checks of the work directory that need no devices: they run before any mesh or compile.

A run that cannot write its checkpoints, or whose newest checkpoint is already past the
requested number of steps, is refused here with one sentence instead of after minutes of
compiling.
"""

from __future__ import annotations

import uuid

from etils import epath

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
  not past ``config.loop.steps``.
  """
  if not workdir:
    raise ValueError("--workdir is empty; give a folder for checkpoints and metrics.")
  check_writable(wd.path(workdir), f"--workdir {workdir}", create=True)
  steps = checkpoint_steps(workdir)
  if steps and steps[-1] > config.loop.steps:
    raise ValueError(
      f"--workdir {workdir} holds a checkpoint at step {steps[-1]}, past "
      f"config.loop.steps={config.loop.steps}; raise steps to continue, or use a new workdir."
    )


def check_writable(root: epath.Path, what: str, *, create: bool) -> None:
  """Raises ValueError (one sentence starting with ``what``, e.g. ``--workdir runs/a``) unless
  ``root`` is a folder this process can write (by writing and deleting a small file);
  ``create``: make it if missing.
  """
  probe = root / f".knitjax-write-check-{uuid.uuid4().hex}"
  try:
    is_file = root.exists() and not root.is_dir()
    if not is_file:
      if create:
        root.mkdir(parents=True, exist_ok=True)
      probe.write_text("")
      probe.unlink()
  except ImportError as e:  # e.g. fsspec's "Install gcsfs to access Google Storage"
    raise ValueError(
      f"{what} needs a storage library that is missing ({e}); for gs:// run "
      "pip install -e '.[gcs]'."
    ) from None
  except OSError as e:
    raise ValueError(f"{what} is not writable ({e.strerror or e}).") from None
  except Exception as e:  # noqa: BLE001 (cloud clients raise their own types, e.g. HttpError)
    raise ValueError(f"{what} is not writable ({type(e).__name__}: {e}).") from None
  if is_file:
    raise ValueError(f"{what} is a file, not a folder.")


def check_checkpoint_workdir(workdir: str) -> int:
  """The newest checkpoint step of a workdir that ``knitjax.eval`` or ``knitjax.export`` reads.

  Nothing is created: a mistyped workdir is refused, not evaluated on the random init.

  Raises:
    ValueError: (one sentence naming the workdir) it is missing, a file, or holds no checkpoint.
  """
  if not workdir:
    raise ValueError("--workdir is empty; give the folder of a run's checkpoints.")
  root = wd.path(workdir)
  if not root.exists():
    raise ValueError(f"--workdir {workdir} does not exist; give the folder of a run's checkpoints.")
  if not root.is_dir():
    raise ValueError(f"--workdir {workdir} is a file, not a folder.")
  steps = checkpoint_steps(workdir)
  if not steps:
    raise ValueError(
      f"--workdir {workdir} holds no checkpoint (no finished step folder in "
      f"{wd.path(workdir, 'checkpoints')}); train there first, or check the path."
    )
  return steps[-1]
