"""Damaged orbax checkpoints, fed to `knitjax.train.checkpoint.Checkpointer.restore`."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from lab.faults.bad_inputs.core import BadInput, Case, Draw, baseline, fresh_copy
from lab.faults.bad_inputs.strategies import (
  IDENT,
  not_json,
  not_object_json,
)

_STEP = "1"
# Files of a step folder that restoring reads (the per-process OCDBT files are merged into the
# root ones when saving, so damage to those changes nothing restored). A missing state/_sharding
# is no damage (the target gives the shardings), a torn one is.
_CKPT_FILES = ("state/manifest.ocdbt", "state/_METADATA", "meta/metadata")
_CKPT_JSON = ("meta/metadata", "_CHECKPOINT_METADATA", "state/_METADATA")


def _ckpt_state(a_shape=(4, 3)) -> dict:
  import jax.numpy as jnp

  return {
    "params": {"a": jnp.full(a_shape, 1.0), "b": {"k": jnp.arange(5.0)}},
    "count": jnp.int32(1),
  }


def context(folder: str) -> dict:
  from knitjax.train.checkpoint import Checkpointer

  pristine = os.path.join(folder, "pristine")
  shutil.rmtree(pristine, ignore_errors=True)
  ckpt = Checkpointer(pristine, keep=1)
  ckpt.save(int(_STEP), _ckpt_state(), {"version": 2})
  ckpt.close()
  ctx = {"folder": folder, "pristine": pristine, "n": 0, "last": None}
  baseline("checkpoint", lambda: _restore(fresh_copy(ctx), _ckpt_state()))
  return ctx


def _restore(workdir: str, target) -> Any:
  from absl import logging

  from knitjax.train.checkpoint import Checkpointer

  verbosity = logging.get_verbosity()
  logging.set_verbosity(logging.ERROR)  # each damaged folder is also reported by a warning
  try:
    ckpt = Checkpointer(workdir)
    try:
      return ckpt.restore(target)
    finally:
      ckpt.close()
  finally:
    logging.set_verbosity(verbosity)


def _damaged(draw: Draw, ctx: dict, damage: Callable[[str], str]) -> BadInput:
  workdir = fresh_copy(ctx)
  folder = os.path.join(workdir, "checkpoints", _STEP)
  what = damage(folder)
  call = lambda: _restore(workdir, _ckpt_state())
  return BadInput(f"{folder}: {what}", (folder,), call, file_errors=True)


def _ckpt_data_files(folder: str) -> list[str]:
  data = sorted(os.path.join("state", "d", f) for f in os.listdir(os.path.join(folder, "state/d")))
  return [*_CKPT_FILES, *data]


def _ckpt_truncate(draw: Draw, ctx: dict) -> BadInput:
  def damage(folder: str) -> str:
    names = [*_ckpt_data_files(folder), "state/_sharding", "_CHECKPOINT_METADATA"]
    name = draw(st.sampled_from(names))
    path = os.path.join(folder, name)
    size = draw(st.integers(0, os.path.getsize(path) - 1))
    os.truncate(path, size)
    return f"{name} truncated to {size} bytes"

  return _damaged(draw, ctx, damage)


def _ckpt_delete(draw: Draw, ctx: dict) -> BadInput:
  def damage(folder: str) -> str:
    name = draw(st.sampled_from([*_ckpt_data_files(folder), "state", "meta", "state/d"]))
    path = os.path.join(folder, name)
    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    return f"{name} deleted"

  return _damaged(draw, ctx, damage)


def _ckpt_garbage(draw: Draw, ctx: dict) -> BadInput:
  def damage(folder: str) -> str:
    name = draw(st.sampled_from(_CKPT_JSON))
    garbage = st.one_of(
      st.text(max_size=40).filter(not_json).map(str.encode),
      st.binary(min_size=1, max_size=40).map(lambda b: b"\xff" + b),
    )
    if name == "meta/metadata":  # the run state must be a JSON object
      garbage = st.one_of(garbage, not_object_json())
    content = draw(garbage)
    with open(os.path.join(folder, name), "wb") as f:
      f.write(content)
    return f"{name} = {content[:80]!r}"

  return _damaged(draw, ctx, damage)


def _ckpt_empty(draw: Draw, ctx: dict) -> BadInput:
  def damage(folder: str) -> str:
    shutil.rmtree(folder)
    os.makedirs(folder)
    return "emptied"

  return _damaged(draw, ctx, damage)


def _ckpt_other_model(draw: Draw, ctx: dict) -> BadInput:
  workdir = fresh_copy(ctx)
  how = draw(st.sampled_from(["shape", "missing", "extra"]))
  if how == "shape":
    shape = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3).filter(lambda s: s != [4, 3]))
    target, name = _ckpt_state(tuple(shape)), "params/a"
  elif how == "missing":
    target = _ckpt_state()
    name = draw(st.sampled_from(["params/a", "params/b/k", "count"]))
    parent = target
    *path, leaf = name.split("/")
    for key in path:
      parent = parent[key]
    del parent[leaf]
  else:
    import jax.numpy as jnp

    target = _ckpt_state()
    key = draw(IDENT.filter(lambda k: k not in ("a", "b")))
    target["params"][key] = jnp.zeros(draw(st.lists(st.integers(1, 4), max_size=2)))
    name = f"params/{key}"
  what = f"restored as a model with {name} {how}"
  return BadInput(what, (name,), lambda: _restore(workdir, target), file_errors=True)


CASES: list[Case] = [
  ("truncated", _ckpt_truncate),
  ("deleted", _ckpt_delete),
  ("garbage_json", _ckpt_garbage),
  ("empty_folder", _ckpt_empty),
  ("other_model", _ckpt_other_model),
]
