"""``python -m lab.faults`` refuses a flag no part could use in one sentence, before any work
(issue 47: each of these used to run, or claim to, and exit 0)."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KILL_MODES = (
  "colocated, disaggregated, trainer_processes, shape_2to1, shape_1to2, devices_2to4, "
  "colocated_2to1, supervised"
)
PARTS = "kill, actors, inputs, entry_points, workdir, backpressure, network, processes"


@pytest.mark.parametrize(
  "args,sentence",
  [
    (["--parts="], f"--parts is empty; give one or more of {PARTS}."),
    (["--parts=inputs,typo"], f"--parts typo not accepted; choose from {PARTS}."),
    (["--parts=kill", "--kills=-1"], "--kills -1 is not accepted; give a count of at least 1."),
    (["--parts=kill", "--kills=0"], "--kills 0 is not accepted; give a count of at least 1."),
    (
      ["--parts=kill", "--kill_modes="],
      f"--kill_modes is empty; give one or more of {KILL_MODES}.",
    ),
    (
      ["--parts=kill", "--kill_modes=colocated,nope"],
      f"--kill_modes nope not accepted; choose from {KILL_MODES}.",
    ),
    (
      ["--parts=network", "--network_trials=link_down,gone"],
      "--network_trials gone not accepted; choose from link_down, loss, partition, node_removed.",
    ),
    (
      ["--parts=inputs", "--examples=-5"],
      "--examples -5 is not accepted; give a count of at least 1.",
    ),
    (
      ["--parts=backpressure", "--seed=-1"],
      "--seed -1 is not accepted; give an integer of at least 0.",
    ),
  ],
)
def test_a_flag_no_part_could_use_is_refused_before_any_work(tmp_path, args, sentence):
  workdir = tmp_path / "faults"
  proc = subprocess.run(
    [sys.executable, "-m", "lab.faults", f"--workdir={workdir}", *args],
    cwd=REPO,
    env={**os.environ, "PYTHONPATH": REPO},
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines()[-1] == f"error: {sentence}", proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr and proc.stdout == ""
  assert not workdir.exists()  # refused before the scratch folder was made


def test_an_empty_workdir_is_refused():
  proc = subprocess.run(
    [sys.executable, "-m", "lab.faults", "--workdir=", "--parts=backpressure"],
    cwd=REPO,
    env={**os.environ, "PYTHONPATH": REPO},
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1] == (
    "error: --workdir is empty; give the scratch folder for faults.json."
  )
