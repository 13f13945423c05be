"""The memory estimate refuses a step this machine cannot hold, in one sentence, and only that."""

import importlib
import os

import pytest

from configs import arith_disagg, arith_tiny
from knitjax.config import from_config_dict
from knitjax.config_memory import check_memory, estimate_bytes, host_memory_bytes


def _config(module, variant, group_size):
  c = module.get_config(variant)
  c.rollout.group_size = group_size
  return from_config_dict(c)


@pytest.mark.parametrize("module", [arith_tiny, arith_disagg])
def test_a_huge_group_is_refused_naming_the_field_estimate_and_memory(module):
  config = _config(module, "quick", 1 << 20)
  with pytest.raises(ValueError) as e:
    check_memory(config, memory=16 * 10**9)
  msg = str(e.value)
  assert msg.startswith("config.rollout.group_size=1048576 ")
  assert "needs an estimated " in msg and "more than this machine's 16 GB" in msg
  assert msg.count(".") >= 1 and "\n" not in msg
  assert estimate_bytes(config) > 100 * 10**9  # hundreds of GB: what the probe saw allocated


def test_processes_share_the_step():
  config = _config(arith_tiny, "quick", 1 << 20)
  need = estimate_bytes(config)
  check_memory(config, processes=4, memory=need // 4 + 1)
  with pytest.raises(ValueError, match="group_size"):
    check_memory(config, processes=4, memory=need // 4 - 1)


def test_the_estimate_grows_with_the_group():
  small, big = (estimate_bytes(_config(arith_tiny, "quick", g)) for g in (8, 64))
  assert 6 * small < big < 10 * small


@pytest.mark.parametrize("name", ["arith_tiny", "arith_disagg", "calc_tool_tiny", "count_vlm_tiny"])
def test_shipped_tiny_configs_fit_a_small_machine(name):
  config = from_config_dict(importlib.import_module(f"configs.{name}").get_config(None))
  check_memory(config, memory=2 * 10**9)  # no refusal: far below a laptop's memory
  assert estimate_bytes(config) < 10**8


def test_host_memory_is_the_physical_memory():
  assert host_memory_bytes() == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_train_refuses_before_making_the_workdir(tmp_path, monkeypatch):
  from knitjax import config_memory, run

  monkeypatch.setattr(config_memory, "host_memory_bytes", lambda: 10**9)
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match=r"more than this machine's 1 GB; lower them\.$"):
    run.train(_config(arith_tiny, "quick", 1 << 16), str(workdir))
  assert not workdir.exists()
