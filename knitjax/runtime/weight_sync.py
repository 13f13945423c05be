"""Weight sync: the trainer publishes versioned parameters; the rollout adopts the newest.

A publish is a few dispatches from the trainer's thread, none of which waits:

1. ``stage``, one jitted function on the train mesh, casts the params to the wire dtype
   (``sync.dtype``: bfloat16 halves the bytes) into fresh buffers, so the next train
   step may donate the trainer's state (XLA orders that step after ``stage`` has read it).
2. ``jax.device_put`` across, which JAX does buffer by buffer, device to device, only where
   every destination shard exists whole on some source device; otherwise (an FSDP- or
   tensor-sharded leaf onto a replicated rollout leaf, the plain publish of before) it falls back
   to ``np.asarray`` of the whole array, a trip through the host. Two routes avoid that:

   - *shard-wise* (train and rollout meshes of equally many devices, e.g. the default half
     split): ``stage`` keeps the train sharding, each shard crosses once to the rollout device in
     its place (:func:`mirror_sharding`), and a jitted identity on the rollout devices gathers
     their own sharding. Train devices hold one extra wire-dtype copy of their shards.
   - *staged* (other device counts): ``stage`` reshards each leaf so that every rollout shard
     exists whole on a train device (:func:`staging_sharding`); for a data-parallel rollout mesh
     that is the whole params in the wire dtype on every train device while the copy runs.

A publisher thread waits for the copy and only then makes the version visible to
``take_newer``, so the rollout never adopts params still being written. At most one publish is
in flight: a second waits for the first (backpressure instead of unbounded staging memory).
``publish="blocking"`` waits in the trainer's thread instead (the reference for the benchmark).

With LoRA the trainer publishes only the adapters: the frozen base is placed on the rollout mesh
once (``base``), and each version taken is that base joined with the version's adapters.
"""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from knitjax import faultpoints
from knitjax.models import lora

SYNC_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def resolve_sync_dtype(sync_dtype: str, compute_dtype: str) -> str:
  """The wire dtype: ``"auto"`` is bfloat16 when the model computes in bfloat16, else float32.

  A float32 model keeps float32 on the wire, so its rollout log-probs equal the trainer's.
  """
  if sync_dtype == "auto":
    return "bfloat16" if compute_dtype == "bfloat16" else "float32"
  return sync_dtype


def wire_dtype(dtype, sync_dtype: str):
  """Floating leaves wider than the wire dtype are narrowed to it; others are sent as stored."""
  wire = jnp.dtype(SYNC_DTYPES[sync_dtype])
  if jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize > wire.itemsize:
    return wire
  return jnp.dtype(dtype)


def wire_copy(dtypes):
  """``f(leaves)``: each leaf cast to its wire dtype in a fresh buffer (jit it with the sharding
  wanted). ``copy=True``: a leaf already in the wire dtype still gets its own buffer, never the
  trainer's (which the next train step donates)."""

  def stage(xs):
    return [jnp.array(x.astype(t), copy=True) for x, t in zip(xs, dtypes, strict=True)]

  return stage


def _indices(s: jax.sharding.Sharding, shape) -> set[tuple]:
  return {
    tuple((i.start, i.stop, i.step) for i in idx) for idx in s.devices_indices_map(shape).values()
  }


def via_host(src: jax.sharding.Sharding, dst: jax.sharding.Sharding, shape) -> bool:
  """Whether ``jax.device_put`` from ``src`` to ``dst`` reads the array through the host: some
  destination shard is not held whole by a source device (JAX's rule for its device-to-device
  path, ``shard_sharded_device_array_slow_path``)."""
  return not _indices(dst, shape) <= _indices(src, shape)


def wire_spec(spec: PartitionSpec, dst_shape: dict, src_mesh, ndim: int) -> PartitionSpec:
  """``spec`` (of a mesh with axis sizes ``dst_shape``) on ``src_mesh``: dimensions keep their
  mesh axes where those have the same size on both meshes (their slices then coincide) and are
  replicated otherwise."""
  kept = []
  for entry in tuple(spec) + (None,) * (ndim - len(spec)):
    axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
    same = all(dst_shape.get(a) == src_mesh.shape.get(a) for a in axes)
    kept.append(entry if axes and same else None)
  return PartitionSpec(*kept)


def _mesh_of(s: jax.sharding.Sharding) -> jax.sharding.Mesh:
  if isinstance(s, NamedSharding):
    return s.mesh
  return jax.sharding.Mesh(np.array(sorted(s.device_set, key=lambda d: d.id)), ("devices",))


