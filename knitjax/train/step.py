"""The jitted train step: one optimizer update per mini-batch.

A mini-batch arrives as ``[K, rows / K, T]`` arrays (K micro-batches). The
step scans over the micro-batches, accumulating gradients. Every micro-batch
is normalised by the *mini-batch's* token and sequence counts
(:class:`~knitjax.train.losses.Normalizer`), so the summed loss and gradient are
exactly those of the whole mini-batch however it is split.

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
from knitjax.train import losses

MICRO_BATCH_FIELDS = (
  "tokens",
  "positions",
  "valid",
  "targets",
  "loss_mask",
  "behavior_logp",
  "advantages",
)


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
  temperature: float = 1.0
  max_new_tokens: int = 1  # Dr. GRPO's constant normaliser


def sequence_logprobs(
  graphdef: nnx.GraphDef, params: nnx.State, mb: dict[str, jax.Array], temperature: float
) -> tuple[jax.Array, jax.Array]:
  """Per-token log-probs and entropies of the targets, at the sampling temperature."""
  model = nnx.merge(graphdef, params)
  logits = model(mb["tokens"], mb["positions"], mb["valid"]).astype(jnp.float32)
  logits = logits / temperature
  return losses.token_logprobs(logits, mb["targets"]), losses.token_entropy(logits)


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
  logp, entropy = sequence_logprobs(graphdef, policy, mb, hparams.temperature)
  return losses.policy_loss(
    logp,
    mb["behavior_logp"],
    mb["advantages"],
    mb["loss_mask"],
    config=hparams.loss,
    norm=norm,
    ref_logp_bt=mb.get("ref_logp"),
    entropy_bt=entropy,
  )


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
    hparams: loss settings, sampling temperature, response budget.
    ref_params: frozen reference policy, used when ``hparams.loss.kl_coef > 0``.
    frozen: with LoRA, the frozen base (``state.params`` are the adapters); the reference
      policy is then the base with the adapters off, and ``ref_params`` is not used.

  Returns:
    The new state and a dict of scalar metrics.
  """
  norm = losses.Normalizer.from_mask(batch["loss_mask"], max_len=float(hparams.max_new_tokens))
  grad_fn = jax.value_and_grad(
    functools.partial(micro_batch_loss, graphdef=graphdef, hparams=hparams, frozen=frozen),
    has_aux=True,
  )

  if frozen is not None:
    ref_params = lora.combine(frozen, lora.disabled(state.params))
  if ref_params is not None and hparams.loss.kl_coef > 0:
    # Reference log-probs of every micro-batch, before (and outside) the gradient scan.
    ref_logp = jax.lax.map(
      lambda mb: sequence_logprobs(graphdef, ref_params, mb, hparams.temperature)[0], batch
    )
    batch = {**batch, "ref_logp": jax.lax.stop_gradient(ref_logp)}

  def body(carry, mb):
    grads_acc, loss_acc, sums_acc = carry
    (loss, sums), grads = grad_fn(state.params, mb, norm)
    grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
    sums_acc = jax.tree.map(jnp.add, sums_acc, sums)
    return (grads_acc, loss_acc + loss, sums_acc), None

  zeros = jax.tree.map(jnp.zeros_like, state.params)
  first = jax.tree.map(lambda x: x[0], batch)
  sums_shape = jax.eval_shape(lambda: grad_fn(state.params, first, norm)[0][1])
  sums0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape)
  (grads, loss, sums), _ = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32), sums0), batch)

  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  # Metric sums are finalised on the host (losses.finalize_metrics) after device_get.
  # param_norm: the updated params' L2 norm; each process reads it from its own replica, so
  # multi-host runs can check that the hosts' copies agree.
  metrics = {
    "loss": loss,
    "grad_norm": optax.tree.norm(grads),
    "param_norm": optax.tree.norm(params),
    **sums,
  }
  return TrainState(params=params, opt_state=opt_state), metrics


def host_metrics(metrics: dict) -> dict[str, float]:
  """Turns a step's device metrics (scalars and metric sums) into plain floats on the host."""
  metrics = jax.device_get(metrics)
  sums = {k: v for k, v in metrics.items() if k.endswith("_sum")}
  rest = {k: float(v) for k, v in metrics.items() if not k.endswith("_sum")}
  return {**rest, **losses.finalize_metrics(sums)}


def batch_shardings(mesh) -> dict[str, NamedSharding]:
  """``[K, rows, ...]`` batch arrays: micro-batch axis unsharded, rows on the "batch" rule."""
  rows = sharding.logical_sharding(mesh, (None, "batch"))
  return {k: rows for k in MICRO_BATCH_FIELDS}


def compile_train_step(
  *,
  graphdef: nnx.GraphDef,
  optimizer: optax.GradientTransformation,
  hparams: StepHParams,
  state_shardings: TrainState,
  mesh,
  with_ref: bool = False,
  frozen_shardings=None,
) -> Callable[..., tuple[TrainState, dict[str, jax.Array]]]:
  """``jax.jit`` of :func:`train_step` with explicit shardings and the state donated."""
  fn = functools.partial(train_step, graphdef=graphdef, optimizer=optimizer, hparams=hparams)
  return jit_step(
    fn,
    state_shardings,
    batch_shardings(mesh),
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
