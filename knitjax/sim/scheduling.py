"""Which prompt scheduler a simulated pipeline runs (``Pipeline.scheduling``).

The runtime's rollout thread starts classes in quota proportion (`PlainScheduler`); only the
simulator, and the staleness benchmark through it, choose between that and the
`AdmissionAwareScheduler`, so the choice lives here (both schedulers: `knitjax.rollout.scheduling`).
"""

from knitjax.rollout.scheduling import AdmissionAwareScheduler, PlainScheduler
from knitjax.transfer.admission import AdmissionIndex

SCHEDULING = ("plain", "admission_aware")


def make_scheduler(kind: str, index: AdmissionIndex, quotas: list[int], horizon_steps: int):
  """Builds the scheduler named by ``Pipeline.scheduling``."""
  if kind == "plain":
    return PlainScheduler(quotas)
  if kind == "admission_aware":
    return AdmissionAwareScheduler(index, quotas, horizon_steps)
  raise ValueError(f"scheduling={kind!r} is not accepted; choose one of: {', '.join(SCHEDULING)}.")