def staging_sharding(
  src: jax.sharding.Sharding, dst: jax.sharding.Sharding, shape
) -> NamedSharding:
  """A sharding on ``src``'s devices holding every shard of ``dst`` whole on some device.

  The destination's spec by :func:`wire_spec`; if that still misses a destination slice, the
  leaf is staged fully replicated.
  """
  mesh = _mesh_of(src)
  if isinstance(dst, NamedSharding):
    staged = NamedSharding(mesh, wire_spec(dst.spec, dict(dst.mesh.shape), mesh, len(shape)))
    if not via_host(staged, dst, shape):
      return staged
  return NamedSharding(mesh, PartitionSpec())


def mirror_sharding(src: jax.sharding.Sharding, dst: jax.sharding.Sharding) -> NamedSharding | None:
  """``src``'s sharding (mesh shape, axis names, spec) on ``dst``'s devices, or None unless both
  are NamedShardings over equally many devices."""
  if not (isinstance(src, NamedSharding) and isinstance(dst, NamedSharding)):
    return None
  if src.mesh.size != dst.mesh.size:
    return None
  devices = np.array(list(dst.mesh.devices.flat)).reshape(src.mesh.devices.shape)
  mesh = jax.sharding.Mesh(devices, src.mesh.axis_names, axis_types=src.mesh.axis_types)
  return NamedSharding(mesh, src.spec)


class AsyncPublisher:
  """What every weight publisher shares: at most one publish in flight (a second waits for the
  first: backpressure instead of unbounded staging memory), completed by a publisher thread
  (``publish="async"``) or in the caller's thread (``"blocking"``), its error surfaced by the
  next publish or ``wait``, and the newest complete version kept for the rollout.

  A subclass dispatches its work, hands the pending part to ``_hand_off``, and implements
  ``_complete(version, job, t0)``, which finishes it and calls ``_record``.
  """

  def __init__(self, publish: str):
    if publish not in ("async", "blocking"):
      raise ValueError(f"publish={publish!r} is not accepted; choose async or blocking.")
    self.mode = publish
    self._lock = threading.Lock()
    self._ready = threading.Condition(self._lock)
    self._latest: tuple[int, object] | None = None
    self._inflight: tuple[int, object, float] | None = None
    self._error: BaseException | None = None
    self._closed = False
    self.published = 0
    self.publish_s = 0.0  # dispatch to copy complete, summed over versions
    self.blocked_s = 0.0  # time the trainer's thread spent in publish, summed
    self.published_bytes = 0
    self.last_publish_s = 0.0
    self._thread = None
    if publish == "async":
      self._thread = threading.Thread(target=self._loop, name="weight-sync", daemon=True)
      self._thread.start()

  def _complete(self, version: int, job, t0: float) -> None:
    raise NotImplementedError

  def _hand_off(self, version: int, job, t0: float, *, block: bool) -> None:
    """Completes ``job`` now (blocking) or hands it to the publisher thread."""
    if self._thread is None or block:
      self._complete(version, job, t0)
      return
    with self._ready:
      self._inflight = (version, job, t0)
      self._ready.notify_all()

  def _record(self, version: int, latest, t0: float, nbytes: int) -> None:
    """Counts a completed publish; ``latest`` (None: none) becomes what ``take_newer`` sees."""
    seconds = time.perf_counter() - t0
    with self._ready:
      if latest is not None:
        self._latest = (version, latest)
      self.published += 1
      self.publish_s += seconds
      self.last_publish_s = seconds
      self.published_bytes += nbytes

  def _loop(self) -> None:
    while True:
      with self._ready:
        while self._inflight is None and not self._closed:
          self._ready.wait()
        if self._inflight is None:
          return
        job = self._inflight
      try:
        self._complete(*job)
      except BaseException as e:  # surfaced by the next publish or wait
        with self._ready:
          self._error = e
      with self._ready:
        self._inflight = None
        self._ready.notify_all()

  def wait(self) -> None:
    """Blocks until the publish in flight (if any) is visible to ``take_newer``."""
    with self._ready:
      while self._inflight is not None and self._error is None:
        self._ready.wait()
      if self._error is not None:
        raise RuntimeError(f"a weight publish failed: {self._error!r}") from self._error

  def _newest(self, version: int | None):
    """The newest complete ``(version, value)`` if newer than ``version`` (None: any)."""
    with self._lock:
      latest = self._latest
    if latest is None or (version is not None and latest[0] <= version):
      return None
    return latest

  def close(self) -> None:
    """Lets the in-flight publish finish, then stops the publisher thread."""
    with self._ready:
      self._closed = True
      self._ready.notify_all()
    if self._thread is not None:
      self._thread.join(timeout=60)


