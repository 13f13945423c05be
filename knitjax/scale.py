"""Scale a running run's Ray rollout workers:
``python -m knitjax.scale --workdir DIR --rollout_workers N``.

Writes the request into the run's workdir (`knitjax.distributed.elastic.request`); the run takes
it before its next train step, starting new workers at the newest weights or retiring workers
once their running share is done (docs/disaggregated.md, "Scaling the rollout workers of a
running run"). Refused in one sentence: ``N`` < 1, a workdir without a run, a run without Ray
rollout workers.
"""

from __future__ import annotations

import sys

from absl import app, flags

_WORKDIR = flags.DEFINE_string("workdir", None, "The running run's workdir.")
_WORKERS = flags.DEFINE_integer("rollout_workers", None, "The number of Ray rollout workers.")
flags.mark_flags_as_required(["workdir", "rollout_workers"])


def main(argv):
  if len(argv) > 1:
    sys.exit(f"error: unexpected arguments {argv[1:]}; give only --workdir and --rollout_workers.")
  from knitjax.distributed.elastic import request

  try:
    print(request(_WORKDIR.value, _WORKERS.value))
  except ValueError as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  app.run(main)
