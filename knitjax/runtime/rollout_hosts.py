"""Rollout hosts: a disaggregated run whose rollout runs in other processes than its trainer.

With ``config.topology.rollout_hosts = N`` the trainer (``python -m knitjax.main``, one process,
training on all of its devices) listens on ``topology.rollout_listen``, writes the bound address
to ``WORKDIR/rollout_endpoint.json`` and waits for N rollout hosts: processes started with
``python -m knitjax.main --role=rollout`` and the same ``--config`` and ``--workdir``, each on
its own machine or devices. Each host builds the configured rollout on its local devices and a
storage unit in its memory, and is then driven by the trainer's rollout thread through
`knitjax.rollout.remote` (metadata to the trainer's one admission index, payloads fetched on
demand from the host's unit). Weights go device to device: the trainer stages each version in
the wire dtype and sharding with a `WeightServer`; each host pulls it with a
`WeightClient` straight into its rollout's shardings (`knitjax.runtime.weight_transfer`).

The run's token authenticates both connections: ``KNITJAX_ROLLOUT_TOKEN`` when set (use that
when the workdir is shared more widely than the run), otherwise ``WORKDIR/rollout_token``,
created by the trainer whole or not at all, owner-only (0600) from the start. A token shorter
than 32 bytes, or a token file open to group or others, is refused in one sentence.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import stat
import tempfile
import time

import jax
from absl import logging
from flax import nnx

from knitjax import workdir as wd
from knitjax.config import Config
from knitjax.rollout import remote, remote_host
from knitjax.runtime import builder, rollout_builder
from knitjax.runtime.weight_sync import resolve_sync_dtype, wire_dtype
from knitjax.runtime.weight_transfer import WeightClient, WeightServer
from knitjax.transfer.storage import InProcessStorageUnit

ENDPOINT = "rollout_endpoint.json"
TOKEN_FILE = "rollout_token"
TOKEN_ENV = "KNITJAX_ROLLOUT_TOKEN"


MIN_TOKEN_BYTES = 32  # shorter tokens (an empty file left by a full disk) would let anyone in


def run_token(workdir: str, *, create: bool) -> bytes:
  """The run's token: ``$KNITJAX_ROLLOUT_TOKEN``, else ``WORKDIR/rollout_token`` (the trainer
  creates it when ``create``; a host reads it).

  Raises:
    ValueError: the token is shorter than `MIN_TOKEN_BYTES`, its file is open to group or
      others, or the file cannot be written (one sentence naming the variable or file).
    FileNotFoundError: no token file and no variable.
  """
  env = os.environ.get(TOKEN_ENV)
  if env is not None:
    token = env.strip().encode()
    if len(token) < MIN_TOKEN_BYTES:
      raise ValueError(
        f"{TOKEN_ENV} holds a {len(token)}-byte token; a rollout token needs at least "
        f"{MIN_TOKEN_BYTES} bytes, e.g. the output of `python -c 'import secrets; "
        "print(secrets.token_hex(32))'`."
      )
    return token
  path = wd.path(workdir, TOKEN_FILE)
  remote_dir = wd.is_remote(workdir)
  if create and not path.exists():
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(32)
    if remote_dir:
      path.write_text(token)
    else:
      _write_private(os.fspath(path), token.encode())
  if not path.exists():
    raise FileNotFoundError(
      f"no rollout token at {path} and {TOKEN_ENV} is not set; start the trainer first or set "
      f"{TOKEN_ENV} to the same value for the trainer and every rollout host."
    )
  if not remote_dir:
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
      raise ValueError(
        f"the rollout token {path} is open to group or others (mode {mode:04o}); run "
        f"`chmod 600 {path}`, or delete it and the trainer makes a new one."
      )
  token = path.read_text().strip().encode()
  if len(token) < MIN_TOKEN_BYTES:
    raise ValueError(
      f"the rollout token {path} holds {len(token)} bytes, fewer than the {MIN_TOKEN_BYTES} a "
      "token needs (a write cut short by a full disk?); delete it and the trainer makes a new one."
    )
  return token


def _write_private(path: str, data: bytes) -> None:
  """Writes ``path`` whole or not at all, owner-only from the start: a temp file (mode 0600) in
  the same folder, written, synced and renamed over ``path``.

  Raises:
    ValueError: the write failed (a full disk, say), naming the path; no file is left.
  """
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".rollout_token.")
  try:
    try:
      view = memoryview(data)
      while view:
        view = view[os.write(fd, view) :]
      os.fsync(fd)
    finally:
      os.close(fd)
    os.rename(tmp, path)
  except OSError as e:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise ValueError(
      f"could not write the rollout token {path} ({e.strerror or e}); free space in the workdir "
      f"or set {TOKEN_ENV}."
    ) from None


class _Channel:
  """`remote.WeightChannel` over a `WeightServer` (params arrive as an nnx.State)."""

  def __init__(self, server: WeightServer):
    self._server = server

  @property
  def address(self) -> str:
    return self._server.address

  def stage(self, params, *pull_ids: int) -> None:
    self._server.stage(jax.tree.leaves(nnx.to_pure_dict(params)), *pull_ids)


def remote_rollout(config: Config, train_mesh, params, workdir: str) -> remote.RemoteRollout:
  """The trainer's side: waits for ``topology.rollout_hosts`` hosts and returns them as one
  rollout. ``params``: the published params (the policy, or the LoRA adapters)."""
  r = config.topology
  sync = resolve_sync_dtype(config.sync.dtype, config.model.dtype)
  wire = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, wire_dtype(x.dtype, sync)), nnx.to_pure_dict(params)
  )
  host = remote.split_address(r.rollout_listen)[0]
  endpoint = wd.path(workdir, ENDPOINT)

  def weights(specs, mesh_shape):
    server = WeightServer(train_mesh, specs, mesh_shape, sync_dtype=sync, address=f"{host}:0")
    return _Channel(server)

  def on_listen(address):
    endpoint.parent.mkdir(parents=True, exist_ok=True)
    endpoint.write_text(json.dumps({"address": address, "pid": os.getpid(), "time": time.time()}))
    logging.info(
      "waiting for %d rollout host(s) at %s: start each with `python -m knitjax.main "
      "--role=rollout --config ... --workdir %s`",
      r.rollout_hosts,
      address,
      workdir,
    )

  return remote.RemoteRollout(
    r.rollout_hosts,
    r.rollout_listen,
    run_token(workdir, create=True),
    published=wire,
    weights=weights,
    timeout_s=r.rollout_host_wait_s,
    on_listen=on_listen,
  )


def _attach(config: Config, unit_id: int, paths: list) -> remote_host.Attached:
  """Builds a host's rollout (on all its local devices) and storage unit ``unit_id``."""
  prompts = builder.build_prompts(config)
  unit = InProcessStorageUnit(
    rollout_builder.build_storage_limits(config, prompts), unit_id=unit_id
  )
  hosted = rollout_builder.hosted_rollout(config, unit)
  own = dict(remote.leaf_paths(nnx.to_pure_dict(hosted.params)))
  leaves = []
  for path, shape, dtype in paths:
    x = own.get(tuple(path))
    if x is None or tuple(x.shape) != tuple(shape):
      raise ValueError(
        f"the trainer publishes {'/'.join(map(str, path))} with shape {tuple(shape)} but this "
        f"host's model has {None if x is None else tuple(x.shape)}: give the host the trainer's "
        "config."
      )
    leaves.append(jax.ShapeDtypeStruct(tuple(shape), jax.numpy.dtype(dtype), sharding=x.sharding))

  def puller(address: str):
    client = WeightClient(address, leaves, address=f"{_own_host(address)}:0")

    def fetch(pull_id: int):
      pure: dict = {}
      for (path, _, _), x in zip(paths, client.pull(pull_id), strict=True):
        node = pure
        for k in path[:-1]:
          node = node.setdefault(k, {})
        node[path[-1]] = x
      state = jax.tree.map(lambda x: x, hosted.params)  # a new State of the same structure
      nnx.replace_by_pure_dict(state, pure)
      return state

    return fetch

  specs = [x.sharding.spec for x in leaves]
  return remote_host.Attached(hosted.rollout, unit, hosted.mesh, specs, puller)


