"""Bad group metadata: `GroupMeta(...)` / `GroupMeta.from_dict`, then `AdmissionIndex.offer`."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import strategies as st

from lab.faults.bad_inputs.core import BadInput, Case, Draw, baseline
from lab.faults.bad_inputs.strategies import (
  IDENT,
  LIST,
  NEG_FLOAT,
  NEG_INT,
  NON_FINITE,
  NOT_INT,
  TEXT,
  not_in,
)

_CLASSES = ("a", "b")
_NOT_REAL = st.one_of(TEXT, st.none(), st.booleans(), LIST)


def context(folder: str) -> dict:
  from knitjax.transfer.group import GroupMeta
  from knitjax.transfer.quota import QuotaSpec

  ctx = {"spec": QuotaSpec({"a": 2, "b": 2}, 2)}
  good = dict(
    group_id=0, cls="a", gen_version=0, num_samples=1, prompt_tokens=(3,), response_tokens=(2,)
  )
  baseline("GroupMeta", lambda: _index(ctx, "minibatch", False).offer(GroupMeta(**good)))
  return ctx


def _index(ctx: dict, policy: str, dynamic_sampling: bool):
  from knitjax.transfer.admission import AdmissionIndex

  return AdmissionIndex(ctx["spec"], policy, dynamic_sampling=dynamic_sampling)


def _meta_kwargs(draw: Draw, group_id: int | None = None) -> dict:
  g, version = draw(st.integers(1, 8)), draw(st.integers(0, 100))
  counts = st.lists(st.integers(0, 100), min_size=g, max_size=g).map(tuple)
  return dict(
    group_id=draw(st.integers(0, 10**6)) if group_id is None else group_id,
    cls=draw(st.sampled_from(_CLASSES)),
    gen_version=version,
    num_samples=g,
    prompt_tokens=draw(counts.map(lambda c: tuple(n + 1 for n in c))),
    response_tokens=draw(counts),
    reward_mean=draw(st.floats(-10, 10)),
    reward_std=draw(st.floats(0, 5)),
    storage_unit=draw(st.integers(0, 3)),
    image_hashes=tuple(draw(st.lists(st.text("0123456789abcdef", min_size=1), max_size=2))),
    completion_time=draw(st.floats(0, 1e6)),
    gen_version_newest=draw(st.one_of(st.none(), st.integers(version, version + 5))),
  )


def _offer(draw: Draw, ctx: dict, group, what: str, *names: str, before=()) -> BadInput:
  """Offers ``group`` (GroupMeta kwargs, built inside the call, or any object) to a fresh index."""
  from knitjax.transfer.admission import POLICIES
  from knitjax.transfer.group import GroupMeta

  index = _index(ctx, draw(st.sampled_from(POLICIES)), draw(st.booleans()))
  for g in before:
    index.offer(g)

  def call():
    return index.offer(GroupMeta(**group) if isinstance(group, dict) else group())

  return BadInput(what, names, call)


def _meta_field(field: str, bad: st.SearchStrategy) -> Callable[[Draw, dict], BadInput]:
  def make(draw: Draw, ctx: dict) -> BadInput:
    kw = _meta_kwargs(draw)
    kw[field] = value = draw(bad)
    return _offer(draw, ctx, kw, f"GroupMeta.{field}={value!r}", field)

  return make


def _meta_unknown_class(draw: Draw, ctx: dict) -> BadInput:
  kw = _meta_kwargs(draw)
  kw["cls"] = value = draw(not_in(("", *_CLASSES)))
  return _offer(draw, ctx, kw, f"GroupMeta.cls={value!r} (spec classes a, b)", "class", "cls")


def _meta_version(draw: Draw, ctx: dict) -> BadInput:
  kw = _meta_kwargs(draw)
  if draw(st.booleans()):
    field, value = "gen_version", draw(st.one_of(NEG_INT, NOT_INT))
  else:
    bad = st.one_of(st.integers(max_value=kw["gen_version"] - 1), NOT_INT.filter(bool))
    field, value = "gen_version_newest", draw(bad)
  kw[field] = value
  return _offer(draw, ctx, kw, f"GroupMeta.{field}={value!r}", field)


def _meta_lengths(draw: Draw, ctx: dict) -> BadInput:
  kw = _meta_kwargs(draw)
  field = draw(st.sampled_from(["prompt_tokens", "response_tokens"]))
  g = kw["num_samples"]
  how = draw(st.sampled_from(["count", "entry", "not_a_sequence"]))
  if how == "count":
    value = tuple(draw(st.lists(st.integers(0, 9), max_size=12).filter(lambda v: len(v) != g)))
  elif how == "entry":
    value = list(kw[field])
    value[draw(st.integers(0, g - 1))] = draw(st.one_of(NEG_INT, NOT_INT.filter(bool)))
    value = tuple(value)
  else:
    value = draw(st.one_of(st.integers(), TEXT, st.none(), st.dictionaries(TEXT, st.integers())))
  kw[field] = value
  return _offer(draw, ctx, kw, f"GroupMeta.{field}={value!r} (num_samples={g})", field)


def _meta_real(draw: Draw, ctx: dict) -> BadInput:
  field = draw(st.sampled_from(["reward_mean", "reward_std", "completion_time"]))
  bad = st.one_of(NON_FINITE, _NOT_REAL)
  if field == "reward_std":
    bad = st.one_of(bad, NEG_FLOAT)
  return _meta_field(field, bad)(draw, ctx)


def _meta_image_hashes(draw: Draw, ctx: dict) -> BadInput:
  kw = _meta_kwargs(draw)
  entry = st.one_of(st.just(""), st.integers(), st.none(), LIST)
  value = draw(
    st.one_of(
      st.lists(entry, min_size=1, max_size=3).map(tuple),
      TEXT,
      st.integers(),
      st.dictionaries(TEXT, TEXT),
    )
  )
  kw["image_hashes"] = value
  return _offer(draw, ctx, kw, f"GroupMeta.image_hashes={value!r}", "image_hashes")


def _meta_duplicate(draw: Draw, ctx: dict) -> BadInput:
  from knitjax.transfer.group import GroupMeta

  before = [GroupMeta(**_meta_kwargs(draw, group_id=i)) for i in range(draw(st.integers(1, 6)))]
  gid = draw(st.integers(0, len(before) - 1))
  what = f"group_id {gid} offered again after {len(before)} groups"
  return _offer(draw, ctx, _meta_kwargs(draw, group_id=gid), what, f"group {gid}", before=before)


def _meta_not_a_group(draw: Draw, ctx: dict) -> BadInput:
  kw = _meta_kwargs(draw)
  value = draw(st.sampled_from([kw, None, "group", 7, tuple(kw.values())]))
  return _offer(draw, ctx, lambda: value, f"offer({type(value).__name__})", "GroupMeta")


def _meta_from_dict(draw: Draw, ctx: dict) -> BadInput:
  from knitjax.transfer.group import GroupMeta

  d = GroupMeta(**_meta_kwargs(draw)).to_dict()
  required = ["group_id", "cls", "gen_version", "num_samples", "prompt_tokens", "response_tokens"]
  how = draw(st.sampled_from(["missing", "unknown", "wrong_type"]))
  if how == "missing":
    key = draw(st.sampled_from(required))
    del d[key]
  elif how == "unknown":
    key = draw(IDENT.filter(lambda k: k not in d))
    d[key] = draw(st.integers())
  else:
    key = draw(st.sampled_from(sorted(d)))
    numbers = {"reward_mean", "reward_std", "completion_time"}
    counts = {"prompt_tokens", "response_tokens", "image_hashes"}
    if key in counts:
      d[key] = draw(st.one_of(st.integers(), st.floats(), st.booleans()))
    elif key in numbers:
      d[key] = draw(st.one_of(TEXT, LIST, st.booleans()))
    elif key == "cls":
      d[key] = draw(st.one_of(st.integers(), LIST, st.just("")))
    else:
      d[key] = draw(st.one_of(TEXT, st.floats(), LIST, st.booleans()))
  what = f"GroupMeta.from_dict, {key} {how}: {d!r}"
  return _offer(draw, ctx, lambda: GroupMeta.from_dict(d), what, key)


CASES: list[Case] = [
  ("unknown_class", _meta_unknown_class),
  ("cls", _meta_field("cls", st.one_of(st.just(""), st.integers(), st.none(), LIST))),
  ("group_id", _meta_field("group_id", NOT_INT)),
  ("version", _meta_version),
  ("num_samples", _meta_field("num_samples", st.one_of(st.integers(max_value=0), NOT_INT))),
  ("lengths", _meta_lengths),
  ("real_fields", _meta_real),
  ("storage_unit", _meta_field("storage_unit", st.one_of(NEG_INT, NOT_INT))),
  ("image_hashes", _meta_image_hashes),
  ("duplicate", _meta_duplicate),
  ("not_a_group", _meta_not_a_group),
  ("from_dict", _meta_from_dict),
]
