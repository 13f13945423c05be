"""What a caller gives the continuous engine and gets back: a `Request` per sample to generate,
a `Finished` per sample done, and the check and grouping of requests by the prompt they share
(a group's ``G`` samples are prefilled once, `knitjax.rollout.continuous`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
  """One sample to generate: ``tag`` is the caller's (e.g. ``(group_id, k)``)."""

  tag: object
  tokens: np.ndarray  # 1-D prompt ids, BOS first
  max_new_tokens: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Finished:
  """A finished sample: tokens and log-probs up to its length, and the versions it used."""

  tag: object
  tokens: np.ndarray  # [length] int32, EOS last when produced
  logprobs: np.ndarray  # [length] float32
  version: int  # oldest policy version used (gen version)
  version_newest: int  # newest policy version used


def group_requests(
  requests: Sequence[Request], *, prompt_len: int, max_new_tokens: int, share_prefix: bool
) -> list[list[Request]]:
  """``requests`` checked (prompt of 1..``prompt_len`` tokens, budget of 1..``max_new_tokens``;
  ValueError naming the request otherwise) and grouped by shared prompt and budget, in order of
  first appearance; without ``share_prefix`` each request is its own group."""
  prompts: dict[object, list[Request]] = {}
  for k, req in enumerate(requests):
    n = len(req.tokens)
    if not 1 <= n <= prompt_len:
      raise ValueError(f"request {req.tag}: prompt of {n} tokens; accepted: 1..{prompt_len}.")
    if not 1 <= req.max_new_tokens <= max_new_tokens:
      raise ValueError(
        f"request {req.tag}: max_new_tokens={req.max_new_tokens}; accepted: 1..{max_new_tokens}."
      )
    toks = np.asarray(req.tokens, np.int32).tobytes()
    key = (toks, req.max_new_tokens) if share_prefix else k
    prompts.setdefault(key, []).append(req)
  return list(prompts.values())
