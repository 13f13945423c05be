"""The rollout hosts' wire format: every message is data, decoded by the type its kind expects.

Trainer and rollout hosts (`knitjax.rollout.remote`, `knitjax.rollout.remote_host`) exchange
messages over ``multiprocessing.connection`` connections, which authenticate the peer (HMAC with
the run's token) but would unpickle whatever it sends: an authenticated peer could run code.
Nothing here is pickled. A message is one byte frame: a 4-byte length, a JSON header
``{"kind": ..., "args": [...], "arrays": [[dtype, shape], ...]}`` and the raw bytes of the NumPy
arrays the arguments hold, appended after the header (token payloads pay no base64). Records
(frozen dataclasses: ``GroupMeta``, ``Prompt``, ``GroupPayload``, ``RolloutStats``) cross in the
form of the record codec `knitjax.records` and are rebuilt with ``records.from_json``.

:data:`MESSAGES` lists every message of the protocol with the types of its arguments; a receiver
names the kinds it accepts at that point and gets them back checked against those types. A
frame that does not decode, a kind not expected, or an argument of another type is one
:class:`WireError` sentence naming the peer.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import struct
import types
import typing
from collections.abc import Mapping, Sequence
from multiprocessing import connection as mpc
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

from knitjax import records
from knitjax.rollout.contract import RolloutStats
from knitjax.tasks.prompts import Prompt
from knitjax.transfer.group import GroupMeta
from knitjax.transfer.payload import GroupPayload

_REF = "__array__"  # {"__array__": i}: the i-th array appended after the header
_LEN = struct.Struct(">I")
_DTYPE_KINDS = "biuf"  # bool, signed and unsigned ints, floats: no objects, strings or voids

Path = tuple[tuple[str | int, ...], tuple[int, ...], str]  # a published leaf: path, shape, dtype
Payload = GroupPayload | dict[str, np.ndarray]

# kind -> argument types. Host -> trainer: control, storage, ready, report, and the replies to
# storage calls (ok, error). Trainer -> host: welcome, weights, go, adopt, start, seed, room,
# close, the storage calls (put, get, get_images, release, stats) and error.
MESSAGES: dict[str, tuple] = {
  "control": (str, int),  # a host's control connection: hostname, pid
  "storage": (int,),  # a host's storage connection, for the unit its control connection got
  "welcome": (int, list[Path]),  # the host's unit id, the leaves the trainer publishes
  "ready": (list[PartitionSpec], dict[str, int], int),  # the host's specs, mesh shape, devices
  "weights": (str,),  # the trainer's weight transfer address
  "go": (),  # both connections are up: the host starts serving
  "report": (list[GroupMeta], int, RolloutStats, int),  # metas, capacity, stats, starts seen
  "adopt": (int, int),  # pull id, version
  "start": (Prompt, int),  # prompt, group id
  "seed": (np.ndarray,),  # the host's base key data
  "room": (bool,),  # whether the trainer wants room
  "close": (),
  "put": (int, Payload, list[np.ndarray]),
  "get": (list[int],),
  "get_images": (list[str],),
  "release": (list[int],),
  "stats": (),
  "error": (str, str),  # a failed call: exception type name, message
}
# The answer ("ok", value) to each storage call.
REPLIES: dict[str, Any] = {
  "put": int,
  "get": list[GroupPayload],
  "get_images": list[np.ndarray],
  "release": type(None),
  "stats": dict[str, Any],
}


class WireError(ValueError):
  """A message that does not decode to what its kind expects."""


def encode(kind: str, *args) -> bytes:
  """One frame holding ``kind`` and ``args`` (see the module docstring)."""
  arrays: list[np.ndarray] = []
  body = _to_json(list(args), arrays)
  meta = [[a.dtype.str, list(a.shape)] for a in arrays]
  raw = json.dumps({"kind": kind, "args": body, "arrays": meta}).encode()
  return b"".join([_LEN.pack(len(raw)), raw, *(a.tobytes() for a in arrays)])


def decode(frame: bytes | memoryview, expect: Mapping[str, tuple], who: str) -> tuple:
  """``(kind, *args)`` of ``frame``, ``kind`` one of ``expect`` and ``args`` of its types.

  Raises:
    WireError: one sentence naming ``who`` and what is wrong.
  """
  try:
    frame = memoryview(frame)
    (n,) = _LEN.unpack(frame[: _LEN.size])
    header = json.loads(bytes(frame[_LEN.size : _LEN.size + n]))
    if not isinstance(header, dict) or set(header) != {"kind", "args", "arrays"}:
      raise ValueError("the header is not {kind, args, arrays}")
    kind, args = header["kind"], header["args"]
    arrays = _arrays(header["arrays"], frame[_LEN.size + n :])
  except (ValueError, TypeError, KeyError, struct.error, RecursionError) as e:
    raise WireError(f"{who} sent a message that does not decode ({e}).") from None
  if not isinstance(kind, str) or kind not in expect:
    raise WireError(f"{who} sent a {str(kind)[:40]!r} message; expected one of {sorted(expect)}.")
  types_ = expect[kind]
  if not isinstance(args, list) or len(args) != len(types_):
    raise WireError(f"{who} sent a {kind!r} message with {len(args)} arguments, not {len(types_)}.")
  try:
    return (kind, *(_decode(t, a, arrays) for t, a in zip(types_, args, strict=True)))
  except (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError) as e:
    raise WireError(f"{who} sent a {kind!r} message that does not decode ({e}).") from None


def send(conn: mpc.Connection, kind: str, *args) -> None:
  """Sends one message (see :func:`encode`)."""
  conn.send_bytes(encode(kind, *args))


def recv(conn: mpc.Connection, expect: Sequence[str] | Mapping[str, tuple], who: str) -> tuple:
  """The next message on ``conn``: ``(kind, *args)``, ``kind`` one of ``expect`` (kinds of
  :data:`MESSAGES`, or kind -> argument types). Raises EOFError/OSError when the connection
  ends, :class:`WireError` when the message is not what was expected."""
  if not isinstance(expect, Mapping):
    expect = {k: MESSAGES[k] for k in expect}
  return decode(conn.recv_bytes(), expect, who)


def _to_json(value: Any, arrays: list[np.ndarray]) -> Any:
  """`records.to_json`, with arrays as references into ``arrays`` instead of base64."""
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {f.name: _to_json(getattr(value, f.name), arrays) for f in dataclasses.fields(value)}
  if isinstance(value, np.ndarray):
    if value.dtype.kind not in _DTYPE_KINDS:
      raise TypeError(f"arrays of dtype {value.dtype} do not cross the wire.")
    arrays.append(np.ascontiguousarray(value))
    return {_REF: len(arrays) - 1}
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, PartitionSpec):
    return [list(e) if isinstance(e, tuple) else _to_json(e, arrays) for e in value]
  if isinstance(value, list | tuple):
    return [_to_json(v, arrays) for v in value]
  if isinstance(value, Mapping):
    return {str(k): _to_json(v, arrays) for k, v in value.items()}
  if value is None or isinstance(value, bool | int | float | str):
    return value
  raise TypeError(f"a {type(value).__name__} does not cross the wire.")


def _arrays(meta: Any, raw: memoryview) -> list[np.ndarray]:
  if not isinstance(meta, list):
    raise ValueError("the array list is not a list")
  out, at = [], 0
  for entry in meta:
    dtype_str, shape = entry
    dtype = np.dtype(dtype_str)
    if dtype.kind not in _DTYPE_KINDS or not isinstance(shape, list):
      raise ValueError(f"an array of dtype {dtype_str!r} and shape {shape!r} is not accepted")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
      raise ValueError(f"an array of shape {shape!r} is not accepted")
    n = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    if at + n > len(raw):
      raise ValueError(f"the frame ends inside array {len(out)}")
    out.append(np.frombuffer(raw[at : at + n], dtype).reshape(shape).copy())
    at += n
  if at != len(raw):
    raise ValueError(f"{len(raw) - at} bytes follow the last array")
  return out


def _decode(hint: Any, value: Any, arrays: list[np.ndarray], build: bool = True) -> Any:
  """``value`` checked against ``hint``, its array references resolved; records are built with
  ``records.from_json`` (``build``), or left as checked mappings inside a record."""
  if hint is Any:
    return _resolve(value, arrays)
  if hint is np.ndarray:
    if not (isinstance(value, dict) and set(value) == {_REF}):
      raise TypeError(f"expected an array, got {type(value).__name__}")
    return _array(value, arrays)
  if hint is PartitionSpec:
    if not isinstance(value, list) or not all(
      e is None or isinstance(e, str) or (isinstance(e, list) and _all_str(e)) for e in value
    ):
      raise TypeError(f"expected a PartitionSpec, got {value!r:.80}")
    return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in value))
  if dataclasses.is_dataclass(hint):
    if not isinstance(value, dict):
      raise TypeError(f"expected a {hint.__name__} record, got {type(value).__name__}")
    fields = _hints(hint)
    checked = {
      k: _decode(fields[k], v, arrays, build=False) if k in fields else v for k, v in value.items()
    }
    return records.from_json(hint, checked) if build else checked
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin in (typing.Union, types.UnionType):
    errors = []
    for alt in args:
      try:
        return _decode(alt, value, arrays, build)
      except (ValueError, TypeError, KeyError, IndexError) as e:
        errors.append(str(e))
    raise TypeError(" or ".join(errors))
  if origin in (list, tuple):
    if not isinstance(value, list):
      raise TypeError(f"expected a list, got {type(value).__name__}")
    if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
      if len(value) != len(args):
        raise TypeError(f"expected {len(args)} items, got {len(value)}")
      items = [_decode(a, v, arrays, build) for a, v in zip(args, value, strict=True)]
    else:
      items = [_decode(args[0], v, arrays, build) for v in value]
    return tuple(items) if origin is tuple and build else items
  if origin is dict:
    if not isinstance(value, dict):
      raise TypeError(f"expected a mapping, got {type(value).__name__}")
    return {k: _decode(args[1], v, arrays, build) for k, v in value.items()}
  if hint is float:
    if isinstance(value, bool) or not isinstance(value, int | float):
      raise TypeError(f"expected a number, got {value!r:.80}")
    return float(value)
  if hint is int and isinstance(value, bool):
    raise TypeError(f"expected an integer, got {value!r}")
  if not isinstance(value, hint):
    raise TypeError(f"expected {hint.__name__}, got {value!r:.80}")
  return value


def _resolve(value: Any, arrays: list[np.ndarray]) -> Any:
  if isinstance(value, dict):
    if set(value) == {_REF}:
      return _array(value, arrays)
    return {k: _resolve(v, arrays) for k, v in value.items()}
  if isinstance(value, list):
    return [_resolve(v, arrays) for v in value]
  return value


def _array(ref: dict, arrays: list[np.ndarray]) -> np.ndarray:
  i = ref[_REF]
  if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(arrays):
    raise IndexError(f"array reference {i!r} is not one of the {len(arrays)} arrays sent")
  return arrays[i]


def _all_str(xs: list) -> bool:
  return all(isinstance(x, str) for x in xs)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
  return typing.get_type_hints(cls)
