"""Multi-turn rollouts: model turns and environment turns alternate inside one trajectory.

:class:`MultiTurnRollout` implements the rollout contract (`knitjax.rollout.contract`) for tasks
with an environment (`knitjax.tasks.environment`). Each ``step`` runs one model turn of every
live trajectory in one batched :class:`~knitjax.rollout.sampler.Sampler` call (per policy
version in use): the prompt of turn ``k`` is the prompt and everything so far, left-padded to
``P + N``, so a trajectory's tokens sit at the positions the trainer gives them. A turn ends at
the end token, at one of the task's stop texts (a tool call's closing token) or at the per-turn
budget ``turn_tokens``. The environment answers each turn (``step(action_text)``); its
observation is tokenized and appended, unless the trajectory is done, ``max_turns`` model turns
were taken, or the response budget ``N`` (model and environment tokens together) is spent. An
observation is cut to the budget that is left.

Payload: ``response_tokens`` hold model and environment tokens in order; ``response_mask`` is off
on environment tokens and ``logprobs`` 0 there, so they stay attended but carry no loss
(`knitjax.train.batch.make_batch`); the reward is the sum of the environment's rewards. A group
is complete when all its ``G`` trajectories are done; its payload then goes to the storage unit
and its ``GroupMeta`` to the caller (admission). New groups join the live set between turns.

Versions: a group keeps the policy version it started with (``adoption="new_groups"``), so a
step runs one sampler call per version in use; with ``adoption="mid_generation"`` live groups
move to each newly adopted version at the next turn (gen version: the oldest, and the newest
recorded). Every turn prefills its whole context again (no KV cache is kept across turns).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from knitjax.rollout.contract import ADOPTION, RolloutStats
from knitjax.rollout.sampler import Sampler
from knitjax.tasks.environment import Environment, EnvironmentSpec
from knitjax.tasks.prompts import Prompt
from knitjax.tasks.tokenizer import CharTokenizer
from knitjax.train.batch import left_pad
from knitjax.transfer.group import GroupMeta
from knitjax.transfer.payload import GroupPayload
from knitjax.transfer.storage import StorageUnit


@dataclasses.dataclass
class Trajectory:
  """One sample's trajectory: the response so far (model and environment tokens)."""

  env: Environment
  tokens: list[int] = dataclasses.field(default_factory=list)
  mask: list[bool] = dataclasses.field(default_factory=list)  # True: a model token
  logprobs: list[float] = dataclasses.field(default_factory=list)
  turns: int = 0  # model turns taken
  reward: float = 0.0
  done: bool = False

  def append(self, tokens, logprobs=None) -> None:
    """Appends model tokens (with their log-probs) or, without log-probs, environment tokens."""
    tokens = [int(t) for t in tokens]
    self.tokens += tokens
    self.mask += [logprobs is not None] * len(tokens)
    self.logprobs += [0.0] * len(tokens) if logprobs is None else [float(x) for x in logprobs]


@dataclasses.dataclass
class _Group:
  prompt: Prompt
  group_id: int
  version: int  # the policy version its next turn uses
  oldest: int  # the version it started with: its gen version
  trajectories: list[Trajectory]

  @property
  def done(self) -> bool:
    return all(t.done for t in self.trajectories)


