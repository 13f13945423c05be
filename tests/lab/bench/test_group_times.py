"""group_times: a run whose logs predate the group wall times is refused with one sentence."""

import json

import pytest

from lab.bench import group_times


@pytest.mark.parametrize("rows", [None, [{"seq": 1, "group_id": 0, "gen_version": 0}]])
def test_a_run_without_group_wall_times_is_refused_with_one_sentence(tmp_path, rows):
  if rows is not None:
    (tmp_path / "offered.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  with pytest.raises(ValueError, match="has no group wall times"):
    group_times.measured(str(tmp_path), warmup_steps=1)
