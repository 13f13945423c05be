"""Weight sync out of a train mesh that spans processes: each process sends its own shards.

Every trainer process runs the same :class:`ShardPublisher`. A publish casts the params to the
wire dtype on the devices (a fresh copy, so the next update may donate the trainer's state),
then, in a publisher thread, copies this process's first-hand shards to host memory, puts them
in Ray's object store (one object per process and version) and posts the reference to the run's
*board*, a small named Ray actor. Process 0 waits on the board until every process has posted
the version, and only then makes it visible to ``take_newer``: the rollout adopts a
`ShardedWeights` (a wire format and one reference per process), and each Ray rollout actor
reassembles the leaves from the parts (`knitjax.distributed.weight_parts`). No process ever holds
another's shards; the whole parameter set exists on a host only inside the rollout actors.

Counters per process: versions published, seconds from dispatch to visible (process 0) or posted
(the others), seconds the trainer's thread was held, and the bytes this process put on the wire:
over the processes they add up to one copy of the params (a leaf replicated across processes is
sent by the process holding its replica 0), which tests/distributed/test_trainer_processes.py
checks.
"""

from __future__ import annotations

import threading
import time

import jax
from flax import nnx

from knitjax import faultpoints
from knitjax.distributed.weight_parts import ShardedWeights, own_parts, parts_bytes, wire_format_of
from knitjax.runtime.weight_sync import SYNC_DTYPES, AsyncPublisher, wire_copy, wire_dtype

COLLECT_TIMEOUT_S = 300.0  # process 0 waits this long for every process's part of a version


class _Board:
  """Ray actor: each version's parts, one reference per trainer process (threaded)."""

  def __init__(self, processes: int):
    self._n = processes
    self._parts: dict[int, dict[int, object]] = {}
    self._cv = threading.Condition()

  def post(self, version: int, process: int, refs: list) -> None:
    with self._cv:
      self._parts.setdefault(version, {})[process] = refs[0]
      self._cv.notify_all()

  def collect(self, version: int, timeout_s: float) -> list | None:
    """Every process's reference of ``version`` in process order (None: not all in time);
    older versions are dropped."""
    with self._cv:
      done = self._cv.wait_for(lambda: len(self._parts.get(version, {})) == self._n, timeout_s)
      for v in [v for v in self._parts if v < version]:
        del self._parts[v]
      if not done:
        return None
      return [self._parts[version][k] for k in range(self._n)]


def board_name(run: str) -> str:
  return f"knitjax-weights-{run}"


def create_board(run: str, processes: int):
  """Process 0: the run's board, named so the other trainer processes find it, on process 0's
  own node (a soft affinity left it on a rollout node, and a rollout node can be lost mid-run)."""
  import ray
  from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

  from knitjax.distributed.ray_storage import NAMESPACE

  here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
  return (
    ray.remote(_Board)
    .options(
      name=board_name(run),
      namespace=NAMESPACE,
      num_cpus=0,
      max_concurrency=4,
      scheduling_strategy=here,
    )
    .remote(processes)
  )


def connect_board(run: str):
  import ray

  from knitjax.distributed.ray_storage import NAMESPACE

  return ray.get_actor(board_name(run), namespace=NAMESPACE)


class ShardPublisher(AsyncPublisher):
  """The publishing side of every trainer process; process 0 also the taking side.

  An `AsyncPublisher` like `knitjax.runtime.weight_sync.WeightSync` (``publish``, ``wait``,
  ``take_newer``, ``close`` and the counters), so the pipeline and the rollout thread use both
  alike.

  Args:
    board: the run's board actor.
    sync_dtype: wire dtype, ``"bfloat16"`` or ``"float32"``.
    publish: ``"async"`` (host copy and object-store put in a thread) or ``"blocking"``.
  """

  def __init__(self, board, *, sync_dtype: str = "float32", publish: str = "async"):
    if sync_dtype not in SYNC_DTYPES:
      raise ValueError(f"sync_dtype={sync_dtype!r} is not accepted; choose one of {SYNC_DTYPES}.")
    super().__init__(publish)
    self._board = board
    self.process, self.processes = jax.process_index(), jax.process_count()
    self.sync_dtype, self.route = sync_dtype, "process_shards"
    self._stage = None
    self._wire_format = None
    self._refs: dict[int, object] = {}  # this process's recent parts (kept alive for the rollout)

  def publish(self, params, version: int, *, block: bool = False) -> float:
    t0 = time.perf_counter()
    self.wait()  # the previous publish first (and its error, if it failed)
    wire_format, leaves = wire_format_of(nnx.to_pure_dict(params))
    if self._stage is None:
      dtypes = [wire_dtype(x.dtype, self.sync_dtype) for x in leaves]
      self._wire_format = wire_format.__class__(
        wire_format.paths, wire_format.shapes, tuple(map(str, dtypes))
      )
      self._stage = jax.jit(wire_copy(dtypes), out_shardings=[x.sharding for x in leaves])
    self._hand_off(version, self._stage(leaves), t0, block=block)
    held = time.perf_counter() - t0
    self.blocked_s += held
    return held

  def _complete(self, version: int, staged: list, t0: float) -> None:
    import ray

    jax.block_until_ready(staged)
    parts = own_parts(staged)
    ref = ray.put(parts)
    self._refs[version] = ref
    for v in [v for v in self._refs if v < version - 2]:
      del self._refs[v]  # the rollout holds what it adopted; Ray frees the rest
    ray.get(self._board.post.remote(version, self.process, [ref]))
    faultpoints.point("weight_sync")
    latest = None  # only process 0 hands versions to the rollout
    if self.process == 0:
      refs = ray.get(self._board.collect.remote(version, COLLECT_TIMEOUT_S))
      if refs is None:
        raise TimeoutError(
          f"the trainer processes did not all send their shards of version {version} within "
          f"{COLLECT_TIMEOUT_S:.0f} s: a trainer process stopped."
        )
      latest = ShardedWeights(self._wire_format, tuple(refs))
    self._record(version, latest, t0, parts_bytes(parts))

  def take_newer(self, version: int | None) -> tuple[int, ShardedWeights] | None:
    return self._newest(version)
