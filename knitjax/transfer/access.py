"""On-demand access: a consumer fetches a released mini-batch's payloads from storage.

The consumer asks each storage unit for exactly the groups of the mini-batch
that live there, computes the advantages of each (complete) group, and lays
the rows out as trainer arrays (:func:`knitjax.train.batch.make_batch`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import numpy as np

from knitjax.train.advantages import compute_advantages
from knitjax.train.batch import make_batch
from knitjax.transfer.admission import MiniBatch
from knitjax.transfer.storage import StorageUnit

FETCH_FIELDS = (
  "prompt_tokens",
  "prompt_lengths",
  "response_tokens",
  "response_lengths",
  "logprobs",
  "rewards",
)


def fetch_minibatch(
  minibatch: MiniBatch,
  storage: Mapping[int, StorageUnit],
  *,
  estimator: str,
  prompt_len: int,
  max_new_tokens: int,
  pad_id: int,
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
  """Fetches and lays out one mini-batch; rows are grouped by group, in mini-batch order.

  Returns:
    The trainer arrays and a few host metrics (reward mean/std, response tokens).
  """
  by_unit: dict[int, list[int]] = defaultdict(list)
  for g in minibatch.groups:
    by_unit[g.storage_unit].append(g.group_id)
  fetched: dict[int, dict[str, np.ndarray]] = {}
  for unit, ids in by_unit.items():
    got = storage[unit].get(ids, FETCH_FIELDS)
    for k, gid in enumerate(ids):
      fetched[gid] = {f: got[f][k] for f in FETCH_FIELDS}

  prompts, responses, logps, advs, rewards = [], [], [], [], []
  for g in minibatch.groups:
    p = fetched[g.group_id]
    r = np.asarray(p["rewards"], np.float32)
    advs.append(np.asarray(compute_advantages(r[None], estimator))[0])
    rewards.append(r)
    for k in range(len(r)):
      n = int(p["response_lengths"][k])
      prompts.append(p["prompt_tokens"][k][: int(p["prompt_lengths"][k])])
      responses.append(p["response_tokens"][k][:n])
      logps.append(p["logprobs"][k][:n])
  batch = make_batch(
    prompts,
    responses,
    logps,
    np.concatenate(advs),
    prompt_len=prompt_len,
    max_new_tokens=max_new_tokens,
    pad_id=pad_id,
  )
  all_rewards = np.concatenate(rewards)
  info = {
    "reward_mean": float(all_rewards.mean()),
    "reward_std": float(all_rewards.std()),
    "response_tokens": float(batch["loss_mask"].sum()),
    "signal_groups": float(np.mean([r.std() > 0 for r in rewards])),
  }
  return batch, info
