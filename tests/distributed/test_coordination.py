"""A run's processes compare one identity (workdir and config, field by field) before building."""

import json

from configs import arith_tiny
from knitjax.config import from_config_dict
from knitjax.distributed.coordination import first_difference, flat_config


def test_two_configs_differ_in_the_field_named_first():
  c = arith_tiny.get_config("quick")
  a = flat_config(from_config_dict(c))
  c.optimizer.lr = 0.5
  c.seed = 7
  b = flat_config(from_config_dict(c))
  assert first_difference(a, a) is None
  key, here, there, n = first_difference(a, b)
  assert (key, here, there, n) == ("optimizer.lr", a["optimizer.lr"], 0.5, 2)


def test_values_compare_as_json_has_them():
  """Tuples survive the key-value store's JSON: a config equals itself after the round trip."""
  flat = flat_config(from_config_dict(arith_tiny.get_config("quick")))
  assert flat["mesh.shape"] == [-1, 1, 1]
  assert first_difference(flat, json.loads(json.dumps(flat))) is None
