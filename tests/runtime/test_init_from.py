"""config.init_from: a run starts from a Hugging Face checkpoint folder instead of random init."""

import jax
import numpy as np
import pytest
from flax import nnx

from configs import arith_tiny
from knitjax.config import from_config_dict
from knitjax.distributed.topology import choose
from knitjax.models import hf
from knitjax.models.transformer import Transformer
from knitjax.runtime import builder, colocated


@pytest.fixture
def checkpoint(tmp_path):
  """A Qwen3-shaped checkpoint (the arith_tiny shape) written by the exporter."""
  c = from_config_dict(arith_tiny.get_config("quick"))
  model = Transformer(c.model, rngs=nnx.Rngs(123))  # not the run's seed: init must come from here
  path = tmp_path / "hf"
  hf.save_hf_params(model, c.model, str(path))
  return str(path), nnx.state(model, nnx.Param)


def _config(path, **model):
  c = arith_tiny.get_config("quick")
  c.init_from = path
  c.model = model or {"dtype": "float32"}
  return c


def test_policy_starts_from_the_checkpoint_and_trains(checkpoint, tmp_path):
  path, saved = checkpoint
  config = from_config_dict(_config(path))
  expected = from_config_dict(arith_tiny.get_config("quick")).model
  assert config.model == expected  # the shape read back from config.json
  mesh = builder.build_mesh(config)
  _, params = builder.build_model(config, mesh)
  for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(params), strict=True):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
  out = colocated.run(config, str(tmp_path / "run"), choose(config))
  assert out["step"] == config.loop.steps


def test_init_from_replaces_the_shape_a_shipped_config_sets(checkpoint):
  """`--config.init_from=DIR` on a shipped config: its tiny model fields give way to config.json."""
  path, _ = checkpoint
  c = arith_tiny.get_config("quick")
  c.init_from = path
  c.model.d_model = 8  # differs from the checkpoint: replaced, with a warning
  config = from_config_dict(c)
  assert config.model == from_config_dict(arith_tiny.get_config("quick")).model


def test_bad_init_from_is_one_clear_error(checkpoint, tmp_path):
  path, _ = checkpoint
  with pytest.raises(ValueError, match=r"config.model.widht is not a known field"):
    from_config_dict(_config(path, widht=32))
  with pytest.raises(ValueError, match="is not a folder"):
    from_config_dict(_config(str(tmp_path / "missing")))


def test_a_character_task_refuses_a_checkpoint_with_its_own_tokenizer(checkpoint):
  # arith's character ids would mean other tokens to a model with a real vocabulary.
  path, _ = checkpoint
  with open(f"{path}/tokenizer.json", "w") as f:
    f.write("{}")
  config = from_config_dict(_config(path))
  with pytest.raises(ValueError, match=r"task.name='arith' encodes prompts with its own character"):
    builder.build_prompts(config)
