"""Bad group payloads, fed to `knitjax.transfer.storage.InProcessStorageUnit.put`."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import strategies as st

from lab.faults.bad_inputs.core import BadInput, Case, Draw, baseline
from lab.faults.bad_inputs.strategies import (
  IDENT,
  LIST,
  NON_FINITE,
  TEXT,
)

_VOCAB, _MAX_SEQ = 50, 48
_DTYPES = [np.int8, np.int16, np.int64, np.uint8, np.uint32, np.float16, np.float32, np.float64]


def context(folder: str) -> dict:
  from knitjax.transfer.storage import StorageLimits

  limits = StorageLimits(
    vocab_size=_VOCAB,
    max_seq_len=_MAX_SEQ,
    max_bytes=1 << 24,
    max_image_bytes=4096,
    on_full="raise",
  )
  ctx = {"limits": limits}
  rng = np.random.default_rng(0)
  image = rng.integers(0, 255, (4, 4, 3)).astype(np.uint8)
  good = _synthetic(rng, 4, 5, 6) | {"image_index": np.zeros(4, np.int32)}
  baseline("payload", lambda: _unit(ctx).put(0, good, [image]))
  return ctx


def _unit(ctx: dict, **changes):
  from knitjax.transfer.storage import InProcessStorageUnit

  return InProcessStorageUnit(dataclasses.replace(ctx["limits"], **changes))


def _synthetic(rng, g: int, p: int, n: int) -> dict:
  from knitjax.transfer.payload import synthetic_payload

  return synthetic_payload(rng, group_size=g, prompt_len=p, response_len=n, vocab_size=_VOCAB)


def _payload(draw: Draw) -> tuple[dict, str]:
  """A valid payload (G in [1, 6], prompts of 1-12 tokens, responses 1-12 wide) and its sizes."""
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  g, p, n = draw(st.integers(1, 6)), draw(st.integers(1, 12)), draw(st.integers(1, 12))
  return _synthetic(rng, g, p, n), f"G={g} P={p} N={n}"


def _put(ctx, payload, what: str, *names: str, gid=0, images=(), unit=None) -> BadInput:
  unit = _unit(ctx) if unit is None else unit
  return BadInput(what, names, lambda: unit.put(gid, payload, images))


def _pl_token_range(draw: Draw, ctx: dict) -> BadInput:
  pl, dims = _payload(draw)
  field = draw(st.sampled_from(["prompt_tokens", "response_tokens"]))
  x = pl[field]
  i, j = draw(st.integers(0, x.shape[0] - 1)), draw(st.integers(0, x.shape[1] - 1))
  x[i, j] = v = draw(st.one_of(st.integers(_VOCAB, 2**31 - 1), st.integers(-(2**31), -1)))
  return _put(ctx, pl, f"{field}[{i}, {j}]={v} ({dims})", field)


def _pl_dtype(draw: Draw, ctx: dict) -> BadInput:
  pl, dims = _payload(draw)
  field = draw(st.sampled_from(sorted(pl)))
  dtype = draw(st.sampled_from([*_DTYPES, np.bool_]).filter(lambda t: t != pl[field].dtype))
  pl[field] = pl[field].astype(dtype)
  return _put(ctx, pl, f"{field} as {np.dtype(dtype)}", field)


def _pl_not_array(draw: Draw, ctx: dict) -> BadInput:
  pl, dims = _payload(draw)
  field = draw(st.sampled_from(sorted(pl)))
  pl[field] = draw(st.sampled_from([pl[field].tolist(), 3, None, "tokens"]))
  return _put(ctx, pl, f"{field} as {type(pl[field]).__name__}", field)


def _on_mask(draw: Draw, pl: dict) -> tuple[int, int]:
  i = draw(st.integers(0, len(pl["rewards"]) - 1))
  return i, draw(st.integers(0, int(pl["response_lengths"][i]) - 1))


def _pl_logprobs(draw: Draw, ctx: dict) -> BadInput:
  pl, dims = _payload(draw)
  field = draw(st.sampled_from(["logprobs", "ref_logprobs"]))
  pl.setdefault(field, pl["logprobs"].copy())
  i, j = _on_mask(draw, pl)
  positive = st.floats(min_value=1e-3, max_value=1e3)
  pl[field][i, j] = v = draw(st.one_of(NON_FINITE, positive))
  return _put(ctx, pl, f"{field}[{i}, {j}]={v} inside the mask ({dims})", field)


def _resize(x: np.ndarray, axis: int, size: int) -> np.ndarray:
  if size <= x.shape[axis]:
    return np.take(x, np.arange(size), axis=axis)
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return np.pad(x, pad)


def _pl_rows(draw: Draw, ctx: dict) -> BadInput:
  pl, dims = _payload(draw)
  pl["ref_logprobs"] = pl["logprobs"].copy()
  fields = ["response_tokens", "response_mask", "response_lengths", "logprobs", "rewards"]
  field = draw(st.sampled_from([*fields, "ref_logprobs"]))
  g = len(pl["rewards"])
  rows = draw(st.integers(0, g + 3).filter(lambda r: r != g))
  pl[field] = _resize(pl[field], 0, rows)
  return _put(ctx, pl, f"{field} with {rows} rows ({dims})", field)


def _pl_width(draw: Draw, ctx: dict) -> BadInput:
  pl, dims = _payload(draw)
  pl["ref_logprobs"] = pl["logprobs"].copy()
  field = draw(st.sampled_from(["response_mask", "logprobs", "ref_logprobs"]))
  n = pl["response_tokens"].shape[1]
  width = draw(st.integers(0, n + 3).filter(lambda w: w != n))
  pl[field] = _resize(pl[field], 1, width)
  return _put(ctx, pl, f"{field} {width} wide ({dims})", field)


def _pl_ndim(draw: Draw, ctx: dict) -> BadInput:
  pl, dims = _payload(draw)
  field = draw(st.sampled_from(sorted(pl)))
  x = pl[field]
  pl[field] = x[..., None] if x.ndim == 1 or draw(st.booleans()) else x.ravel()
  return _put(ctx, pl, f"{field} with shape {list(pl[field].shape)} ({dims})", field)


def _pl_missing(draw: Draw, ctx: dict) -> BadInput:
  from knitjax.transfer.payload import REQUIRED_FIELDS

  pl, dims = _payload(draw)
  field = draw(st.sampled_from([*REQUIRED_FIELDS, "response_mask and response_lengths"]))
  for name in field.split(" and "):
    del pl[name]
  return _put(ctx, pl, f"{field} missing", field.split(" and ")[0])


def _pl_unknown(draw: Draw, ctx: dict) -> BadInput:
  from knitjax.transfer.payload import INPUT_FIELDS

  pl, dims = _payload(draw)
  key = draw(st.one_of(st.just("prompt_lengths"), IDENT.filter(lambda k: k not in INPUT_FIELDS)))
  pl[key] = np.zeros(len(pl["rewards"]), np.int32)
  return _put(ctx, pl, f"unknown field {key!r}", key)


def _pl_lengths(draw: Draw, ctx: dict) -> BadInput:
  pl, dims = _payload(draw)
  n = pl["response_tokens"].shape[1]
  i = draw(st.integers(0, len(pl["rewards"]) - 1))
  if draw(st.booleans()):  # out of [0, N]
    v = draw(st.one_of(st.integers(-(2**31), -1), st.integers(n + 1, 2**31 - 1)))
    if draw(st.booleans()):
      del pl["response_mask"]
    names = ("response_lengths",)
  else:  # shorter than the mask
    v = draw(st.integers(0, int(pl["response_lengths"][i]) - 1))
    names = ("response_mask", "response_lengths")
  pl["response_lengths"][i] = v
  return _put(ctx, pl, f"response_lengths[{i}]={v} ({dims})", *names)


def _pl_rewards(draw: Draw, ctx: dict) -> BadInput:
  pl, dims = _payload(draw)
  i = draw(st.integers(0, len(pl["rewards"]) - 1))
  pl["rewards"][i] = v = draw(NON_FINITE)
  return _put(ctx, pl, f"rewards[{i}]={v}", "rewards")


def _pl_group_id(draw: Draw, ctx: dict) -> BadInput:
  gid = draw(st.one_of(TEXT, st.floats(), st.none(), st.booleans(), LIST, st.just(np.float32(1.0))))
  return _put(ctx, _payload(draw)[0], f"group_id={gid!r}", "group_id", gid=gid)


def _pl_duplicate(draw: Draw, ctx: dict) -> BadInput:
  unit = _unit(ctx)
  gid = draw(st.integers(0, 2**40))
  unit.put(gid, _payload(draw)[0])
  return _put(ctx, _payload(draw)[0], f"group_id {gid} put twice", "group_id", gid=gid, unit=unit)


def _pl_too_long(draw: Draw, ctx: dict) -> BadInput:
  pl, dims = _payload(draw)
  need = pl["prompt_tokens"].shape[1] + int(pl["response_lengths"].max())
  m = draw(st.integers(1, need - 1)) if need > 1 else 1
  unit = _unit(ctx, max_seq_len=m)
  what = f"max_seq_len={m} < {need} ({dims})"
  return _put(ctx, pl, what, "prompt_tokens", "response_tokens", unit=unit)


def _pl_empty(draw: Draw, ctx: dict) -> BadInput:
  pl, dims = _payload(draw)
  g = len(pl["rewards"])
  if draw(st.booleans()):
    pl["prompt_tokens"] = np.zeros((g, 0), np.int32)
    return _put(ctx, pl, f"prompt_tokens [{g}, 0]", "prompt_tokens")
  for field in ("response_tokens", "response_mask", "logprobs"):
    pl[field] = pl[field][:, :0]
  pl["response_lengths"][:] = 0
  return _put(ctx, pl, f"response_tokens [{g}, 0]", "response_tokens")


def _images(k: int) -> list[np.ndarray]:
  return [np.full((4, 4, 3), i, np.uint8) for i in range(k)]


def _pl_image_index(draw: Draw, ctx: dict) -> BadInput:
  pl, dims = _payload(draw)
  k = draw(st.integers(0, 2))
  g = len(pl["rewards"])
  pl["image_index"] = np.zeros(g, np.int32) if k else np.full(g, -1, np.int32)
  i = draw(st.integers(0, g - 1))
  v = draw(st.one_of(st.integers(-(2**31), -1), st.integers(k, 2**31 - 1)))
  pl["image_index"][i] = v
  return _put(ctx, pl, f"image_index[{i}]={v} with {k} images", "image_index", images=_images(k))


def _pl_bad_image(draw: Draw, ctx: dict) -> BadInput:
  pl, dims = _payload(draw)
  pl["image_index"] = np.zeros(len(pl["rewards"]), np.int32)
  images = _images(draw(st.integers(1, 3)))
  k = draw(st.integers(0, len(images) - 1))
  how = draw(st.sampled_from(["non_finite", "dtype", "ndim", "empty", "too_large", "not_array"]))
  if how == "non_finite":
    image = np.zeros((4, 4, 3), draw(st.sampled_from([np.float16, np.float32])))
    image[draw(st.integers(0, 3)), draw(st.integers(0, 3)), 0] = draw(NON_FINITE)
  elif how == "dtype":
    image = np.zeros((4, 4, 3), draw(st.sampled_from([np.int8, np.int32, np.float64, np.bool_])))
  elif how == "ndim":
    image = np.zeros(draw(st.sampled_from([(16,), (2, 4, 4, 3), ()])), np.uint8)
  elif how == "empty":
    image = np.zeros(draw(st.sampled_from([(0, 4), (4, 0, 3), (0, 0)])), np.uint8)
  elif how == "too_large":
    side = draw(st.integers(38, 64))  # 38 * 38 * 3 bytes > max_image_bytes 4096
    image = np.zeros((side, side, 3), np.uint8)
  else:
    image = images[k].tolist()
  images[k] = image
  return _put(ctx, pl, f"images[{k}] {how}", f"images[{k}]", images=images)


def _pl_not_mapping(draw: Draw, ctx: dict) -> BadInput:
  pl, dims = _payload(draw)
  value = draw(st.sampled_from([list(pl.items()), tuple(pl.values()), None, "payload", 7]))
  return _put(ctx, value, f"payload as {type(value).__name__}", "payload")


def _pl_too_large(draw: Draw, ctx: dict) -> BadInput:
  m = draw(st.integers(1, 24))  # the smallest payload (G=P=N=1) stores 25 bytes
  return _put(ctx, _payload(draw)[0], f"max_bytes={m}", "payload", unit=_unit(ctx, max_bytes=m))


def _pl_ragged(draw: Draw, ctx: dict) -> BadInput:
  pl, dims = _payload(draw)
  rows = [r[: draw(st.integers(1, len(r)))].copy() for r in pl["prompt_tokens"]]
  i = draw(st.integers(0, len(rows) - 1))
  how = draw(st.sampled_from(["empty", "dtype", "2-D", "token"]))
  if how == "empty":
    rows[i] = rows[i][:0]
  elif how == "dtype":
    rows[i] = rows[i].astype(draw(st.sampled_from(_DTYPES)))
  elif how == "2-D":
    rows[i] = rows[i][None]
  else:
    rows[i][draw(st.integers(0, len(rows[i]) - 1))] = draw(st.integers(_VOCAB, 2**31 - 1))
  pl["prompt_tokens"] = rows
  return _put(ctx, pl, f"ragged prompt_tokens, row {i} {how}", "prompt_tokens")


CASES: list[Case] = [
  ("token_range", _pl_token_range),
  ("dtype", _pl_dtype),
  ("not_array", _pl_not_array),
  ("logprobs", _pl_logprobs),
  ("rows", _pl_rows),
  ("width", _pl_width),
  ("ndim", _pl_ndim),
  ("missing_field", _pl_missing),
  ("unknown_field", _pl_unknown),
  ("lengths", _pl_lengths),
  ("rewards", _pl_rewards),
  ("group_id", _pl_group_id),
  ("duplicate", _pl_duplicate),
  ("too_long", _pl_too_long),
  ("empty", _pl_empty),
  ("image_index", _pl_image_index),
  ("bad_image", _pl_bad_image),
  ("not_mapping", _pl_not_mapping),
  ("too_large", _pl_too_large),
  ("ragged_prompts", _pl_ragged),
]