class MultiTurnRollout:
  """Multi-turn trajectories behind the rollout contract (see the module docstring).

  Args:
    sampler: the batched sampler; its ``prompt_len`` must be ``prompt_len + max_new_tokens``
      (a turn's context), its ``max_new_tokens`` is the per-turn budget, and its stop tokens
      must include the environment's stop texts.
    storage: the storage unit the payloads go to.
    environment: the task's environment (one instance per trajectory) and stop texts.
    tokenizer: decodes turns, encodes observations.
    group_size: ``G``.
    prompt_len: ``P``, the longest prompt.
    max_new_tokens: ``N``, the response budget of a trajectory (model and environment tokens).
    max_turns: model turns per trajectory, at most.
    max_groups: groups live at once (None: no bound; colocated steps start all).
    adoption: ``"new_groups"`` or ``"mid_generation"`` (see the module docstring).
  """

  def __init__(
    self,
    sampler: Sampler,
    storage: StorageUnit,
    *,
    environment: EnvironmentSpec,
    tokenizer: CharTokenizer,
    group_size: int,
    prompt_len: int,
    max_new_tokens: int,
    max_turns: int,
    max_groups: int | None = None,
    adoption: str = "new_groups",
  ):
    if sampler.prompt_len != prompt_len + max_new_tokens:
      raise ValueError(
        f"the multi-turn sampler's prompt_len is {sampler.prompt_len}; accepted: prompt_len + "
        f"max_new_tokens = {prompt_len + max_new_tokens} (a turn's whole context)."
      )
    stops = stop_ids(environment, tokenizer)
    if not set(stops) <= set(sampler.eos_ids):
      raise ValueError(
        f"the multi-turn sampler stops at {sampler.eos_ids}; accepted: stop tokens that include "
        f"the environment's {stops}."
      )
    if max_turns < 1:
      raise ValueError(f"MultiTurnRollout max_turns is {max_turns}; accepted: an int >= 1.")
    if adoption not in ADOPTION:
      raise ValueError(f"MultiTurnRollout adoption is {adoption!r}; accepted: one of {ADOPTION}.")
    self._sampler, self._unit, self._env = sampler, storage, environment
    self._tokenizer, self._g = tokenizer, group_size
    self._n, self._max_turns = max_new_tokens, max_turns
    self._max, self._adoption = max_groups, adoption
    self._params: dict[int, object] = {}
    self._version: int | None = None
    self._queued: list[tuple[Prompt, int]] = []
    self._live: dict[int, _Group] = {}
    self._stats = RolloutStats(shards=sampler.batch_shards)

  @property
  def storage(self) -> dict[int, StorageUnit]:
    return {self._unit.unit_id: self._unit}

  @property
  def version(self) -> int | None:
    return self._version

  @property
  def inflight(self) -> int:
    return len(self._queued) + len(self._live)

  def adopt(self, params, version: int) -> None:
    self._params[version], self._version = params, version
    if self._adoption == "mid_generation":
      for group in self._live.values():
        group.version = version
    self._drop_unused_params()

  def capacity(self) -> int:
    return (1 << 30 if self._max is None else self._max) - self.inflight

  def start(self, prompt: Prompt, group_id: int) -> None:
    if self._version is None:
      raise RuntimeError("the rollout has no policy: call adopt(params, version) first.")
    self._queued.append((prompt, group_id))

  def step(self, rng: jax.Array, *, want_room: bool = False) -> list[GroupMeta]:
    """Runs one model turn of every live trajectory; returns the groups that completed."""
    del want_room  # one step is one turn: room comes back at the turn's end
    for prompt, gid in self._queued:
      self._live[gid] = self._begin(prompt, gid)
    self._queued = []
    for k, version in enumerate(sorted({g.version for g in self._live.values()})):
      rows = [
        (g, t)
        for g in self._live.values()
        if g.version == version
        for t in g.trajectories
        if not t.done
      ]
      if rows:
        self._turn(rows, self._params[version], jax.random.fold_in(rng, k))
    done = [gid for gid, g in self._live.items() if g.done]
    metas = [self._complete(self._live.pop(gid)) for gid in done]
    self._drop_unused_params()
    return metas

  def _begin(self, prompt: Prompt, gid: int) -> _Group:
    trajectories = []
    for _ in range(self._g):
      t = Trajectory(env=self._env.make())
      self._observe(t, t.env.reset(prompt))
      trajectories.append(t)
    return _Group(prompt, gid, self._version, self._version, trajectories)

  def _observe(self, t: Trajectory, observation: str) -> None:
    """Appends an observation's tokens, cut to the budget; a spent budget ends the trajectory."""
    ids = self._tokenizer.encode(observation, bos=False) if observation else []
    t.append(ids[: self._n - len(t.tokens)])
    if len(t.tokens) >= self._n:
      t.done = True

  def _turn(self, rows: list[tuple[_Group, Trajectory]], params, rng: jax.Array) -> None:
    """One model turn of ``rows`` (one sampler call), then the environment's answers."""
    contexts = [np.concatenate([g.prompt.tokens, np.asarray(t.tokens, np.int32)]) for g, t in rows]
    batch = bucket(len(contexts), self._sampler.batch_shards)
    contexts += [contexts[0]] * (batch - len(contexts))  # filler rows, dropped below
    tokens_bp, lens_b = left_pad(contexts, self._sampler.prompt_len, self._tokenizer.pad_id)
    samples = self._sampler(params, tokens_bp, lens_b, rng)
    self._stats.decode_iterations += self._sampler.sampling.max_new_tokens
    self._stats.decode_passes += self._sampler.sampling.max_new_tokens
    for i, (_, t) in enumerate(rows):
      n = min(int(samples.lengths[i]), self._n - len(t.tokens))
      ids = samples.tokens[i, :n]
      t.append(ids, samples.logprobs[i, :n])
      t.turns += 1
      self._stats.tokens += n
      observation, reward, done = t.env.step(self._tokenizer.decode(ids, stop_at_eos=False))
      t.reward += float(reward)
      if done or t.turns >= self._max_turns or len(t.tokens) >= self._n:
        t.done = True
      else:
        self._observe(t, observation)

  def _complete(self, group: _Group) -> GroupMeta:
    payload = trajectory_payload(group.prompt, group.trajectories, self._n)
    rewards = payload.rewards
    meta = GroupMeta(
      group_id=group.group_id,
      cls=group.prompt.cls,
      gen_version=group.oldest,
      num_samples=self._g,
      prompt_tokens=(len(group.prompt.tokens),) * self._g,
      response_tokens=tuple(int(x) for x in payload.response_lengths),
      reward_mean=float(rewards.mean()),
      reward_std=float(rewards.std()),
      storage_unit=self._unit.unit_id,
      completion_time=time.time(),
      gen_version_newest=None if group.version == group.oldest else group.version,
    )
    self._unit.put(group.group_id, payload)
    return meta

  def _drop_unused_params(self) -> None:
    used = {g.version for g in self._live.values()} | {self._version}
    for v in [v for v in self._params if v not in used]:
      del self._params[v]

  def stats(self) -> RolloutStats:
    live = sum(not t.done for g in self._live.values() for t in g.trajectories)
    return dataclasses.replace(self._stats, live_samples=live)

  def close(self) -> None:
    self._unit.close()  # the unit built for this rollout (a Ray actor with storage='ray')


