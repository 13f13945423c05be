"""Part (c) of the fault suite: thousands of generated bad inputs, each of which must be refused.

Every input is bad by construction: a valid one (a shipped config, a GSM8K file, a synthetic group
payload, a `GroupMeta`, an orbax checkpoint, a Hugging Face checkpoint folder) with one corruption
that the code documents it refuses. Each is fed to the function that must reject it and the outcome
is counted, never asserted, so one run counts every case:

- rejected: a ``ValueError`` (for files also a ``FileNotFoundError``); a rejection should also be
  one sentence (no newline, no traceback) and name the field or file that was corrupted, else it
  counts under ``not_one_sentence`` / ``not_named`` as well;
- tracebacks: any other exception (a crash, not a rejection);
- silent_accepts: no exception at all.

Inputs are drawn with hypothesis (``st.data()``, seeded, no example database). A kind's examples
are split evenly over its cases, and every case runs at least once. `core` counts the outcomes and
drives hypothesis; each kind's cases live in a module of their own.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from lab.faults.bad_inputs import (
  checkpoints,
  config_extremes,
  configs,
  group_meta,
  hf_checkpoints,
  model_folders,
  payloads,
  prompt_files,
)
from lab.faults.bad_inputs.core import (
  COUNTERS,
  KIND_WEIGHTS,
  BadInput,
  Case,
  Tally,
  allocate,
  classify,
  generate,
)

__all__ = ["COUNTERS", "KINDS", "KIND_WEIGHTS", "BadInput", "allocate", "classify", "run"]

# kind -> (its cases, the function that builds what they share in a scratch folder)
KINDS: dict[str, tuple[list[Case], Callable[[str], dict]]] = {
  "configs": (configs.CASES, configs.context),
  "payloads": (payloads.CASES, payloads.context),
  "group_meta": (group_meta.CASES, group_meta.context),
  "prompt_files": (prompt_files.CASES, prompt_files.context),
  "hf_checkpoints": (hf_checkpoints.CASES, hf_checkpoints.context),
  "checkpoints": (checkpoints.CASES, checkpoints.context),
  "model_folders": (model_folders.CASES, model_folders.context),
  "config_extremes": (config_extremes.cases(), config_extremes.context),
}


def run(workdir: str, *, examples: int = 10_000, seed: int = 0) -> dict:
  """Generates ``examples`` bad inputs spread over the kinds and counts how each is refused.

  Args:
    workdir: scratch folder for the files the generator writes (created if missing).
    examples: total bad inputs, split by `KIND_WEIGHTS` (each kind gets at least one per case).
    seed: hypothesis seed; the same seed draws the same inputs.

  Returns:
    ``{"examples": n, "by_kind": {kind: {counter: n}}, "by_case": {"kind/case": {...}},
    "failures": [{"kind", "case", "outcome", "input", "error", "message"}, ...]}`` with the
    counters of `COUNTERS`.
  """
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  counts = allocate(examples, {k: len(cases) for k, (cases, _) in KINDS.items()})
  tally = Tally()
  for kind, (cases, make_ctx) in KINDS.items():
    folder = os.path.join(workdir, kind)
    os.makedirs(folder, exist_ok=True)
    generate(kind, counts[kind], seed, cases, make_ctx(folder), tally)
  return {
    "examples": sum(c["examples"] for c in tally.by_kind.values()),
    "by_kind": tally.by_kind,
    "by_case": tally.by_case,
    "failures": tally.failures,
  }
