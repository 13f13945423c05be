"""Evaluate a checkpoint alone: ``python -m knitjax.eval --config configs/<x>.py --workdir DIR``.

Restores the newest intact checkpoint of ``DIR`` (or the config's starting policy when the
workdir has none: ``config.init_from`` or the seeded random init), runs the held-out evaluation
of ``config.eval`` (greedy accuracy, and pass@k when ``config.eval.samples`` > 0) and writes
``DIR/eval_checkpoint.json`` plus the greedy answers. Training is not resumed or changed.
"""

import json
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from knitjax import cli
from knitjax import workdir as wd

_CONFIG = config_flags.DEFINE_config_file("config", None, "The run's config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir (its checkpoints).")
_PROMPTS = flags.DEFINE_integer("prompts", 0, "Held-out prompts (0: config.eval.prompts).")
flags.mark_flags_as_required(["config", "workdir"])


def evaluate(config, workdir: str) -> dict:
  """Evaluates the newest checkpoint of ``workdir``; returns the metrics with the step."""
  import jax

  from knitjax.runtime import builder, rollout_builder

  mesh = builder.build_mesh(config)
  prompts = builder.build_prompts(config)
  graphdef, learner = builder.build_learner(config, mesh, workdir)
  restored = learner.restore() if wd.path(workdir, "checkpoints").is_dir() else None
  step = 0 if restored is None else learner.version // config.admission.minibatches
  evaluator = rollout_builder.build_evaluator(config, graphdef, mesh, prompts)
  with jax.set_mesh(mesh):
    rng = jax.random.fold_in(rollout_builder.eval_rng(config), step)
    metrics, answers = evaluator(learner.policy_params, rng)
  learner.close()
  out = {"step": step, "checkpoint": restored is not None, **metrics}
  wd.path(workdir).mkdir(parents=True, exist_ok=True)
  wd.path(workdir, "eval_checkpoint.json").write_text(
    json.dumps({**out, "answers": answers}, indent=1)
  )
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


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
