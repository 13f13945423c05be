"""Length sampling: lognormal moments, the generation cap, traces and stream independence."""

import numpy as np
import pytest

from knitjax.sim.lengths import LengthSampler, clipped_lognormal_mean, lognormal_params
from knitjax.sim.workload import ClassSpec


def test_lognormal_params_reproduce_mean_and_cv():
  mu, s = lognormal_params(3000.0, 1.0)
  mean = np.exp(mu + s * s / 2)
  std = mean * np.sqrt(np.exp(s * s) - 1)
  assert mean == pytest.approx(3000.0)
  assert std / mean == pytest.approx(1.0)


def test_samples_match_the_clipped_mean_and_respect_the_cap():
  spec = ClassSpec(name="m", quota=1, length_mean=3000.0, length_cv=1.0, length_max=8000)
  x = LengthSampler([spec], seed=0).take(0, 200_000)
  assert x.max() == 8000 and x.min() >= 1
  assert x.mean() == pytest.approx(clipped_lognormal_mean(3000.0, 1.0, 8000), rel=0.01)
  # The cap binds: the clipped mean is below the lognormal mean.
  assert clipped_lognormal_mean(3000.0, 1.0, 8000) < 2900
  assert clipped_lognormal_mean(500.0, 0.0, 8000) == 500.0


def test_trace_file_lengths(tmp_path):
  path = tmp_path / "lengths.txt"
  path.write_text("# lengths\n10\n20\n30\n")
  spec = ClassSpec(name="t", quota=1, length_trace=str(path))
  x = LengthSampler([spec], seed=1).take(0, 3000)
  assert set(x.tolist()) == {10, 20, 30}
  with pytest.raises(ValueError, match="does not exist"):
    LengthSampler([ClassSpec(name="t", quota=1, length_trace=str(tmp_path / "no"))], seed=0)


def test_class_streams_do_not_depend_on_interleaving():
  specs = [ClassSpec(name="a", quota=1), ClassSpec(name="b", quota=1)]
  s1, s2 = LengthSampler(specs, seed=7), LengthSampler(specs, seed=7)
  a1 = np.concatenate([s1.take(0, 5), s1.take(0, 70_000)])
  s2.take(1, 100)
  a2 = np.concatenate([s2.take(0, 50_000), s2.take(0, 20_005)])
  np.testing.assert_array_equal(a1, a2)
