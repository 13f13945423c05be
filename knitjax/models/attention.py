"""Grouped-query attention behind one function, `attend`, with implementations chosen by backend.

Which key a query sees comes from per-position information only: the cache slot of each query
(``q_offset + t``; key ``s`` sits in slot ``s``), key validity ``[B, S]`` and optional segment ids
(packed sequences). Query at slot ``i`` sees key ``s`` iff ``s <= i`` AND (key ``s`` is valid OR
``s == i``: a padding query sees only itself, so its discarded output stays finite) AND, with
segment ids, both are in the same segment.

A tree mask (shared-prompt attention) widens the segment clause. A row ``[prompt | r1 | ... | rG]``
holds a group's prompt once and its G responses after it, each in its own segment; the per-query
prefix id is, for a response token, the segment id of its prompt (0 elsewhere). The clause becomes
``q_seg == kv_seg OR q_prefix == kv_seg``: a response token sees its prompt and the earlier tokens
of its own response, exactly what it would see in its own row ``[prompt | response]``, while the
prompt's keys and values are computed once for all G responses. A valid key is never in segment 0,
so prefix 0 (prompts, padding, ordinary packed rows) exposes nothing.

Implementations (`TransformerConfig.attention`):
  * ``"xla"``: blockwise (flash-style) attention in pure JAX. An online softmax over key blocks
    for each query block, and a `jax.custom_vjp` whose backward recomputes each block's scores
    from the saved output and log-sum-exp, so neither pass ever holds ``[T, S]`` scores. Key
    blocks after a query block's last slot are skipped (a loop with a dynamic trip count), which
    also bounds decode by the cache index instead of ``max_len``. K/V are never repeated for GQA.
  * ``"dense"``: one einsum softmax over float32 ``[B, K, G, T, S]`` scores and a dense mask: the
    reference the tests compare against, and the fastest at tiny lengths.
  * ``"cudnn"``: `jax.nn.dot_product_attention(implementation="cudnn")` on GPU (bfloat16 or
    float16 only). cuDNN's sequence-length inputs describe right padding; knitjax left-pads, so
    validity and segments go in as a boolean ``[B, 1, T, S]`` mask (broadcast over heads), plus
    ``is_causal`` for a full sequence, which lets cuDNN skip the blocks above the diagonal (a
    tree mask is a subset of the causal mask, so it goes in the same boolean mask).
  * ``"splash"``: the Pallas TPU splash-attention kernel, causal, with segment ids carrying key
    validity (a padding key is in segment 0, which no real query has). The kernel only knows
    segment equality, so a tree mask runs it twice, over disjoint key sets: each query over its own
    segment, and each response query over its prompt (query segment = prefix id). The two partial
    softmaxes merge by their log-sum-exps, and the backward runs each part's kernel backward with
    the merged output and log-sum-exp, which sums to the exact gradient of the union.
  * ``"auto"``: cudnn on GPU (bfloat16/float16; xla in float32), splash on TPU, and on the CPU
    dense when the whole attention fits in one block (``T <= BLOCK_Q`` and ``S <= BLOCK_K``,
    where blockwise would compute the very same scores plus loop overhead), else xla.

cudnn and splash take a full sequence (no cache offset): attention against a KV cache (prefill,
decode) runs ``"xla"`` for them, which also attends only the filled part of the cache.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from knitjax import jax_compat

IMPLS = ("auto", "xla", "dense", "cudnn", "splash")


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["segment_ids_bt", "prefix_ids_bt", "past_k", "past_v", "past_valid_bs"],
  meta_fields=["spans"],
)
@dataclasses.dataclass(frozen=True)
class SequenceMask:
  """What a query of a full sequence sees beyond its earlier-or-equal valid keys: the training
  layout as the model takes it (`knitjax.train.layouts`). The default, no fields: one row per
  sequence (padded rows).

  Attributes:
    segment_ids_bt: int32 ``[B, T]`` packed-sequence ids (0 on padding): a query sees a key only
      in its own segment. None: one sequence per row.
    prefix_ids_bt: int32 ``[B, T]`` tree mask (shared-prompt rows ``[prompt | r1 | ... | rG]``):
      for a response token the segment id of its prompt, whose keys it sees too; 0 elsewhere.
      Needs ``segment_ids_bt``. None: no prefixes.
    spans: ``(P, N)`` of fixed-span shared-prompt rows ``[prompt (P) | N | ... | N]``
      (`knitjax.train.prompt_sharing`): the same tree mask computed span by span
      (:func:`attend_spans`), so no query meets another response's keys; the ids are then not
      read. None: :func:`attend` with the ids.
    past_k: keys of ``S0`` earlier positions each row continues (a group's prompt computed once
      per mini-batch, `knitjax.train.prefix`): ``[L, B, S0, K, H]`` as the model takes them,
      ``[B, S0, K, H]`` as a block sees its layer's (:meth:`layer`). A row's queries sit at slots
      ``S0 ..`` after them: its own keys follow, and it sees the valid past keys and its earlier
      own ones, exactly as if the past positions were the first ``S0`` columns of the row. Not
      with segment ids or spans. None: no past.
    past_v: their values, shaped as ``past_k``.
    past_valid_bs: bool ``[B, S0]``, True on the past positions that hold a real token.
  """

  segment_ids_bt: jax.Array | None = None
  prefix_ids_bt: jax.Array | None = None
  spans: tuple[int, int] | None = None
  past_k: jax.Array | None = None
  past_v: jax.Array | None = None
  past_valid_bs: jax.Array | None = None

  @property
  def plain(self) -> bool:
    """One row per sequence: nothing beyond the causal, valid keys."""
    ids = self.segment_ids_bt is None and self.prefix_ids_bt is None
    return ids and self.spans is None and self.past_k is None

  def layer(self, i) -> "SequenceMask":
    """What block ``i`` takes: layer ``i``'s past keys and values (``i`` may be traced)."""
    if self.past_k is None:
      return self
    return dataclasses.replace(self, past_k=self.past_k[i], past_v=self.past_v[i])

  def as_int32(self) -> "SequenceMask":
    """The ids as int32 (a batch may carry them in another integer type)."""
    cast = lambda x: None if x is None else x.astype(jnp.int32)  # noqa: E731
    return dataclasses.replace(
      self, segment_ids_bt=cast(self.segment_ids_bt), prefix_ids_bt=cast(self.prefix_ids_bt)
    )


