"""Per-token log-probs and entropies straight from hidden states, chunked along the sequence.

The plain path (``model(...)`` then :func:`knitjax.train.losses.token_logprobs` and
:func:`~knitjax.train.losses.token_entropy`) holds the float32 logits ``[B, T, V]`` and, for the
backward, the softmax of the same size: at V = 152k (Qwen) the largest activations of the step.
:func:`token_logprobs_and_entropy` reads the final-normed hidden states ``[B, T, D]`` and the
unembedding table instead and runs over ``chunk`` positions at a time (every row of the
micro-batch in each chunk, so a batch-sharded row never leaves its device): a chunk's logits
``[B, chunk, V]`` exist only inside one iteration of a scan. Per chunk, with ``z = x W^T / tau``,

  lse  = logsumexp(z)           (one per chunk, shared by both outputs)
  logp = z[y] - lse
  H    = lse - sum_v p_v z_v,   p = exp(z - lse)

A ``jax.custom_vjp`` keeps only ``x``, ``W``, ``lse`` and ``E_p[z]`` for the backward, which
recomputes each chunk's logits and applies

  dlogp / dz = onehot(y) - p
  dH / dz    = -p * (z - E_p[z]),  E_p[z] = sum_v p_v z_v = lse - H

then ``dx = g_z W / tau`` (per chunk) and ``dW = sum_chunks g_z^T x / tau`` (a float32
accumulator the size of the table).

Entropy (``entropy`` argument): ``"none"`` computes none (reference log-probs, in-step
advantages); ``"metric"`` computes it in the forward (an exp and a sum over the chunk's logits,
no extra matmul) and returns it without gradient; ``"loss"`` also differentiates it. The train
step asks for ``"loss"`` when ``entropy_coef > 0`` and ``"metric"`` otherwise (the entropy
metric is kept: it costs no matmul).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Default positions per chunk (config.layout.logprob_chunk). A chunk's float32 logits are
# rows x 128 x V x 4 bytes (74 MiB a row at V = 152k). Below a few hundred positions the memory
# is mostly the table-sized part (its float32 gradient accumulator and its compute-dtype copy,
# ~800 MiB at Qwen2.5-0.5B), so smaller chunks save little and only add scan iterations
# (lab/bench/logprob_memory.py: fwd+bwd temporaries at T = 2048, one row: 1343 MiB with
# chunks of 512, 1120 with 128, against 4755 with whole logits).
DEFAULT_CHUNK = 128
ENTROPY_MODES = ("none", "metric", "loss")
# The table's axes: "vd" [V, D] (tied embedding), "dv" [D, V] (a separate lm_head).
TABLE_AXES = ("vd", "dv")


def logits(x_btd: jax.Array, table: jax.Array, table_axes: str) -> jax.Array:
  """float32 logits ``x @ W^T`` of hidden states ``x`` and the table cast to ``x``'s dtype."""
  spec = "...d,vd->...v" if table_axes == "vd" else "...d,dv->...v"
  table = table.astype(x_btd.dtype)
  return jnp.einsum(spec, x_btd, table, preferred_element_type=jnp.float32)


# Below this temperature the logits are shifted (max 0) before they are divided, as the sampler
# does: near float32's smallest normal temperature (1.18e-38, the least the config accepts) the
# plain quotient overflows to inf and the log-sum-exp turns NaN. Above it the plain quotient
# stays, bit for bit as before (it overflows only for logits beyond 3e35, no model's).
SHIFT_BELOW = 1e-3
# The floor of a shifted tempered logit. exp of anything below about -104 is 0 in float32, and the
# sampler never draws a token more than about 21 below the max (the span of its Gumbel noise),
# so the floor changes no probability and no log-prob of a token that can be drawn. It keeps
# z and the cotangents through the entropy's p * z finite (at float32's lowest they overflowed).
SHIFTED_FLOOR = -1e4


def tempered(logits_v: jax.Array, temperature: float) -> jax.Array:
  """float32 ``logits / temperature`` as log softmax sees it: finite wherever the logits are.

  Below ``SHIFT_BELOW`` each row is shifted first, so its max is exactly 0, and floored at
  ``SHIFTED_FLOOR``; log softmax, its gradient and the entropy do not change under the shift,
  and the sampled argmax token gets the sampler's log-prob 0.
  """
  if temperature >= SHIFT_BELOW:  # static
    return logits_v / temperature
  peak = jax.lax.stop_gradient(jnp.max(logits_v, axis=-1, keepdims=True))  # log softmax ignores it
  return jnp.maximum((logits_v - peak) / temperature, SHIFTED_FLOOR)


