"""Character-level tokenizer for the synthetic and GSM8K-style tasks.

Ids: ``pad=0``, ``bos=1``, ``eos=2``, then one id per character of the alphabet in order. A tiny
vocabulary lets a randomly initialised policy learn a task by RL alone on a CPU.

The model's vocabulary may be larger than the tokenizer's (``config.model.vocab_size`` or an
``init_from`` checkpoint's), so the policy can sample ids the tokenizer has no character for;
`CharTokenizer.decode` turns each into `UNKNOWN_CHAR` rather than failing a reward.
"""

from collections.abc import Iterable

import numpy as np

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
_NUM_SPECIAL = 3
# U+FFFD, the Unicode replacement character: not in any alphabet, not a digit. Dropping unknown ids
# instead would join their neighbours ("1", <unknown>, "2" -> "12"), which a reward could match.
UNKNOWN_CHAR = "\ufffd"


class CharTokenizer:
  """Maps each character of ``alphabet`` to one token id, after three special ids."""

  def __init__(self, alphabet: str):
    if not alphabet:
      raise ValueError("alphabet must hold at least one character.")
    if len(set(alphabet)) != len(alphabet):
      dupes = sorted({c for c in alphabet if alphabet.count(c) > 1})
      raise ValueError(f"alphabet has repeated characters {dupes!r}; each must appear once.")
    self.alphabet = alphabet
    self._char_to_id = {c: i + _NUM_SPECIAL for i, c in enumerate(alphabet)}
    self.pad_id = PAD_ID
    self.bos_id = BOS_ID
    self.eos_id = EOS_ID
    self.eos_ids = (EOS_ID,)  # the stop tokens, as a Hugging Face tokenizer may have several
    self.vocab_size = len(alphabet) + _NUM_SPECIAL

  def encode(self, text: str, *, bos: bool = True) -> list[int]:
    """Returns the ids of ``text``, preceded by BOS when ``bos``; never appends EOS."""
    ids = [self.bos_id] if bos else []
    for pos, c in enumerate(text):
      tok = self._char_to_id.get(c)
      if tok is None:
        raise ValueError(
          f"character {c!r} at position {pos} is not in the tokenizer alphabet {self.alphabet!r}."
        )
      ids.append(tok)
    return ids

  def num_tokens(self, text: str, *, bos: bool = True) -> int:
    """Returns ``len(encode(text, bos=bos))`` without encoding: one token per character."""
    return len(text) + int(bos)

  def decode(self, ids: Iterable[int] | np.ndarray, *, stop_at_eos: bool = True) -> str:
    """Returns the text of ``ids``; BOS and PAD are dropped, EOS ends the text when ``stop_at_eos``.

    Any id a model can sample decodes: an id at or above ``vocab_size`` (a model vocabulary larger
    than the tokenizer's) becomes one `UNKNOWN_CHAR` (U+FFFD), which no reward reads as part of a
    number or an answer. With ``stop_at_eos=False`` an EOS is kept visible as ``"<eos>"`` so
    callers can tell that it was produced.

    Raises:
      ValueError: for a negative id, which no model samples.
    """
    out = []
    for tok in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
      if tok == self.eos_id:
        if stop_at_eos:
          break
        out.append("<eos>")
      elif tok in (self.pad_id, self.bos_id):
        continue
      elif _NUM_SPECIAL <= tok < self.vocab_size:
        out.append(self.alphabet[tok - _NUM_SPECIAL])
      elif tok >= self.vocab_size:
        out.append(UNKNOWN_CHAR)
      else:
        raise ValueError(f"token id {tok} is negative; token ids are >= 0.")
    return "".join(out)

  def __repr__(self) -> str:
    return f"CharTokenizer(alphabet={self.alphabet!r})"


def split_at_eos(
  ids: Iterable[int] | np.ndarray, eos_id: int | Iterable[int]
) -> tuple[np.ndarray, bool]:
  """Returns (the ids before the first EOS, whether an EOS was produced).

  ``eos_id`` is one stop token or several (``tokenizer.eos_ids``); the first of any ends the text.
  """
  ids = np.asarray(ids, dtype=np.int64).reshape(-1)
  hits = np.flatnonzero(np.isin(ids, np.asarray(eos_id, dtype=np.int64).reshape(-1)))
  if hits.size:
    return ids[: hits[0]], True
  return ids, False
