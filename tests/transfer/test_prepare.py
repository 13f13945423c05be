"""Batch preparation with packing: the consumer's packed mini-batch and its packing metrics."""

import jax
import numpy as np
import pytest

from knitjax import sharding
from knitjax.train.packing import PackSpec
from knitjax.transfer.prepare import MiniBatchPreparer
from tests.transfer.test_access import LAYOUT, N_NEW, P_LEN, G, _payloads, _stored

PACK_LEN = 14


def test_packed_mini_batch_reports_its_packing_metrics():
  payloads = _payloads(2, n=4)
  minibatch, units = _stored(payloads)
  mesh = sharding.make_mesh((2, 1, 1), devices=jax.devices()[:2])
  prepare = MiniBatchPreparer(
    units, layout=LAYOUT, mesh=mesh, micro_batches=2, consumer=0, num_consumers=1,
    pack=PackSpec(pack_len=PACK_LEN, multiple=4),
  )  # fmt: skip
  batch, info = prepare(minibatch)
  seg = np.asarray(batch["segment_ids"]).reshape(-1, PACK_LEN)
  rows = G * len(payloads)
  real = sum(P_LEN + int(n) for p in payloads for n in p["response_lengths"])  # full prompts
  assert int(np.asarray(batch["valid"]).sum()) == real
  per_sequence = seg.max(axis=1)
  assert per_sequence.sum() == rows and len(seg) % 4 == 0
  assert info["pack_rows"] == len(seg)
  assert info["pack_fill"] == pytest.approx(real / (len(seg) * PACK_LEN))
  assert info["pack_padded_fill"] == pytest.approx(real / (rows * (P_LEN + N_NEW)))
  assert info["pack_segments_mean"] == pytest.approx(rows / len(seg))
  assert info["pack_segments_max"] == per_sequence.max() >= 2
  assert info["response_tokens"] == float(np.asarray(batch["loss_mask"]).sum())  # kept as before
