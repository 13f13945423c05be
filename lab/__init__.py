"""The lab beside the knitjax library: benchmarks (``python -m lab.bench``), the fault suite
(``python -m lab.faults``), the emulated cluster (``lab.cluster``), local multi-process launchers
(``lab.local_processes``), the one FLOPs count (``lab.flops``) and one-off measurement scripts
(``lab.scripts``).

It runs from a source checkout (the repository root on ``sys.path``), may import dev and peer
packages (hypothesis, Ray, Tunix), and is never imported by ``knitjax``; the installed wheel
holds none of it (tests/test_layers.py, pyproject.toml).
"""

import os

# The source checkout the lab runs from: the working directory and PYTHONPATH of the runs it starts.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def without_device_count(env: dict[str, str]) -> dict[str, str]:
  """``env`` for a run this lab starts: XLA_FLAGS without a fake-device count, so the run's own
  ``config.mesh.cpu_devices`` (or the script's count) decides, and the other XLA flags given (the
  tests' fast compiles) still hold."""
  env = dict(env)
  flags = [
    f
    for f in env.pop("XLA_FLAGS", "").split()
    if not f.startswith("--xla_force_host_platform_device_count")
  ]
  if flags:
    env["XLA_FLAGS"] = " ".join(flags)
  return env
