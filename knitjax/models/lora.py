"""LoRA: low-rank adapters on the decoder's projections, and the frozen base they ride on.

A projection with kernel ``W [in..., out...]`` becomes (Hu et al. 2021, arXiv:2106.09685)

    y = x·W + (alpha / r) · (x·A)·B,    A [in..., r],  B [r, out...],

with ``A`` drawn like PEFT's (uniform in ±1/sqrt(fan_in), kaiming-uniform with a = sqrt(5)) and
``B = 0``, so a fresh adapter leaves the model exactly as it was. Adapters are `nnx.LoRAParam`
variables (a kind of `nnx.Param`) living beside the kernel they adapt (``q_lora`` beside
``q_kernel``); `split` separates them from the frozen base, `combine` joins the two again (no
copy: the same arrays), `disabled` gives the "adapters off" state (the base model exactly, which
serves as the reference policy), and `merged` folds them into the kernels,
``W + (alpha / r)·A·B``, for export.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from knitjax import sharding
from knitjax.models.keys import params_key, params_key_parts

# Projections an adapter may sit on, by the name configs use (`TransformerConfig.lora_targets`).
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
ATTENTION_TARGETS = ("q", "k", "v", "o")
# Dtypes the frozen base may be stored in (`TransformerConfig.lora_base_dtype`).
BASE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# TransformerConfig fields that configure adapters; a checkpoint's config.json never sets them.
CONFIG_FIELDS = ("lora_rank", "lora_alpha", "lora_targets", "lora_base_dtype")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  """What every adapter of a model shares: rank r, alpha (scale = alpha / r) and the targets."""

  rank: int
  alpha: float
  targets: tuple[str, ...]

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def check_fields(rank, alpha, targets, base_dtype, *, where: str = "TransformerConfig") -> tuple:
  """Validates the LoRA fields of a model config; returns ``targets`` as a tuple.

  Raises:
    ValueError: naming the field and the accepted values.
  """
  if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
    raise ValueError(f"{where}.lora_rank must be an integer >= 0 (0: no LoRA), got {rank!r}.")
  if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha < math.inf:
    raise ValueError(f"{where}.lora_alpha must be a finite number > 0, got {alpha!r}.")
  if isinstance(targets, str) or not all(isinstance(t, str) for t in targets):
    raise ValueError(
      f"{where}.lora_targets must be a list of projection names from {TARGETS}, got {targets!r}."
    )
  targets = tuple(targets)
  unknown = [t for t in targets if t not in TARGETS]
  if unknown or (rank and not targets) or len(set(targets)) != len(targets):
    raise ValueError(
      f"{where}.lora_targets={list(targets)} is not accepted; give distinct names from "
      f"{', '.join(TARGETS)} (at least one when lora_rank > 0)."
    )
  if base_dtype not in BASE_DTYPES:
    raise ValueError(
      f"{where}.lora_base_dtype must be one of {sorted(BASE_DTYPES)}, got {base_dtype!r}."
    )
  return targets


class Adapter(nnx.Module):
  """The low-rank update ``(alpha / r)·(x·A)·B`` of one kernel ``[in..., out...]``."""

  def __init__(
    self,
    in_shape: tuple[int, ...],
    out_shape: tuple[int, ...],
    axes: tuple[str | None, ...],
    *,
    spec: LoraSpec,
    dtype: jnp.dtype,
    rngs: nnx.Rngs,
  ):
    """Args: ``axes``: the kernel's logical axes (``in`` then ``out``); the rank axis is
    replicated ("lora_rank")."""
    n_in = len(in_shape)
    bound = math.prod(in_shape) ** -0.5
    shape = (*in_shape, spec.rank)
    pending = getattr(_DRAWS, "pending", None)
    if pending is None:
      a = _draw_a(params_key(rngs), shape, bound)
    else:  # drawn later with every adapter of its shape (`init_adapters`)
      a = jnp.zeros(shape, jnp.float32)
      pending.append((self, params_key_parts(rngs), shape, bound))
    b = jnp.zeros((spec.rank, *out_shape), jnp.float32)
    self.a = nnx.LoRAParam(
      a, eager_sharding=False, out_sharding=(*axes[:n_in], "lora_rank"), lora_scale=spec.scale
    )
    self.b = nnx.LoRAParam(b, eager_sharding=False, out_sharding=("lora_rank", *axes[n_in:]))
    self.n_in, self.scale, self.dtype = n_in, spec.scale, dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    """``x [..., in...] -> [..., out...]``, in the compute dtype."""
    h = jnp.tensordot(x, self.a[...].astype(self.dtype), axes=self.n_in)
    return jnp.tensordot(h * self.scale, self.b[...].astype(self.dtype), axes=1)


def _draw_a(key: jax.Array, shape: tuple[int, ...], bound: float) -> jax.Array:
  """A fresh ``A``: uniform in ``[-bound, bound)``, ``bound = 1 / sqrt(fan_in)``."""
  return jax.nn.initializers.uniform(2 * bound)(key, shape, jnp.float32) - bound


def _draw_folded(key, count, *, shape, bound) -> jax.Array:
  return _draw_a(jax.random.fold_in(key, count), shape, bound)


_DRAWS = threading.local()  # the adapters built in `_pending_draws`, their A not drawn yet


@contextlib.contextmanager
def _pending_draws():
  pending: list = []
  _DRAWS.pending = pending
  try:
    yield pending
  finally:
    _DRAWS.pending = None


def adapter(
  name: str,
  spec: LoraSpec | None,
  kernel: nnx.Param,
  n_in: int,
  *,
  dtype: jnp.dtype,
  rngs: nnx.Rngs,
) -> Adapter | None:
  """An adapter for projection ``name`` with ``kernel`` (``n_in`` input axes) if ``spec`` targets
  it, else None."""
  if spec is None or name not in spec.targets:
    return None
  shape = tuple(kernel[...].shape)
  axes = tuple(kernel.get_metadata()["out_sharding"])
  return Adapter(shape[:n_in], shape[n_in:], axes, spec=spec, dtype=dtype, rngs=rngs)


def split(params: nnx.State) -> tuple[nnx.State, nnx.State]:
  """``(adapters, base)`` of a model's params: the trainable `nnx.LoRAParam`s and the rest."""
  return nnx.split_state(params, nnx.LoRAParam, ...)


