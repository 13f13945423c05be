"""A config file with a syntax error on line 6 (tests/test_main.py)."""

import ml_collections


def get_config(:
  return ml_collections.ConfigDict()
