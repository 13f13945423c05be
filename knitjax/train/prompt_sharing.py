"""Shared-prompt layout: a group's prompt once, then its G responses (NumPy, host side).

A GRPO group is G responses to one prompt. The padded layout
(:func:`knitjax.train.batch.make_batch`) runs that prompt G times through the backbone, in every
forward and backward of the step; with prompt length P, response length R the step processes
``G (P + R)`` tokens where ``P + G R`` carry all the information. This layout lays a group out
as one **unit**::

    [ prompt (P_g) | response 1 (n_1) | response 2 (n_2) | ... | response G (n_G) ]

and the model attends with a **tree mask** (:mod:`knitjax.models.attention`): the prompt is one
segment (``segment_ids`` a), each response a segment of its own (a + 1, ..., a + G) whose tokens
also see the prompt's segment (``prefix_ids`` a, 0 elsewhere). RoPE positions of each response
continue from the prompt's end (``P_g, P_g + 1, ...``), exactly those of its padded row.

Scoring (``score_index``): in the padded row position ``t`` predicts token ``t + 1``, so response
token ``k`` is scored from the hidden state of the token before it: the prompt's last token for
``k = 0``. Here the prompt's last token is shared by G responses, so scoring moves onto the
scored tokens: the column of response token ``k`` holds ``targets`` = that token, its
``loss_mask`` and ``behavior_logp``, and ``score_index`` = the column whose hidden state scores it
(the previous column of its response, or the prompt's last column for ``k = 0``, G targets at one
shared position). The step gathers the hidden states (and critic values) at ``score_index``
before the output projection (:func:`knitjax.train.step.forward`).

Why the gradient is exact, with no custom rule. Write the padded layout's computation of response
``g`` as ``f_g(prompt activations, response g activations)``: every layer maps the prompt's
positions to the same values in every row (a prompt token attends only to earlier prompt tokens,
so its activations do not depend on the response), and response ``g``'s positions see exactly the
prompt's keys and values and their own, with the same positions. The shared layout computes each
prompt activation once and feeds it to all G responses' attention (the tree mask) and, for the
prompt's last hidden state, to G scoring gathers. The loss is ``sum_g L_g``; by the chain rule the
cotangent of a value used by several consumers is the sum of their cotangents: autodiff's
transpose of a fan-out (the attention's key/value reads across segments, the gather's
scatter-add) is exactly that sum. So every prompt activation receives ``sum_g dL_g / d(that
activation in row g)``: the padded layout's gradient, summed over its G copies of the prompt, which
is what the parameters' gradient sums anyway. Log-probs, losses, KL, advantages and gradients
equal the padded layout's up to float summation order (``tests/train/test_prompt_sharing.py``).

Which rows share. A group shares when all its rows hold the same prompt (tokens equal) and every
response has at least one token (a response of none would own no segment). Otherwise each of its
rows is a unit of its own (multi-turn groups whose environment turns differ would, if they were
laid into the prompt): ``[prompt | response]`` as one segment, exactly a packed row
(:mod:`knitjax.train.packing`) in this layout's scoring convention.

Row fields: a response's ``advantages``, ``rewards`` and ``group_id`` go to each of its tokens (a
single-row unit: to each token of its segment, prompt included, as packing does); a shared
prompt's tokens carry the padding values (0, 0, -1), so the in-step group estimators
(:mod:`knitjax.train.step_advantages`) see one row per response, none for the prompt.

Sequences: with ``pack=False`` each unit fills one sequence in **fixed spans**, ``seq_len = P +
G N`` tokens (``P``, ``N``: the padded prompt and response widths): the prompt left-padded in
columns ``[0, P)`` as in its padded row, response ``j`` right-padded in ``[P + j N, P + (j + 1)
N)``. The model then attends span by span (:func:`knitjax.models.attention.attend_spans`,
``StepHParams.shared_spans``): the prompt once, each span over the prompt's keys and its own, so
no score is spent on one response against another. With ``pack=True`` units are laid out
contiguously (``[prompt | r1 | r2 | ...]``) and packed first-fit decreasing into sequences of
``seq_len`` (= ``pack_len``) tokens, a unit never split
(:func:`knitjax.train.packing.first_fit_decreasing`), under the general tree mask. The count
``S`` is rounded up to ``multiple`` (micro-batches times batch shards) with empty sequences, so
a group never splits across micro-batches and the micro-batch count stays the config's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from knitjax.train.packing import first_fit_decreasing, sequence_count

# config.layout.prompt_sharing: "group" is this module's layout; "prefix" each prompt once per
# mini-batch, its rows in any micro-batches (knitjax.train.prefix); "auto" the measured rule
# (`knitjax.runtime.layout_choice.prompt_sharing_mode`).
PROMPT_SHARING_MODES = ("auto", "off", "group", "prefix")


def units(batch: Mapping[str, np.ndarray], prompt_len: int) -> list[list[int]]:
  """The rows of each unit, in row order (the module docstring's rule).

  Args:
    batch: :func:`~knitjax.train.batch.make_batch` arrays (``tokens``, ``valid``, ``group_id``).
    prompt_len: ``P``, the padded prompt width of ``batch``.
  """
  tokens, valid = np.asarray(batch["tokens"]), np.asarray(batch["valid"], bool)
  group = np.asarray(batch["group_id"]).reshape(-1)
  response_len = valid[:, prompt_len:].sum(axis=1)
  by_group: dict[int, list[int]] = {}
  for r, g in enumerate(group.tolist()):
    by_group.setdefault(g, []).append(r)
  out = []
  for rows in sorted(by_group.values(), key=lambda rs: rs[0]):
    toks, mask = tokens[rows, :prompt_len], valid[rows, :prompt_len]
    same = bool(((toks == toks[0]) & (mask == mask[0])).all())
    if len(rows) > 1 and same and (response_len[rows] > 0).all():
      out.append(rows)
    else:
      out.extend([r] for r in rows)
  return out


def unit_lengths_from_counts(
  groups: Sequence[tuple[Sequence[int], Sequence[int]]],
) -> list[int]:
  """Tokens of each unit from groups' token counts alone (``(prompt_tokens, response_tokens)``
  per group, one entry per row: ``GroupMeta``'s), for consumers that must agree on a sequence
  count before they hold the payloads. A group with equal prompt lengths and no empty response
  is taken to share (its payload's prompts are then checked by :func:`share_batch`)."""
  out = []
  for prompts, responses in groups:
    if len(prompts) > 1 and len(set(prompts)) == 1 and min(responses) > 0:
      out.append(int(prompts[0]) + int(sum(responses)))
    else:
      out.extend(int(p) + int(r) for p, r in zip(prompts, responses, strict=True))
  return out


def plan_sequences(lengths: Sequence[int], *, seq_len: int, pack: bool) -> list[list[int]]:
  """Units per sequence: one each (``pack=False``), else first-fit decreasing."""
  lengths = np.asarray(lengths, np.int64)
  if (over := lengths > seq_len).any():
    i = int(np.argmax(over))
    raise ValueError(
      f"a shared-prompt unit (a group's prompt and its responses) has {lengths[i]} tokens, more "
      f"than a sequence's {seq_len}; raise config.layout.pack_len to at least {int(lengths.max())}."
    )
  if not pack:
    return [[u] for u in range(len(lengths))]
  return first_fit_decreasing(lengths, seq_len)


def share_batch(
  batch: Mapping[str, np.ndarray],
  *,
  prompt_len: int,
  seq_len: int,
  pack: bool = False,
  multiple: int = 1,
  count: int = 0,
) -> dict[str, np.ndarray]:
  """Lays a padded mini-batch out with shared prompts (the module docstring).

  Args:
    batch: :func:`~knitjax.train.batch.make_batch` arrays (``[R, P + N]`` token fields, ``[R]``
      ``advantages``, ``rewards``, ``group_id``; optional ``[R]`` ``image_index`` of a VLM,
      which needs ``pack=False``).
    prompt_len: ``P``, the padded prompt width of ``batch``.
    seq_len: tokens per output sequence.
    pack: several units per sequence (first-fit decreasing); False: one each.
    multiple: ``S`` is rounded up to a multiple of this.
    count: ``S`` exactly (agreed between consumers); 0: as few as the units need.

  Returns:
    ``[S, seq_len]`` arrays: ``tokens, positions, valid, targets, loss_mask, behavior_logp,
    advantages, rewards, group_id, segment_ids, prefix_ids, score_index`` (and ``[S]``
    ``image_index`` when given).

  Raises:
    ValueError: a unit does not fit, a row with loss has an empty prompt, the units need more
      than ``count`` sequences, or images come with ``pack=True``.
  """
  if multiple < 1:
    raise ValueError(f"multiple={multiple} must be >= 1.")
  tokens = np.asarray(batch["tokens"])
  valid = np.asarray(batch["valid"], bool)
  loss, behavior = np.asarray(batch["loss_mask"]), np.asarray(batch["behavior_logp"])
  adv = np.asarray(batch["advantages"], np.float32)
  if adv.ndim != 1:
    raise ValueError(
      f"shared-prompt layout takes one advantage per row ([R]), got shape {list(adv.shape)}."
    )
  rewards = np.asarray(batch["rewards"], np.float32).reshape(-1)
  group = np.asarray(batch["group_id"], np.int32).reshape(-1)
  images = batch.get("image_index")
  if images is not None and pack:
    raise ValueError("a VLM batch takes one unit per sequence: shared prompts with pack=False.")
  p_len = valid[:, :prompt_len].sum(axis=1)
  n_len = valid[:, prompt_len:].sum(axis=1)
  if (bad := (p_len == 0) & (loss.sum(axis=1) > 0)).any():
    i = int(np.argmax(bad))
    raise ValueError(
      f"row {i} carries loss but has an empty prompt: nothing scores its first token."
    )
  groups = units(batch, prompt_len)
  lengths = [int(p_len[u[0]] + n_len[u].sum()) for u in groups]
  sequences = plan_sequences(lengths, seq_len=seq_len, pack=pack)
  s_count = sequence_count(
    len(sequences), multiple, count,
    what=f"the shared-prompt units need {{S}} sequences of {seq_len} tokens",
  )  # fmt: skip
  shape = (s_count, seq_len)
  out = {
    "tokens": np.zeros(shape, tokens.dtype),
    "positions": np.zeros(shape, np.int32),
    "valid": np.zeros(shape, bool),
    "targets": np.zeros(shape, np.int32),
    "loss_mask": np.zeros(shape, loss.dtype),
    "behavior_logp": np.zeros(shape, behavior.dtype),
    "advantages": np.zeros(shape, np.float32),
    "rewards": np.zeros(shape, np.float32),
    "group_id": np.full(shape, -1, np.int32),
    "segment_ids": np.zeros(shape, np.int32),
    "prefix_ids": np.zeros(shape, np.int32),
    "score_index": np.broadcast_to(np.arange(seq_len, dtype=np.int32), shape).copy(),
  }
  if images is not None:
    out["image_index"] = np.full((s_count,), -1, np.asarray(images).dtype)
  span_len = tokens.shape[1] - prompt_len  # N, a response's width (fixed spans)
  most = max((len(u) for u in groups), default=0)
  if not pack and prompt_len + most * span_len > seq_len:
    raise ValueError(
      f"a group of {most} responses does not fit a shared-prompt row of {seq_len} tokens "
      f"(a prompt of {prompt_len} and spans of {span_len}); is config.rollout.group_size right?"
    )
  for s, seq in enumerate(sequences):
    col, seg = 0, 1
    for u in seq:
      rows = groups[u]
      first = rows[0]
      pl = int(p_len[first])
      if not pack:  # fixed spans: the prompt left-padded to P, response j at P + j N
        col = prompt_len - pl
      src = slice(prompt_len - pl, prompt_len)
      dst = slice(col, col + pl)
      out["tokens"][s, dst] = tokens[first, src]
      out["positions"][s, dst] = np.arange(pl)
      out["valid"][s, dst] = True
      out["segment_ids"][s, dst] = seg
      prompt_seg, prompt_last = seg, col + pl - 1
      shared = len(rows) > 1
      if not shared:  # one row: prompt and response are its one segment, fields on every token
        _row_fields(out, s, dst, first, adv, rewards, group)
      if images is not None:
        out["image_index"][s] = images[first]
      col += pl
      for j, r in enumerate(rows):
        n = int(n_len[r])
        if shared:
          seg += 1
        if not pack:
          col = prompt_len + j * span_len
        dst = slice(col, col + n)
        out["tokens"][s, dst] = tokens[r, prompt_len : prompt_len + n]
        out["targets"][s, dst] = tokens[r, prompt_len : prompt_len + n]
        out["positions"][s, dst] = pl + np.arange(n)
        out["valid"][s, dst] = True
        out["segment_ids"][s, dst] = seg
        out["prefix_ids"][s, dst] = prompt_seg if shared else 0
        # Response token k is scored at column P - 1 + k of its padded row.
        out["loss_mask"][s, dst] = loss[r, prompt_len - 1 : prompt_len - 1 + n]
        out["behavior_logp"][s, dst] = behavior[r, prompt_len - 1 : prompt_len - 1 + n]
        score = np.arange(col - 1, col + n - 1, dtype=np.int32)
        if n:
          score[0] = prompt_last
        out["score_index"][s, dst] = score
        _row_fields(out, s, dst, r, adv, rewards, group)
        col += n
      seg += 1
  return out


def _row_fields(out, s, dst, r, adv, rewards, group) -> None:
  out["advantages"][s, dst] = adv[r]
  out["rewards"][s, dst] = rewards[r]
  out["group_id"][s, dst] = group[r]


def sharing_metrics(batch: Mapping[str, np.ndarray], shared: Mapping[str, np.ndarray]) -> dict:
  """Tokens the padded rows hold (``share_padded_tokens``, their valid tokens: ``G (P + R)`` for
  a group), those the shared layout holds (``share_tokens``: ``P + G R``), their ratio
  (``share_token_ratio``), the sequences ``share_rows`` and the positions' fill ``share_fill``."""
  padded = float(np.count_nonzero(batch["valid"]))
  tokens = float(np.count_nonzero(shared["valid"]))
  return {
    "share_padded_tokens": padded,
    "share_tokens": tokens,
    "share_token_ratio": padded / max(tokens, 1.0),
    "share_rows": float(shared["valid"].shape[0]),
    "share_fill": tokens / max(shared["valid"].size, 1),
  }


@dataclasses.dataclass(frozen=True)
class ShareSpec:
  """How a trainer lays out each mini-batch with shared prompts: ``spec(batch)`` is
  :func:`share_batch` with these.

  Attributes:
    prompt_len: the padded prompt width of the mini-batches.
    seq_len: tokens per sequence (``pack_len`` when packing, else prompt width + G response
      widths).
    multiple: the sequence count is rounded up to a multiple of this.
    pack: several units per sequence.
  """

  prompt_len: int
  seq_len: int
  multiple: int
  pack: bool = False

  def __call__(self, batch: Mapping[str, np.ndarray], *, count: int = 0) -> dict[str, np.ndarray]:
    return share_batch(
      batch, prompt_len=self.prompt_len, seq_len=self.seq_len, pack=self.pack,
      multiple=self.multiple, count=count,
    )  # fmt: skip

  def with_metrics(
    self, batch: Mapping[str, np.ndarray], *, count: int = 0
  ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """The shared layout (``count``: see :func:`share_batch`) and its :func:`sharing_metrics`;
    a VLM batch's unique ``images`` pass through unchanged."""
    rows = {k: v for k, v in batch.items() if k != "images"}
    shared = self(rows, count=count)
    if "images" in batch:
      shared["images"] = batch["images"]
    return shared, sharing_metrics(rows, shared)

  def plan_parts(
    self, parts: Sequence[Sequence[tuple[Sequence[int], Sequence[int]]]], *, row_len: int
  ) -> tuple[int, dict[str, float]]:
    """The sequence count every part (a consumer's groups, as ``(prompt_tokens,
    response_tokens)``) lays out, and the whole mini-batch's :func:`sharing_metrics`, from the
    groups' token counts alone."""
    del row_len  # the metrics count tokens, not padded positions
    plans, tokens, padded = [], 0, 0
    for groups in parts:
      lengths = unit_lengths_from_counts(groups)
      plans.append(plan_sequences(lengths, seq_len=self.seq_len, pack=self.pack))
      tokens += sum(lengths)
      padded += sum(sum(p) + sum(r) for p, r in groups)
    count = sequence_count(max((len(p) for p in plans), default=0), self.multiple)
    rows = count * len(parts)
    return count, {
      "share_padded_tokens": float(padded),
      "share_tokens": float(tokens),
      "share_token_ratio": padded / max(tokens, 1.0),
      "share_rows": float(rows),
      "share_fill": tokens / max(rows * self.seq_len, 1),
    }
