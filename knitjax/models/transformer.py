"""Decoder-only transformer of the Qwen2 / Qwen2.5 / Qwen3 / Llama-3 family in Flax NNX.

Two paths share the same blocks: `__call__` runs a whole sequence (training), and `prefill` /
`decode_step` run against a preallocated `KVCache` (sampling). Sequences are laid out with the
prompt LEFT-padded, so every sequence of a batch writes the same cache slot at each step; positions
come from the caller (`cumsum(valid) - 1`), so padding never shifts RoPE.
"""

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from knitjax.models import attention, dtypes, layers, lora
from knitjax.models.attention import PLAIN, SequenceMask

# TransformerConfig fields that choose how the model runs (kernels, memory), not its shape or
# weights: a config may set them on top of a checkpoint's shape (`config.init_from`).
EXECUTION_FIELDS = ("dtype", "attention", "remat", "scan_layers")

# Rematerialisation policies of the full-sequence forward (`TransformerConfig.remat`): what each
# decoder block keeps for the backward pass; the rest is recomputed there.
REMAT_POLICIES = {
  "none": None,  # keep every activation (no recomputation)
  "block": jax.checkpoint_policies.nothing_saveable,  # keep only each block's input
  # keep the matmul outputs without a batch dimension (the projections), recompute the rest
  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

# Upper bounds on the shape: each far above any released model (vocabularies ~256K, d_model 16K,
# ~126 layers), far below what takes minutes or all memory before a check could speak.
MAX_DIMS = {
  "vocab_size": 1 << 24,
  "num_layers": 1024,
  "d_model": 1 << 17,
  "num_heads": 1 << 12,
  "num_kv_heads": 1 << 12,
  "ffn_dim": 1 << 20,
}
MAX_HEAD_DIM = 1 << 12


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
  """Shape and options of the decoder. Params are always float32; `dtype` is the compute dtype."""

  vocab_size: int
  num_layers: int
  d_model: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  ffn_dim: int
  rope_theta: float = 10_000.0
  # Long-context RoPE frequency scaling (Llama-3.1 "llama3", "yarn", "linear"); None: plain RoPE.
  # A mapping of RopeScaling's fields (as a ConfigDict gives it) is converted.
  rope_scaling: layers.RopeScaling | None = None
  norm_eps: float = 1e-6
  tie_embeddings: bool = True
  qk_norm: bool = False  # Qwen3
  qkv_bias: bool = False  # Qwen2 / Qwen2.5
  dtype: str = "float32"  # "float32" | "bfloat16" | "auto" (dtypes.resolve_dtype: bf16 on TPU/GPU)
  # Attention implementation (knitjax.models.attention): "auto" (cudnn on GPU, splash on TPU,
  # blockwise "xla" on the CPU, "dense" there when one block holds it all), "xla", "dense",
  # "cudnn", "splash".
  attention: str = "auto"
  # A critic head on the shared trunk (`logits_and_values`); PPO with GAE sets it.
  value_head: bool = False
  # LoRA (knitjax.models.lora): rank 0 trains every param; rank r > 0 puts adapters of rank r
  # (scale lora_alpha / r) on the lora_targets projections and trains only them, the base frozen
  # (stored in lora_base_dtype).
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple[str, ...] = lora.TARGETS
  lora_base_dtype: str = "float32"
  # Memory and compile time of the full-sequence (training) forward; neither changes the math.
  # remat: one of REMAT_POLICIES. scan_layers: run the decoder blocks as one `lax.scan` (one block
  # compiled instead of num_layers); params keep their per-layer structure (checkpoints, weight sync
  # and LoRA unchanged) and are stacked in the compute dtype inside the jitted step.
  remat: str = "none"
  scan_layers: bool = False

  def __post_init__(self):
    for name, most in MAX_DIMS.items():
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"TransformerConfig.{name} must be a positive integer, got {value!r}.")
      if value > most:
        raise ValueError(f"TransformerConfig.{name}={value:,} is not accepted; at most {most:,}.")
    if self.head_dim > MAX_HEAD_DIM:
      raise ValueError(
        f"TransformerConfig.head_dim={self.head_dim:,} is not accepted; at most {MAX_HEAD_DIM:,}."
      )
    if self.num_kv_heads > self.num_heads:
      raise ValueError(
        f"TransformerConfig.num_kv_heads ({self.num_kv_heads}) must be at most num_heads "
        f"({self.num_heads})."
      )
    if not isinstance(self.head_dim, int) or self.head_dim < 2 or self.head_dim % 2:
      raise ValueError(
        f"TransformerConfig.head_dim must be a positive even integer (RoPE), got {self.head_dim!r}."
      )
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"TransformerConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
        f"({self.num_kv_heads})."
      )
    if self.dtype == dtypes.AUTO_DTYPE:
      object.__setattr__(self, "dtype", dtypes.resolve_dtype(self.dtype))
    if self.dtype not in dtypes.DTYPES:
      raise ValueError(
        f"TransformerConfig.dtype must be one of {sorted(dtypes.DTYPES)} or 'auto', got "
        f"{self.dtype!r}."
      )
    if self.remat not in REMAT_POLICIES:
      raise ValueError(
        f"TransformerConfig.remat must be one of {sorted(REMAT_POLICIES)}, got {self.remat!r}."
      )
    if not isinstance(self.scan_layers, bool):
      raise ValueError(
        f"TransformerConfig.scan_layers must be true or false, got {self.scan_layers!r}."
      )
    if self.attention not in attention.IMPLS:
      raise ValueError(
        f"TransformerConfig.attention must be one of {list(attention.IMPLS)}, "
        f"got {self.attention!r}."
      )
    if not self.rope_theta > 0:
      raise ValueError(f"TransformerConfig.rope_theta must be > 0, got {self.rope_theta!r}.")
    if not self.norm_eps > 0:
      raise ValueError(f"TransformerConfig.norm_eps must be > 0, got {self.norm_eps!r}.")
    targets = lora.check_fields(
      self.lora_rank, self.lora_alpha, self.lora_targets, self.lora_base_dtype
    )
    object.__setattr__(self, "lora_targets", targets)  # a list from a ConfigDict; hashable now
    if self.lora_rank > self.d_model:
      raise ValueError(
        f"TransformerConfig.lora_rank={self.lora_rank:,} is not accepted; at most d_model "
        f"({self.d_model}), the rank of a full update."
      )
    scaling = self.rope_scaling
    if isinstance(scaling, Mapping):
      known = {f.name for f in dataclasses.fields(layers.RopeScaling)}
      unknown = sorted(set(scaling) - known)
      if unknown or "rope_type" not in scaling or "factor" not in scaling:
        bad = f"has no field {unknown[0]!r}" if unknown else "needs rope_type and factor"
        raise ValueError(
          f"TransformerConfig.rope_scaling {bad}; fields: {', '.join(sorted(known))}."
        )
      try:
        scaling = layers.RopeScaling(**scaling)
      except ValueError as e:
        raise ValueError(f"TransformerConfig.rope_scaling is not accepted: {e}") from None
      # Frozen: the config is a static jit argument and must stay hashable.
      object.__setattr__(self, "rope_scaling", scaling)
    elif scaling is not None and not isinstance(scaling, layers.RopeScaling):
      raise ValueError(
        f"TransformerConfig.rope_scaling must be a RopeScaling, a mapping of its fields or None, "
        f"got {scaling!r:.80}."
      )

  @property
  def compute_dtype(self) -> jnp.dtype:
    return dtypes.DTYPES[self.dtype]

  @property
  def lora(self) -> lora.LoraSpec | None:
    """The adapters' shape, or None without LoRA."""
    if not self.lora_rank:
      return None
    return lora.LoraSpec(self.lora_rank, float(self.lora_alpha), self.lora_targets)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Keys and values of every layer for `max_len` slots, filled left to right.

  One scalar `index` for the whole batch says where the next position goes (prompts are
  left-padded, so all sequences advance together); `valid_bs` marks slots that hold real tokens.
  """

  k: tuple[jax.Array, ...]  # per layer [B, S, num_kv_heads, head_dim], compute dtype
  v: tuple[jax.Array, ...]  # per layer [B, S, num_kv_heads, head_dim], compute dtype
  valid_bs: jax.Array  # [B, S] bool
  index: jax.Array  # int32 scalar: next free slot

  @property
  def max_len(self) -> int:
    return self.valid_bs.shape[1]


class Block(nnx.Module):
  """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    dtype = config.compute_dtype
    self.attn_norm = layers.RMSNorm(config.d_model, eps=config.norm_eps, rngs=rngs)
    self.attn = layers.Attention(
      d_model=config.d_model,
      num_heads=config.num_heads,
      num_kv_heads=config.num_kv_heads,
      head_dim=config.head_dim,
      rope_theta=config.rope_theta,
      norm_eps=config.norm_eps,
      qk_norm=config.qk_norm,
      qkv_bias=config.qkv_bias,
      dtype=dtype,
      rngs=rngs,
      attention=config.attention,
    )
    self.mlp_norm = layers.RMSNorm(config.d_model, eps=config.norm_eps, rngs=rngs)
    self.mlp = layers.MLP(config.d_model, config.ffn_dim, dtype=dtype, rngs=rngs)

  def __call__(
    self,
    x_btd,
    sin_cos,
    valid_bs,
    kv_cache=None,
    cache_index=None,
    mask: SequenceMask = PLAIN,
  ):
    attn_out, kv = self.attn(self.attn_norm(x_btd), sin_cos, valid_bs, kv_cache, cache_index, mask)
    x_btd = x_btd + attn_out
    return x_btd + self.mlp(self.mlp_norm(x_btd)), kv


