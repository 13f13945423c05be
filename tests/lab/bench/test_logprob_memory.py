"""The log-prob memory benchmark: chunked log-probs hold less than the whole logits."""

from configs.bench import logprob_memory as bench_config
from lab.bench.logprob_memory import measure, run


def test_chunks_hold_less_than_whole_logits():
  c = bench_config.get_config("quick")
  kwargs = dict(vocab=c.vocab, d_model=c.d_model, seq_len=c.seq_lens[0], rows=c.rows,
                dtype=c.dtype)  # fmt: skip
  plain = measure(chunk=0, **kwargs)
  chunked = measure(chunk=c.chunks[0], **kwargs)  # a quarter of the sequence per chunk
  # The plain backward holds at least the float32 logits; the chunked one a chunk's worth and
  # the table's float32 gradient accumulator.
  assert plain["fwd_bwd_temp_bytes"] >= plain["logits_bytes"]
  assert chunked["fwd_bwd_temp_bytes"] < plain["fwd_bwd_temp_bytes"] / 2
  assert chunked["fwd_temp_bytes"] < plain["fwd_temp_bytes"]
  assert chunked["fwd_bwd_peak_bytes"] < plain["fwd_bwd_peak_bytes"]


def test_run_writes_json_and_plot(tmp_path):
  result = run(bench_config.get_config("quick"), str(tmp_path))
  assert [r["chunk"] for r in result["rows_table"]] == [0, 16]
  assert (tmp_path / "logprob_memory.json").exists()
  assert (tmp_path / "logprob_memory.png").exists()
