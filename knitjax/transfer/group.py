"""Group metadata: what the admission index knows about one complete group.

The payload (tokens, log-probs, images) stays in its storage unit; only this small record
travels through admission, consumer planning and the simulator. `GroupIdSet` remembers which
group ids were seen, compactly, so that no id is admitted twice.
"""

import bisect
import dataclasses
import math
import numbers
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from knitjax import records


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupMeta:
  """Metadata of one complete group (the `G` responses sampled for one prompt).

  Attributes:
    group_id: unique id of the group (also its key in the storage unit).
    cls: quota class of the group's prompt (e.g. ``"math"``).
    gen_version: gen version of the group: the oldest rollout version over its samples.
    num_samples: number of responses `G` in the group.
    prompt_tokens: prompt length of each sample.
    response_tokens: response length of each sample.
    reward_mean: mean reward over the samples.
    reward_std: standard deviation of the rewards (0 means no learning signal).
    storage_unit: index of the storage unit that holds the payload.
    image_hashes: sha256 content hashes of the images the prompt uses (multimodal).
    completion_time: time the last sample was rewarded (seconds, caller's clock).
    gen_version_newest: newest rollout version used (partial rollout); ``None`` means the same
      as ``gen_version``.
  """

  group_id: int
  cls: str
  gen_version: int
  num_samples: int
  prompt_tokens: tuple[int, ...]
  response_tokens: tuple[int, ...]
  reward_mean: float = 0.0
  reward_std: float = 0.0
  storage_unit: int = 0
  image_hashes: tuple[str, ...] = ()
  completion_time: float = 0.0
  gen_version_newest: int | None = None

  def __post_init__(self):
    # Lists (e.g. from a checkpoint) become tuples so records stay immutable and hashable.
    for name in ("prompt_tokens", "response_tokens", "image_hashes"):
      value = getattr(self, name)
      if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise ValueError(f"GroupMeta.{name}={value!r} must be a sequence (one entry per item).")
      if not isinstance(value, tuple):
        object.__setattr__(self, name, tuple(value))
    if not _is_int(self.group_id):
      raise ValueError(f"GroupMeta.group_id={self.group_id!r} must be an int.")
    if not isinstance(self.cls, str) or not self.cls:
      raise ValueError(f"GroupMeta.cls={self.cls!r} must be a non-empty class name.")
    if not _is_int(self.gen_version) or self.gen_version < 0:
      raise ValueError(f"GroupMeta.gen_version={self.gen_version!r} must be an int >= 0.")
    newest = self.gen_version_newest
    if newest is not None and (not _is_int(newest) or newest < self.gen_version):
      raise ValueError(
        f"GroupMeta.gen_version_newest={newest!r} must be None or an int >= "
        f"gen_version={self.gen_version}."
      )
    if not _is_int(self.num_samples) or self.num_samples < 1:
      raise ValueError(f"GroupMeta.num_samples={self.num_samples!r} must be an int >= 1.")
    for name in ("prompt_tokens", "response_tokens"):
      value = getattr(self, name)
      if len(value) != self.num_samples:
        raise ValueError(
          f"GroupMeta.{name} has {len(value)} entries but num_samples={self.num_samples}; "
          "give one token count per sample."
        )
      if any(not _is_int(n) or n < 0 for n in value):
        raise ValueError(f"GroupMeta.{name}={value!r} must hold ints >= 0.")
    for name in ("reward_mean", "reward_std", "completion_time"):
      value = getattr(self, name)
      if not _is_real(value) or not math.isfinite(value):
        raise ValueError(f"GroupMeta.{name}={value!r} must be a finite number.")
    if self.reward_std < 0:
      raise ValueError(f"GroupMeta.reward_std={self.reward_std!r} must be >= 0.")
    if not _is_int(self.storage_unit) or self.storage_unit < 0:
      raise ValueError(f"GroupMeta.storage_unit={self.storage_unit!r} must be an int >= 0.")
    if any(not isinstance(h, str) or not h for h in self.image_hashes):
      raise ValueError(f"GroupMeta.image_hashes={self.image_hashes!r} must hold non-empty str.")

  @property
  def total_tokens(self) -> int:
    """Prompt plus response tokens over all samples."""
    return sum(self.prompt_tokens) + sum(self.response_tokens)

  @property
  def newest_version(self) -> int:
    """Newest rollout version used by the group (``gen_version`` without partial rollout)."""
    return self.gen_version if self.gen_version_newest is None else self.gen_version_newest

  def to_dict(self) -> dict[str, Any]:
    """Plain-Python form (lists instead of tuples), e.g. for checkpoints (`knitjax.records`)."""
    return records.to_json(self)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "GroupMeta":
    """Inverse of `to_dict`."""
    return records.from_json(cls, d)