class Transformer(nnx.Module):
  """Decoder-only language model returning float32 logits."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    dtype = config.compute_dtype
    self.embedder = layers.Embed(config.vocab_size, config.d_model, dtype=dtype, rngs=rngs)
    self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.num_layers)])
    self.final_norm = layers.RMSNorm(config.d_model, eps=config.norm_eps, rngs=rngs)
    if config.tie_embeddings:
      self.lm_head = None
    else:
      self.lm_head = layers.param(
        rngs,
        jax.nn.initializers.normal(stddev=config.d_model**-0.5),
        (config.d_model, config.vocab_size),
        ("embed", "vocab"),
      )
    if config.lora is not None:
      # Drawn after every base param, so the base is the same as without LoRA for one seed.
      for block in self.blocks:
        block.attn.add_adapters(config.lora, rngs)
        block.mlp.add_adapters(config.lora, rngs)
    # Created last, so a value head leaves the other params' random init unchanged.
    self.value_head = layers.ValueHead(config.d_model, rngs=rngs) if config.value_head else None

  def _rope(self, positions_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    c = self.config
    return layers.rope_sin_cos(positions_bt, c.head_dim, c.rope_theta, c.rope_scaling)

  def embed(self, tokens_bt: jax.Array) -> jax.Array:
    """Token embeddings [B, T, D] in the compute dtype."""
    return self.embedder(tokens_bt)

  def unembedding(self) -> tuple[jax.Array, str]:
    """The output projection as stored (float32, or a LoRA base's dtype) and its axes: the tied
    embedding table ``([V, D], "vd")`` or the lm_head ``([D, V], "dv")``. The logits are
    ``hidden_states(...) @ W^T`` with ``W`` cast to the compute dtype (`knitjax.train.logprobs`
    casts it inside, so its gradient stays in the param's dtype)."""
    if self.lm_head is None:
      return self.embedder.embedding[...], "vd"
    return self.lm_head[...], "dv"

  def _logits(self, x_btd: jax.Array) -> jax.Array:
    x_btd = self.final_norm(x_btd)
    if self.lm_head is None:
      return self.embedder.attend(x_btd)
    head = self.lm_head[...].astype(x_btd.dtype)
    return jnp.einsum("...d,dv->...v", x_btd, head, preferred_element_type=jnp.float32)

  def _inputs(self, tokens_bt, embeddings_btd):
    if embeddings_btd is None:
      return self.embed(tokens_bt)
    return embeddings_btd.astype(self.config.compute_dtype)

  def __call__(
    self,
    tokens_bt: jax.Array,
    positions_bt: jax.Array,
    valid_bt: jax.Array,
    *,
    embeddings_btd: jax.Array | None = None,
    mask: SequenceMask = PLAIN,
  ) -> jax.Array:
    """Full-sequence forward: float32 logits [B, T, V].

    Args:
      tokens_bt: int token ids.
      positions_bt: RoPE positions (`cumsum(valid) - 1`, clipped at 0; per packed row: from 0).
      valid_bt: bool, False on padding; a query sees keys that are earlier-or-equal AND valid.
      embeddings_btd: used instead of `embed(tokens_bt)` when given (e.g. image rows spliced in).
      mask: what a query sees beyond its causal, valid keys (`SequenceMask`: packed rows, the
        shared-prompt tree mask, whose responses' states then equal those of their own rows
        ``[prompt | response]``, or fixed spans); the default: one sequence per row.
    """
    x = self._hidden(tokens_bt, positions_bt, valid_bt, embeddings_btd, mask)
    return self._logits(x)

  def logits_and_values(
    self,
    tokens_bt: jax.Array,
    positions_bt: jax.Array,
    valid_bt: jax.Array,
    *,
    mask: SequenceMask = PLAIN,
  ) -> tuple[jax.Array, jax.Array]:
    """Full-sequence forward of policy and critic: float32 logits [B, T, V] and values [B, T].

    The value at position ``t`` estimates the return from the state ``tokens[: t + 1]``, the
    state in which the logits at ``t`` choose token ``t + 1``. Needs ``config.value_head``.
    """
    if self.value_head is None:
      raise ValueError("logits_and_values needs a value head; set TransformerConfig.value_head.")
    x = self._hidden(tokens_bt, positions_bt, valid_bt, None, mask)
    return self._logits(x), self.value_head(self.final_norm(x))

  def hidden_states(
    self,
    tokens_bt: jax.Array,
    positions_bt: jax.Array,
    valid_bt: jax.Array,
    *,
    embeddings_btd: jax.Array | None = None,
    mask: SequenceMask = PLAIN,
  ) -> jax.Array:
    """Full-sequence forward up to the final norm: hidden states [B, T, D] in the compute dtype.

    With `unembedding()` they give the logits (`knitjax.train.logprobs` reads them this way, so
    that the [B, T, V] logits need not exist at once); the arguments are `__call__`'s.
    """
    x = self._hidden(tokens_bt, positions_bt, valid_bt, embeddings_btd, mask)
    return self.final_norm(x)

  def hidden_states_and_values(
    self,
    tokens_bt: jax.Array,
    positions_bt: jax.Array,
    valid_bt: jax.Array,
    *,
    mask: SequenceMask = PLAIN,
  ) -> tuple[jax.Array, jax.Array]:
    """`hidden_states` and the critic's float32 values [B, T] from the same forward pass.

    The value head reads the same final-normed states as the logits (see `logits_and_values`).
    """
    if self.value_head is None:
      raise ValueError(
        "hidden_states_and_values needs a value head; set TransformerConfig.value_head."
      )
    x = self.hidden_states(tokens_bt, positions_bt, valid_bt, mask=mask)
    return x, self.value_head(x)

  def _hidden(
    self,
    tokens_bt,
    positions_bt,
    valid_bt,
    embeddings_btd,
    mask: SequenceMask = PLAIN,
  ) -> jax.Array:
    """The last block's output [B, T, D] (before the final norm)."""
    x = self._inputs(tokens_bt, embeddings_btd)
    valid_bt = valid_bt.astype(jnp.bool_)
    sin_cos = self._rope(positions_bt)
    return self._blocks(x, sin_cos, valid_bt, mask.as_int32())

  def _blocks(self, x_btd: jax.Array, sin_cos, valid_bs, mask: SequenceMask) -> jax.Array:
    """Every decoder block over a full sequence, with the configured remat and layer scan
    (each block with its layer's part of ``mask``, `SequenceMask.layer`)."""
    c = self.config
    graphdef = nnx.graphdef(self.blocks[0])

    def block_fn(state, x, mask):
      return nnx.merge(graphdef, state)(x, sin_cos, valid_bs, None, None, mask)[0]

    policy = REMAT_POLICIES[c.remat]
    if c.remat != "none":
      block_fn = jax.checkpoint(block_fn, policy=policy)
    states = [nnx.state(block) for block in self.blocks]
    if not c.scan_layers:
      for i, state in enumerate(states):
        x_btd = block_fn(state, x_btd, mask.layer(i))
      return x_btd
    # Kernels (every param of 2+ dims) are cast to the compute dtype before stacking, as each
    # block would cast them at use anyway: the stacked copy is the one bf16 compute makes.
    dtype = c.compute_dtype

    def stack(*leaves):
      cast = [x.astype(dtype) if x.ndim >= 2 else x for x in leaves]
      return jnp.stack(cast)

    stacked = jax.tree.map(stack, *states)
    past = (mask.past_k, mask.past_v)  # scanned with the layers' params (None: nothing)

    def body(x, xs):
      state, (k, v) = xs
      return block_fn(state, x, dataclasses.replace(mask, past_k=k, past_v=v)), None

    x_btd, _ = jax.lax.scan(body, x_btd, (stacked, past))
    return x_btd

  def keys_values(
    self,
    tokens_bt: jax.Array,
    positions_bt: jax.Array,
    valid_bt: jax.Array,
    *,
    embeddings_btd: jax.Array | None = None,
  ) -> tuple[jax.Array, jax.Array]:
    """Every layer's keys and values of full sequences (one row per sequence, left-padded as a
    prompt): ``[L, B, T, K, H]`` each, in the compute dtype, RoPE applied to the keys. Rows that
    continue these positions take them as `SequenceMask.past_k` / ``past_v``
    (`knitjax.train.prefix`: a group's prompt computed once per mini-batch). The last block's
    feed-forward and the output projection are not needed, and under ``jax.jit`` not computed."""
    x = self._inputs(tokens_bt, embeddings_btd)
    valid_bt = valid_bt.astype(jnp.bool_)
    sin_cos = self._rope(positions_bt)
    ks, vs = [], []
    for block in self.blocks:
      x, (k, v) = block(x, sin_cos, valid_bt)
      ks.append(k)
      vs.append(v)
    return jnp.stack(ks), jnp.stack(vs)

  def init_cache(self, batch: int, max_len: int) -> KVCache:
    """An empty cache for `batch` sequences of up to `max_len` positions (prompt + response)."""
    c = self.config
    shape = (batch, max_len, c.num_kv_heads, c.head_dim)
    return KVCache(
      k=tuple(jnp.zeros(shape, c.compute_dtype) for _ in range(c.num_layers)),
      v=tuple(jnp.zeros(shape, c.compute_dtype) for _ in range(c.num_layers)),
      valid_bs=jnp.zeros((batch, max_len), jnp.bool_),
      index=jnp.zeros((), jnp.int32),
    )

  def _extend(self, x_btd, positions_bt, valid_bt, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Runs T new positions at slots [index, index + T) against everything cached so far."""
    t = x_btd.shape[1]
    valid_bs = jax.lax.dynamic_update_slice(
      cache.valid_bs, valid_bt.astype(jnp.bool_), (0, cache.index)
    )
    sin_cos = self._rope(positions_bt)
    new_k, new_v = [], []
    for block, k, v in zip(self.blocks, cache.k, cache.v, strict=True):
      # Query t sits in slot index + t; the blockwise path reads only slots <= index + T - 1.
      x_btd, (k, v) = block(x_btd, sin_cos, valid_bs, (k, v), cache.index)
      new_k.append(k)
      new_v.append(v)
    return x_btd, KVCache(tuple(new_k), tuple(new_v), valid_bs, cache.index + t)

  def prefill(
    self,
    tokens_bt: jax.Array,
    positions_bt: jax.Array,
    valid_bt: jax.Array,
    cache: KVCache,
    *,
    embeddings_btd: jax.Array | None = None,
  ) -> tuple[jax.Array, KVCache]:
    """Writes a left-padded prompt into the cache; returns the last position's logits [B, V]."""
    x = self._inputs(tokens_bt, embeddings_btd)
    x, cache = self._extend(x, positions_bt, valid_bt, cache)
    return self._logits(x[:, -1]), cache

  def decode_step(
    self, tokens_b: jax.Array, positions_b: jax.Array, cache: KVCache
  ) -> tuple[jax.Array, KVCache]:
    """Appends one token per sequence to the cache; returns its next-token logits [B, V]."""
    x = self.embed(tokens_b[:, None])
    valid_b1 = jnp.ones(x.shape[:2], jnp.bool_)
    x, cache = self._extend(x, positions_b[:, None], valid_b1, cache)
    return self._logits(x[:, 0]), cache
