"""Rollout worker: prompts -> G samples each -> rewards -> complete groups.

The worker turns a batch of prompts into complete groups: a :class:`GroupMeta`
(what the admission index sees) and a payload (what the storage unit keeps).
It is the same in colocated and disaggregated execution.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from knitjax.rollout.sampler import Sampler
from knitjax.tasks.prompts import Prompt
from knitjax.tasks.tokenizer import CharTokenizer
from knitjax.train.batch import left_pad
from knitjax.transfer.group import GroupMeta


@dataclasses.dataclass(frozen=True)
class Group:
  """A complete group: metadata for admission, payload for the storage unit."""

  meta: GroupMeta
  payload: dict[str, np.ndarray]


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
  ):
    self._sampler = sampler
    self._tokenizer = tokenizer
    self._reward_fn = reward_fn
    self._group_size = group_size
    self._prompt_len = prompt_len
    self._storage_unit = storage_unit

  def generate(
    self,
    params: nnx.State,
    prompts: Sequence[Prompt],
    *,
    version: int,
    rng: jax.Array,
    first_group_id: int,
  ) -> list[Group]:
    """Samples one group per prompt at policy ``version``; ids count up from ``first_group_id``."""
    g = self._group_size
    rows = [p.tokens for p in prompts for _ in range(g)]
    tokens_bp, lens_b = left_pad(rows, self._prompt_len, self._tokenizer.pad_id)
    samples = self._sampler(params, tokens_bp, lens_b, rng)
    done = time.time()
    groups = []
    for i, prompt in enumerate(prompts):
      sl = slice(i * g, (i + 1) * g)
      resp = samples.tokens[sl]
      lengths = samples.lengths[sl]
      rewards = np.array(
        [self._reward_fn(prompt, resp[k, : lengths[k]], self._tokenizer) for k in range(g)],
        np.float32,
      )
      meta = GroupMeta(
        group_id=first_group_id + i,
        cls=prompt.cls,
        gen_version=version,
        num_samples=g,
        prompt_tokens=(len(prompt.tokens),) * g,
        response_tokens=tuple(int(n) for n in lengths),
        reward_mean=float(rewards.mean()),
        reward_std=float(rewards.std()),
        storage_unit=self._storage_unit,
        completion_time=done,
      )
      payload = {
        "prompt_tokens": np.stack([prompt.tokens] * g).astype(np.int32),
        "response_tokens": resp.astype(np.int32),
        "response_lengths": lengths.astype(np.int32),
        "logprobs": samples.logprobs[sl].astype(np.float32),
        "rewards": rewards,
      }
      groups.append(Group(meta=meta, payload=payload))
    return groups
