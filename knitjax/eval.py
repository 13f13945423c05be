"""Evaluate a checkpoint alone: ``python -m knitjax.eval --config configs/<x>.py --workdir DIR``.

Restores the newest intact checkpoint of ``DIR``, runs the held-out evaluation of
``config.eval`` (greedy accuracy, and pass@k when ``config.eval.samples`` > 0; on each held-out
set, ``config.eval.extra_paths`` included) and writes ``DIR/eval_checkpoint.json`` with the
greedy answers. Training is not resumed or changed; a running run's workdir may be evaluated (no
lock is taken). A workdir that is missing, a file, or holds no checkpoint is refused in one
sentence (nothing is created), as is one that cannot be written, before anything is evaluated.
"""

import json
import sys

from absl import flags, logging
from ml_collections import config_flags

from knitjax import cli
from knitjax import workdir as wd

# Flags only when run as a command: the library function can be imported beside another entry
# point (both define --config).
if __name__ == "__main__":
  _CONFIG = config_flags.DEFINE_config_file("config", None, "The run's config file.")
  _WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir (its checkpoints).")
  _PROMPTS = flags.DEFINE_integer("prompts", 0, "Held-out prompts (0: config.eval.prompts).")
  flags.mark_flags_as_required(["config", "workdir"])


def evaluate(config, workdir: str) -> dict:
  """Evaluates the newest checkpoint of ``workdir``; returns the metrics with the step."""
  import jax

  from knitjax.runtime import builder, rollout_builder
  from knitjax.runtime.preflight import check_checkpoint_workdir, check_writable

  check_checkpoint_workdir(workdir)
  check_writable(wd.path(workdir), f"--workdir {workdir}", create=False)
  mesh = builder.build_mesh(config)
  prompts = builder.build_prompts(config)
  graphdef, learner = builder.build_learner(config, mesh, workdir, prompt_len=prompts.prompt_len)
  restored = learner.restore()
  step = learner.version // config.admission.minibatches
  evaluator = rollout_builder.build_evaluator(config, graphdef, mesh, prompts)
  with jax.set_mesh(mesh):
    rng = jax.random.fold_in(rollout_builder.eval_rng(config), step)
    metrics, answers = evaluator(learner.policy_params, rng)
  learner.close()
  out = {"step": step, "checkpoint": restored is not None, **metrics}
  file = wd.path(workdir, "eval_checkpoint.json")
  # The first held-out set's greedy answers under "answers", another set's under "answers_<name>".
  named = {f"answers_{name}" if name else "answers": records for name, records in answers.items()}
  try:
    file.write_text(json.dumps({**out, **named}, indent=1))
  except OSError as e:  # checked writable above; a disk that filled up meanwhile
    print(json.dumps(out))  # the result is not lost
    raise wd.write_error(file, e) from None
  return out


def main(argv):
  del argv
  cli.quiet_libraries()
  import dataclasses

  from knitjax.config import from_config_dict

  try:
    config = from_config_dict(_CONFIG.value)
    if _PROMPTS.value:
      config = dataclasses.replace(
        config, eval=dataclasses.replace(config.eval, prompts=_PROMPTS.value)
      )
  except (OSError, ValueError) as e:
    sys.exit(f"error: {cli.one_line(e)}")
  cli.request_cpu_devices(config.mesh.cpu_devices)
  try:
    out = evaluate(config, _WORKDIR.value)
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f"error: {e}")
  logging.info("eval: %s", out)
  print(json.dumps(out))


def _stopped(how: str) -> str:
  return f"stopped by {how}; nothing was evaluated or written (rerun the same command)."


if __name__ == "__main__":
  cli.run(main, stopped=_stopped)
