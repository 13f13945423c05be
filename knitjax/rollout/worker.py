"""The batched rollout: prompts -> G samples each (one sampler call) -> rewards -> groups.

:class:`RolloutWorker` turns a batch of prompts into complete groups: a :class:`GroupMeta`
(what the admission index sees) and a payload (what the storage unit keeps);
:class:`BatchedRollout` puts it behind the rollout contract (`knitjax.rollout.contract`), used
in colocated and disaggregated execution, in process or inside a Ray actor.
:func:`~knitjax.transfer.assembly.assemble_group` scores one group's samples (the continuous
engine's rollout uses it too).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from knitjax.rollout.contract import RolloutStats
from knitjax.rollout.sampler import Sampler, Samples
from knitjax.tasks.prompts import Prompt
from knitjax.tasks.tokenizer import CharTokenizer
from knitjax.train.batch import left_pad
from knitjax.transfer.assembly import Group, assemble_group
from knitjax.transfer.group import GroupMeta
from knitjax.transfer.storage import StorageUnit, image_hash


class RolloutWorker:
  """Samples G responses per prompt with the given parameters and scores them."""

  def __init__(
    self,
    *,
    sampler: Sampler,
    tokenizer: CharTokenizer,
    reward_fn: Callable[[Prompt, np.ndarray, CharTokenizer], float],
    group_size: int,
    prompt_len: int,
    storage_unit: int = 0,
    class_max_new_tokens: Mapping[str, int] | None = None,
    prompt_embedder: Callable | None = None,
  ):
    self._sampler = sampler
    # VLM: (params, tokens_bp, unique images, row -> image index) -> prompt embeddings.
    self._prompt_embedder = prompt_embedder
    # Per-class token budgets: a sample is cut at its class's budget (as if generation had
    # stopped there), so every runtime trains on the same data whatever its sampler's width.
    self._budgets = dict(class_max_new_tokens or {})
    self._tokenizer = tokenizer
    self._reward_fn = reward_fn
    self.group_size = group_size
    self.max_new_tokens = sampler.sampling.max_new_tokens
    self._prompt_len = prompt_len
    self._storage_unit = storage_unit

  def generate(
    self,
    params: nnx.State,
    prompts: Sequence[Prompt],
    *,
    version: int,
    rng: jax.Array,
    group_ids: Sequence[int],
  ) -> list[Group]:
    """Samples one group per prompt at policy ``version``; ``group_ids``: one id per prompt."""
    g = self.group_size
    samples = self.sample(params, prompts, rng=rng)
    done = time.time()
    groups = []
    for i, prompt in enumerate(prompts):
      sl = slice(i * g, (i + 1) * g)
      budget = self._budgets.get(prompt.cls, samples.tokens.shape[1])
      groups.append(
        assemble_group(
          prompt,
          samples.tokens[sl],
          np.minimum(samples.lengths[sl], budget),
          samples.logprobs[sl],
          group_id=group_ids[i],
          version=version,
          reward_fn=self._reward_fn,
          tokenizer=self._tokenizer,
          storage_unit=self._storage_unit,
          completion_time=done,
        )
      )
    return groups

  def sample(
    self,
    params: nnx.State,
    prompts: Sequence[Prompt],
    *,
    rng: jax.Array,
    group_size: int | None = None,
  ) -> Samples:
    """``group_size`` (default: the worker's G) samples per prompt, prompt-major, unscored."""
    g = self.group_size if group_size is None else group_size
    rows = [p.tokens for p in prompts for _ in range(g)]
    tokens_bp, lens_b = left_pad(rows, self._prompt_len, self._tokenizer.pad_id)
    return self._sampler(
      params, tokens_bp, lens_b, rng, embeddings=self._embeddings(params, prompts, tokens_bp, g)
    )

  def _embeddings(self, params, prompts: Sequence[Prompt], tokens_bp: np.ndarray, g: int):
    """Image prompts: embeddings with each unique image of the batch encoded once; else None."""
    if all(p.image is None for p in prompts):
      return None
    if self._prompt_embedder is None:
      raise ValueError("prompts carry images but the rollout worker has no prompt_embedder (VLM).")
    slots: dict[str, int] = {}
    images, index = [], []
    for p in prompts:
      if p.image is None:
        index.append(-1)
        continue
      h = image_hash(p.image)
      if h not in slots:
        slots[h] = len(images)
        images.append(p.image)
      index.append(slots[h])
    index_b = np.repeat(np.asarray(index, np.int32), g)
    return self._prompt_embedder(params, tokens_bp, np.stack(images), index_b)


class BatchedRollout:
  """The batched sampler behind the rollout contract: each ``step`` generates every started group
  in one call at the newest adopted version, and writes the payloads into ``storage``.

  Args:
    worker: sampler, rewards and group assembly.
    storage: the storage unit the payloads go to.
    max_groups: groups one call generates at most (None: no bound; colocated steps start all).
  """

  def __init__(self, worker: RolloutWorker, storage: StorageUnit, *, max_groups: int | None = None):
    self._worker, self._unit, self._max = worker, storage, max_groups
    self._params, self._version = None, None
    self._queued: list[tuple[Prompt, int]] = []
    self._stats = RolloutStats()

  @property
  def storage(self) -> dict[int, StorageUnit]:
    return {self._unit.unit_id: self._unit}

  @property
  def version(self) -> int | None:
    return self._version

  @property
  def inflight(self) -> int:
    return len(self._queued)

  def adopt(self, params, version: int) -> None:
    self._params, self._version = params, version

  def capacity(self) -> int:
    return (1 << 30 if self._max is None else self._max) - len(self._queued)

  def start(self, prompt: Prompt, group_id: int) -> None:
    if self._version is None:
      raise RuntimeError("the rollout has no policy: call adopt(params, version) first.")
    self._queued.append((prompt, group_id))

  def step(self, rng: jax.Array, *, want_room: bool = False) -> list[GroupMeta]:
    del want_room  # one call generates every started group
    if not self._queued:
      return []
    prompts, ids = zip(*self._queued, strict=True)
    self._stats.live_samples = len(prompts) * self._worker.group_size
    groups = self._worker.generate(
      self._params, prompts, version=self._version, rng=rng, group_ids=ids
    )
    self._queued = []
    metas = []
    for g in groups:
      self._unit.put(g.meta.group_id, g.payload, images=g.images)
      self._stats.tokens += sum(g.meta.response_tokens)
      # the unit written is the one a consumer fetches from (one per Ray actor)
      metas.append(dataclasses.replace(g.meta, storage_unit=self._unit.unit_id))
    self._stats.decode_iterations += self._worker.max_new_tokens
    self._stats.decode_passes += self._worker.max_new_tokens
    self._stats.live_samples = 0
    return metas

  def stats(self) -> RolloutStats:
    return dataclasses.replace(self._stats)

  def close(self) -> None:
    self._unit.close()  # the unit built for this rollout (a Ray actor with storage='ray')
