"""A disaggregated run killed with SIGKILL resumes with its admission state and counters intact.

Groups pending in the admission index or queued for the trainer at the checkpoint keep their
payloads (snapshot); groups still generating are regenerated; none is lost, none consumed twice.
"""

import collections
import json
import os
import shutil
import subprocess
import sys
import textwrap

from configs import arith_disagg
from knitjax.config import from_config_dict
from knitjax.run import train
from knitjax.train.checkpoint import Checkpointer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, KILL_AFTER = 6, 3


def read_jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def ckpt_meta(workdir, step):
  with open(os.path.join(workdir, "checkpoints", str(step), "meta", "metadata")) as f:
    return json.load(f)


def test_sigkill_resume_loses_nothing_and_consumes_nothing_twice(tmp_path):
  workdir = str(tmp_path / "run")
  script = textwrap.dedent(f"""
      import os, signal, time
      from configs import arith_disagg
      from knitjax.config import from_config_dict
      from knitjax.run import train
      c = arith_disagg.get_config("quick")
      c.loop.steps = {STEPS}
      def on_step(step, metrics):
        if step == {KILL_AFTER}:
          # wait for the async checkpoint to commit (its final folder appears on the rename);
          # the rollout keeps offering groups meanwhile
          done = os.path.join({workdir!r}, "checkpoints", str(step), "_CHECKPOINT_METADATA")
          deadline = time.monotonic() + 120
          while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.01)
          os.kill(os.getpid(), signal.SIGKILL)
      train(from_config_dict(c), {workdir!r}, on_step=on_step)
  """)
  env = {**os.environ, "PYTHONPATH": REPO}
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True)
  assert proc.returncode == -9, proc.stderr.decode()[-3000:]
  assert Checkpointer(workdir).latest_step() == KILL_AFTER
  first_offered = read_jsonl(os.path.join(workdir, "offered.jsonl"))
  first_consumed = read_jsonl(os.path.join(workdir, "consumed.jsonl"))
  saved = ckpt_meta(workdir, KILL_AFTER)
  shutil.copytree(workdir, str(tmp_path / "at_kill"))

  config = arith_disagg.get_config("quick")
  config.loop.steps = STEPS
  train(from_config_dict(config), workdir)

  rows = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # no step duplicated
  consumed = read_jsonl(os.path.join(workdir, "consumed.jsonl"))
  offered = read_jsonl(os.path.join(workdir, "offered.jsonl"))
  final = ckpt_meta(workdir, STEPS)

  # The history up to the checkpoint is the first run's; the rest is the resumed run's.
  assert [c for c in consumed if c["step"] < KILL_AFTER] == [
    c for c in first_consumed if c["step"] < KILL_AFTER
  ]
  assert [c["consume_version"] for c in consumed] == list(range(2 * STEPS))
  ids = [g for c in consumed for g in c["group_ids"]]
  assert len(ids) == len(set(ids)), "a group was consumed twice"

  # Admission counters restored intact: offer sequence numbers continue without gap or repeat.
  counters = saved["admission"]["counters"]
  assert [o["seq"] for o in offered] == list(range(1, len(offered) + 1))
  assert [o for o in offered if o["seq"] <= counters["offered"]] == first_offered[
    : counters["offered"]
  ]
  # The first run offered more groups after its checkpoint (they were generating in it): the
  # resumed run drops them and regenerates their prompts first (group ids restart at the
  # checkpoint's next id, so ids of dropped groups may be handed out again).
  # (Whether any group was offered between the checkpoint and the kill depends on thread timing;
  # the checks below hold either way.)
  assert (
    min(o["group_id"] for o in offered if o["seq"] > counters["offered"]) >= saved["next_group_id"]
  )
  regenerated = collections.Counter(p["prompt_id"] for p in saved["generating"])
  resumed = collections.Counter(
    o["prompt_id"] for o in offered if o["seq"] > counters["offered"]
  ) + collections.Counter(p["prompt_id"] for p in final["generating"])
  assert not regenerated - resumed  # every prompt generating at the checkpoint came back

  # offered = consumed + rejected + pending, as counts and as sets of group ids.
  pending = [g["group_id"] for g in final["admission"]["open"]]
  pending += [g["group_id"] for _, g in final["admission"]["waiting"]]
  pending += [g["group_id"] for mb in final["queued"] for g in mb["groups"]]
  rejected = [o["group_id"] for o in offered if o["rejected"]]
  assert sorted(ids + rejected + pending) == sorted(o["group_id"] for o in offered)
  last = rows[-1]
  assert last["groups_offered"] == len(offered) == final["admission"]["counters"]["offered"]
  assert last["groups_consumed"] == len(ids) == final["consumed"]
  assert last["groups_pending"] == len(pending) and last["groups_lost"] == 0
  assert all(r["quota_violations"] == 0 for r in rows)
