"""A complete group from its scored samples: the metadata admission sees and the payload the
storage unit keeps, built in one place for the batched and the continuous rollouts."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from knitjax.tasks.prompts import Prompt
from knitjax.tasks.tokenizer import CharTokenizer
from knitjax.transfer.group import GroupMeta
from knitjax.transfer.payload import GroupPayload
from knitjax.transfer.storage import image_hash


@dataclasses.dataclass(frozen=True)
class Group:
  """A complete group: metadata for admission, payload for the storage unit."""

  meta: GroupMeta
  payload: GroupPayload
  images: tuple[np.ndarray, ...] = ()  # image prompts: the group's images (payload image_index)


def assemble_group(
  prompt: Prompt,
  tokens_gn: np.ndarray,
  lengths_g: np.ndarray,
  logprobs_gn: np.ndarray,
  *,
  group_id: int,
  version: int,
  reward_fn: Callable[[Prompt, np.ndarray, CharTokenizer], float],
  tokenizer: CharTokenizer,
  storage_unit: int = 0,
  completion_time: float = 0.0,
  version_newest: int | None = None,
) -> Group:
  """Scores the G responses of one prompt and returns the complete group.

  Args:
    prompt: the group's prompt.
    tokens_gn: [G, N] generated tokens; positions at or beyond a sample's length become padding.
    lengths_g: [G] response lengths (tokens kept per sample).
    logprobs_gn: [G, N] behaviour log-probs of the tokens.
    group_id: the group's id (its storage key).
    version: gen version (the oldest policy version the group used).
    reward_fn: the verifier.
    tokenizer: the task's tokenizer.
    storage_unit: the storage unit that will hold the payload.
    completion_time: when the last sample finished.
    version_newest: newest policy version used (partial rollout); None: same as ``version``.
  """
  g, n = tokens_gn.shape
  lengths = np.asarray(lengths_g, np.int32)
  keep = np.arange(n)[None, :] < lengths[:, None]
  resp = np.where(keep, tokens_gn, tokenizer.pad_id).astype(np.int32)
  logprobs = np.where(keep, logprobs_gn, 0.0).astype(np.float32)
  rewards = np.array(
    [reward_fn(prompt, resp[k, : lengths[k]], tokenizer) for k in range(g)], np.float32
  )
  meta = GroupMeta(
    group_id=group_id,
    cls=prompt.cls,
    gen_version=version,
    num_samples=g,
    prompt_tokens=(len(prompt.tokens),) * g,
    response_tokens=tuple(int(x) for x in lengths),
    reward_mean=float(rewards.mean()),
    reward_std=float(rewards.std()),
    storage_unit=storage_unit,
    completion_time=completion_time,
    gen_version_newest=None if version_newest in (None, version) else version_newest,
  )
  image_index = None
  if prompt.image is not None:
    image_index = np.zeros(g, np.int32)
    meta = dataclasses.replace(meta, image_hashes=(image_hash(prompt.image),))
  payload = GroupPayload(  # validated where it enters storage
    prompt_tokens=np.tile(prompt.tokens.astype(np.int32), (g, 1)),
    prompt_lengths=np.full(g, len(prompt.tokens), np.int32),
    response_tokens=resp,
    response_mask=keep,
    response_lengths=lengths,
    logprobs=logprobs,
    rewards=rewards,
    image_index=image_index,
  )
  images = () if prompt.image is None else (prompt.image,)
  return Group(meta=meta, payload=payload, images=images)
