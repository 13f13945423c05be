"""The private JAX that knitjax needs where JAX has no public API: all of it, and only here.

Written against jax 0.10.2. `check` names each private symbol the installed JAX no longer has
(tests/test_jax_compat.py fails with its sentences); nothing else in knitjax/ may use
``jax._src``. Private modules are imported inside the functions that use them, so a JAX
without them still imports knitjax and `check` can say what is missing. What is here, and why
no public API serves:

* The coordination service's key-value store (`key_value_store`):
  `jax.distributed` exposes only ``initialize``, ``is_initialized`` and ``shutdown``; the client
  of the store it opens is ``jax._src.distributed.global_state.client``.
* Whether a backend has started (`backends_started`): every public query (``jax.devices``,
  ``jax.default_backend``, ``jax.extend.backend.backends``) starts one, and configs are read
  before ``jax.distributed.initialize``, which must come first.
* The splash-attention kernel's backward (`splash_backward`): the public kernel is
  differentiable only through its own forward, and the tree mask needs the backward run with
  another output and log-sum-exp.

`knitjax.cli` also names the logger ``"jax._src.xla_bridge"`` to quiet its start-up records:
a logger name, not an import, so a rename only lets those records through.
"""

from __future__ import annotations

import importlib
import inspect
import typing

import jax

WRITTEN_FOR = "0.10.2"
_SPLASH = "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel"
_CLIENT = "_jax.DistributedRuntimeClient"
_MISSING = object()

# (module, attribute path) of every private symbol used below.
PRIVATE = (
  ("jax._src.distributed", "global_state.client"),
  ("jax._src.lib", f"{_CLIENT}.key_value_set"),
  ("jax._src.lib", f"{_CLIENT}.blocking_key_value_get"),
  ("jax._src.lib", f"{_CLIENT}.key_value_try_get"),
  ("jax._src.lib", f"{_CLIENT}.key_value_increment"),
  ("jax._src.lib", f"{_CLIENT}.key_value_delete"),
  ("jax._src.xla_bridge", "backends_are_initialized"),
  (_SPLASH, "_splash_attention_bwd"),
  (_SPLASH, "SplashResidualsType"),
)
# `_splash_attention_bwd`'s parameters and its residual layout, as of jax 0.10.2.
_SPLASH_BWD_PARAMS = (
  "save_residuals", "mask_value", "is_mqa", "block_sizes", "residual_checkpoint_name",
  "mask_function", "attn_logits_soft_cap", "interpret", "res", "do",
)  # fmt: skip
_SPLASH_RESIDUALS = 9  # q, k, v, segment_ids, sinks, out, lse, dq_mask_info, dkv_mask_info


def check() -> list[str]:
  """One sentence for each private symbol (or layout) this module uses that the installed JAX
  no longer has; empty when all are there."""
  problems = []
  for module, path in PRIVATE:
    if _lookup(module, path) is _MISSING:
      problems.append(_sentence(f"no longer has {module}.{path}"))
  bwd = _lookup(_SPLASH, "_splash_attention_bwd")
  if bwd is not _MISSING and tuple(inspect.signature(bwd).parameters) != _SPLASH_BWD_PARAMS:
    problems.append(_sentence(f"changed the parameters of {_SPLASH}._splash_attention_bwd"))
  residuals = _lookup(_SPLASH, "SplashResidualsType")
  if residuals is not _MISSING and len(typing.get_args(residuals)) != _SPLASH_RESIDUALS:
    problems.append(_sentence(f"changed the residual layout of {_SPLASH}._splash_attention_bwd"))
  return problems


def _lookup(module: str, path: str):
  """The object at ``module.path``, or `_MISSING`."""
  try:
    obj = importlib.import_module(module)
  except ImportError:
    return _MISSING
  for name in path.split("."):
    obj = getattr(obj, name, _MISSING)
    if obj is _MISSING:
      break
  return obj


def _sentence(what: str) -> str:
  return (
    f"jax {jax.__version__} {what}; knitjax/jax_compat.py was written against jax "
    f"{WRITTEN_FOR} — update it."
  )