PLAIN = SequenceMask()

# Block sizes of the xla path: a query block's scores against a key block are the largest
# temporary, [B, K, G, BLOCK_Q, BLOCK_K] float32 (14 MiB for Qwen2.5-0.5B's 14 heads, batch 1).
BLOCK_Q = 512
BLOCK_K = 512

# Masked scores: finite, so a block where a row sees no key gives exp(-huge) = 0, never NaN.
_MASK_VALUE = -1e30
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def resolve(impl: str, *, t: int, s: int, dtype, cached: bool) -> str:
  """The implementation `attend` runs: ``impl`` with "auto" (and kernels that cannot take a
  cache offset, when ``cached``) turned into a concrete one for this backend and shape."""
  if impl not in IMPLS:
    raise ValueError(f"attention implementation must be one of {list(IMPLS)}, got {impl!r}.")
  backend = jax.default_backend()
  if impl == "auto":
    if backend == "gpu" and jnp.dtype(dtype) in _CUDNN_DTYPES:
      impl = "cudnn"
    elif backend == "tpu":
      impl = "splash"
    elif backend == "cpu" and t <= BLOCK_Q and s <= BLOCK_K:
      # One block holds it all: blockwise would compute the same scores, plus loop overhead.
      return "dense"
    else:
      return "xla"
  if impl == "cudnn":
    if backend != "gpu":
      raise ValueError(f"attention 'cudnn' needs a GPU; this backend is {backend!r}.")
    if jnp.dtype(dtype) not in _CUDNN_DTYPES:
      raise ValueError(
        f"attention 'cudnn' needs dtype bfloat16 or float16, got {jnp.dtype(dtype).name}."
      )
  if impl == "splash" and backend != "tpu":
    raise ValueError(f"attention 'splash' needs a TPU; this backend is {backend!r}.")
  if impl in ("cudnn", "splash") and cached:
    return "xla"
  return impl


