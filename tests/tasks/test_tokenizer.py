"""Tests for knitjax.tasks.tokenizer."""

import numpy as np
import pytest

from knitjax.tasks.tokenizer import UNKNOWN_CHAR, CharTokenizer, split_at_eos


def test_ids_and_round_trip():
  tok = CharTokenizer("ab c")
  assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 7)
  assert tok.encode("a cb") == [1, 3, 5, 6, 4]
  assert tok.encode("a cb", bos=False) == [3, 5, 6, 4]
  assert tok.decode(tok.encode("a cb")) == "a cb"
  assert tok.decode(np.array([1, 3, 2, 4, 0])) == "a"
  assert tok.decode([1, 3, 2, 4, 0], stop_at_eos=False) == "a<eos>b"


def test_errors():
  tok = CharTokenizer("ab")
  with pytest.raises(ValueError, match=r"character 'z' at position 1"):
    tok.encode("az")
  with pytest.raises(ValueError, match="token id -1 is negative"):
    tok.decode([3, -1])
  with pytest.raises(ValueError, match="repeated"):
    CharTokenizer("aba")


def test_decode_accepts_ids_beyond_the_vocab():
  """A model vocab larger than the tokenizer's: unknown ids decode to U+FFFD, one per id."""
  tok = CharTokenizer("ab")
  assert UNKNOWN_CHAR == "\ufffd" and tok.vocab_size == 5
  assert tok.decode([5]) == UNKNOWN_CHAR
  assert tok.decode(np.array([3, 5, 151_935, 4], np.int32)) == f"a{UNKNOWN_CHAR * 2}b"
  assert tok.decode([3, 2**40, 2, 4]) == f"a{UNKNOWN_CHAR}"  # EOS still ends the text
  assert tok.decode([9, 2, 9], stop_at_eos=False) == f"{UNKNOWN_CHAR}<eos>{UNKNOWN_CHAR}"


def test_num_tokens():
  tok = CharTokenizer("ab ")
  for text in ["", "a", "ab ba"]:
    assert tok.num_tokens(text) == len(tok.encode(text))
    assert tok.num_tokens(text, bos=False) == len(tok.encode(text, bos=False))


def test_split_at_eos():
  body, has_eos = split_at_eos([5, 6, 2, 7, 0], eos_id=2)
  assert body.tolist() == [5, 6] and has_eos
  body, has_eos = split_at_eos(np.array([5, 6]), eos_id=2)
  assert body.tolist() == [5, 6] and not has_eos