# ---- the coordination service's key-value store ------------------------------------------------
# The errors of the store's client are `jax.errors.JaxRuntimeError`s told apart only by their
# text. jax 0.10.2 raises "DEADLINE_EXCEEDED: GetKeyValue() timed out with key: ..." when a
# blocking get runs out of time and "NOT_FOUND: Config key ... not found." when a try-get finds
# no key; anything else (a lost service: UNAVAILABLE, ABORTED, ...) is raised as it is.


def _timed_out(e: Exception) -> bool:
  return "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower()


def _not_found(e: Exception) -> bool:
  return "NOT_FOUND" in str(e) or "not found" in str(e).lower()


class KeyValueStore:
  """The key-value store of the coordination service that ``jax.distributed`` holds open
  (served by process 0). Values are strings."""

  def __init__(self, client):
    self._client = client

  def set(self, key: str, value: str, *, overwrite: bool = False) -> None:
    """Sets ``key``; without ``overwrite``, a key already set raises."""
    self._client.key_value_set(key, value, allow_overwrite=overwrite)

  def get(self, key: str, timeout_s: float) -> str | None:
    """The value of ``key``, waiting up to ``timeout_s`` for it to be set; None if it was not."""
    try:
      return self._client.blocking_key_value_get(key, max(1, int(timeout_s * 1000)))
    except Exception as e:  # the client has no error type of its own per cause
      if _timed_out(e):
        return None
      raise

  def try_get(self, key: str) -> str | None:
    """The value of ``key`` now, or None if it is not set."""
    try:
      return self._client.key_value_try_get(key)
    except Exception as e:  # as in `get`
      if _not_found(e):
        return None
      raise

  def increment(self, key: str, by: int) -> int:
    """Adds ``by`` to the integer at ``key`` (0 if unset); the new value."""
    return self._client.key_value_increment(key, by)

  def delete(self, key: str) -> None:
    self._client.key_value_delete(key)


def key_value_store() -> KeyValueStore | None:
  """The store of the running ``jax.distributed`` runtime; None if it was not initialized."""
  from jax._src import distributed

  client = distributed.global_state.client
  return None if client is None else KeyValueStore(client)


# ---- backends ----------------------------------------------------------------------------------


def backends_started() -> bool:
  """Whether JAX has started its backends (asking does not start them)."""
  from jax._src import xla_bridge

  return xla_bridge.backends_are_initialized()


# ---- the splash-attention kernel's backward ----------------------------------------------------


def splash_backward(kernel, q, k, v, segment_ids, out, lse, d_out):
  """``(dq, dk, dv)`` of a splash MQA kernel, run with the given output and log-sum-exp.

  Calls ``splash_attention_kernel._splash_attention_bwd`` (private, jax 0.10.2), whose
  residuals are ``(q, k, v, segment_ids, sinks, out, logsumexp, dq_mask_info, dkv_mask_info)``;
  the mask infos come from ``kernel`` (a `make_splash_mqa` kernel built with backward block
  sizes), with their partial mask blocks collapsed to ``[-1, block_q, block_kv]`` as
  ``_splash_attention`` does before its custom_vjp. No sinks.

  Args:
    kernel: the kernel whose forward is being differentiated.
    q: queries ``[G, L, H]``; k, v: keys and values ``[L, H]``.
    segment_ids: the kernel's ``SegmentIds``, or None.
    out: the attention output ``[G, L, H]`` the backward is taken at.
    lse: its log-sum-exp ``[G, L]``.
    d_out: the output's cotangent ``[G, L, H]``.
  """
  splash = importlib.import_module(_SPLASH)

  def collapse(info):
    blocks = info.partial_mask_blocks
    if blocks is None:
      return info
    return info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))

  kw = kernel.kwargs
  residuals = (q, k, v, segment_ids, None, out, lse, collapse(kernel.dq_mask_info),
               collapse(kernel.dkv_mask_info))  # fmt: skip
  cotangents = splash._splash_attention_bwd(
    False, kw["mask_value"], kw["is_mqa"], kw["block_sizes"], None, kw["mask_function"],
    kw["attn_logits_soft_cap"], kw["interpret"], residuals, d_out,
  )  # fmt: skip
  return cotangents[3:6]  # after the three mask infos' (None) cotangents
