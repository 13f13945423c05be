"""Resume on another shape: a colocated run on 2 CPU devices, killed with SIGKILL mid-run,
resumed by the same command on 4, and one of 2 trainer processes resumed by 1 (the fault suite's
``devices_2to4`` and ``colocated_2to1`` kill modes; about 30 s and 75 s here).

The resumed run must say it resharded its checkpoint and end with the parameters of an
uninterrupted replay of the batches both runs trained on (dumped by `lab.batch_dump`: steps up to
the checkpoint on a 2-device mesh, the rest on 4), to rtol 1e-5; every step logged once. The
process-count modes (``shape_2to1``, ``shape_1to2``: a trainer of two processes with a Ray
rollout, about 3 minutes each here) and the supervisor's failover run in the fault suite
(``python -m lab.faults --parts kill --kill_modes ...``; figures in docs/reliability.md).
"""

import pytest

from lab.faults import kill_resume


@pytest.mark.parametrize(
  ("mode", "before", "after"),
  [("devices_2to4", (1, 2), (1, 4)), ("colocated_2to1", (2, 1), (1, 1))],
)
def test_a_checkpoint_resumes_on_another_shape_exactly(tmp_path, mode, before, after):
  result = kill_resume.run_shape(str(tmp_path), mode, log=lambda _: None)
  (trial,) = result["trials"]
  assert trial["problems"] == [] and result["ok"] == 1
  assert (trial["before"], trial["after"]) == (before, after)
  assert trial["resumed_at_step"] > 0 and trial["tolerance_used"] <= 1.0
