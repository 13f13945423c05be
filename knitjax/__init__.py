"""knitjax: RL post-training for language and vision-language models in JAX.

The path a trajectory takes from rollout to training (admission, storage,
on-demand access, encoder deduplication) is the point of this package; see
docs/ and docs/glossary.md for the words used throughout.
"""

__version__ = "0.1.0"
