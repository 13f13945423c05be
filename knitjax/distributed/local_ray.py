"""Starting or joining Ray for a run, with as little of it reachable by others as Ray allows.

A run that needs Ray (``topology.storage="ray"``, ``topology.rollout_workers > 0``) joins
``topology.ray_address`` when given (a cluster someone manages), otherwise starts a local Ray.
What Ray 2.60 exposes when started with ``ray.init`` and what is done about it:

- Its gRPC servers (GCS, raylets, core workers) listen on every interface whatever node address
  ``ray.init`` is given (a loopback address is mapped to the node's own). Ray's token
  authentication guards them and is on by default; a local Ray is refused when
  ``RAY_AUTH_MODE=disabled``.
- Its token: a run's own, ``WORKDIR/ray_token`` (``token_dir``), unless the user chose one
  (``RAY_AUTH_TOKEN_PATH``, ``RAY_AUTH_TOKEN``; else Ray's ``~/.ray/auth_token``). Ray writes a
  token file with the default umask (0644: readable by every user of the machine, who could
  then call the cluster). It is created owner-only (0600) before Ray would create it, and an
  existing one open to group or others is made owner-only, with a warning.
- Its autoscaler monitor serves Prometheus metrics without authentication on every interface
  (``AUTOSCALER_METRIC_PORT``, default 44217), and ``ray.init`` cannot turn the monitor off: the
  monitor is started with an invalid port, so its metrics server does not start. Metrics
  collection is off (``enable_metrics_collection``); the dashboard is not started.
- The runtime-env agent's HTTP server listens on the node address; it answers 401 without the
  token.

A local Ray is also started lean: the raylet prestarts no idle Python workers (by default it asks
for one per CPU when the driver registers, about 80 MiB each). knitjax runs only actors, each in a
worker of its own, so the pool sits idle but for the workers actors take. ``local_init_kwargs``
holds the settings; docs/disaggregated.md has the measured footprint
(``python -m lab.scripts.ray_footprint``). The GCS server, raylet, its dashboard and runtime-env
agents (the raylet exits without them), the autoscaler monitor, the log monitor (it carries the
actors' output to the driver) and the API server started without its dashboard stay: ``ray.init``
offers no switch for the last three.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import stat
import threading

from absl import logging

RUN_TOKEN = "ray_token"  # a run's own Ray token, in its workdir
MAX_TOKEN_BYTES = 1 << 16  # read to check it decodes: a token is 64 characters
_MONITOR_PORT = "AUTOSCALER_METRIC_PORT"  # read by the monitor process that ray.init starts


def ensure_ray(address: str = "", *, needed_by: str = "this run", token_dir: str = "") -> None:
  """Joins ``address``, or starts a local Ray as the module docstring describes.

  ``token_dir`` (a run's local workdir): a local Ray authenticates with a token of that run,
  ``TOKEN_DIR/ray_token`` (made owner-only), unless the user chose one (``RAY_AUTH_TOKEN`` or
  ``RAY_AUTH_TOKEN_PATH``); the run's other processes join with the same file.

  Raises:
    ValueError: Ray is not installed, ``RAY_AUTH_MODE=disabled`` for a local start, or Ray's
      token file is not a regular file of UTF-8 text, or is open to others and cannot be made
      owner-only (one sentence).
  """
  try:
    import ray
  except ImportError:
    raise ValueError(f"{needed_by} needs Ray: pip install -e '.[ray]'.") from None
  if ray.is_initialized():
    return
  if token_dir and not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
    run_token = os.path.join(os.path.abspath(token_dir), RUN_TOKEN)
    if not address or os.path.exists(run_token):  # a local start makes it; a join reads it
      os.environ["RAY_AUTH_TOKEN_PATH"] = run_token
  check_ray_token()  # Ray itself hangs on a FIFO and names no file when the text is not UTF-8
  with _our_signals():
    _init(ray, address)


@contextlib.contextmanager
def _our_signals():
  """Keeps this process's SIGTERM and SIGINT handlers across ``ray.init``.

  ``ray.init`` replaces SIGTERM's with ``sys.exit`` and its core worker installs a native
  failure handler that prints a stack and aborts; the run's own handlers (`knitjax.cli`: one
  line, exit 143 or 130, nothing lost) are put back once Ray has started.
  """
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    yield
  finally:
    for s, handler in saved.items():
      if handler is not None:
        signal.signal(s, handler)


def _init(ray, address: str) -> None:
  if address:
    ray.init(address=address, include_dashboard=False)
    return
  if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
    raise ValueError(
      "RAY_AUTH_MODE=disabled would start a local Ray that accepts unauthenticated calls on every "
      "interface; unset it, or start Ray yourself and pass config.topology.ray_address."
    )
  private_ray_token()
  saved = os.environ.get(_MONITOR_PORT)
  os.environ[_MONITOR_PORT] = "-1"  # the monitor logs that its metrics server did not start
  try:
    ray.init(**local_init_kwargs())
  finally:
    if saved is None:
      os.environ.pop(_MONITOR_PORT)
    else:
      os.environ[_MONITOR_PORT] = saved


def local_init_kwargs() -> dict:
  """What ``ensure_ray`` passes to ``ray.init`` for a local start (Ray 2.60's names).

  ``prestart_worker_first_driver`` is Ray's own switch (``ray_config_def.h``) for the workers the
  raylet starts when the first driver registers; without them each actor's worker is started
  when its lease asks for one, as for any actor once the pool is used up: an actor's first call
  can wait about 0.4 s longer. Ray's other prestart (ahead of a backlog of tasks) is left on:
  knitjax submits no tasks, so it never fires.
  """
  return {
    "include_dashboard": False,
    "_system_config": {
      "enable_metrics_collection": False,  # nothing serves or exports metrics
      "prestart_worker_first_driver": False,  # no idle worker per CPU at the first driver
    },
  }


def ray_token_path() -> str | None:
  """The file Ray reads its token from (None: ``RAY_AUTH_TOKEN`` holds it)."""
  if os.environ.get("RAY_AUTH_TOKEN"):
    return None
  return os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")


def check_ray_token() -> None:
  """Raises ValueError (one sentence naming the file) unless Ray's token file, where there is one,
  is a regular file of UTF-8 text: Ray fails on a directory with a traceback, waits forever to
  read a FIFO, and names no file when the text does not decode.
  """
  path = ray_token_path()
  if path is None or not os.path.exists(path):
    return  # RAY_AUTH_TOKEN holds it, or a local start makes it
  fix = "point RAY_AUTH_TOKEN_PATH at the file that holds the token (64 hex digits)"
  mode = os.stat(path).st_mode
  if not stat.S_ISREG(mode):
    raise ValueError(f"Ray's token {path} is {_file_kind(mode)}, not a regular file; {fix}.")
  try:
    with open(path, "rb") as f:
      f.read(MAX_TOKEN_BYTES).decode("utf-8")
  except UnicodeDecodeError:
    raise ValueError(f"Ray's token {path} is not UTF-8 text; {fix}.") from None
  except OSError as e:
    raise ValueError(f"Ray's token {path} cannot be read ({e.strerror}); {fix}.") from None


def _file_kind(mode: int) -> str:
  kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
  return next((name for test, name in kinds if test(mode)), "a device")


def private_ray_token() -> None:
  """Makes Ray's token file owner-only: creates it (0600, as Ray would, 256 random bits) when
  missing, tightens an existing one that group or others may read.

  Raises:
    ValueError: the file is not a regular file of UTF-8 text (`check_ray_token`), or is open to
      others and cannot be changed (one sentence naming it).
  """
  path = ray_token_path()
  if path is None:
    return
  if not os.path.exists(path):
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    try:
      fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it meanwhile: check that one below
      pass
    else:
      try:
        with os.fdopen(fd, "w") as f:
          f.write(secrets.token_hex(32))
        return
      except OSError:
        with contextlib.suppress(OSError):
          os.unlink(path)
        raise
  check_ray_token()
  mode = stat.S_IMODE(os.stat(path).st_mode)
  if not mode & 0o077:
    return
  try:
    os.chmod(path, 0o600)
  except OSError as e:
    raise ValueError(
      f"Ray's token {path} is open to group or others (mode {mode:04o}) and cannot be made "
      f"owner-only ({e.strerror}); anyone who reads it can run code in the run's Ray: "
      f"`chmod 600 {path}`."
    ) from None
  logging.warning(
    "made Ray's token %s owner-only (it was %04o): anyone who reads it can run code in Ray.",
    path,
    mode,
  )


def ray_failure(error: BaseException) -> str | None:
  """One sentence for an error of the run's Ray cluster (an actor that died past its restarts,
  a node that became unreachable: Ray marks it dead after about a minute of failed health
  checks, and an actor pinned to it cannot be rescheduled), else None. The error or one it was
  raised from must be Ray's."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if type(error).__module__.startswith("ray."):
      first = (str(error).strip().splitlines() or [""])[-1][:300]
      return (
        f"the run's Ray cluster lost a part the run needs ({type(error).__name__}: {first}); "
        "check that every Ray node is up and reachable (`ray status`)."
      )
    error = error.__cause__ or error.__context__
  return None
