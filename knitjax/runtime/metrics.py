"""Per-step metrics: ``metrics.jsonl``, TensorBoard, terminal progress and the reward plot.

The workdir may be a cloud URL (``gs://...``, see :mod:`knitjax.workdir`); then only process 0
writes there, ``metrics.jsonl`` is rewritten whole on upload and TensorBoard's event file is
uploaded whole on each of its flushes (object stores cannot append).
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Mapping

from absl import logging
from etils import epath

from knitjax import workdir as wd


def _jsonable(v):
  if hasattr(v, "item"):
    v = v.item()
  if isinstance(v, float) and not math.isfinite(v):
    return None
  return v


class MetricsWriter:
  """Appends one JSON object per train step and mirrors scalars to TensorBoard.

  Resuming appends to the same ``metrics.jsonl``; rows from steps after the
  checkpoint being resumed are dropped first, so every step appears once. In a multi-host run
  only process 0 (``primary``) writes files and progress; the others' writes are no-ops.

  A local ``metrics.jsonl`` is flushed after every row. A remote one is uploaded whole after
  the row of every checkpoint step (``checkpoint_every``, and the last step), before that
  checkpoint is saved, and otherwise at most every ``upload_every_s`` seconds: a kill -9 may
  lose rows after the newest checkpoint, which a resume drops anyway, never one it keeps.
  """

  def __init__(
    self,
    workdir: str,
    *,
    total_steps: int,
    start_step: int = 0,
    log_every: int = 10,
    primary: bool | None = None,
    checkpoint_every: int = 1,
    upload_every_s: float = 60.0,
  ):
    if primary is None:
      import jax

      primary = jax.process_index() == 0
    self.primary = primary
    self._file = self._tb = None
    if not primary:
      return
    self.path = wd.path(workdir, "metrics.jsonl")
    kept = [r for r in wd.read_rows(self.path) if r.get("step", 0) <= start_step]
    self._file = wd.JsonlFile(self.path, kept)
    self._remote = wd.is_remote(self.path)
    self._checkpoint_every, self._upload_every_s = checkpoint_every, upload_every_s
    self._uploaded = time.monotonic()
    self._tb = None
    try:
      from tensorboardX import SummaryWriter

      tb = wd.path(workdir, "tb")
      if self._remote:
        _route_tensorboard(tb)
      self._tb = SummaryWriter(str(tb))
    except ImportError:  # TensorBoard is optional; metrics.jsonl is the record.
      logging.warning("tensorboardX is not installed; writing metrics.jsonl only.")
    self._total = total_steps
    self._start_step = start_step
    self._log_every = log_every
    # The ETA is timed from the end of the first step this process writes: that step includes
    # XLA compilation, so extrapolating from it overstates the rest of the run many times over.
    self._first: tuple[int, float] | None = None  # (step, time) when the first step ended

  def write(self, step: int, metrics: Mapping[str, float]) -> None:
    """Records the metrics of train step ``step`` (1-based: steps completed)."""
    if not self.primary:
      return
    row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
    self._file.write(row)
    due = step % self._checkpoint_every == 0 or step == self._total
    if not self._remote or due or time.monotonic() - self._uploaded >= self._upload_every_s:
      self._file.flush()
      self._uploaded = time.monotonic()
    if self._tb is not None:
      for k, v in row.items():
        if isinstance(v, int | float) and k != "step":
          self._tb.add_scalar(k, v, step)
    now = time.time()
    if self._first is None:
      self._first = (step, now)
    done = step - self._start_step
    if step % self._log_every == 0 or step == self._total or done == 1:
      logging.info(
        "step %d/%d  version %s  reward %.3f  loss %.4f  tokens/s %.0f  arch_staleness %.2f  %s",
        step,
        self._total,
        row.get("version"),
        row.get("reward_mean") or 0.0,
        row.get("loss") or 0.0,
        row.get("tokens_per_s") or 0.0,
        row.get("arch_staleness_mean") or 0.0,
        self._eta(step, now),
      )

  def _eta(self, step: int, now: float) -> str:
    """``ETA <s>s`` from the steps after the first (compiled) one, or when it will be known."""
    first_step, first_time = self._first
    if step == self._total:
      return "ETA 0s"
    if step == first_step:
      return f"ETA after step {step + 1}"
    eta = (now - first_time) / (step - first_step) * (self._total - step)
    return f"ETA {eta:.0f}s"

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
    if self._tb is not None:
      self._tb.close()


def mean_rows(rows: list[Mapping[str, float]]) -> dict[str, float]:
  """Per-key means over the mini-batches of a train step (every row has the same keys)."""
  return {k: float(sum(r[k] for r in rows) / len(rows)) for k in rows[0]}


def read_metrics(workdir: str) -> list[dict]:
  """Reads ``workdir/metrics.jsonl``, dropping a torn last line (see `workdir.read_rows`)."""
  return wd.read_rows(wd.path(workdir, "metrics.jsonl"))


def plot_reward(workdir: str, *, config_name: str | None = None, window: int = 10) -> str:
  """Writes ``workdir/reward.png``: reward per step and its moving average, titled with the
  config (``config_name``: its file and variant, ``configs/arith_tiny.py:quick``) and workdir.
  """
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = read_metrics(workdir)
  steps = [r["step"] for r in rows]
  reward = [r.get("reward_mean") or 0.0 for r in rows]
  avg = [
    sum(reward[max(0, i - window + 1) : i + 1]) / len(reward[max(0, i - window + 1) : i + 1])
    for i in range(len(reward))
  ]
  fig, ax = plt.subplots(figsize=(6, 3.5))
  ax.set_title(reward_title(workdir, config_name), fontsize=9)
  ax.plot(steps, reward, alpha=0.35, label="reward_mean")
  ax.plot(steps, avg, label=f"{window}-step moving average")
  ax.set_xlabel("train step")
  ax.set_ylabel("reward")
  ax.set_ylim(-0.02, 1.02)
  ax.grid(alpha=0.3)
  ax.legend(loc="lower right")
  fig.tight_layout()
  path = wd.path(workdir, "reward.png")
  with path.open("wb") as f:
    fig.savefig(f, format="png", dpi=120)
  plt.close(fig)
  return str(path)


def reward_title(workdir: str, config_name: str | None) -> str:
  """The reward plot's title: the config that ran (when named; a notebook's is not) and where."""
  what = f"reward: {config_name}" if config_name else "reward"
  return f"{what}\nworkdir {workdir}"


class _UploadedEventFile:
  """A TensorBoard event file on an object store: kept in memory, uploaded whole on flush."""

  def __init__(self, path: str):
    self._path, self._buffer = epath.Path(path), io.BytesIO()

  def write(self, data: bytes) -> None:
    self._buffer.write(data)

  def flush(self) -> None:
    self._path.write_bytes(self._buffer.getvalue())

  def close(self) -> None:
    self.flush()


class _EpathEventFiles:
  """tensorboardX's writer factory interface, through epath (the route of everything else)."""

  def open(self, path: str) -> _UploadedEventFile:
    return _UploadedEventFile(path)

  def directory_check(self, path: str) -> None:
    epath.Path(path).mkdir(parents=True, exist_ok=True)


def _route_tensorboard(logdir: epath.Path) -> None:
  """Sends tensorboardX's files for ``logdir``'s scheme through epath.

  tensorboardX picks a writer by scheme; its own ``gs://`` writer needs the google-cloud-storage
  client and other schemes fall back to ``open()``. Registering (idempotently) an epath writer
  for the scheme makes TensorBoard go where checkpoints and metrics.jsonl go.
  """
  from tensorboardX import record_writer

  record_writer.register_writer_factory(str(logdir).split("://", 1)[0], _EpathEventFiles())


def fault_counters(rollout, units: list[dict] | None = None) -> dict[str, float]:
  """Cumulative ``actor_restarts`` (rollout actors replaced plus storage units restarted) and
  ``groups_regenerated`` (groups generated again because their actor died) of a rollout.

  ``units``: the storage units' ``stats()`` if the caller already has them.
  """
  s = rollout.stats()
  if units is None:
    units = [u.stats() for u in rollout.storage.values()]
  return {
    "actor_restarts": float(s.actor_restarts + sum(u.get("restarts", 0) for u in units)),
    "groups_regenerated": float(s.groups_regenerated),
  }
