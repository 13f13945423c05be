"""The jitted train step: one optimizer update per mini-batch.

A mini-batch arrives as ``[K, rows / K, T]`` arrays (K micro-batches). The
step scans over the micro-batches, accumulating gradients. Every micro-batch
is normalised by the *mini-batch's* token and sequence counts
(:class:`~knitjax.train.losses.Normalizer`), so the summed loss and gradient are
exactly those of the whole mini-batch however it is split.

Before the scan, outside the gradient, the step runs the forward passes that
need the whole mini-batch: the reference policy's log-probs (a KL term), and,
for PPO with a critic (GAE) or the KL as a reward, the current params' values
and log-probs, from which :mod:`knitjax.train.step_advantages` recomputes the
advantages. With a critic each micro-batch adds ``value_coef`` times the
clipped value loss (:mod:`knitjax.train.value_loss`), aggregated like the
policy loss.

Packed rows (`knitjax.train.packing`): the batch then has ``[K, S / K, pack_len]`` sequences
with a ``segment_ids`` field (several rows per sequence) and per-token advantages; the model
masks attention by segment and the losses reduce per segment, so loss and gradient are those of
the padded rows. In-step advantages (GAE, the KL as a reward) work per segment too: GAE restarts
at each segment's end and the group estimators run over the segments
(:mod:`knitjax.train.step_advantages`).

Shared prompts (`knitjax.train.prompt_sharing`): sequences laid out like packed ones (a segment
per response, per-token row fields) whose responses also see their group's prompt (``prefix_ids``,
the tree mask) and whose targets are scored from the hidden states at ``score_index``
(:func:`scored_states`), in every forward: the policy's, the reference's and the in-step ones.

Prompts once per mini-batch (`knitjax.train.prefix`): the batch also holds the mini-batch's
prompts, ``[U, P - 1]`` and not split; the step computes their keys and values once (a ``vjp``),
hands each micro-batch's rows theirs (``prefix_index``), accumulates the prompts' cotangent over
the micro-batches and sends it back once; the reference and in-step forwards read the prompts'
keys and values under their own params.

The VLM step (`knitjax.train.mm_step`) is this step's core with images: the same forward
(:func:`forward`), loss (:func:`model_loss`), micro-batch scan (`knitjax.train.accumulation`) and
update (:func:`apply_gradients`); a step only chooses what its mini-batch computes once.

With LoRA (`knitjax.models.lora`) the state's params are the adapters only: the step
differentiates and updates them, while the frozen base comes in as a separate, non-donated
argument, and the reference policy is that base with the adapters off (no second copy).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding

from knitjax import sharding
from knitjax.models import lora
from knitjax.models.attention import SequenceMask
from knitjax.train import accumulation, losses, prefix, step_advantages, value_loss
from knitjax.train import kl as kl_lib
from knitjax.train import logprobs as logprobs_lib
from knitjax.train.step_advantages import AdvantageConfig

MICRO_BATCH_FIELDS = (
  "tokens",
  "positions",
  "valid",
  "targets",
  "loss_mask",
  "behavior_logp",
  "advantages",
  "rewards",  # [rows] sequence rewards: advantages recomputed in the step (GAE, KL as reward)
  "group_id",  # [rows] the row's group (GroupMeta.group_id): in-step group estimators
)
# With packing (knitjax.train.packing) every field is [sequences, pack_len], plus:
PACKED_FIELDS = (*MICRO_BATCH_FIELDS, "segment_ids")
# With shared prompts (knitjax.train.prompt_sharing) also the tree mask's prefix segment of each
# query and the column whose hidden state scores each target:
SHARED_FIELDS = (*PACKED_FIELDS, "prefix_ids", "score_index")
# With prompts once per mini-batch (knitjax.train.prefix) the rows are [rows, N], each naming
# its prompt; the prompts [U, P - 1] are not split into micro-batches.
PREFIX_ROW_FIELDS = (*MICRO_BATCH_FIELDS, prefix.INDEX_FIELD)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
  """Trainer state on device: parameters and optimizer state (with LoRA: the adapters')."""

  params: nnx.State
  opt_state: optax.OptState


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepHParams:
  """Static hyperparameters the step is compiled for."""

  loss: losses.LossConfig
  advantage: AdvantageConfig = AdvantageConfig()
  temperature: float = 1.0
  max_new_tokens: int = 1  # Dr. GRPO's constant normaliser
  # Positions per chunk of the log-prob / entropy computation (knitjax.train.logprobs): the
  # [B, T, V] logits never exist at once; 0: the plain path (whole logits).
  logprob_chunk: int = logprobs_lib.DEFAULT_CHUNK
  # Shared prompts in fixed spans (knitjax.train.prompt_sharing, not packed): (P, N), the prompt
  # width and the response span width, so attention runs span by span
  # (knitjax.models.attention.attend_spans); None: by the batch's segment and prefix ids.
  shared_spans: tuple[int, int] | None = None

  @property
  def entropy_mode(self) -> str:
    """The train forward's entropy: differentiated when it is a loss term, else a metric only."""
    return "loss" if self.loss.entropy_coef > 0 else "metric"

  @property
  def advantages_in_step(self) -> bool:
    """Whether the step recomputes the advantages (a critic, or the KL as a reward)."""
    return self.advantage.critic or self.loss.kl_penalty == "reward"


def sequence_logprobs(
  graphdef: nnx.GraphDef,
  params: nnx.State,
  mb: dict[str, jax.Array],
  temperature: float,
  *,
  chunk: int = logprobs_lib.DEFAULT_CHUNK,
  spans: tuple[int, int] | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Per-token log-probs and entropies (no gradient) of the targets, at the sampling
  temperature (``spans``: see :func:`forward`)."""
  logp, entropy, _ = forward(
    nnx.merge(graphdef, params), mb, temperature=temperature, chunk=chunk, spans=spans
  )
  return logp, entropy


def forward(
  model: nnx.Module,
  mb: dict[str, jax.Array],
  *,
  temperature: float,
  chunk: int = logprobs_lib.DEFAULT_CHUNK,
  spans: tuple[int, int] | None = None,
  values: bool = False,
  entropy: str = "metric",
  images: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
  """Log-probs and entropies of a micro-batch's targets under ``model`` (at the sampling
  temperature), and with ``values`` the critic's values ``[B, T]`` from the same forward pass
  (else None): the forward of every train step, text and VLM.

  ``chunk`` positions at a time (:mod:`knitjax.train.logprobs`; 0: whole logits); ``spans``: the
  batch holds fixed-span shared-prompt rows of this ``(P, N)`` (``StepHParams.shared_spans``);
  ``entropy``: ``"none"`` (None is returned), ``"metric"`` (no gradient) or ``"loss"``;
  ``images``: a VLM's image rows ``[B, P, D]`` for its rows' image tokens.
  """
  inputs = (mb["tokens"], mb["positions"], mb["valid"])
  kwargs = {"mask": sequence_mask(mb, spans)}
  if images is not None:
    kwargs["image_rows_bpd"] = images
  if values:
    hidden, values_bt = model.hidden_states_and_values(*inputs, **kwargs)
  else:
    hidden, values_bt = model.hidden_states(*inputs, **kwargs), None
  hidden, values_bt = scored_states(hidden, values_bt, mb.get("score_index"))
  table, table_axes = model.unembedding()
  if spans is not None and chunk:
    # A row holds G responses: G times the positions per chunk keep the padded rows' logits
    # memory per chunk (rows x chunk x V) with G times fewer table-sized gradient updates.
    chunk *= max(1, (mb["tokens"].shape[-1] - spans[0]) // spans[1])
  logp, ent = logprobs_lib.token_logprobs_and_entropy(
    hidden, table, mb["targets"], table_axes=table_axes, temperature=temperature, chunk=chunk,
    entropy=entropy,
  )  # fmt: skip
  return logp, ent, values_bt


def step_forward(model, mb, hparams: StepHParams, **kwargs):
  """:func:`forward` at the step's temperature, log-prob chunk and spans."""
  return forward(
    model, mb, temperature=hparams.temperature, chunk=hparams.logprob_chunk,
    spans=hparams.shared_spans, **kwargs,
  )  # fmt: skip


def sequence_mask(mb: dict[str, jax.Array], spans: tuple[int, int] | None) -> SequenceMask:
  """The model's view of a micro-batch's training layout (`knitjax.train.layouts`): packed and
  shared sequences' ``segment_ids`` and ``prefix_ids``, fixed ``spans`` ``(P, N)``
  (``StepHParams.shared_spans``), and rows' prompt keys and values (``past_k``, ``past_v``,
  ``past_valid``: `knitjax.train.prefix.attach`); none of them for padded rows."""
  return SequenceMask(
    mb.get("segment_ids"), mb.get("prefix_ids"), spans,
    mb.get("past_k"), mb.get("past_v"), mb.get("past_valid"),
  )  # fmt: skip


def scored_states(
  hidden_btd: jax.Array, values_bt: jax.Array | None, score_index_bt: jax.Array | None
) -> tuple[jax.Array, jax.Array | None]:
  """The hidden states (and values) that score each column's target: those at ``score_index``
  (shared prompts, `knitjax.train.prompt_sharing`: a gather, whose transpose sums the G
  responses' gradients into the prompt's last position), else unchanged."""
  if score_index_bt is None:
    return hidden_btd, values_bt
  index = score_index_bt.astype(jnp.int32)
  hidden_btd = jnp.take_along_axis(hidden_btd, index[..., None], axis=1)
  if values_bt is not None:
    values_bt = jnp.take_along_axis(values_bt, index, axis=1)
  return hidden_btd, values_bt


def micro_batch_loss(
  params: nnx.State,
  mb: dict[str, jax.Array],
  norm: losses.Normalizer,
  *,
  graphdef: nnx.GraphDef,
  hparams: StepHParams,
  frozen: nnx.State | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """One micro-batch's contribution to the mini-batch loss, and its metric sums.

  ``frozen``: the LoRA base; ``params`` are then the adapters (the only differentiated input).
  """
  policy = params if frozen is None else lora.combine(frozen, params)
  return model_loss(nnx.merge(graphdef, policy), mb, norm, hparams)


def model_loss(
  model: nnx.Module,
  mb: dict[str, jax.Array],
  norm: losses.Normalizer,
  hparams: StepHParams,
  *,
  images: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """A micro-batch's loss under ``model`` and its metric sums: the policy loss (against
  ``mb["ref_logp"]`` when it holds the reference's log-probs) and, with a critic, the clipped
  value loss; every train step's loss, text and VLM (``images``: see :func:`forward`)."""
  critic = hparams.advantage.critic
  logp, entropy, values = step_forward(
    model, mb, hparams, values=critic, entropy=hparams.entropy_mode, images=images
  )
  loss, sums = losses.policy_loss(
    logp,
    mb["behavior_logp"],
    mb["advantages"],
    mb["loss_mask"],
    config=hparams.loss,
    norm=norm,
    ref_logp_bt=mb.get("ref_logp"),
    entropy_bt=entropy,
    segment_ids_bt=mb.get("segment_ids"),
  )
  if critic:
    a = hparams.advantage
    v_loss, v_clipped = value_loss.value_loss(
      values, mb["old_values"], mb["returns"], clip=a.value_clip
    )
    m = mb["loss_mask"].astype(jnp.float32)
    agg = losses.aggregate(
      v_loss,
      m,
      aggregation=hparams.loss.aggregation,
      norm=norm,
      segment_ids_bt=mb.get("segment_ids"),
    )
    loss = loss + a.value_coef * agg
    sums = {
      **sums,
      "value_loss_sum": jax.lax.stop_gradient(jnp.sum(v_loss * m)),
      "value_clip_sum": jnp.sum(v_clipped * m),
    }
  return loss, sums


def normalizer(batch: dict[str, jax.Array], hparams: StepHParams) -> losses.Normalizer:
  """The mini-batch's token and sequence counts that every micro-batch's loss divides by."""
  return losses.Normalizer.from_mask(
    batch["loss_mask"],
    max_len=float(hparams.max_new_tokens),
    segment_ids_bt=batch.get("segment_ids"),
  )


def apply_gradients(
  state: TrainState,
  optimizer: optax.GradientTransformation,
  loss: jax.Array,
  grads: nnx.State,
  sums: dict[str, jax.Array],
) -> tuple[TrainState, dict[str, jax.Array]]:
  """The optimizer update of a mini-batch's summed gradient, and the step's metrics (every
  train step's tail, text and VLM).

  Metric sums are finalised on the host (:func:`host_metrics`) after ``device_get``.
  ``param_norm``: the updated params' L2 norm; each process reads it from its own replica, so
  multi-host runs can check that the hosts' copies agree.
  """
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {
    "loss": loss,
    "grad_norm": optax.tree.norm(grads),
    "param_norm": optax.tree.norm(params),
    **sums,
  }
  return TrainState(params=params, opt_state=opt_state), metrics


def recompute_advantages(
  batch: dict[str, jax.Array],
  params: nnx.State,
  *,
  graphdef: nnx.GraphDef,
  hparams: StepHParams,
  prompts: dict[str, jax.Array] | None = None,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
  """The batch with its advantages recomputed over the whole mini-batch, and their metrics.

  The current params' log-probs and values of every micro-batch (``jax.lax.map``, outside the
  gradient) give the KL penalty (against ``batch["ref_logp"]``) and the critic's old values.
  ``prompts``: the rows continue these (`knitjax.train.prefix`).
  """
  loss = hparams.loss
  reward_kl = loss.kl_penalty == "reward" and loss.kl_coef > 0
  if reward_kl and "ref_logp" not in batch:
    raise ValueError("kl_penalty='reward' needs the reference policy's params (ref_params).")
  critic = hparams.advantage.critic
  attach = _prompts_of(graphdef, params, prompts)
  model = nnx.merge(graphdef, params)
  logp, _, values = jax.lax.map(
    lambda mb: step_forward(model, attach(mb), hparams, values=critic, entropy="none"), batch
  )
  logp, values = jax.lax.stop_gradient((logp, values))
  kl = None
  if reward_kl:
    kl = kl_lib.kl_estimate(
      logp, batch["ref_logp"], estimator=loss.kl_estimator, clamp=loss.kl_clamp
    )
  new, metrics = step_advantages.compute(
    batch, config=hparams.advantage, old_values=values, kl=kl, kl_coef=loss.kl_coef
  )
  return {**batch, **new}, metrics


def _prompts_of(graphdef, params, prompts):
  """``mb -> mb`` with its rows' prompt keys and values under ``params`` (no gradient;
  `knitjax.train.prefix`), or unchanged without prompts."""
  if prompts is None:
    return lambda mb: mb
  kv_u = jax.lax.stop_gradient(prefix.prompt_kv(graphdef, params, prompts))
  return lambda mb: prefix.attach(mb, kv_u, prompts)


def train_step(
  state: TrainState,
  batch: dict[str, jax.Array],
  *,
  graphdef: nnx.GraphDef,
  optimizer: optax.GradientTransformation,
  hparams: StepHParams,
  ref_params: nnx.State | None = None,
  frozen: nnx.State | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
  """Applies one optimizer update from a mini-batch of K micro-batches.

  Args:
    state: parameters and optimizer state.
    batch: ``[K, rows / K, ...]`` arrays (see :mod:`knitjax.train.batch`).
    graphdef: the model's graph definition.
    optimizer: the optax transformation.
    hparams: loss and advantage settings, sampling temperature, response budget.
    ref_params: frozen reference policy, used when ``hparams.loss.kl_coef > 0``.
    frozen: with LoRA, the frozen base (``state.params`` are the adapters); the reference
      policy is then the base with the adapters off, and ``ref_params`` is not used.

  Returns:
    The new state and a dict of scalar metrics.
  """
  batch, prompts = prefix.split(batch)  # prompts once per mini-batch: knitjax.train.prefix
  norm = normalizer(batch, hparams)
  if frozen is not None:
    ref_params = lora.combine(frozen, lora.disabled(state.params))
  if ref_params is not None and hparams.loss.kl_coef > 0:
    # Reference log-probs of every micro-batch, before (and outside) the gradient scan.
    attach = _prompts_of(graphdef, ref_params, prompts)
    ref_model = nnx.merge(graphdef, ref_params)
    ref_logp = jax.lax.map(
      lambda mb: step_forward(ref_model, attach(mb), hparams, entropy="none")[0], batch
    )
    batch = {**batch, "ref_logp": jax.lax.stop_gradient(ref_logp)}
  adv_metrics = {}
  if hparams.advantages_in_step:
    policy = state.params if frozen is None else lora.combine(frozen, state.params)
    batch, adv_metrics = recompute_advantages(
      batch, policy, graphdef=graphdef, hparams=hparams, prompts=prompts
    )
  loss_fn = functools.partial(micro_batch_loss, graphdef=graphdef, hparams=hparams, frozen=frozen)
  if prompts is None:
    loss, sums, grads, _ = accumulation.value_and_grad(
      lambda p, _, mb: loss_fn(p, mb, norm), state.params, (), batch
    )
  else:  # each prompt once, its rows in any micro-batches
    combine = (lambda p: p) if frozen is None else functools.partial(lora.combine, frozen)
    loss, sums, grads = prefix.value_and_grad(
      lambda p: prefix.prompt_kv(graphdef, combine(p), prompts),
      lambda p, kv_u, mb: loss_fn(p, prefix.attach(mb, kv_u, prompts), norm),
      state.params,
      batch,
    )
  return apply_gradients(state, optimizer, loss, grads, {**adv_metrics, **sums})


def host_metrics(metrics: dict) -> dict[str, float]:
  """Turns a step's device metrics (scalars and metric sums) into plain floats on the host."""
  metrics = jax.device_get(metrics)
  sums = {k: v for k, v in metrics.items() if k.endswith("_sum")}
  rest = {k: float(v) for k, v in metrics.items() if not k.endswith("_sum")}
  return {**rest, **losses.finalize_metrics(sums)}


def batch_fields(
  *, packed: bool = False, shared: bool = False, prefixed: bool = False
) -> tuple[str, ...]:
  """The row fields of a batch: padded rows, packed sequences, shared-prompt sequences or rows
  that continue their prompts (``prefixed``, `knitjax.train.prefix`)."""
  if prefixed:
    return PREFIX_ROW_FIELDS
  if shared:
    return SHARED_FIELDS
  return PACKED_FIELDS if packed else MICRO_BATCH_FIELDS


def batch_shardings(
  mesh, *, packed: bool = False, shared: bool = False, prefixed: bool = False
) -> dict[str, NamedSharding]:
  """``[K, rows, ...]`` batch arrays: micro-batch axis unsharded, rows on the "batch" rule.

  ``packed``: the fields of packed sequences (``PACKED_FIELDS``); ``shared``: of shared-prompt
  sequences (``SHARED_FIELDS``, `knitjax.train.prompt_sharing`); ``prefixed``: rows that continue
  their prompts (``PREFIX_ROW_FIELDS``), and the ``[U, P - 1]`` prompts split over the batch
  axes (`knitjax.train.prefix`).
  """
  rows = sharding.logical_sharding(mesh, (None, "batch"))
  out = {k: rows for k in batch_fields(packed=packed, shared=shared, prefixed=prefixed)}
  if prefixed:
    out.update({k: sharding.logical_sharding(mesh, ("batch",)) for k in prefix.PROMPT_FIELDS})
  return out


def compile_train_step(
  *,
  graphdef: nnx.GraphDef,
  optimizer: optax.GradientTransformation,
  hparams: StepHParams,
  state_shardings: TrainState,
  mesh,
  with_ref: bool = False,
  frozen_shardings=None,
  packed: bool = False,
  shared: bool = False,
  prefixed: bool = False,
) -> Callable[..., tuple[TrainState, dict[str, jax.Array]]]:
  """``jax.jit`` of :func:`train_step` with explicit shardings and the state donated.

  ``packed``: the batch holds packed sequences (``PACKED_FIELDS``, `knitjax.train.packing`);
  ``shared``: shared-prompt sequences (``SHARED_FIELDS``, `knitjax.train.prompt_sharing`);
  ``prefixed``: rows that continue their prompts, each prompt once (`knitjax.train.prefix`).
  """
  fn = functools.partial(train_step, graphdef=graphdef, optimizer=optimizer, hparams=hparams)
  return jit_step(
    fn,
    state_shardings,
    batch_shardings(mesh, packed=packed, shared=shared, prefixed=prefixed),
    mesh,
    with_ref=with_ref,
    frozen_shardings=frozen_shardings,
  )


def jit_step(
  fn, state_shardings: TrainState, batch_shardings, mesh, *, with_ref: bool, frozen_shardings=None
):
  """Jits ``fn(state, batch, ref_params=None)`` with explicit shardings and the state donated.

  With ``with_ref`` the compiled step takes ``(state, batch, ref_params)``, else ``(state, batch)``.
  With ``frozen_shardings`` (LoRA) it takes ``(state, batch, frozen)``: the frozen base, placed
  with those shardings and not donated (it also gives the reference policy).
  """
  in_shardings = [state_shardings, batch_shardings]
  if frozen_shardings is not None:
    in_shardings.append(frozen_shardings)
    step = lambda state, batch, frozen: fn(state, batch, frozen=frozen)  # noqa: E731
  elif with_ref:
    in_shardings.append(state_shardings.params)
    step = lambda state, batch, ref: fn(state, batch, ref_params=ref)  # noqa: E731
  else:
    step = lambda state, batch: fn(state, batch)  # noqa: E731
  return jax.jit(
    step,
    in_shardings=tuple(in_shardings),
    out_shardings=(state_shardings, sharding.replicated(mesh)),
    donate_argnums=(0,),
  )


def init_train_state(
  params: nnx.State, optimizer: optax.GradientTransformation, mesh
) -> tuple[TrainState, TrainState]:
  """Initialises the optimizer state next to already sharded params.

  Returns:
    ``(state, state_shardings)``.
  """
  param_shardings = sharding.state_shardings(params, mesh)
  opt_shardings = sharding.optimizer_shardings(optimizer, params, mesh)
  opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
  shardings = TrainState(params=param_shardings, opt_state=opt_shardings)
  return TrainState(params=params, opt_state=opt_state), shardings
