"""The attention memory benchmark: compiled memory of one layer, dense vs blockwise."""

import json
import os

from configs.bench import attention_memory as bench_config
from lab.bench import attention_memory


def test_blockwise_layer_holds_less_and_grows_slower(tmp_path):
  result = attention_memory.run(bench_config.get_config("quick"), str(tmp_path))
  rows = {(r["T"], r["impl"]): r for r in result["rows"]}
  for name in attention_memory.PASSES:
    temp = f"{name}_temp_bytes"
    # Dense scratch grows ~4x per doubling of T ([T, T] scores; measured 2.7x with the O(T)
    # buffers); blockwise ~2x at most.
    assert rows[2048, "dense"][temp] > 2.5 * rows[1024, "dense"][temp], name
    assert rows[2048, "xla"][temp] < 2.3 * rows[1024, "xla"][temp], name
    assert rows[2048, "xla"][temp] < rows[2048, "dense"][temp] / 4, name
    assert rows[2048, "xla"][f"{name}_peak_bytes"] < rows[2048, "dense"][f"{name}_peak_bytes"]
  with open(os.path.join(tmp_path, "attention_memory.json")) as f:
    assert json.load(f)["rows"] == result["rows"]
  assert os.path.getsize(os.path.join(tmp_path, "attention_memory.png")) > 0
