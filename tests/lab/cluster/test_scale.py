"""The dilation that maps a named real workload onto the emulated cluster (pure arithmetic)."""

import pytest

from lab.cluster import scale


def _real(**kw):
  base = dict(
    name="w",
    accelerator="a",
    peak_tflops=1000.0,
    utilisation=0.5,
    accelerators=2,
    decoder_params=1e9,
    encoder_params=0.5e9,
    tokens_per_row=100,
    patches_per_image=200,
    group_size=4,
  )
  return scale.RealWorkload(**{**base, **kw})


def test_real_compute_counts_flops_per_row():
  r = scale.real_compute(_real())
  assert r["flops_per_s"] == 1e15
  assert r["decoder_flops_per_row"] == 2 * 1e9 * 100 * 3
  assert r["encoder_flops_per_row"] == 2 * 0.5e9 * 200 * 3
  assert r["naive_s"] == pytest.approx((6e11 + 6e11) / 1e15)
  assert r["dedup_s"] == pytest.approx((6e11 + 6e11 / 4) / 1e15)


def test_dilation_keeps_the_transfer_to_compute_ratio():
  w = _real(link_gbps=25.0, latency_us=10.0)
  d = scale.dilation(w, emulated_naive_s_per_row=0.012)  # real: 1.2 ms per row
  assert d["factor"] == pytest.approx(10.0)
  assert d["link_mbit"] == pytest.approx(2500.0)
  assert d["latency_ms_needed"] == pytest.approx(0.1)
  # the same bytes over the emulated link take `factor` times as long as over the real one
  nbytes = 1e8
  real_ratio = nbytes * 8 / (25e9) / d["real"]["naive_s"]
  emulated_ratio = nbytes * 8 / (d["link_mbit"] * 1e6) / 0.012
  assert emulated_ratio == pytest.approx(real_ratio)


def test_bad_inputs_are_named():
  with pytest.raises(ValueError, match=r"utilisation=1.5 must be in \(0, 1\]"):
    _real(utilisation=1.5)
  with pytest.raises(ValueError, match=r"RealWorkload.accelerators=0 must be > 0"):
    _real(accelerators=0)
  with pytest.raises(ValueError, match="must be > 0"):
    scale.dilation(_real(), 0.0)