def combine(base: nnx.State, adapters: nnx.State) -> nnx.State:
  """The model's params from its frozen base and its adapters (the same arrays, no copy)."""
  return nnx.merge_state(base, adapters)


def disabled(adapters: nnx.State) -> nnx.State:
  """Adapters switched off (all zero): ``combine(base, disabled(a))`` computes the base model."""
  return jax.tree.map(jnp.zeros_like, adapters)


def merged(params: nnx.State) -> nnx.State:
  """The params with every adapter folded into its kernel, ``W + (alpha / r)·A·B`` (float32),
  and the adapters dropped: the state of the same model without LoRA (``lora_rank=0``).

  An adapter ``<x>_lora`` adapts the kernel ``<x>_kernel`` beside it; its scale travels as
  metadata (``lora_scale``) of its ``a``.
  """
  adapters: dict[tuple, dict[str, nnx.LoRAParam]] = {}
  out = {}
  for key, variable in nnx.to_flat_state(params):
    if isinstance(variable, nnx.LoRAParam):
      adapters.setdefault(key[:-1], {})[key[-1]] = variable
    else:
      out[key] = variable
  for key, ab in adapters.items():
    kernel_key = (*key[:-1], key[-1].removesuffix("_lora") + "_kernel")
    if kernel_key not in out or set(ab) != {"a", "b"}:
      raise ValueError(f"adapter {'/'.join(map(str, key))} has no kernel {kernel_key[-1]!r}.")
    a, b = (ab[n].get_value().astype(jnp.float32) for n in ("a", "b"))
    delta = ab["a"].get_metadata()["lora_scale"] * jnp.tensordot(a, b, axes=1)
    kernel = out[kernel_key]
    w = kernel.get_value()
    out[kernel_key] = kernel.replace((w.astype(jnp.float32) + delta).astype(w.dtype))
  return nnx.from_flat_state(list(out.items()))


def init_adapters(make_model, mesh=None) -> nnx.State:
  """Fresh adapters of ``make_model()`` (A random, B = 0), sharded on ``mesh``; the base params
  it would draw are never materialised.

  The ``A`` of every adapter of one shape are drawn together, one vmapped draw (the same values
  as each alone: a key's bits do not depend on the batch it is drawn in), and the jitted draw
  returns them stacked, to be cut apart on the host: XLA's CPU backend compiles a kernel per
  output, so returning each adapter from the jit cost SmolLM2-135M's 210 adapters 16-23 s of
  compile on 2 cores.
  """
  layout: list = []  # (path of an A, its shape's group, its index there), found while tracing

  def draw() -> list[jax.Array]:
    with _pending_draws() as pending:
      model = make_model()
    paths = {id(node): path for path, node in nnx.iter_graph(model) if isinstance(node, Adapter)}
    groups: dict = {}
    for adapter_, key_parts, shape, bound in pending:
      parts = groups.setdefault((shape, bound), [])
      layout.append(((*paths[id(adapter_)], "a"), list(groups).index((shape, bound)), len(parts)))
      parts.append(key_parts)
    return [
      jax.vmap(functools.partial(_draw_folded, shape=shape, bound=bound))(
        jnp.stack([k for k, _ in parts]), jnp.stack([c for _, c in parts])
      )
      for (shape, bound), parts in groups.items()
    ]

  abstract = nnx.state(nnx.eval_shape(make_model), nnx.LoRAParam)
  if mesh is None:
    stacked = draw()
  else:
    with jax.set_mesh(mesh):
      stacked = jax.jit(draw)()
  host = [np.asarray(s) for s in stacked]  # adapters are small; cut apart on the host
  drawn = {path: host[g][j] for path, g, j in layout}
  flat = [
    (path, v.replace(drawn[path] if path in drawn else np.zeros(v.shape, v.dtype)))
    for path, v in nnx.to_flat_state(abstract)
  ]
  state = nnx.from_flat_state(flat)
  if mesh is None:
    return jax.device_put(state)
  return jax.device_put(state, sharding.state_shardings(abstract, mesh))


def cast_base(params: nnx.State, dtype: str, mesh) -> nnx.State:
  """The params with the frozen base stored in ``dtype`` (adapters stay float32), in place on
  ``mesh`` (a jitted cast with the same shardings)."""
  if BASE_DTYPES[dtype] == jnp.float32:
    return params
  adapters, base = split(params)
  shardings = sharding.state_shardings(base, mesh)
  base = jax.jit(
    lambda b: jax.tree.map(lambda x: x.astype(BASE_DTYPES[dtype]), b), out_shardings=shardings
  )(base)
  return combine(base, adapters)


def tree_bytes(tree) -> int:
  """Bytes of a pytree's arrays (concrete or `jax.ShapeDtypeStruct`), e.g. params published per
  version or an optimizer state."""
  arrays = [x for x in jax.tree.leaves(tree) if hasattr(x, "shape")]
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in arrays)
