"""Export a checkpoint as a Hugging Face folder:
``python -m knitjax.export --config configs/<x>.py --workdir DIR --out FOLDER``.

Restores the newest intact checkpoint of ``DIR`` (or the config's starting policy when the workdir
has none) and writes its policy with `knitjax.models.hf.save_hf_params`: ``config.json`` and
safetensors in Hugging Face layout. LoRA adapters are merged into the base weights
(``W + (alpha / r)·A·B``), so the folder holds the plain model; it loads as ``config.init_from``
(knitjax writes no tokenizer.json: a task with its own tokenizer trains on it).
"""

import json
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from knitjax import cli
from knitjax import workdir as wd

_CONFIG = config_flags.DEFINE_config_file("config", None, "The run's config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir (its checkpoints).")
_OUT = flags.DEFINE_string("out", None, "The Hugging Face folder to write.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Stored dtype.")
flags.mark_flags_as_required(["config", "workdir", "out"])


def export(config, workdir: str, out: str, *, dtype: str = "float32") -> dict:
  """Writes the newest checkpoint's policy (adapters merged) to ``out``; returns what it wrote."""
  import jax
  import ml_dtypes
  import numpy as np

  from knitjax.runtime import builder

  if config.vision is not None:
    raise ValueError("knitjax.export writes text decoders; config.vision is set (a VLM).")
  mesh = builder.build_mesh(config)
  _, learner = builder.build_learner(config, mesh, workdir)
  restored = learner.restore() if wd.path(workdir, "checkpoints").is_dir() else None
  step = 0 if restored is None else learner.version // config.admission.minibatches
  from knitjax.models import hf

  stored = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
  with jax.set_mesh(mesh):
    hf.save_hf_params(learner.policy_params, config.model, out, dtype=stored)
  learner.close()
  return {"step": step, "checkpoint": restored is not None, "out": out, "dtype": dtype}


def main(argv):
  del argv
  cli.quiet_libraries()
  from knitjax.config import from_config_dict

  try:
    config = from_config_dict(_CONFIG.value)
  except (OSError, ValueError) as e:
    sys.exit(f"error: {cli.one_line(e)}")
  cli.request_cpu_devices(config.mesh.cpu_devices)
  try:
    out = export(config, _WORKDIR.value, _OUT.value, dtype=_DTYPE.value)
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f"error: {e}")
  logging.info("export: %s", out)
  print(json.dumps(out))


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
