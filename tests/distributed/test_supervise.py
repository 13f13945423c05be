"""`knitjax.supervise`: restarts on the processes left after a loss, with a limit, a line each.

Most run a stand-in trainer (tests/distributed/fake_trainer.py); the last is a real two-process
run without Ray (about 30 s). The measured failover (a two-process disaggregated trainer, process
1 killed mid-run) is the fault suite's ``supervised`` kill mode, with its figures in
docs/reliability.md.
"""

import os

import pytest

from knitjax import supervise

FAKE = "tests.distributed.fake_trainer"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
  monkeypatch.chdir(REPO)  # the stand-in is started as `python -m tests.distributed...`


def _run(tmp_path, plan: str, processes: int, max_restarts: int = 3):
  (tmp_path / "plan").write_text(plan)
  code = supervise.supervise(
    [f"--workdir={tmp_path}"], processes, max_restarts=max_restarts, module=FAKE
  )
  started = [
    tuple(map(int, line.split())) for line in (tmp_path / "started").read_text().split("\n") if line
  ]
  return code, started


def test_a_lost_process_restarts_the_run_on_the_processes_left(tmp_path, capfd):
  code, started = _run(tmp_path, "kill1", processes=3)
  assert code == 0
  # Attempt 1: three processes of one run; attempt 2: the two left, a run of 2 processes.
  assert sorted(started[:3]) == [(0, 3), (1, 3), (2, 3)]
  assert sorted(started[3:]) == [(0, 2), (1, 2)]
  lines = [line for line in capfd.readouterr().err.splitlines() if "knitjax.supervise" in line]
  assert len(lines) == 1
  assert "restart 1 of at most 3: trainer process 1 of 3 lost (SIGKILL)" in lines[0]
  assert lines[0].endswith("resuming from the start (no checkpoint yet) on 2 processes.")


def test_the_last_process_left_runs_without_distributed(tmp_path, capfd):
  os.makedirs(tmp_path / "checkpoints" / "4")
  code, started = _run(tmp_path, "kill1", processes=2)
  assert code == 0 and started[2:] == [(0, 1)]  # no --num_processes: one plain process
  err = capfd.readouterr().err
  assert "resuming from checkpoint 4 on 1 process." in err


def test_restarts_stop_at_the_limit(tmp_path, capfd):
  code, started = _run(tmp_path, "killall killall killall", processes=1, max_restarts=2)
  assert code == 1 and len(started) == 3  # the first start and two restarts
  lines = [line for line in capfd.readouterr().err.splitlines() if "knitjax.supervise" in line]
  assert len(lines) == 3 and "giving up" in lines[-1]


def test_a_run_that_stops_without_a_loss_is_not_restarted(tmp_path, capfd):
  code, started = _run(tmp_path, "fail", processes=2)
  assert code == 1 and len(started) == 2
  assert "knitjax.supervise" not in capfd.readouterr().err


def test_the_command_line_is_checked_in_one_sentence(capsys):
  for argv in (["--processes=2"], ["--processes=0", "--", "--workdir=/tmp/x"]):
    with pytest.raises(SystemExit):
      supervise.main(argv)
  with pytest.raises(SystemExit):
    supervise.main(["--processes=2", "--", "--workdir=/tmp/x", "--distributed"])
  assert "are the supervisor's to set" in capsys.readouterr().err


def test_a_real_two_process_run_finishes_by_itself_after_a_kill(tmp_path):
  # Two trainer processes of the colocated kill run (no Ray), process 1 killed with SIGKILL
  # after step 2: the supervisor restarts the run on one process, which resumes from the
  # newest checkpoint on another shape and logs every step once.
  from lab.faults import kill_resume

  result = kill_resume.run_supervised(
    str(tmp_path), log=lambda _: None, run=kill_resume.RUNS["colocated"], kill_after=2,
    reference=False,
  )  # fmt: skip
  (trial,) = result["trials"]
  assert trial["problems"] == [], trial
  assert trial["restart_lines"][0].endswith("on 1 process.")
  assert trial["seconds_kill_to_restart"] < 5  # seen at once, not after the 30 s pulse silence
