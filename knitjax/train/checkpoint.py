"""Checkpoints with orbax: device state (params, optimizer) plus host metadata.

The host metadata holds the one counter that is the truth for progress, the
policy ``version`` (optimizer updates applied); the train step is derived from
it. It also holds the RNG seed data, the prompt iterator state, and whatever
the runtime adds (admission index, staleness counters).

Restoring tries the newest checkpoint first and falls back to older ones that
``keep`` retained when a checkpoint is damaged (a torn file, a missing item,
unparseable metadata); the damaged folders are moved to
``workdir/checkpoints_damaged`` so that later saves and ``keep`` see only intact
ones. A checkpoint written by a different model is refused up front, naming the
first array that differs, before orbax tries to restore onto this run's shapes.

Resuming on another shape (another number of trainer processes or devices) is a restore onto
this run's shardings: orbax reads each array's stored chunks into the target's shards, so the
parameters and optimizer state are resharded as they load. The meta records the layout that
wrote it (``_layout``: processes and devices); a restore onto another layout says so in one log
line and records both in :attr:`Checkpointer.resharded`. The host run state is the same whatever
the layout (process 0 writes it), so it carries over as it is.

The workdir may be a cloud URL (``gs://bucket/run``): paths go through ``etils.epath`` (see
:mod:`knitjax.workdir`), as orbax's own do.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from knitjax import workdir as wd

# Orbax's per-step metadata file; it writes it before the step folder is committed.
_STEP_METADATA = "_CHECKPOINT_METADATA"
# The meta key of the layout that wrote a checkpoint; kept here, never seen by the caller.
_LAYOUT = "_layout"


def layout(state: Any) -> dict[str, int]:
  """The layout of ``state``: this run's processes, and the devices its arrays are spread over."""
  shardings = [getattr(leaf, "sharding", None) for leaf in jax.tree.leaves(state)]
  sets = [s.device_set for s in shardings if s is not None]
  return {"processes": jax.process_count(), "devices": max(map(len, sets), default=1)}


def _describe(lay: dict) -> str:
  p, d = lay.get("processes"), lay.get("devices")
  return f"{p} process{'es' if p != 1 else ''} of {d} device{'s' if d != 1 else ''} in all"


class Checkpointer:
  """Saves and restores ``(state, meta)`` in ``workdir/checkpoints/<train step>``.

  Attributes:
    directory: ``workdir/checkpoints``, absolute if local (see :func:`knitjax.workdir.path`).
    restored_step: the step the last :meth:`restore` loaded (None before one).
    resharded: ``(layout that wrote it, this layout)`` when the last restore loaded a
      checkpoint written by another number of processes or devices, else None.
  """

  def __init__(self, workdir: str, *, keep: int = 2):
    self.directory = wd.path(workdir, "checkpoints")
    self.damaged_directory = wd.path(workdir, "checkpoints_damaged")
    self.restored_step: int | None = None
    self.resharded: tuple[dict, dict] | None = None
    self._saving: tuple[int, int] | None = None  # (step, bytes of arrays) of the last save
    self._manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
      # Registered up front so a fresh process can read a step's tree metadata before restoring.
      item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
    )

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def path(self, step: int) -> epath.Path:
    """The folder of the checkpoint of train step ``step``."""
    return self.directory / str(step)

  def save(self, step: int, state: Any, meta: Mapping[str, Any]) -> None:
    """Saves asynchronously; a crash mid-save leaves the previous checkpoint intact.

    Raises:
      knitjax.workdir.DiskFull (a ValueError): one sentence naming the folder, the bytes and the
        free space; the disk filled up while this or the previous save was written. The partial
        folder is removed.
    """
    self.wait()  # orbax waits for the previous save here anyway; its error is named, not raised
    self._saving = (step, sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(state)))
    with self._disk_full_named():
      saved = self._manager.save(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardSave(state),
          meta=ocp.args.JsonSave({**meta, _LAYOUT: layout(state)}),
        ),
      )
    if not saved:  # orbax skips a step at or before its newest one without a word
      logging.warning(
        "checkpoint of step %d was not saved: %s already holds step %s.",
        step,
        self.directory,
        self.latest_step(),
      )

  def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
    """Restores onto the shardings of ``abstract_state`` (a pytree of arrays or shape structs).

    Without ``step``, tries the newest checkpoint and then older ones: each damaged one is
    reported with a warning and, once an older one restored, moved to ``damaged_directory``.

    Raises:
      FileNotFoundError: no checkpoint exists in the directory (or not ``step``).
      ValueError: no checkpoint tried is intact, or one was written by a different model.
    """
    if step is None:
      steps = sorted(self._manager.all_steps(), reverse=True)
      if not steps:
        raise FileNotFoundError(f"no checkpoint found in {self.directory}.")
    elif step not in self._manager.all_steps():
      raise FileNotFoundError(f"no checkpoint of step {step} found in {self.directory}.")
    else:
      steps = [step]
    target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), abstract_state
    )
    damaged: list[tuple[int, str]] = []
    for i, s in enumerate(steps):
      restored, reason = self._try_restore(s, target)
      if restored is None:
        damaged.append((s, reason))
        then = "trying an older one" if i + 1 < len(steps) else "no older one is left"
        logging.warning("checkpoint %s is damaged (%s); %s.", self.path(s), reason, then)
        continue
      for bad, _ in damaged:
        self._set_aside(bad)
      if damaged:
        self._manager.reload()
      state, meta = restored
      written, here = meta.pop(_LAYOUT, None), layout(target)
      self.restored_step = s
      self.resharded = (written, here) if written and written != here else None
      if self.resharded:
        logging.info(
          "restored checkpoint %s, written by %s, resharded onto %s",
          self.path(s), _describe(written), _describe(here),
        )  # fmt: skip
      else:
        logging.info("restored checkpoint %s", self.path(s))
      return state, meta
    listing = "; ".join(f"{self.path(s)} ({reason})" for s, reason in damaged)
    raise ValueError(
      f"no intact checkpoint to resume from in {self.directory}: {listing}; restore those "
      "folders from a copy, or move them away to start afresh."
    )

  def _try_restore(self, step: int, target: Any) -> tuple[tuple[Any, dict] | None, str]:
    """``((state, meta), "")``, or ``(None, why)`` when the checkpoint is damaged.

    Raises:
      ValueError: the checkpoint was written by a different model.
    """
    folder = self.path(step)
    # Orbax raises whatever its layers raise on a damaged folder (KeyError for a missing item,
    # JSONDecodeError, OSError, tensorstore's ValueError...): everything here counts as damage.
    try:
      _check_step_metadata(folder)
      stored = self._manager.item_metadata(step)["state"].tree
    except Exception as e:  # noqa: BLE001 (see above)
      return None, _reason(e)
    _check_same_model(folder, stored, target)  # a ValueError that is not damage
    try:
      restored = self._manager.restore(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
        ),
      )
    except Exception as e:  # noqa: BLE001 (see above)
      return None, _reason(e)
    if not isinstance(restored["meta"], Mapping):
      return None, f"meta is a {type(restored['meta']).__name__}, not a JSON object"
    return (restored["state"], dict(restored["meta"])), ""

  def _set_aside(self, step: int) -> None:
    """Moves a damaged step folder out of orbax's sight, keeping it for inspection."""
    folder = self.path(step)
    if jax.process_index() == 0:
      self.damaged_directory.mkdir(parents=True, exist_ok=True)
      dest, n = self.damaged_directory / str(step), 0
      while dest.exists():
        n += 1
        dest = self.damaged_directory / f"{step}.{n}"
      folder.rename(dest)  # on an object store: a copy of each object, then a delete
      logging.warning("moved damaged checkpoint %s to %s.", folder, dest)
    ocp.multihost.sync_global_processes(f"knitjax_set_aside_{step}")

  def wait(self) -> None:
    """Waits for the save in flight. Raises ValueError (one sentence) if the disk filled up."""
    with self._disk_full_named():
      self._manager.wait_until_finished()

  def close(self) -> None:
    self.wait()
    self._manager.close()

  @contextlib.contextmanager
  def _disk_full_named(self):
    """Turns a full disk met by the save in flight into one sentence, and removes the partial
    folder orbax left (``<step>.orbax-checkpoint-tmp...``: never restored, but it holds space)."""
    try:
      yield
    except Exception as e:
      if not wd.is_disk_full(e) or self._saving is None:
        raise
      step, nbytes = self._saving
      self._saving = None
      if jax.process_index() == 0:
        for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
          partial.rmtree(missing_ok=True)
      free = wd.free_bytes(self.directory)
      room = f"; {free:,} bytes are free there" if free is not None else ""
      kept = [int(p.name) for p in self.directory.iterdir() if p.name.isdigit()]
      then = f"resume from checkpoint {max(kept)}" if kept else "start again"
      raise wd.DiskFull(
        f"no space left on the device of {self.directory} for the checkpoint of step {step} "
        f"(about {nbytes:,} bytes of arrays{room}); free space and rerun the same command to "
        f"{then}."
      ) from None