def attend(
  q_btnh: jax.Array,
  k_bskh: jax.Array,
  v_bskh: jax.Array,
  *,
  kv_valid_bs: jax.Array,
  q_offset: jax.Array | int = 0,
  q_segment_bt: jax.Array | None = None,
  kv_segment_bs: jax.Array | None = None,
  q_prefix_bt: jax.Array | None = None,
  impl: str = "auto",
  block_q: int | None = None,
  block_k: int | None = None,
) -> jax.Array:
  """Softmax attention of T queries over S keys (GQA: K kv-heads serve N = K * G query heads).

  Args:
    q_btnh: queries [B, T, N, H] (RoPE applied), in the compute dtype.
    k_bskh: keys [B, S, K, H]; key ``s`` sits in cache slot ``s``.
    v_bskh: values [B, S, K, H].
    kv_valid_bs: bool, True where the key holds a real token.
    q_offset: slot of the first query (int32 scalar; 0 for a full sequence, the cache index when
      extending a cache).
    q_segment_bt: int32 segment ids of the queries (0 on padding, >= 1 per packed sequence);
      None: no segments.
    kv_segment_bs: the keys' segment ids; needed with ``q_segment_bt``.
    q_prefix_bt: int32 [B, T] tree mask: for a response token of a shared-prompt group, the
      segment id of its prompt, whose keys it also sees; 0 elsewhere. Needs segment ids. None: no
      prefixes.
    impl: one of `IMPLS`.
    block_q: query block of the xla path (clipped to T); None: `BLOCK_Q`.
    block_k: key block of the xla path (clipped to S); None: `BLOCK_K`.

  Returns:
    The attention output [B, T, N, H] in the dtype of ``q_btnh``.
  """
  b, t, n, h = q_btnh.shape
  s, kh = k_bskh.shape[1], k_bskh.shape[2]
  if (q_segment_bt is None) != (kv_segment_bs is None):
    raise ValueError("attend needs both q_segment_bt and kv_segment_bs, or neither.")
  if q_prefix_bt is not None and q_segment_bt is None:
    raise ValueError("attend's q_prefix_bt (tree mask) needs q_segment_bt and kv_segment_bs.")
  full = isinstance(q_offset, int) and q_offset == 0 and t == s
  impl = resolve(impl, t=t, s=s, dtype=q_btnh.dtype, cached=not full)
  scale = float(h) ** -0.5
  q = q_btnh.reshape(b, t, kh, n // kh, h)
  q_offset = jnp.asarray(q_offset, jnp.int32)
  kv_valid_bs = kv_valid_bs.astype(jnp.bool_)
  segs = None if q_segment_bt is None else (q_segment_bt, kv_segment_bs, q_prefix_bt)
  if impl == "dense":
    out = _dense(q, k_bskh, v_bskh, q_offset, kv_valid_bs, segs, scale)
  elif impl == "xla":
    bq, bk = min(block_q or BLOCK_Q, t), min(block_k or BLOCK_K, s)
    out = _flash(q, k_bskh, v_bskh, q_offset, kv_valid_bs, segs, scale, bq, bk)
  elif impl == "cudnn":
    return _cudnn(q_btnh, k_bskh, v_bskh, kv_valid_bs, segs, scale)
  else:
    return _splash(q_btnh, k_bskh, v_bskh, kv_valid_bs, q_segment_bt, kv_segment_bs, scale,
                   q_prefix=q_prefix_bt)  # fmt: skip
  return out.reshape(b, t, n, h)


def attend_spans(
  q_btnh: jax.Array,
  k_btkh: jax.Array,
  v_btkh: jax.Array,
  *,
  kv_valid_bs: jax.Array,
  prompt_len: int,
  span_len: int,
  impl: str = "auto",
) -> jax.Array:
  """The tree mask of a fixed-span shared-prompt row, span by span: no wasted scores.

  A row is ``[prompt (P columns, left-padded) | span 1 (N) | ... | span G (N)]``, each span one
  response, right-padded (`knitjax.train.prompt_sharing`, ``pack=False``). Under the tree mask a
  prompt query sees the earlier valid prompt keys, and a query of span g the valid prompt keys
  and the earlier valid keys of span g: exactly a padded row ``[prompt | response g]``. So the
  prompt runs as one causal attention over ``[B, P]``, and the spans as ``B G`` causal
  attentions of their N queries (positions ``P .. P + N - 1``, a query offset of P) over their
  ``P + N`` keys: the prompt's, broadcast to every span, and their own. The scores are then
  ``P^2 + G N (P + N)`` a row, never the ``(P + G N)^2`` of one causal pass over the whole row
  (most of which the mask discards). The broadcast's transpose sums the G spans' gradients into
  the prompt's keys and values: the exact gradient, as for the tree mask. Both parts run
  `attend` (``impl``; kernels that take no query offset run "xla" for the spans, as with a
  cache).

  Args:
    q_btnh, k_btkh, v_btkh: queries, keys and values of the row, ``T = P + G N`` positions.
    kv_valid_bs: bool ``[B, T]``, True on real tokens.
    prompt_len: P.
    span_len: N.
    impl: one of `IMPLS`.

  Returns:
    The attention output ``[B, T, heads, H]``.
  """
  b, t, n, h = q_btnh.shape
  p, m = prompt_len, span_len
  g = (t - p) // m if m > 0 else 0
  if p < 1 or m < 1 or p + g * m != t:
    raise ValueError(
      f"a fixed-span row of {t} positions is not a prompt of {p} and spans of {m}; "
      "attend_spans needs T = P + G N with P, N >= 1."
    )
  valid_p = kv_valid_bs[:, :p]
  out_p = attend(q_btnh[:, :p], k_btkh[:, :p], v_btkh[:, :p], kv_valid_bs=valid_p, impl=impl)

  def per_span(x, prompt):  # [B, G N, ...] -> [B G, P + N, ...], the prompt before each span
    x = x.reshape(b, g, m, *x.shape[2:])
    prompt = jnp.broadcast_to(prompt[:, None], (b, g, *prompt.shape[1:]))
    return jnp.concatenate([prompt, x], axis=2).reshape(b * g, p + m, *x.shape[3:])

  out_r = attend(
    q_btnh[:, p:].reshape(b * g, m, n, h),
    per_span(k_btkh[:, p:], k_btkh[:, :p]),
    per_span(v_btkh[:, p:], v_btkh[:, :p]),
    kv_valid_bs=per_span(kv_valid_bs[:, p:], valid_p),
    q_offset=p,
    impl=impl,
  )
  return jnp.concatenate([out_p, out_r.reshape(b, g * m, n, h)], axis=1)


def _visible(q_slot, k_slot, kv_valid, q_seg=None, kv_seg=None, q_prefix=None):
  """[B, Tq, Sk] bool from per-position inputs: q_slot [Tq], k_slot [Sk], kv_valid [B, Sk],
  segment ids [B, Tq] / [B, Sk], prefix ids [B, Tq] (the segment a response query also sees)."""
  causal = k_slot[None, :] <= q_slot[:, None]
  own = k_slot[None, :] == q_slot[:, None]
  mask = causal[None] & (kv_valid[:, None, :] | own[None])
  if q_seg is not None:
    same = q_seg[:, :, None] == kv_seg[:, None, :]
    if q_prefix is not None:
      same = same | (q_prefix[:, :, None] == kv_seg[:, None, :])
    mask = mask & same
  return mask


def dense_mask(
  t: int, kv_valid_bs, q_offset=0, q_segment_bt=None, kv_segment_bs=None, q_prefix_bt=None
):
  """The [B, T, S] mask of the dense and cudnn paths (`attend`'s arguments)."""
  q_slot = jnp.asarray(q_offset, jnp.int32) + jnp.arange(t)
  k_slot = jnp.arange(kv_valid_bs.shape[1])
  valid = kv_valid_bs.astype(jnp.bool_)
  return _visible(q_slot, k_slot, valid, q_segment_bt, kv_segment_bs, q_prefix_bt)


def _dense(q, k, v, q_offset, kv_valid, segs, scale):
  """Reference: [B, K, G, T, S] float32 scores, masked, softmax, weighted sum of values."""
  mask = dense_mask(q.shape[1], kv_valid, q_offset, *(segs or ()))
  scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
  scores = jnp.where(mask[:, None, None], scores * scale, _MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  return jnp.einsum("bkgts,bskh->btkgh", probs, v)


# ---- xla: blockwise attention -------------------------------------------------------------------
# Blocks that do not divide the length start at min(i * block, length - block) (no padded copy of
# a whole cache): the last block overlaps the one before it, and rows of it that an earlier block
# already covered ("stale": slot < i * block) are masked out wherever they would count twice.


def _varying(*trees) -> tuple[str, ...]:
  """The manual mesh axes (inside `jax.shard_map`) any of the arrays varies over."""
  axes = set()
  for x in jax.tree.leaves(trees):
    axes |= set(jax.typeof(x).manual_axis_type.varying)
  return tuple(sorted(axes))


def _vary(tree, axes):
  """``tree`` typed as varying over ``axes``: loop carries created from constants must match the
  type of what the loop body makes of the (batch-sharded) inputs."""

  def one(x):
    missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(one, tree)


def _start(i, block, length):
  return jnp.minimum(i * block, length - block)


def _slice(x, start, size, axis=1):
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _key_block(j, k, v, kv_valid, segs, bk):
  """Key block j: its start, keys, values, validity, segments and slots."""
  ks = _start(j, bk, k.shape[1])
  k_slot = ks + jnp.arange(bk)
  kv_seg = None if segs is None else _slice(segs[1], ks, bk)
  return ks, _slice(k, ks, bk), _slice(v, ks, bk), _slice(kv_valid, ks, bk), kv_seg, k_slot


def _query_segs(segs, qs, bq):
  """A query block's segment and prefix ids [B, bq] (prefix None without a tree mask), or None
  without segments."""
  if segs is None:
    return None
  q_seg, _, q_prefix = segs
  return _slice(q_seg, qs, bq), None if q_prefix is None else _slice(q_prefix, qs, bq)


def _n_key_blocks(last_slot, bk, s):
  """Key blocks up to the one holding ``last_slot`` (later keys are in no query's past)."""
  return jnp.clip(last_slot // bk + 1, 0, -(-s // bk))


def _flash_forward(q, k, v, q_offset, kv_valid, segs, scale, bq, bk):
  b, t, kh, g, h = q.shape
  s = k.shape[1]
  n_q = -(-t // bq)
  axes = _varying(q, k, v, q_offset, kv_valid, segs)

  def query_block(i, carry):
    out, lse = carry
    qs = _start(i, bq, t)
    q_blk = _slice(q, qs, bq)
    q_slot = q_offset + qs + jnp.arange(bq)
    q_segs = _query_segs(segs, qs, bq)

    def key_block(j, acc):
      m, denom, o = acc
      ks, k_blk, v_blk, valid, kv_seg, k_slot = _key_block(j, k, v, kv_valid, segs, bk)
      sc, mask = _stale_masked(q_blk, q_slot, q_segs, k_blk, valid, kv_seg, k_slot, j * bk, scale)
      m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
      p = jnp.where(mask, jnp.exp(sc - m_new[..., None]), 0.0)
      alpha = jnp.exp(m - m_new)
      pv = jnp.einsum("bkgqs,bskh->bkgqh", p.astype(v.dtype), v_blk,
                      preferred_element_type=jnp.float32)  # fmt: skip
      return m_new, alpha * denom + jnp.sum(p, axis=-1), alpha[..., None] * o + pv

    init = _vary(
      (
        jnp.full((b, kh, g, bq), _MASK_VALUE, jnp.float32),
        jnp.zeros((b, kh, g, bq), jnp.float32),
        jnp.zeros((b, kh, g, bq, h), jnp.float32),
      ),
      axes,
    )
    n_k = _n_key_blocks(q_offset + qs + bq - 1, bk, s)
    m, denom, o = jax.lax.fori_loop(0, n_k, key_block, init)
    # Every query sees its own slot (denom > 0); this guards a query slot past the cache's end.
    denom = jnp.where(denom > 0, denom, 1.0)
    o_blk = jnp.transpose(o / denom[..., None], (0, 3, 1, 2, 4)).astype(q.dtype)
    out = jax.lax.dynamic_update_slice_in_dim(out, o_blk, qs, axis=1)
    lse = jax.lax.dynamic_update_slice_in_dim(lse, m + jnp.log(denom), qs, axis=3)
    return out, lse

  init = _vary((jnp.zeros(q.shape, q.dtype), jnp.zeros((b, kh, g, t), jnp.float32)), axes)
  return jax.lax.fori_loop(0, n_q, query_block, init)


def _stale_masked(q_blk, q_slot, q_segs, k_blk, valid, kv_seg, k_slot, first_fresh, scale):
  """Block scores [B, K, G, bq, bk] with keys before ``first_fresh`` (counted by the block
  before) hidden from every query, its own slot included."""
  q_seg, q_prefix = q_segs or (None, None)
  mask = _visible(q_slot, k_slot, valid, q_seg, kv_seg, q_prefix)
  mask = mask & (k_slot >= first_fresh)[None, None]
  sc = jnp.einsum("bqkgh,bskh->bkgqs", q_blk, k_blk, preferred_element_type=jnp.float32)
  mask = mask[:, None, None]
  return jnp.where(mask, sc * scale, _MASK_VALUE), mask


def _flash_backward(q, k, v, q_offset, kv_valid, segs, scale, bq, bk, out, lse, d_out):
  b, t, kh, g, h = q.shape
  s = k.shape[1]
  n_q = -(-t // bq)
  axes = _varying(q, k, v, q_offset, kv_valid, segs, d_out)
  # D_i = rowsum(dO_i * O_i) [B, K, G, T]: the softmax backward's per-row correction.
  delta = jnp.einsum("btkgh,btkgh->bkgt", d_out.astype(jnp.float32), out.astype(jnp.float32))

  def key_block(j, carry):
    dq, dk, dv = carry
    ks, k_blk, v_blk, valid, kv_seg, k_slot = _key_block(j, k, v, kv_valid, segs, bk)

    def query_block(i, acc):
      dq, dk_j, dv_j = acc
      qs = _start(i, bq, t)
      q_blk, do_blk = _slice(q, qs, bq), _slice(d_out, qs, bq)
      q_slot = q_offset + qs + jnp.arange(bq)
      q_segs = _query_segs(segs, qs, bq)
      sc, mask = _stale_masked(q_blk, q_slot, q_segs, k_blk, valid, kv_seg, k_slot, j * bk, scale)
      # Rows an earlier query block already covered add to dq, dk and dv once only.
      mask = mask & (qs + jnp.arange(bq) >= i * bq)[:, None]
      p = jnp.where(mask, jnp.exp(sc - _slice(lse, qs, bq, axis=3)[..., None]), 0.0)
      dp = jnp.einsum("bqkgh,bskh->bkgqs", do_blk, v_blk, preferred_element_type=jnp.float32)
      ds = p * (dp - _slice(delta, qs, bq, axis=3)[..., None]) * scale
      f32 = dict(preferred_element_type=jnp.float32)
      dv_j = dv_j + jnp.einsum("bkgqs,bqkgh->bskh", p.astype(d_out.dtype), do_blk, **f32)
      dk_j = dk_j + jnp.einsum("bkgqs,bqkgh->bskh", ds.astype(q.dtype), q_blk, **f32)
      dq_blk = jnp.einsum("bkgqs,bskh->bqkgh", ds.astype(k.dtype), k_blk, **f32)
      dq = jax.lax.dynamic_update_slice_in_dim(dq, _slice(dq, qs, bq) + dq_blk, qs, axis=1)
      return dq, dk_j, dv_j

    # Query blocks wholly before this key block's first slot cannot see it.
    first = jnp.clip((ks - q_offset) // bq, 0, n_q)
    zeros = _vary(jnp.zeros((b, bk, kh, h), jnp.float32), axes)
    dq, dk_j, dv_j = jax.lax.fori_loop(first, n_q, query_block, (dq, zeros, zeros))
    dk = jax.lax.dynamic_update_slice_in_dim(dk, _slice(dk, ks, bk) + dk_j, ks, axis=1)
    dv = jax.lax.dynamic_update_slice_in_dim(dv, _slice(dv, ks, bk) + dv_j, ks, axis=1)
    return dq, dk, dv

  init = _vary(
    (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
     jnp.zeros(v.shape, jnp.float32)),
    axes,
  )  # fmt: skip
  n_k = _n_key_blocks(q_offset + t - 1, bk, s)
  dq, dk, dv = jax.lax.fori_loop(0, n_k, key_block, init)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _flash(q, k, v, q_offset, kv_valid, segs, scale, bq, bk):
  return _flash_forward(q, k, v, q_offset, kv_valid, segs, scale, bq, bk)[0]


def _flash_fwd(q, k, v, q_offset, kv_valid, segs, scale, bq, bk):
  out, lse = _flash_forward(q, k, v, q_offset, kv_valid, segs, scale, bq, bk)
  # Saved for the backward: inputs, output and log-sum-exp, all O(T) or O(S); no scores.
  return out, (q, k, v, q_offset, kv_valid, segs, out, lse)


def _flash_bwd(scale, bq, bk, res, d_out):
  q, k, v, q_offset, kv_valid, segs, out, lse = res
  dq, dk, dv = _flash_backward(q, k, v, q_offset, kv_valid, segs, scale, bq, bk, out, lse, d_out)
  # Segment and prefix ids are integers: no cotangent (None for each, matching their structure).
  no_segs = jax.tree.map(lambda _: None, segs)
  return dq, dk, dv, None, None, no_segs


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---- accelerator kernels (written from the JAX documentation; no GPU/TPU to run them here) -------


def _cudnn(q, k, v, kv_valid, segs, scale):
  """cuDNN flash attention on a full sequence (T == S, no cache offset).

  ``is_causal`` holds with a tree mask too: every mask here (validity, segments, prefixes) only
  removes keys from the causal mask, so cuDNN may skip the blocks above the diagonal.
  """
  t = q.shape[1]
  mask = dense_mask(t, kv_valid, 0, *(segs or ()))[:, None]  # [B, 1, T, S], shared by heads
  return jax.nn.dot_product_attention(
    q, k, v, mask=mask, scale=scale, is_causal=True, implementation="cudnn"
  )


def _splash(q, k, v, kv_valid, q_seg, kv_seg, scale, *, q_prefix=None, interpret=False):
  """The Pallas splash kernel on a full sequence: causal, key validity as segment 0.

  The kernel takes one sequence, queries [heads, T, H]; GQA runs its MQA form per kv-head (the G
  query heads of a group share one key/value head [S, H]), over batch and kv-heads by
  `jax.vmap`. Lengths are padded to a multiple of 128 (the kernel's smallest block) with
  segment-0 padding. A tree mask (``q_prefix``) runs `_splash_tree`. ``interpret`` runs the
  kernel in the Pallas interpreter (any backend: tests).
  """
  splash, _ = _splash_modules()
  b, t, n, h = q.shape
  kh = k.shape[2]
  g = n // kh
  pad = -t % 128
  length = t + pad
  if q_seg is None:
    q_seg, kv_seg = jnp.ones((b, t), jnp.int32), jnp.ones((b, t), jnp.int32)
  # A padding key is in segment 0 and no real query is: real queries never see it, and a padding
  # query (segment 0 too) sees only padding keys, which keeps its discarded output finite.
  q_ids = jnp.where(kv_valid, q_seg, 0).astype(jnp.int32)
  kv_ids = jnp.where(kv_valid, kv_seg, 0).astype(jnp.int32)
  widths = ((0, 0), (0, pad))
  q_ids, kv_ids = jnp.pad(q_ids, widths), jnp.pad(kv_ids, widths)
  qp = jnp.pad(q * jnp.asarray(scale, q.dtype), ((0, 0), (0, pad), (0, 0), (0, 0)))
  kp, vp = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (k, v))
  # [B, K, G, T, H] queries against [B, K, S, H] keys.
  qp = jnp.transpose(qp.reshape(b, length, kh, g, h), (0, 2, 3, 1, 4))
  kp, vp = jnp.transpose(kp, (0, 2, 1, 3)), jnp.transpose(vp, (0, 2, 1, 3))

  if q_prefix is None:
    kernel = _splash_kernel(length, g, interpret=interpret)

    def one(q_ghd, k_sd, v_sd, qi, ki):
      return kernel(q_ghd, k_sd, v_sd, segment_ids=splash.SegmentIds(q=qi, kv=ki))

    ids = (q_ids, kv_ids)
  else:
    # The prefix part's query ids: a response query's prompt segment; -1 (no key's id, not even
    # padding's 0) for every other query, which then sees nothing there.
    p_ids = jnp.where(kv_valid & (q_prefix > 0), q_prefix, -1).astype(jnp.int32)
    p_ids = jnp.pad(p_ids, widths, constant_values=-1)

    def one(q_ghd, k_sd, v_sd, qi, ki, pi):
      own, prefix = splash.SegmentIds(q=qi, kv=ki), splash.SegmentIds(q=pi, kv=ki)
      return _splash_tree(q_ghd, k_sd, v_sd, own, prefix, interpret)

    ids = (q_ids, kv_ids, p_ids)
  per_head = jax.vmap(one, in_axes=(0, 0, 0) + (None,) * len(ids))  # kv-heads
  out = jax.vmap(per_head)(qp, kp, vp, *ids)  # [B, K, G, T', H]
  out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, length, n, h)
  return out[:, :t].astype(q.dtype)


def _splash_modules():
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # noqa: PLC0415
    splash_attention_kernel as splash,
  )
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # noqa: PLC0415
    splash_attention_mask as mask_lib,
  )

  return splash, mask_lib


def _splash_kernel(length: int, g: int, *, interpret: bool, save_residuals: bool = False):
  """The causal MQA splash kernel for G query heads over ``length`` (a multiple of 128) slots."""
  splash, mask_lib = _splash_modules()
  block = next(b for b in (512, 256, 128) if length % b == 0)
  sizes = splash.BlockSizes(
    block_q=block, block_kv=block, block_kv_compute=block,
    block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
    block_q_dq=block, block_kv_dq=block,
  )  # fmt: skip
  mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((length, length)) for _ in range(g)])
  return splash.make_splash_mqa(
    mask=mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, save_residuals=save_residuals,
    interpret=interpret,
  )  # fmt: skip


