"""Command-line error handling shared by ``knitjax.main`` and ``lab.bench``."""

import contextlib
import logging as std_logging
import os
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable

from absl import app, flags, logging


class _QuietLibraries(std_logging.Filter):
  """Keeps libraries' INFO chatter out of the progress output: orbax's lines on every save, and
  JAX's note on each backend it tried and could not start (``Unable to initialize backend 'tpu':
  ... Failed to open libtpu.so`` on every CPU machine).

  Orbax's errors about a full disk (a traceback from each of its saving threads) are dropped: the
  checkpointer raises one sentence for it. Other warnings and errors pass: JAX warns when a GPU or
  TPU is present but its backend failed, and a backend named in ``JAX_PLATFORMS`` that fails
  raises.
  """

  def filter(self, record: std_logging.LogRecord) -> bool:
    if ("/orbax/" in record.pathname or record.name == "asyncio") and _disk_full(record):
      return False  # the checkpointer raises one sentence for it; orbax's threads log tracebacks
    if record.levelno >= std_logging.WARNING:
      return True
    return "/orbax/" not in record.pathname and record.name != "jax._src.xla_bridge"


# What a full disk leaves behind in orbax's and TensorStore's threads once orbax gave up a save:
# callbacks into the event loop orbax closed, futures for an executor it shut down.
_AFTERMATH = ("Event loop is closed", "cannot schedule new futures after")


def _disk_full(record: std_logging.LogRecord) -> bool:
  from knitjax import workdir as wd

  e = record.exc_info[1] if record.exc_info else None
  if e is not None and (wd.is_disk_full(e) or _aftermath(e)):
    return True
  return "No space left on device" in record.getMessage()


def _aftermath(e: BaseException) -> bool:
  return isinstance(e, RuntimeError) and str(e).startswith(_AFTERMATH)


def _quiet_threads() -> None:
  """Threads that die of a full disk (TensorBoard's writer, orbax's savers) or of its aftermath
  end without a traceback: the main thread meets the full disk too and says so in one sentence
  (the checkpointer, ``metrics.jsonl``). Every other exception is reported as before."""
  from knitjax import workdir as wd

  thread_hook, unraisable_hook = threading.excepthook, sys.unraisablehook

  def thread_exception(args):
    if args.exc_value is not None and wd.is_disk_full(args.exc_value):
      name = args.thread.name if args.thread is not None else "a thread"
      logging.warning("%s stopped: no space left on device (%s).", name, args.exc_value)
    elif args.exc_value is None or not _aftermath(args.exc_value):
      thread_hook(args)

  def unraisable(u):
    if u.exc_value is None or not (_aftermath(u.exc_value) or wd.is_disk_full(u.exc_value)):
      unraisable_hook(u)

  threading.excepthook, sys.unraisablehook = thread_exception, unraisable


def quiet_libraries() -> None:
  """Drops libraries' INFO records (orbax, JAX's backend probing) from absl's handler; warnings
  still show. Call it before JAX starts its backends.
  """
  logging.get_absl_handler().addFilter(_QuietLibraries())


def one_line(e: Exception) -> str:
  """The informative line of a flag-parsing error (config files raise through a traceback)."""
  if isinstance(e, AttributeError | KeyError):
    return _unknown_field(e)
  text = str(e).replace("\\n", "\n").replace("\\'", "'")
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  if any("Traceback" in line or "Errno" in line for line in lines):
    return lines[-1]
  return " ".join(lines)


def _unknown_field(e: AttributeError | KeyError) -> str:
  """``unknown config field lrr. Did you mean "lr" instead of "lrr"?`` from what ml_collections
  raises: a KeyError whose message is the quoted field and a hint, maybe inside an AttributeError.
  """
  while e.args and isinstance(e.args[0], AttributeError | KeyError):
    e = e.args[0]
  message = e.args[0] if e.args and isinstance(e.args[0], str) else str(e)
  first, *rest = [line.strip() for line in message.splitlines() if line.strip()] or [""]
  return " ".join(["unknown config field", first.strip("'\"") + ("." if rest else ""), *rest])


def _config_file_error(e: BaseException, argv: list[str]) -> str | None:
  """``file:line: message`` when ``e`` was raised while running a config file's own code."""
  if isinstance(e, SyntaxError) and e.filename:
    return f"{e.filename}:{e.lineno}: {type(e).__name__}: {e.msg}"
  configs = {
    os.path.abspath(a.split("=", 1)[1].split(":", 1)[0])
    for a in argv
    if a.startswith(("--config=", "-config="))
  }
  frames = [
    f for f in traceback.extract_tb(e.__traceback__) if os.path.abspath(f.filename) in configs
  ]
  if not frames:
    return None
  f = frames[-1]
  return f"{f.filename}:{f.lineno}: {type(e).__name__}: {one_line(e)}"


def parse_flags(argv: list[str]) -> list[str]:
  """Parses flags; a bad config file or override ends in one line, not a traceback.

  An error raised by the config file's own code (a syntax error, a NameError, a failed import)
  is reported as ``file:line: error``; a bad override names the field.
  """
  argv = [argv[0], *_joined(argv[1:])]
  for arg in argv[1:]:
    if sentence := _renamed_override(arg):
      sys.exit(f"error: bad --config or flag: {sentence}")
  try:
    return flags.FLAGS(argv)
  except SystemExit:
    raise
  except Exception as e:  # the command-line boundary: whatever a config file raises
    where = _config_file_error(e, argv)
    if where is not None:
      sys.exit(f"error: in the config file: {where}")
    if isinstance(e, flags.Error | AttributeError | KeyError | OSError | TypeError | ValueError):
      sys.exit(f"error: bad --config or flag: {one_line(e)}")
    raise


