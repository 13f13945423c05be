"""Batched sampling: prefill + decode over a preallocated KV cache, one jitted call per shape.

The whole generation (prefill, then a `lax.while_loop` of decode steps that exits once every
sequence has produced EOS) runs inside `jax.shard_map` over the batch axes, so sampling (top-k,
top-p, categorical draws) never triggers a collective: each batch shard draws with its own key,
`fold_in(rng, shard index)`, then `fold_in(., step)`. Params enter the shard_map replicated, so
sharded params are all-gathered once per call, not per token (and a tensor axis, if any, runs
the whole model redundantly: fine for the colocated tiny models of today, not for big ones).

Top-k and top-p combine as in Hugging Face: top-k first, then top-p on the renormalised top-k
distribution; ties at the threshold are kept.

Log-probs: `Samples.logprobs` holds log_softmax(logits / temperature) at each sampled token, the
distribution before top-k / top-p truncation (no renormalisation), which is what the trainer
recomputes from its own forward pass (the behaviour policy of its importance ratios is the
tempered one). It is computed in float32 as log_softmax((logits - max logits) / temperature) and
clamped at 0: subtracting the max first keeps every tempered logit finite or -inf however small
the temperature (the max is exactly 0, so the argmax token's log-prob is finite; a token at -inf
has probability 0 and is never drawn), and the clamp removes what rounding is left (XLA's exp/log
are approximations). Dividing first, as this module once did, put the argmax token's log-prob
above 0 inside the fused decode step (+1e-4 at temperature 0.1, +2 at 1e-6) and overflowed near
0. So every temperature gives log-probs that are finite and <= 0, as storage requires. (The
trainer's recomputation, knitjax.train.logprobs, shifts the same way below temperature 1e-3, so
it stays finite down to 1.18e-38; above it, it divides first and stays within 3e-5 of the exact
value at the argmax token: measured with random float32 logits.)

`temperature == 0` is greedy: the argmax token, reported with its log-prob under the untempered
policy, log_softmax(logits) (clamped at 0 too). Under the greedy policy itself that token has
probability 1 (log-prob 0), which says nothing; the untempered log-prob is the model's confidence
and lets tests compare the cached path with a full forward. Greedy log-probs never enter a loss:
runs that train refuse temperature 0 (`config.rollout.temperature`; the trainer recomputes
log_softmax(logits / temperature)), evaluation and `knitjax.chat` use it. Any temperature > 0,
however small, samples the tempered distribution and reports its log-prob (at 1e-6 that is the
argmax unless two logits are within ~1e-5), so no threshold turns a positive temperature greedy.
"""

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from knitjax import sharding

# The smallest temperature > 0 that float32 holds as a normal number: below it 1 / T is not
# representable and the tempered logits would be NaN.
MIN_TEMPERATURE = float(np.finfo(np.float32).tiny)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
  """How tokens are drawn. `temperature == 0` is greedy (see the module docstring for its
  log-probs); `top_k == 0` and `top_p == 1` are off."""

  max_new_tokens: int
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
      raise ValueError(
        f"SamplingConfig.max_new_tokens must be a positive integer, got {self.max_new_tokens!r}."
      )
    if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf):
      raise ValueError(
        f"SamplingConfig.temperature must be 0 (greedy) or a finite value >= {MIN_TEMPERATURE:.3g}"
        f" (float32's smallest normal number), got {self.temperature!r}."
      )
    if not isinstance(self.top_k, int) or self.top_k < 0:
      raise ValueError(f"SamplingConfig.top_k must be an integer >= 0, got {self.top_k!r}.")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p!r}.")


@dataclasses.dataclass(frozen=True)
class Samples:
  """Generated responses (host arrays)."""

  tokens: np.ndarray  # [B, N] int32, pad_id after the end
  lengths: np.ndarray  # [B] int32, generated tokens including the EOS token if produced
  logprobs: np.ndarray  # [B, N] float32, log_softmax(logits / T) at each token (<= 0), 0 beyond


def _truncated(scaled_bv: jax.Array, config: SamplingConfig) -> jax.Array:
  """The tempered logits with the tokens top-k / top-p drop set to -inf."""
  if not config.top_k and config.top_p == 1:
    return scaled_bv
  vocab = scaled_bv.shape[-1]
  k = min(config.top_k, vocab) if config.top_k else vocab
  top_bk = jax.lax.top_k(scaled_bv, k)[0]  # sorted, descending
  if config.top_p < 1:
    # Smallest prefix whose mass reaches top_p; the first token is always kept.
    probs_bk = jax.nn.softmax(top_bk, axis=-1)
    mass_before = jnp.cumsum(probs_bk, axis=-1) - probs_bk
    top_bk = jnp.where(mass_before < config.top_p, top_bk, jnp.inf)
  threshold_b1 = jnp.min(top_bk, axis=-1, keepdims=True)
  return jnp.where(scaled_bv >= threshold_b1, scaled_bv, -jnp.inf)