# ---- splash with a tree mask: two kernel calls merged by log-sum-exp ----------------------------
# Query i's visible keys split into two disjoint sets, its own segment A and (for a response) its
# prompt's segment B: the kernel with segment ids (q: seg, kv: seg) covers A, and with (q: prefix,
# kv: seg) covers B; causality is the same mask for both. With l_A, l_B each part's log-sum-exp of
# scores and o_A, o_B its softmax output, the union has
#   l = logaddexp(l_A, l_B),  o = exp(l_A - l) o_A + exp(l_B - l) o_B.
# The union's backward is flash attention's: P = exp(S - l) on the union's mask, D = rowsum(dO o),
# dS = P (dO V^T - D). Restricted to part X, P is exp(S - l) on X's mask, so dq, dk, dv of the
# union are the sums of each part's kernel backward run with the union's o and l instead of its
# own (the identity ring attention uses). The kernel's public call is not differentiable when it
# returns its log-sum-exp, so `_splash_tree` is a `jax.custom_vjp` calling the kernel's backward
# (private: `jax_compat.splash_backward`). A part a query sees nothing of has l = mask value
# (about -2.4e38, finite) and weight exp(l_X - l) = 0; every query sees itself in part A, so l is
# finite.


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _splash_tree(q, k, v, own, prefix, interpret):
  return _splash_tree_forward(q, k, v, own, prefix, interpret)[0]