def stop_ids(environment: EnvironmentSpec, tokenizer: CharTokenizer) -> tuple[int, ...]:
  """The end tokens and the token of each of the environment's stop texts."""
  ids = list(tokenizer.eos_ids)
  for text in environment.stop_texts:
    encoded = tokenizer.encode(text, bos=False)
    if len(encoded) != 1:
      raise ValueError(
        f"the environment's stop text {text!r} encodes to {len(encoded)} tokens; accepted: "
        "texts of exactly one token."
      )
    ids += [t for t in encoded if t not in ids]
  return tuple(ids)


def bucket(rows: int, shards: int) -> int:
  """Rows of a sampler call: ``shards x`` the smallest power of two that fits ``rows`` (a few
  compiled shapes however many trajectories are live)."""
  per_shard = -(-rows // shards)
  return shards * (1 << max(per_shard - 1, 0).bit_length())


def trajectory_payload(prompt: Prompt, trajectories: list[Trajectory], width: int) -> GroupPayload:
  """A group's payload: responses ``[G, width]``, mask off on environment tokens, log-probs 0
  there, the trajectories' rewards (validated where it enters storage)."""
  g = len(trajectories)
  lengths = np.array([len(t.tokens) for t in trajectories], np.int32)
  tokens = np.zeros((g, width), np.int32)
  mask = np.zeros((g, width), bool)
  logprobs = np.zeros((g, width), np.float32)
  for k, t in enumerate(trajectories):
    tokens[k, : lengths[k]] = t.tokens
    mask[k, : lengths[k]] = t.mask
    logprobs[k, : lengths[k]] = t.logprobs
  return GroupPayload(
    prompt_tokens=np.tile(prompt.tokens, (g, 1)),
    prompt_lengths=np.full(g, len(prompt.tokens), np.int32),
    response_tokens=tokens,
    response_mask=mask,
    response_lengths=lengths,
    logprobs=np.where(mask, logprobs, np.float32(0.0)),
    rewards=np.array([t.reward for t in trajectories], np.float32),
  )
