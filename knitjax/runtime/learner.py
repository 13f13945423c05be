"""The Learner: the trainer's state, policy version, staleness accounting and checkpoints.

Both loops (colocated and disaggregated) hand it prepared mini-batches in (step, index) order;
``consume`` applies one optimizer update each and advances the policy version. What a checkpoint
records besides the device state is a :class:`RunState` (host metadata, JSON through
`knitjax.records`), so a loop differs from the other only in where its mini-batches come from
and in the rollout-side fields of its run state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from knitjax import faultpoints, records
from knitjax.models import lora
from knitjax.tasks.prompts import Prompt
from knitjax.train.checkpoint import Checkpointer
from knitjax.train.step import TrainState, host_metrics
from knitjax.transfer.admission import MiniBatch
from knitjax.transfer.feed import Prepared
from knitjax.transfer.staleness import StalenessTracker


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunState:
  """Host side of a checkpoint: counters, prompt streams, admission, and the rollout's queue.

  Attributes:
    mode: the runtime mode that wrote it ("" in checkpoints from before it was recorded).
    version: policy version (optimizer updates applied); the train step is derived from it.
    next_group_id: first group id not handed out yet.
    prompts: state of the per-class prompt streams.
    admission: the admission index's state (pending groups and counters).
    staleness: the staleness tracker's state.
    consumed: groups consumed so far (disaggregated).
    queued: released mini-batches not consumed yet (disaggregated).
    payloads: the payloads of pending and queued groups (`knitjax.transfer.snapshot`).
    generating: prompts of groups still generating; a resumed run regenerates them first.
    restarts: how often the run was resumed (disaggregated: seeds the rollout's draws).
  """

  mode: str = ""
  version: int = 0
  next_group_id: int = 0
  prompts: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  admission: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  staleness: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  consumed: int = 0
  queued: tuple[MiniBatch, ...] = ()
  payloads: Mapping[str, Any] | None = None
  generating: tuple[Prompt, ...] = ()
  restarts: int = 0


# Run-state fields a checkpoint must hold to resume: both modes need these, a disaggregated run
# every field but `mode` (which checkpoints written before it was recorded lack).
_COMMON_FIELDS = ("version", "next_group_id", "prompts", "admission", "staleness")


def _needed_fields(mode: str) -> tuple[str, ...]:
  if mode == "colocated":
    return _COMMON_FIELDS
  return tuple(f.name for f in dataclasses.fields(RunState) if f.name != "mode")


class Learner:
  """Applies prepared mini-batches to the train state, one optimizer update each.

  Args:
    state: the sharded train state (restored in place by :meth:`restore`).
    train_step: the compiled step, ``(state, batch[, ref_params | frozen]) -> (state, metrics)``.
    ref_params: the frozen reference policy when the loss has a KL term, else None.
    frozen: with LoRA, the frozen base (the state then holds only the adapters), else None.
    checkpointer: where checkpoints go.
    every_steps: checkpoint cadence in train steps (the last step is always saved).
    mode: the runtime mode, recorded in checkpoints and checked on resume.
    on_batch: called with ``(mini-batch, train batch)`` before each update, in every process
      (this process's shards of the global batch), whatever the topology; None: nothing.
  """

  def __init__(
    self,
    state: TrainState,
    train_step: Callable,
    *,
    ref_params=None,
    frozen=None,
    checkpointer: Checkpointer,
    every_steps: int,
    mode: str,
    on_batch: Callable[[MiniBatch, dict], None] | None = None,
  ):
    self.state = state
    self._on_batch = on_batch
    extra = ref_params if frozen is None else frozen
    self._update = train_step if extra is None else lambda s, b: train_step(s, b, extra)
    self.frozen = frozen
    self._ckpt, self._every, self._mode = checkpointer, every_steps, mode
    self.version = 0
    self.tracker = StalenessTracker()

  @property
  def policy_params(self):
    """The policy's whole params (what rollout and evaluation run): with LoRA the frozen base
    joined with the current adapters (the same arrays, no copy), else the trained params."""
    if self.frozen is None:
      return self.state.params
    return lora.combine(self.frozen, self.state.params)

  def restore(self) -> RunState | None:
    """Restores the newest intact checkpoint, if any; returns its run state (None: a fresh run).

    Raises:
      ValueError: the checkpoint was written by the other runtime mode, or its run state
        lacks a field this mode resumes from or is not a run state.
    """
    if self._ckpt.latest_step() is None:
      return None
    state, meta = self._ckpt.restore(self.state)
    folder = self._ckpt.path(self._ckpt.restored_step)
    mode = meta.get("mode")
    if mode and mode != self._mode:
      raise ValueError(
        f"the workdir's checkpoints come from a {mode} run, but config.topology.mode="
        f"{self._mode!r}; resume with topology.mode={mode!r} or start in a new workdir "
        "(switching would drop its queued groups)."
      )
    if missing := [k for k in _needed_fields(self._mode) if k not in meta]:
      raise ValueError(
        f"checkpoint {folder} has no {', '.join(map(repr, missing))} in its run state (meta), "
        f"which a {self._mode} run resumes from; it was written by an older knitjax or by "
        "another runtime mode, so resume it with the mode that wrote it or start in a new "
        "workdir."
      )
    try:
      run = records.from_json(RunState, meta)
    except (ValueError, TypeError, KeyError) as e:
      raise ValueError(
        f"checkpoint {folder} has a run state (meta) that cannot be read: {e}"
      ) from e
    self.state, self.version = state, run.version
    self.tracker.load_state_dict(run.staleness)
    return run

  def consume(self, prepared: Prepared) -> dict[str, float]:
    """One optimizer update from a prepared mini-batch; returns its metrics (host floats)."""
    if self._on_batch is not None:
      self._on_batch(prepared.minibatch, prepared.batch)
    self.state, metrics = self._update(self.state, prepared.batch)
    metrics = host_metrics(metrics)  # waits for the update
    self.tracker.record(prepared.minibatch, consume_version=self.version)
    self.version += 1
    faultpoints.point("update")
    return metrics

  def maybe_save(self, done: int, total: int, run_state: Callable[[], RunState]) -> bool:
    """Checkpoints after train step ``done`` if the cadence (or the last step) says so."""
    if done % self._every and done != total:
      return False
    run = dataclasses.replace(
      run_state(), mode=self._mode, version=self.version, staleness=self.tracker.state_dict()
    )
    self._ckpt.save(done, self.state, records.to_json(run))
    faultpoints.point("checkpoint")
    return True

  def close(self) -> None:
    self._ckpt.close()
