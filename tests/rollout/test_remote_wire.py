"""The rollout hosts' wire format (knitjax.rollout.wire): every message of the protocol crosses
as data and comes back equal; a pickle, a frame that does not decode, an unexpected kind or an
argument of another type is one sentence naming the peer, and nothing is ever unpickled."""

import os
import pickle

import numpy as np
import pytest
from jax.sharding import PartitionSpec

from knitjax.rollout import wire
from knitjax.rollout.contract import RolloutStats
from knitjax.tasks.prompts import Prompt
from knitjax.transfer.group import GroupMeta
from knitjax.transfer.payload import synthetic_payload
from knitjax.transfer.validation import validate_payload

META = GroupMeta(
  group_id=7,
  cls="a",
  gen_version=2,
  num_samples=2,
  prompt_tokens=(3, 3),
  response_tokens=(4, 1),
  reward_mean=0.5,
  image_hashes=("ab",),
  gen_version_newest=3,
)
PROMPT = Prompt(
  prompt_id=1, cls="a", text="1+1", tokens=np.arange(3), answer="2", image=np.ones((2, 2, 3), "u1")
)
PAYLOAD = validate_payload(
  7,
  synthetic_payload(
    np.random.default_rng(0), group_size=2, prompt_len=3, response_len=4, vocab_size=32
  ),
  0,
  vocab_size=32,
  max_seq_len=7,
)
STATS = RolloutStats(tokens=5, decode_iterations=2, shards=1)
PATH = (("params", "layers", 0, "w"), (4, 8), "bfloat16")


def _same(a, b):
  if isinstance(a, np.ndarray):
    return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
  if hasattr(a, "__dataclass_fields__"):
    return type(a) is type(b) and all(
      _same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__
    )
  if isinstance(a, list | tuple):
    return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
  if isinstance(a, dict):
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
  return type(a) is type(b) and a == b


SAMPLES = {
  "control": ("host-a", 123),
  "storage": (0,),
  "welcome": (1, [PATH]),
  "ready": ([PartitionSpec(None, "tensor"), PartitionSpec(("data", "fsdp"))], {"data": 2}, 2),
  "weights": ("127.0.0.1:4000",),
  "go": (),
  "report": ([META], 3, STATS, 4),
  "adopt": (5, 2),
  "start": (PROMPT, 9),
  "seed": (np.array([1, 2], np.uint32),),
  "room": (True,),
  "close": (),
  "put": (7, PAYLOAD, [np.zeros((2, 2, 3), np.uint8)]),
  "get": ([7, 8],),
  "get_images": (["ab"],),
  "release": ([7],),
  "stats": (),
  "error": ("KeyError", "groups [8] are not held"),
}


def test_every_message_of_the_protocol_comes_back_equal():
  assert set(SAMPLES) == set(wire.MESSAGES)
  for kind, args in SAMPLES.items():
    got = wire.decode(wire.encode(kind, *args), wire.MESSAGES, "host 0")
    assert got[0] == kind
    assert _same(list(got[1:]), list(args)), kind
  # a put also takes a plain mapping of input arrays; replies by the call they answer
  arrays = {"prompt_tokens": np.ones((2, 3), np.int32), "rewards": np.zeros(2, np.float32)}
  _, _, payload, _ = wire.decode(wire.encode("put", 1, arrays, []), wire.MESSAGES, "t")
  assert _same(payload, arrays)
  for call, value in [("put", 12), ("get", [PAYLOAD]), ("release", None), ("stats", {"a": 1})]:
    expect = {"ok": (wire.REPLIES[call],)}
    assert _same(wire.decode(wire.encode("ok", value), expect, "t")[1], value)


def test_token_payloads_cross_as_raw_bytes_not_base64():
  tokens = np.arange(1 << 16, dtype=np.int32)
  frame = wire.encode("seed", tokens)
  assert len(frame) < tokens.nbytes + 200


class _RunsCode:
  def __init__(self, marker):
    self.marker = marker

  def __reduce__(self):
    return (os.system, (f"touch {self.marker}",))


def test_a_pickle_is_refused_and_never_run(tmp_path):
  marker = tmp_path / "ran"
  frame = pickle.dumps(_RunsCode(marker))
  with pytest.raises(wire.WireError, match=r"^rollout host 0 sent a message that does not decode"):
    wire.decode(frame, wire.MESSAGES, "rollout host 0")
  assert not marker.exists()


@pytest.mark.parametrize(
  ("frame", "match"),
  [
    (b"\x00\x00", "does not decode"),
    (b"\x00\x00\x00\x02{}", r"does not decode \(the header is not \{kind, args, arrays\}\)"),
    (wire.encode("start", PROMPT, 1), r"sent a 'start' message; expected one of \['report'\]"),
    (wire.encode("report", [META], "3", STATS, 4), r"'report' message that does not decode"),
    (wire.encode("report", [META], True, STATS, 4), "expected an integer"),
    (wire.encode("report", [{"group_id": 1}], 3, STATS, 4), "lacks the fields"),
    (wire.encode("report", [META], 3), "with 2 arguments, not 4"),
    (wire.encode("report", [META], 3, STATS, 4) + b"x", "1 bytes follow the last array"),
  ],
)
def test_a_malformed_message_is_one_sentence_naming_the_peer(frame, match):
  with pytest.raises(wire.WireError, match=match) as e:
    wire.decode(frame, {"report": wire.MESSAGES["report"]}, "rollout host 3 (h, pid 1)")
  msg = str(e.value)
  assert msg.startswith("rollout host 3 (h, pid 1) sent") and "\n" not in msg


def test_arrays_of_objects_neither_cross_nor_decode():
  with pytest.raises(TypeError, match="object"):
    wire.encode("seed", np.array([None], object))
  frame = wire.encode("seed", np.zeros(2, np.uint8))
  forged = frame.replace(b'"|u1"', b'"|O8"')  # the header claims an object array
  with pytest.raises(wire.WireError, match="not accepted"):
    wire.decode(forged, wire.MESSAGES, "t")