class WeightSync(AsyncPublisher):
  """The hand-off point between the trainer (publishes) and the rollout (takes).

  Args:
    rollout_shardings: pytree of shardings of the published params on the rollout mesh.
    base: with LoRA, the frozen base already on the rollout mesh (published params are then the
      adapters); None: published params are the whole policy.
    sync_dtype: wire dtype, ``"bfloat16"`` or ``"float32"`` (see :func:`resolve_sync_dtype`).
    publish: ``"async"`` (the copy completes in the background) or ``"blocking"``.
  """

  def __init__(
    self,
    rollout_shardings,
    *,
    base=None,
    sync_dtype: str = "float32",
    publish: str = "async",
  ):
    if sync_dtype not in SYNC_DTYPES:
      raise ValueError(f"sync_dtype={sync_dtype!r} is not accepted; choose one of {SYNC_DTYPES}.")
    super().__init__(publish)
    self._dst = jax.tree.leaves(rollout_shardings)
    self._base = base
    self.sync_dtype = sync_dtype
    # Built at the first publish: the jitted cast-and-reshard on the train mesh, the sharding
    # crossing to the rollout devices, and (shard-wise route) the gather there.
    self._stage = self._staged = self._wire = self._gather = None
    self.route = ""

  def _build_stage(self, leaves):
    if len(leaves) != len(self._dst):
      raise ValueError(
        f"published params have {len(leaves)} leaves but the rollout shardings {len(self._dst)}."
      )
    stage = wire_copy([wire_dtype(x.dtype, self.sync_dtype) for x in leaves])

    mirrors = [mirror_sharding(x.sharding, d) for x, d in zip(leaves, self._dst, strict=True)]
    if all(m is not None for m in mirrors):
      # Shard-wise: each train shard crosses once, to the rollout device in its place; the
      # rollout devices then gather their sharding among themselves.
      self.route = "shard_wise"
      self._wire = mirrors
      self._gather = jax.jit(lambda xs: xs, out_shardings=self._dst)
      self._staged = [x.sharding for x in leaves]
      return jax.jit(stage, out_shardings=self._staged)
    self.route = "staged"
    self._wire, self._gather = self._dst, None
    pairs = zip(leaves, self._dst, strict=True)
    self._staged = [staging_sharding(x.sharding, d, x.shape) for x, d in pairs]
    return jax.jit(stage, out_shardings=self._staged)

  def host_leaves(self, params) -> int:
    """Leaves of ``params`` whose copy across would go through the host (0 by construction;
    checked with :func:`via_host` on the shardings this sync uses)."""
    leaves = jax.tree.leaves(params)
    if self._stage is None:
      self._stage = self._build_stage(leaves)
    pairs = zip(self._staged, self._wire, leaves, strict=True)
    return sum(via_host(s, w, x.shape) for s, w, x in pairs)

  def publish(self, params, version: int, *, block: bool = False) -> float:
    """Starts copying ``params`` onto the rollout mesh as ``version``.

    Returns the seconds the caller was held: the whole copy when blocking (``block`` or
    ``publish="blocking"``), otherwise the dispatch plus any wait for the previous publish.
    """
    t0 = time.perf_counter()
    leaves, treedef = jax.tree.flatten(params)
    self.wait()  # the previous publish first (and its error, if it failed)
    if self._stage is None:
      self._stage = self._build_stage(leaves)
    # Each jitted part runs under its own devices' mesh (publish is called under the trainer's).
    with jax.set_mesh(_mesh_of(leaves[0].sharding)):
      staged = self._stage(leaves)
    moved = jax.device_put(staged, self._wire)
    if self._gather is not None:
      with jax.set_mesh(self._dst[0].mesh):
        moved = self._gather(moved)
    self._hand_off(version, jax.tree.unflatten(treedef, moved), t0, block=block)
    held = time.perf_counter() - t0
    self.blocked_s += held
    return held

  def _complete(self, version: int, moved, t0: float) -> None:
    jax.block_until_ready(moved)
    faultpoints.point("weight_sync")
    self._record(version, moved, t0, lora.tree_bytes(moved))

  def take_newer(self, version: int | None) -> tuple[int, object] | None:
    """The newest complete ``(version, params)`` if newer than ``version`` (None: any), else None.

    With a ``base`` the params are the base joined with the published adapters (no copy).
    """
    latest = self._newest(version)
    if latest is not None and self._base is not None:
      return latest[0], lora.combine(self._base, latest[1])
    return latest