def _reason(e: Exception, limit: int = 200) -> str:
  """A short one-line reason for a warning: the exception type and its first line."""
  text = str(e).strip().splitlines()[0] if str(e).strip() else ""
  reason = f"{type(e).__name__}: {text}" if text else type(e).__name__
  return reason if len(reason) <= limit else reason[: limit - 3] + "..."


def _check_step_metadata(folder: epath.Path) -> None:
  """Orbax restores despite a torn step metadata file; a torn file means the folder is suspect."""
  path = folder / _STEP_METADATA
  if path.exists():
    json.loads(path.read_text())


def _path_name(path) -> str:
  """``params/blocks/0/attn/q_kernel/value`` for a key path (dict keys, attributes, indices)."""
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


def _shapes(tree) -> dict[str, tuple[int, ...] | None]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {
    _path_name(p): tuple(leaf.shape) if getattr(leaf, "shape", None) is not None else None
    for p, leaf in leaves
  }


def _more(names: list[str]) -> str:
  return names[0] + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")


def _check_same_model(folder: epath.Path, stored_tree, target) -> None:
  """Raises a one-sentence ValueError naming what differs between checkpoint and target."""
  stored, wanted = _shapes(stored_tree), _shapes(target)
  differences = []
  shapes = [k for k in wanted if k in stored and stored[k] != wanted[k]]
  if shapes:
    k = shapes[0]
    extra = f" ({len(shapes) - 1} more arrays differ)" if len(shapes) > 1 else ""
    differences.append(f"{k} has shape {stored[k]}, this run's model has {wanted[k]}{extra}")
  if missing := [k for k in wanted if k not in stored]:
    differences.append(f"it lacks {_more(missing)}, which this run's model has")
  # Orbax lists the stored tree with sorted keys; name extras in this run's top-level order.
  order: dict[str, int] = {}
  for k in wanted:
    order.setdefault(k.split("/")[0], len(order))
  unknown = sorted(
    (k for k in stored if k not in wanted), key=lambda k: order.get(k.split("/")[0], len(order))
  )
  if unknown:
    differences.append(f"it has {_more(unknown)}, which this run's model lacks")
  if differences:
    raise ValueError(
      f"checkpoint {folder} was written by a different model: {'; '.join(differences)}; "
      "resume with the model config that wrote it or start in a new workdir."
    )
