"""The learning recipe (configs/smollm2_learn.py): its training and held-out prompts never meet.

Two steps of its tiny variant run in tests/lab/bench/test_device_scripts.py, through the device
script that runs the GPU variant (one run of the real model for both checks)."""

import pytest

from configs import smollm2_learn
from knitjax.config import from_config_dict
from knitjax.tasks import gsm8k, word_problems


@pytest.mark.parametrize("family", sorted(word_problems.FAMILIES))
def test_generated_splits_share_no_question(family):
  train = word_problems.fixed_split("train", family)
  train_q = {r["question"] for r in train}
  assert len(train) == len(train_q) == word_problems.TRAIN_SIZE
  for split in word_problems.splits_of(family)[1:]:
    heldout = word_problems.fixed_split(split, family)
    assert len(heldout) == word_problems.HELDOUT_SIZE
    assert not train_q & {r["question"] for r in heldout}


def test_generated_paths_name_family_and_split():
  assert gsm8k.generated_path("generated:train") == ("mixed", "train")
  assert gsm8k.generated_path("generated:one_step:heldout") == ("one_step", "heldout")
  path = "generated:one_step:heldout_phrasings"
  assert gsm8k.generated_path(path) == ("one_step", "heldout_phrasings")
  for bad in ("generated:", "generated:one_step", "generated:hard:train", "generated:a:b:train"):
    with pytest.raises(ValueError, match=r"unknown generated data .* choose one of: generated:"):
      gsm8k.generated_path(bad)


def test_the_recipe_never_evaluates_on_what_it_trains_on(smollm2_folder):
  """Both held-out sets (numbers and phrasings) are the recipe's, full size, none of their
  prompts trained on."""
  from knitjax.runtime import builder

  config = from_config_dict(smollm2_learn.get_config())
  assert config.init_from == smollm2_folder and config.eval.prompts >= 200
  assert config.task.reward == "numeric_match"  # accuracy and train reward count the same thing
  prompts = builder.build_prompts(config)
  source = prompts.sources["gsm8k"]
  train_texts = {p.text for p in source.next(source.num_examples)}
  sets = builder.build_eval_sets(config, prompts)
  assert list(sets) == ["", "heldout_phrasings"]
  for heldout in sets.values():
    assert len(heldout) == config.eval.prompts
    assert len({p.text for p in heldout}) == len(heldout)
    assert not {p.text for p in heldout} & train_texts
    assert heldout[0].text.endswith("<|im_end|>\n<|im_start|>assistant\n")
  numbers = word_problems.fixed_split("heldout", "one_step")[: config.eval.prompts]
  phrasings = word_problems.fixed_split("heldout_phrasings", "one_step")[: config.eval.prompts]
  for heldout, records in ((sets[""], numbers), (sets["heldout_phrasings"], phrasings)):
    assert all(r["question"] in p.text for p, r in zip(heldout, records, strict=True))