def _renamed_override(arg: str) -> str | None:
  """The sentence naming the new name of an override of a renamed field
  (``--config.train.lr=3e-4`` -> ``config.optimizer.lr``), or what replaced a retired one;
  else None."""
  name = arg.lstrip("-").split("=", 1)[0]
  if name == "role":
    from knitjax.config import RETIRED

    return f"--role {RETIRED['topology.rollout_hosts']}"
  if not name.startswith("config."):
    return None
  from knitjax.config import renamed

  return renamed(name)


def _joined(args: list[str]) -> list[str]:
  """``--config FILE`` as ``--config=FILE``, so the config file's path is found in one place."""
  out, i = [], 0
  while i < len(args):
    if args[i] in ("--config", "-config") and i + 1 < len(args):
      out.append(f"--config={args[i + 1]}")
      i += 2
    else:
      out.append(args[i])
      i += 1
  return out


def request_cpu_devices(count: int) -> None:
  """Asks XLA for ``count`` fake CPU devices (config.mesh.cpu_devices; 0: leave as is).

  Must run before JAX starts; harmless on TPU/GPU, and an XLA_FLAGS setting already given wins.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if count and "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}"


class Terminated(BaseException):
  """SIGTERM, raised in the main thread where Python delivers signals (a BaseException, as
  KeyboardInterrupt is, so no ``except Exception`` on the way swallows it)."""


def _terminate(signum, frame):
  raise Terminated()


# Exit codes of a process ended by the signal, as shells report them (128 + signal number).
_CODES = {"Ctrl-C": 128 + signal.SIGINT, "SIGTERM": 128 + signal.SIGTERM}


@contextlib.contextmanager
def stoppable(stopped: Callable[[str], str]):
  """Ctrl-C (SIGINT) and SIGTERM inside the block end the process with one line, not a traceback.

  ``stopped("Ctrl-C")`` (or ``"SIGTERM"``) gives the line, e.g. where to resume; it is printed to
  stderr and the block raises SystemExit with 130 (143 for SIGTERM), the codes a shell gives a
  process the signal ended. Checkpoints are written whole or not at all, so stopping anywhere
  is safe.
  """
  previous = signal.signal(signal.SIGTERM, _terminate)
  try:
    yield
  except (KeyboardInterrupt, Terminated) as e:
    how = "SIGTERM" if isinstance(e, Terminated) else "Ctrl-C"
    try:
      line = stopped(how)
    except Exception:  # noqa: BLE001 (e.g. flags not parsed yet: the line is a courtesy)
      line = f"stopped by {how}."
    print(line, file=sys.stderr, flush=True)
    stop = SystemExit(_CODES[how])
    stop.stopped = True
    raise stop from None
  finally:
    signal.signal(signal.SIGTERM, previous)


def run(main: Callable[[list[str]], None], *, stopped: Callable[[str], str]) -> None:
  """``absl.app.run(main)`` with :func:`parse_flags`, stopped cleanly by Ctrl-C or SIGTERM.

  After the stop line (and after the error line of a full disk) the process ends at once
  (``os._exit``), as a kill would: the threads a run started (orbax's finishing save, a rollout
  thread blocked in a queue, TensorBoard's writer) would otherwise print their own tracebacks
  while the interpreter shuts down under them. Nothing is lost that a kill would not lose, and a
  kill anywhere is survived (docs/reliability.md).
  """
  _quiet_threads()
  try:
    with stoppable(stopped):
      app.run(main, flags_parser=parse_flags)
  except SystemExit as e:
    from knitjax import workdir as wd

    if getattr(e, "stopped", False):
      _exit_now(e.code)
    if wd.is_disk_full(e.__context__):  # an `error: no space left ...` line; the shutdown's own
      print(e.code, file=sys.stderr)  # writes (TensorBoard's last flush) would only fail again
      _exit_now(1)
    raise
  except Exception as e:  # a full disk met where no sentence names it yet (a plot, a log)
    from knitjax import workdir as wd

    if not wd.is_disk_full(e):
      raise
    if isinstance(e, OSError):
      e = wd.write_error(e.filename or "the workdir", e)
    print(f"error: {e}", file=sys.stderr)
    _exit_now(1)


def _exit_now(code: int) -> None:
  for stream in (sys.stdout, sys.stderr):
    stream.flush()
  os._exit(code)


def distributed_flags_problem(address: str | None, processes: int | None, index: int | None):
  """One sentence on what is wrong with ``--distributed``'s flags, else None.

  Process 0 also checks that it can listen on ``address``: a port another program or another
  run's coordinator holds is refused here, where JAX's coordinator would share it silently
  (its socket reuses ports) and pair the processes of two runs.
  """
  if processes is not None and processes < 1:
    return f"--num_processes={processes} is not accepted; give 1 or more."
  if index is not None and (index < 0 or (processes is not None and index >= processes)):
    top = "" if processes is None else f" (--num_processes={processes})"
    return f"--process_id={index} is not accepted; give 0..{(processes or 1) - 1}{top}."
  if not address:
    return None
  host, sep, port = address.rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    return (
      f"--coordinator_address={address!r} is not accepted; give host:port with a port in "
      "1..65535, e.g. 127.0.0.1:12345."
    )
  try:
    infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
  except OSError as e:
    return f"--coordinator_address={address!r}: host {host!r} does not resolve ({e.strerror})."
  if index != 0:
    return None
  family, _, _, _, sockaddr = infos[0]
  with socket.socket(family, socket.SOCK_STREAM) as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed run's TIME_WAIT is fine
    try:
      s.bind(sockaddr)
    except OSError as e:
      return (
        f"--coordinator_address={address!r} cannot be listened on ({e.strerror}): another "
        "run's coordinator or another program holds it, or it is not this machine's address; "
        "choose a free port on this machine."
      )
  return None