def _splash_tree_forward(q, k, v, own, prefix, interpret):
  """One sequence: queries [G, L, H] (scaled), keys and values [L, H]; output and lse [G, L]."""
  kernel = _splash_kernel(q.shape[1], q.shape[0], interpret=interpret, save_residuals=True)
  o_own, (l_own,) = kernel(q, k, v, segment_ids=own)
  o_pre, (l_pre,) = kernel(q, k, v, segment_ids=prefix)
  lse = jnp.logaddexp(l_own, l_pre)
  w_own, w_pre = jnp.exp(l_own - lse)[..., None], jnp.exp(l_pre - lse)[..., None]
  out = w_own * o_own.astype(jnp.float32) + w_pre * o_pre.astype(jnp.float32)
  return out.astype(q.dtype), lse


def _splash_tree_fwd(q, k, v, own, prefix, interpret):
  out, lse = _splash_tree_forward(q, k, v, own, prefix, interpret)
  return out, (q, k, v, own, prefix, out, lse)


def _splash_tree_bwd(interpret, res, d_out):
  q, k, v, own, prefix, out, lse = res
  kernel = _splash_kernel(q.shape[1], q.shape[0], interpret=interpret)
  (dq_a, dk_a, dv_a), (dq_b, dk_b, dv_b) = (
    jax_compat.splash_backward(kernel, q, k, v, ids, out, lse, d_out) for ids in (own, prefix)
  )
  f32 = jnp.float32
  dq = (dq_a.astype(f32) + dq_b.astype(f32)).astype(q.dtype)
  dk = (dk_a.astype(f32) + dk_b.astype(f32)).astype(k.dtype)
  dv = (dv_a.astype(f32) + dv_b.astype(f32)).astype(v.dtype)
  return dq, dk, dv, None, None


_splash_tree.defvjp(_splash_tree_fwd, _splash_tree_bwd)