class GroupIdSet:
  """A set of group ids, held as sorted, disjoint ranges ``[start, end)``.

  Group ids are handed out in increasing order within a run (the rollout thread, the colocated
  loop, the simulator) and almost all of them complete and are offered, though not in order. So
  the ids seen form few ranges: about as many as groups generate at once, plus one per id never
  offered (in flight at a restart, lost with a rollout actor). Memory and the JSON form stay
  small however long the run, and membership is a binary search. Any ints work; ids far apart
  just cost one range each.
  """

  def __init__(self):
    self._starts: list[int] = []
    self._ends: list[int] = []

  def __contains__(self, gid: int) -> bool:
    i = bisect.bisect_right(self._starts, gid) - 1
    return i >= 0 and gid < self._ends[i]

  def __len__(self) -> int:
    return sum(e - s for s, e in zip(self._starts, self._ends, strict=True))

  def __eq__(self, other) -> bool:
    return isinstance(other, GroupIdSet) and self.ranges() == other.ranges()

  def add(self, gid: int) -> bool:
    """Adds `gid`, merging it with the ranges it touches; False (and no change) if present."""
    gid = operator.index(gid)  # a NumPy int becomes a Python int, so `ranges` stays JSON-able
    starts, ends = self._starts, self._ends
    if ends and gid == ends[-1]:  # the next id after the newest range: the common case
      ends[-1] = gid + 1
      return True
    i = bisect.bisect_right(starts, gid) - 1  # the range starting at or before gid
    if i >= 0 and gid < ends[i]:
      return False
    joins_left = i >= 0 and ends[i] == gid
    joins_right = i + 1 < len(starts) and starts[i + 1] == gid + 1
    if joins_left and joins_right:
      ends[i] = ends.pop(i + 1)
      del starts[i + 1]
    elif joins_left:
      ends[i] = gid + 1
    elif joins_right:
      starts[i + 1] = gid
    else:
      starts.insert(i + 1, gid)
      ends.insert(i + 1, gid + 1)
    return True

  def ranges(self) -> list[list[int]]:
    """The ranges as ``[[start, end], ...]``, sorted and not touching (the JSON form)."""
    return [[s, e] for s, e in zip(self._starts, self._ends, strict=True)]

  @classmethod
  def from_ranges(cls, ranges: Sequence[Sequence[int]]) -> "GroupIdSet":
    """Inverse of `ranges`; raises a ValueError unless they are sorted, disjoint int pairs."""
    out = cls()
    if isinstance(ranges, str | bytes) or not isinstance(ranges, Sequence):
      raise ValueError(f"group id ranges {ranges!r} must be a list of [start, end] pairs.")
    for r in ranges:
      ok = isinstance(r, Sequence) and len(r) == 2 and all(_is_int(x) for x in r)
      if not ok or r[0] >= r[1]:
        raise ValueError(
          f"group id range {r!r} is not a [start, end] pair of ints with start < end."
        )
      if out._ends and r[0] <= out._ends[-1]:
        last = [out._starts[-1], out._ends[-1]]
        raise ValueError(
          f"group id range {list(r)} overlaps, touches or precedes {last}; "
          "ranges must be sorted and apart."
        )
      out._starts.append(int(r[0]))
      out._ends.append(int(r[1]))
    return out


def _is_int(x) -> bool:
  # numbers.Integral also admits NumPy integers, which callers often pass.
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool)