def _own_host(trainer_address: str) -> str:
  """Where this host's transfer server listens: its own address on the route to the trainer
  (loopback when the trainer is local), never every interface. A UDP socket's ``connect``
  only picks the route; nothing is sent."""
  host = remote.split_address(trainer_address)[0]
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
    probe.connect((host, 9))
    return probe.getsockname()[0]


def _endpoint(workdir: str, wait_s: float) -> str:
  path, deadline = wd.path(workdir, ENDPOINT), time.monotonic() + wait_s
  while not path.exists():
    if time.monotonic() > deadline:
      raise TimeoutError(
        f"no trainer wrote {path} within {wait_s:.0f} s; start the trainer with "
        "config.topology.rollout_hosts > 0 and the same --workdir."
      )
    time.sleep(0.5)
  return json.loads(path.read_text())["address"]


def serve(config: Config, workdir: str) -> dict:
  """``python -m knitjax.main --role=rollout``: serves as one of the trainer's rollout hosts
  until the trainer is done; returns this host's counters."""
  r = config.topology
  if not r.rollout_hosts:
    raise ValueError(
      "--role=rollout needs config.topology.rollout_hosts > 0 (the trainer waits for that many "
      "hosts); set it for the trainer and the hosts alike."
    )
  address = _endpoint(workdir, r.rollout_host_wait_s)
  token = run_token(workdir, create=False)
  logging.info("rollout host: connecting to the trainer at %s", address)
  counts = remote_host.serve(
    lambda: _endpoint(workdir, r.rollout_host_wait_s),
    token,
    lambda unit_id, paths: _attach(config, unit_id, paths),
    timeout_s=r.rollout_host_wait_s,
  )
  logging.info("rollout host finished: %s", json.dumps(counts))
  # beside the run's records, for benchmarks (pull_s: seconds the versions took to arrive)
  wd.replace_atomically(
    wd.path(workdir) / f"rollout_host{counts['unit_id']}.json", json.dumps(counts)
  )
  return counts