def _tempered_grad(g_z: jax.Array, temperature: float) -> jax.Array:
  """``g_z / temperature``; below ``SHIFT_BELOW`` kept in float32's range: a tie at the max
  overflows to inf there, which the global-norm clip would turn into NaN."""
  g = g_z / temperature
  if temperature >= SHIFT_BELOW:
    return g
  big = jnp.finfo(g.dtype).max
  return jnp.clip(g, -big, big)


def _chunk_forward(x, table, y, *, table_axes, temperature, entropy):
  """One chunk: (logp, lse, E_p[z] or None) from its logits, one log-sum-exp for both."""
  z = tempered(logits(x, table, table_axes), temperature)
  lse = jax.nn.logsumexp(z, axis=-1)
  logp = jnp.take_along_axis(z, y[..., None], axis=-1)[..., 0] - lse
  mean_z = None
  if entropy:
    mean_z = jnp.sum(jnp.exp(z - lse[..., None]) * z, axis=-1)
  return logp, lse, mean_z


def _split(a: jax.Array, chunk: int) -> jax.Array:
  """``[B, T, ...]`` -> ``[T / chunk, B, chunk, ...]`` (T padded with zeros to a multiple)."""
  t = a.shape[1]
  n = -(-t // chunk)
  pad = [(0, 0)] * a.ndim
  pad[1] = (0, n * chunk - t)
  a = jnp.pad(a, pad)
  a = a.reshape(a.shape[0], n, chunk, *a.shape[2:])
  return jnp.moveaxis(a, 1, 0)


def _merge(a: jax.Array, t: int) -> jax.Array:
  """Inverse of :func:`_split`: ``[n, B, chunk, ...]`` -> ``[B, T, ...]``."""
  a = jnp.moveaxis(a, 0, 1)
  return a.reshape(a.shape[0], -1, *a.shape[3:])[:, :t]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _chunked(x_btd, table, targets_bt, table_axes, temperature, chunk, entropy):
  out, _ = _chunked_fwd(x_btd, table, targets_bt, table_axes, temperature, chunk, entropy)
  return out


def _chunked_fwd(x_btd, table, targets_bt, table_axes, temperature, chunk, entropy):
  """Forward; with symbolic zeros the inputs come as ``CustomVJPPrimal``s saying whether they
  are differentiated (a frozen LoRA base's table is not: its gradient is then not computed)."""
  table_grad = True
  if isinstance(table, jax.custom_derivatives.CustomVJPPrimal):
    table_grad = table.perturbed
    x_btd, table, targets_bt = x_btd.value, table.value, targets_bt.value
  t = x_btd.shape[1]
  fwd = functools.partial(
    _chunk_forward, table_axes=table_axes, temperature=temperature, entropy=entropy != "none"
  )

  def body(_, xs):
    x, y = xs
    logp, lse, mean_z = fwd(x, table, y)
    return None, (logp, lse, mean_z if mean_z is not None else lse)

  xs = (_split(x_btd, chunk), _split(targets_bt, chunk))
  _, (logp, lse, mean_z) = jax.lax.scan(body, None, xs)
  logp, lse, mean_z = (_merge(a, t) for a in (logp, lse, mean_z))
  # E_p[z] (not H = lse - E_p[z]) is kept: the backward's z - E_p[z] then has no lse - lse
  # cancellation (the rounding error of the whole-logits autodiff path).
  # () or None: whether the table's gradient is wanted (a static marker in the residuals).
  residuals = (x_btd, table, targets_bt, lse, mean_z, () if table_grad else None)
  return (logp, lse - mean_z), residuals


def _chunked_bwd(table_axes, temperature, chunk, entropy, residuals, cotangents):
  x_btd, table, targets_bt, lse_bt, mean_z_bt, table_grad = residuals
  table_grad = table_grad is not None
  g_logp_bt, g_ent_bt = cotangents
  zero = jax.custom_derivatives.SymbolicZero
  # An entropy without a cotangent (a metric, or nothing downstream of it) costs no work.
  with_entropy = entropy == "loss" and not isinstance(g_ent_bt, zero)
  if isinstance(g_ent_bt, zero):
    g_ent_bt = jnp.zeros(lse_bt.shape, jnp.float32)
  if isinstance(g_logp_bt, zero):
    g_logp_bt = jnp.zeros(lse_bt.shape, jnp.float32)
  t = x_btd.shape[1]
  vocab = table.shape[0] if table_axes == "vd" else table.shape[1]

  def body(g_table, xs):
    x, y, lse, mean_z, g_logp, g_ent = xs
    z = tempered(logits(x, table, table_axes), temperature)
    p = jnp.exp(z - lse[..., None])
    onehot = jnp.arange(vocab, dtype=y.dtype) == y[..., None]
    g_z = g_logp[..., None] * (onehot - p)
    if with_entropy:
      g_z = g_z - g_ent[..., None] * p * (z - mean_z[..., None])
    # Matmuls in the compute dtype (x's) with float32 results, as the forward's.
    g_z = _tempered_grad(g_z, temperature).astype(x.dtype)
    w = table.astype(x.dtype)
    if table_axes == "vd":
      g_x = jnp.einsum("bcv,vd->bcd", g_z, w, preferred_element_type=jnp.float32)
    else:
      g_x = jnp.einsum("bcv,dv->bcd", g_z, w, preferred_element_type=jnp.float32)
    if table_grad:
      spec = "bcv,bcd->vd" if table_axes == "vd" else "bcv,bcd->dv"
      g_table = g_table + jnp.einsum(spec, g_z, x, preferred_element_type=jnp.float32)
    return g_table, g_x.astype(x.dtype)

  xs = tuple(_split(a, chunk) for a in (x_btd, targets_bt, lse_bt, mean_z_bt, g_logp_bt, g_ent_bt))
  g_table0 = jnp.zeros(table.shape, jnp.float32) if table_grad else None
  g_table, g_x = jax.lax.scan(body, g_table0, xs)
  g_table = g_table.astype(table.dtype) if table_grad else None
  return _merge(g_x, t), g_table, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd, symbolic_zeros=True)