def _sample(logits_bv: jax.Array, key: jax.Array, config: SamplingConfig):
  """Draws one token per row; returns (tokens [B], untruncated log-probs [B], each <= 0)."""
  logits_bv = logits_bv.astype(jnp.float32)
  # Shifted before dividing: the max is exactly 0 and the rest finite or -inf at any temperature.
  shifted = logits_bv - jnp.max(logits_bv, axis=-1, keepdims=True)
  if config.temperature == 0:
    tokens, scaled = jnp.argmax(logits_bv, axis=-1), shifted  # untempered log-probs
  else:
    scaled = shifted / jnp.float32(config.temperature)
    tokens = jax.random.categorical(key, _truncated(scaled, config), axis=-1)
  logprobs = jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), tokens[:, None], axis=-1)
  # XLA's exp/log round: the argmax token's log-prob can come out a few ulps above 0.
  return tokens.astype(jnp.int32), jnp.minimum(logprobs[:, 0], 0.0)


def is_eos(token: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
  """Whether each token is one of the stop tokens (Llama-3 instruct has two)."""
  return functools.reduce(jnp.logical_or, [token == e for e in eos_ids])


def eos_tuple(eos_id: int | Sequence[int]) -> tuple[int, ...]:
  """The stop tokens as a non-empty tuple of ints (a static, hashable jit argument)."""
  ids = (eos_id,) if isinstance(eos_id, int | np.integer) else tuple(eos_id)
  if not ids or any(isinstance(e, bool) or int(e) < 0 for e in ids):
    raise ValueError(f"eos ids must be one or more token ids >= 0, got {eos_id!r}.")
  return tuple(int(e) for e in ids)


def _generate_shard(
  params, prompts_bp, prompt_lens_b, rng, pad_id, embeddings_bpd, *, graphdef, sampling, eos_ids
):
  """Generation for one batch shard (inside shard_map: no collectives)."""
  rng = jax.random.fold_in(rng, jax.lax.axis_index(sharding.BATCH_AXES))
  model = nnx.merge(graphdef, params)
  b, p = prompts_bp.shape
  n = sampling.max_new_tokens
  valid_bp = jnp.arange(p)[None, :] >= (p - prompt_lens_b)[:, None]
  positions_bp = jnp.maximum(jnp.cumsum(valid_bp, axis=1) - 1, 0)
  cache = model.init_cache(b, p + n)
  # Image prompts come as embeddings (placeholders already replaced); decoding is text only.
  logits_bv, cache = model.prefill(
    prompts_bp, positions_bp, valid_bp, cache, embeddings_btd=embeddings_bpd
  )

  def emit(step, logits_bv, state):
    """Samples token `step`; records it unless the sequence already ended."""
    tokens_bn, logprobs_bn, lengths_b, done_b = state
    token_b, logprob_b = _sample(logits_bv, jax.random.fold_in(rng, step), sampling)
    token_b = jnp.where(done_b, pad_id, token_b)
    logprob_b = jnp.where(done_b, 0.0, logprob_b)
    tokens_bn = jax.lax.dynamic_update_slice(tokens_bn, token_b[:, None], (0, step))
    logprobs_bn = jax.lax.dynamic_update_slice(logprobs_bn, logprob_b[:, None], (0, step))
    lengths_b = lengths_b + (~done_b).astype(jnp.int32)
    done_b = done_b | is_eos(token_b, eos_ids)
    return token_b, (tokens_bn, logprobs_bn, lengths_b, done_b)

  state = (
    jnp.full((b, n), pad_id, jnp.int32),
    jnp.zeros((b, n), jnp.float32),
    jnp.zeros((b,), jnp.int32),
    jnp.zeros((b,), jnp.bool_),
  )
  # Per-shard values: mark them as varying over the batch axes, like everything they mix with.
  state = jax.lax.pcast(state, sharding.BATCH_AXES, to="varying")
  token_b, state = emit(0, logits_bv, state)

  def cond(carry):
    step, _, _, state = carry
    return (step < n) & ~jnp.all(state[3])  # per shard: no collective to agree on the exit

  def body(carry):
    step, token_b, cache, state = carry
    # Response token `step - 1` sits at RoPE position prompt_len + step - 1.
    logits_bv, cache = model.decode_step(token_b, prompt_lens_b + step - 1, cache)
    token_b, state = emit(step, logits_bv, state)
    return step + 1, token_b, cache, state

  _, _, _, (tokens_bn, logprobs_bn, lengths_b, _) = jax.lax.while_loop(
    cond, body, (jnp.ones((), jnp.int32), token_b, cache, state)
  )
  return tokens_bn, lengths_b, logprobs_bn


@functools.partial(jax.jit, static_argnames=("graphdef", "mesh", "sampling", "eos_ids"))
def _generate(
  params,
  prompts_bp,
  prompt_lens_b,
  rng,
  pad_id,
  embeddings_bpd,
  *,
  graphdef,
  mesh,
  sampling,
  eos_ids,
):
  """Whole generation as one jitted call; compiled once per (model, mesh, sampling, shapes)."""
  batch, rep = PartitionSpec(sharding.BATCH_AXES), PartitionSpec()
  shard_fn = functools.partial(
    _generate_shard, graphdef=graphdef, sampling=sampling, eos_ids=eos_ids
  )
  return jax.shard_map(
    shard_fn,
    mesh=mesh,
    in_specs=(rep, batch, batch, rep, rep, batch),
    out_specs=(batch, batch, batch),
  )(params, prompts_bp, prompt_lens_b, rng, pad_id, embeddings_bpd)


class Sampler:
  """Generates `max_new_tokens` continuations of left-padded prompts with a KV cache."""

  def __init__(
    self,
    graphdef: nnx.GraphDef,
    *,
    mesh: jax.sharding.Mesh,
    sampling: SamplingConfig,
    eos_id: int | Sequence[int],
    pad_id: int,
    prompt_len: int,
  ):
    """`eos_id`: the stop token, or several (a sequence ends at the first of any)."""
    if prompt_len < 1:
      raise ValueError(f"Sampler prompt_len must be >= 1, got {prompt_len}.")
    self.graphdef = graphdef
    self.mesh = mesh
    self.sampling = sampling
    self.eos_ids = eos_tuple(eos_id)
    self.eos_id = self.eos_ids[0]
    self.pad_id = pad_id
    self.prompt_len = prompt_len
    self.batch_shards = math.prod(mesh.shape[a] for a in sharding.BATCH_AXES)

  def __call__(
    self,
    params: nnx.State,
    prompts: np.ndarray,
    prompt_lens: np.ndarray,
    rng: jax.Array,
    *,
    embeddings: jax.Array | None = None,
  ) -> Samples:
    """Samples one response per prompt.

    Args:
      params: model params (any sharding on `mesh`; gathered once for generation).
      prompts: [B, prompt_len] int32, LEFT-padded; B divisible by the batch shards of the mesh.
      prompt_lens: [B] int32, real prompt tokens per row, in [1, prompt_len].
      rng: PRNG key.
      embeddings: [B, prompt_len, d_model] prompt embeddings used instead of the prompt's token
        embeddings in the prefill (VLM prompts: image placeholders replaced by patch features).
    """
    prompts = np.asarray(prompts, np.int32)
    prompt_lens = np.asarray(prompt_lens, np.int32)
    if prompts.ndim != 2 or prompts.shape[1] != self.prompt_len:
      raise ValueError(f"prompts must be [B, {self.prompt_len}], got shape {prompts.shape}.")
    b = prompts.shape[0]
    if b % self.batch_shards:
      raise ValueError(
        f"batch size {b} must be divisible by the mesh's {self.batch_shards} batch shards."
      )
    if prompt_lens.shape != (b,) or prompt_lens.min() < 1 or prompt_lens.max() > self.prompt_len:
      raise ValueError(f"prompt_lens must be [{b}] values in [1, {self.prompt_len}].")
    batch = functools.partial(sharding.batch_sharding, self.mesh)
    with jax.set_mesh(self.mesh):
      tokens, lengths, logprobs = _generate(
        params,
        jax.device_put(prompts, batch(2)),
        jax.device_put(prompt_lens, batch(1)),
        rng,
        np.int32(self.pad_id),
        None if embeddings is None else jax.device_put(embeddings, batch(3)),
        graphdef=self.graphdef,
        mesh=self.mesh,
        sampling=self.sampling,
        eos_ids=self.eos_ids,
      )
    tokens, lengths, logprobs = sharding.to_host((tokens, lengths, logprobs))
    return Samples(tokens=tokens, lengths=lengths, logprobs=logprobs)
