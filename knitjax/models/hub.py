"""`init_from` strings -> checkpoint folders: a local folder, or a Hugging Face Hub id.

`resolve_checkpoint("Qwen/Qwen2.5-0.5B-Instruct@main")` downloads (or finds in the cache) only
what `knitjax.models.hf` and the tokenizer read: safetensors weights, configs, tokenizer files and
chat template. The cache and offline mode are huggingface_hub's own: `HF_HOME` / `HF_HUB_CACHE`
pick the cache folder and `HF_HUB_OFFLINE=1` returns the cached snapshot without any network
call (huggingface_hub reads these variables when it is imported, so set them before starting).
"""

import os
import re

ALLOW_PATTERNS = (
  "*.safetensors",
  "*.safetensors.index.json",
  "config.json",
  "generation_config.json",
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "chat_template.jinja",
  "preprocessor_config.json",
)
# org/name as the Hub spells it: letters, digits, '-', '_', '.'; then an optional @revision.
_HUB_ID = re.compile(r"([A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@([^\s@]+))?")
_ACCEPTED = "accepted: an existing checkpoint folder or a Hub id 'org/name' (optionally @revision)"


def _parse_hub_id(init_from: str) -> tuple[str, str | None] | None:
  match = _HUB_ID.fullmatch(init_from)
  if match is None:
    return None
  repo_id, revision = match.groups()
  if "--" in repo_id or ".." in repo_id or repo_id.endswith((".git", "-", ".")):
    return None  # the Hub refuses these too
  return repo_id, revision


def resolve_checkpoint(init_from: str) -> str:
  """The local folder of a checkpoint: `init_from` itself, or the Hub snapshot it names.

  Args:
    init_from: a folder (returned unchanged), or `org/name[@revision]` resolved with
      `huggingface_hub.snapshot_download` (only weights, configs and tokenizer files).

  Raises:
    ValueError: one sentence saying what to do, for a string that is neither an existing folder
      nor a Hub id, a Hub id not in the cache while offline, or a failed download.
  """
  if not isinstance(init_from, str) or not init_from:
    raise ValueError(f"init_from={init_from!r} is empty or not a string; {_ACCEPTED}.")
  if os.path.isdir(init_from):
    return init_from
  parsed = _parse_hub_id(init_from)
  if parsed is None or os.path.exists(init_from):
    what = "is a file, not a folder" if os.path.exists(init_from) else "is not a folder"
    raise ValueError(f"init_from={init_from!r} {what} and not a Hub id; {_ACCEPTED}.")
  repo_id, revision = parsed

  import huggingface_hub
  from huggingface_hub import constants, errors

  at = f"{repo_id}@{revision or 'main'}"
  try:
    return huggingface_hub.snapshot_download(
      repo_id, revision=revision, allow_patterns=list(ALLOW_PATTERNS)
    )
  except errors.IncompleteSnapshotError:
    raise ValueError(
      f"the cached snapshot of {at} in {constants.HF_HUB_CACHE} is incomplete and the Hub cannot "
      "be reached; download it again with network access (unset HF_HUB_OFFLINE)."
    ) from None
  except errors.LocalEntryNotFoundError:
    if constants.HF_HUB_OFFLINE:
      raise ValueError(
        f"{at} is not in the Hugging Face cache {constants.HF_HUB_CACHE} and HF_HUB_OFFLINE is "
        "set; download it once online (hf download " + repo_id + "), point HF_HUB_CACHE / HF_HOME "
        "at the cache holding it, or pass its local folder."
      ) from None
    raise ValueError(
      f"{at} could not be downloaded (the Hub cannot be reached) and is not in the cache "
      f"{constants.HF_HUB_CACHE}; check the network, or pass a local checkpoint folder."
    ) from None
  except errors.RevisionNotFoundError:
    raise ValueError(
      f"{repo_id} has no revision {revision!r} on the Hub; pass a branch, tag or commit it has."
    ) from None
  except errors.RepositoryNotFoundError:  # also gated / private repos without a token
    raise ValueError(
      f"{repo_id} is not a model repository on the Hub that this token can read; check the id, "
      "or log in (hf auth login) for gated and private models."
    ) from None
  except (errors.HfHubHTTPError, errors.HFValidationError, OSError) as e:
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ValueError(
      f"{at} could not be downloaded ({reason:.200}); check the network and the id, or pass a "
      "local checkpoint folder."
    ) from None