def token_logprobs_and_entropy(
  hidden_btd: jax.Array,
  table: jax.Array,
  targets_bt: jax.Array,
  *,
  table_axes: str,
  temperature: float = 1.0,
  chunk: int = DEFAULT_CHUNK,
  entropy: str = "metric",
) -> tuple[jax.Array, jax.Array | None]:
  """float32 ``log softmax(x W^T / temperature)[targets]`` and entropies, ``[B, T]`` each.

  Args:
    hidden_btd: final-normed hidden states (the model's compute dtype).
    table: the unembedding table, in ``table_axes`` (``Transformer.unembedding``); cast to the
      hidden states' dtype for the matmuls, its gradient comes back in its own dtype.
    targets_bt: int token ids in ``[0, V)``.
    table_axes: ``"vd"`` (``[V, D]``, tied embedding) or ``"dv"`` (``[D, V]``, lm_head).
    temperature: the sampler's temperature, so the log-probs match the behavior log-probs.
    chunk: positions per chunk (every row in each); ``0``: the plain path, whole logits.
    entropy: ``"none"`` (returns None), ``"metric"`` (no gradient) or ``"loss"``.

  Returns:
    ``(logp, entropy or None)``; the gradient reaches ``hidden_btd`` and ``table``.
  """
  if entropy not in ENTROPY_MODES:
    raise ValueError(f"entropy must be one of {ENTROPY_MODES}, got {entropy!r}.")
  if table_axes not in TABLE_AXES:
    raise ValueError(f"table_axes must be one of {TABLE_AXES}, got {table_axes!r}.")
  if not isinstance(chunk, int) or chunk < 0:
    raise ValueError(f"chunk must be a non-negative integer, got {chunk!r}.")
  targets_bt = targets_bt.astype(jnp.int32)
  if chunk == 0:
    z = tempered(logits(hidden_btd, table, table_axes), temperature)
    lse = jax.nn.logsumexp(z, axis=-1)
    logp = jnp.take_along_axis(z, targets_bt[..., None], axis=-1)[..., 0] - lse
    if entropy == "none":
      return logp, None
    ent = lse - jnp.sum(jnp.exp(z - lse[..., None]) * z, axis=-1)
    return logp, ent if entropy == "loss" else jax.lax.stop_gradient(ent)
  # Even chunks: as many as `chunk` asks for, each ceil(T / n) long, so the last is not mostly
  # padding (T = 132 at chunk 128: two of 66, not 256 positions' logits).
  t = hidden_btd.shape[1]
  chunk = -(-t // -(-t // chunk))
  logp, ent = _chunked(
    hidden_btd, table, targets_bt, table_axes, float(temperature), chunk, entropy
  )
  if entropy == "none":
    return logp, None
  return logp, ent if entropy == "loss" else jax.lax.stop_gradient(ent)
