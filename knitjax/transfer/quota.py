"""Quota spec: per-class group counts per train step and per-mini-batch bounds."""

import dataclasses
import numbers
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class QuotaSpec:
  """What every train step must hold, validated on construction.

  A train step consumes exactly ``class_quotas[c]`` groups of each class `c`, split into
  ``minibatches`` mini-batches of ``groups_per_minibatch`` groups each; a mini-batch holds between
  ``min_per_minibatch.get(c, 0)`` and ``max_per_minibatch.get(c, groups_per_minibatch)`` groups
  of class `c`. Construction raises a `ValueError` naming the conflict when no step can satisfy
  the spec. Positional use follows the issue: ``QuotaSpec(class_quotas, minibatches, ...)``.

  Attributes:
    class_quotas: groups of each class per train step (all > 0); the order of the keys is the
      class order used everywhere (``classes``).
    minibatches: number `M` of mini-batches per train step.
    min_per_minibatch: optional per-class lower bound on a mini-batch's groups.
    max_per_minibatch: optional per-class upper bound on a mini-batch's groups.
  """

  class_quotas: Mapping[str, int]
  minibatches: int
  min_per_minibatch: Mapping[str, int] = dataclasses.field(default_factory=dict)
  max_per_minibatch: Mapping[str, int] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    # Private copies: a caller mutating its dict later must not change a validated spec.
    for name in ("class_quotas", "min_per_minibatch", "max_per_minibatch"):
      value = getattr(self, name)
      if not isinstance(value, Mapping):
        raise ValueError(f"QuotaSpec.{name}={value!r} must be a mapping from class name to int.")
      object.__setattr__(self, name, dict(value))
    quotas = self.class_quotas
    if not quotas:
      raise ValueError("QuotaSpec.class_quotas is empty; give at least one class with a quota.")
    for c, q in quotas.items():
      if not isinstance(c, str) or not c:
        raise ValueError(f"QuotaSpec.class_quotas has class name {c!r}; use non-empty str.")
      if not _is_int(q) or q < 1:
        raise ValueError(
          f"QuotaSpec.class_quotas[{c!r}]={q!r} must be an int >= 1 (drop a class to disable it)."
        )
    m = self.minibatches
    if not _is_int(m) or m < 1:
      raise ValueError(f"QuotaSpec.minibatches={m!r} must be an int >= 1.")
    total = sum(quotas.values())
    if total % m:
      raise ValueError(
        f"QuotaSpec: the quotas sum to {total} groups per step, which minibatches={m} does not "
        "divide; make the sum a multiple of minibatches."
      )
    for name in ("min_per_minibatch", "max_per_minibatch"):
      for c, b in getattr(self, name).items():
        if c not in quotas:
          raise ValueError(
            f"QuotaSpec.{name} names class {c!r}, which is not in class_quotas {sorted(quotas)}."
          )
        if not _is_int(b) or b < 0:
          raise ValueError(f"QuotaSpec.{name}[{c!r}]={b!r} must be an int >= 0.")
    size = total // m
    for c, q in quotas.items():
      lo, hi = self.min_of(c), self.max_of(c)
      if lo > hi:
        raise ValueError(
          f"QuotaSpec: min_per_minibatch[{c!r}]={lo} exceeds max_per_minibatch[{c!r}]={hi}."
        )
      # Per class, M*lo <= q <= M*hi is also sufficient (docs/admission.md): the spread
      # q/M per mini-batch is a fractional solution, and bounded flows have integral ones.
      if m * lo > q:
        raise ValueError(
          f"QuotaSpec: min_per_minibatch[{c!r}]={lo} over {m} mini-batches needs {m * lo} "
          f"groups, but class_quotas[{c!r}]={q}."
        )
      if m * min(hi, size) < q:
        raise ValueError(
          f"QuotaSpec: class_quotas[{c!r}]={q} does not fit in {m} mini-batches of at most "
          f"{min(hi, size)} groups of that class (max_per_minibatch or groups_per_minibatch)."
        )

  def __hash__(self):
    return hash(
      (
        tuple(sorted(self.class_quotas.items())),
        self.minibatches,
        tuple(sorted(self.min_per_minibatch.items())),
        tuple(sorted(self.max_per_minibatch.items())),
      )
    )

  @property
  def classes(self) -> tuple[str, ...]:
    """Class names in a fixed order (the order of ``class_quotas``)."""
    return tuple(self.class_quotas)

  @property
  def groups_per_step(self) -> int:
    """`B`: groups consumed by one train step."""
    return sum(self.class_quotas.values())

  @property
  def groups_per_minibatch(self) -> int:
    """`B/M`: groups in one mini-batch."""
    return self.groups_per_step // self.minibatches

  def min_of(self, cls: str) -> int:
    """Lower bound on class `cls` per mini-batch (0 when unbounded)."""
    return self.min_per_minibatch.get(cls, 0)

  def max_of(self, cls: str) -> int:
    """Upper bound on class `cls` per mini-batch, capped at the mini-batch size."""
    return min(
      self.max_per_minibatch.get(cls, self.groups_per_minibatch), self.groups_per_minibatch
    )

  def to_dict(self) -> dict:
    """Plain-Python form, e.g. for checkpoints."""
    return {
      "class_quotas": dict(self.class_quotas),
      "minibatches": self.minibatches,
      "min_per_minibatch": dict(self.min_per_minibatch),
      "max_per_minibatch": dict(self.max_per_minibatch),
    }


def _is_int(x) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)
