"""Resume on another shape: a colocated run on 2 CPU devices, killed with SIGKILL mid-run,
resumed by the same command on 4 (the fault suite's ``devices_2to4`` kill mode).

The resumed run must say it resharded its checkpoint and end with the parameters of an
uninterrupted replay of the batches both runs trained on (dumped by `lab.batch_dump`: steps up to
the checkpoint on a 2-device mesh, the rest on 4), to rtol 1e-5; every step logged once. The
process-count modes (``shape_2to1``, ``shape_1to2``: a trainer of two processes with a Ray
rollout, about 3 minutes each here) and the supervisor's failover run in the fault suite
(``python -m lab.faults --parts kill --kill_modes ...``; figures in docs/reliability.md).
"""

from lab.faults import kill_resume


def test_a_checkpoint_of_2_devices_resumes_on_4_exactly(tmp_path):
  result = kill_resume.run_shape(str(tmp_path), "devices_2to4", log=lambda _: None)
  (trial,) = result["trials"]
  assert trial["problems"] == [] and result["ok"] == 1
  assert (trial["before"], trial["after"]) == ((1, 2), (1, 4))
