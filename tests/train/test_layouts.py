"""The contract every training layout (`knitjax.train.layouts`) keeps for the preparers: the count
it plans from the groups' token counts is the count it lays out from their rows, it refuses a
sequence multiple its consumers cannot share, and its fields are those it shards for the step."""

import jax
import pytest

from knitjax import sharding
from knitjax.train import layouts
from knitjax.train.packing import PackSpec
from knitjax.train.prefix import PROMPT_FIELDS, PrefixSpec
from knitjax.train.prompt_sharing import ShareSpec
from knitjax.transfer.access import fetch_minibatch
from tests.transfer.test_access import N_NEW, P_LEN, ROW_SPEC, G
from tests.transfer.test_prepare import _two_units

LAYOUTS = {
  "padded": layouts.PADDED,
  "packed": layouts.Packed(PackSpec(pack_len=14, multiple=2)),
  "shared": layouts.Shared(ShareSpec(prompt_len=P_LEN, seq_len=P_LEN + G * N_NEW, multiple=2)),
  "shared_packed": layouts.Shared(
    ShareSpec(prompt_len=P_LEN, seq_len=P_LEN + G * N_NEW + 4, multiple=2, pack=True)
  ),
  "shared_prefix": layouts.SharedPrefix(PrefixSpec(prompt_len=P_LEN, slots=4)),
}


def _rows():
  """Four groups' padded rows, each group's G rows with one prompt (as a group of G samples of
  one prompt has), and the mini-batch's metadata."""
  minibatch, units = _two_units()
  rows, _ = fetch_minibatch(minibatch, units, ROW_SPEC)
  for g in range(len(minibatch.groups)):  # full prompts: columns [0, P) of every row
    rows["tokens"][g * G : (g + 1) * G, :P_LEN] = rows["tokens"][g * G, :P_LEN]
  return rows, minibatch


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_planned_count_is_the_laid_out_count(name):
  layout = LAYOUTS[name]
  rows, minibatch = _rows()
  sequences, metrics = layout.lay_out(rows)
  parts = [[(g.prompt_tokens, g.response_tokens) for g in minibatch.groups]]
  count, planned = layout.plan_count(parts, row_len=P_LEN + N_NEW)
  if name == "padded":
    assert (count, planned, metrics) == (0, {}, {})  # the rows as they arrive
    assert sequences.keys() == rows.keys()
    return
  assert count == len(sequences["tokens"]) and count % 2 == 0
  again, _ = layout.lay_out(rows, count=count)
  assert len(again["tokens"]) == count
  assert planned == pytest.approx(metrics)  # the metadata's figures are the rows'


@pytest.mark.parametrize("name", LAYOUTS)
def test_consumers_share_the_sequence_multiple_or_are_refused(name):
  layout = LAYOUTS[name]
  assert layout.for_consumers(1) == layout
  if name == "padded":
    assert layout.for_consumers(3) == layout
    return
  if name == "shared_prefix":  # each consumer's prompts are not laid out yet
    with pytest.raises(ValueError, match="not accepted with 2 consumers"):
      layout.for_consumers(2)
    return
  assert layout.for_consumers(2).spec.multiple == 1
  with pytest.raises(ValueError, match="not accepted with 3 consumers and 2 micro-batch row"):
    layout.for_consumers(3)


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_step_fields_are_the_sharded_fields(name):
  layout = LAYOUTS[name]
  sequences, _ = layout.lay_out(_rows()[0])
  host = layouts.micro_batches(layout, sequences, 2)
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  shardings = layouts.shardings(layout, mesh, vlm=False)
  assert set(shardings) <= set(host)  # the step reads these; the rest stays on the host
  # Every field split into the 2 micro-batches but the prompts laid out once beside them.
  assert all(v.shape[0] == 2 for k, v in host.items() if k not in PROMPT_FIELDS)
  assert all(len(host[k]) == 4 for k in PROMPT_FIELDS if k in host)
