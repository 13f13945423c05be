"""A config file with a NameError on line 8 (tests/test_main.py)."""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.seed = undefined_name  # noqa: F821
  return c
