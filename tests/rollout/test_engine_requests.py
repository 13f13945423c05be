"""Requests grouped by the prompt they share, checked with one sentence naming the request."""

import numpy as np
import pytest

from knitjax.rollout.engine_requests import Request, group_requests


def _req(tag, toks, budget=4):
  return Request(tag=tag, tokens=np.asarray(toks, np.int32), max_new_tokens=budget)


def test_requests_group_by_prompt_and_budget_in_order_of_first_appearance():
  reqs = [_req(0, [1, 2]), _req(1, [1, 3]), _req(2, [1, 2]), _req(3, [1, 2], budget=2)]
  groups = group_requests(reqs, prompt_len=4, max_new_tokens=4, share_prefix=True)
  assert [[r.tag for r in g] for g in groups] == [[0, 2], [1], [3]]
  alone = group_requests(reqs, prompt_len=4, max_new_tokens=4, share_prefix=False)
  assert [[r.tag for r in g] for g in alone] == [[0], [1], [2], [3]]


@pytest.mark.parametrize(
  "req, says",
  [
    (_req("g7", [1, 2, 3, 4, 5]), "request g7: prompt of 5 tokens; accepted: 1..4."),
    (_req("g8", []), "request g8: prompt of 0 tokens"),
    (_req("g9", [1], budget=9), "request g9: max_new_tokens=9; accepted: 1..4."),
  ],
)
def test_a_bad_request_is_named_in_one_sentence(req, says):
  with pytest.raises(ValueError, match=says.replace(".", r"\.")):
    group_requests([req], prompt_len=4, max_new_tokens=4, share_prefix=True)
