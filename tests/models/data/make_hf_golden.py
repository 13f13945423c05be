"""Writes the golden fixtures of tests/models/test_hf.py with real Hugging Face `transformers`.

Not part of knitjax (torch and transformers are never project dependencies); run it in a
throwaway environment and commit what it writes:

  python -m venv /tmp/hfref && /tmp/hfref/bin/pip install torch transformers safetensors
  /tmp/hfref/bin/python tests/models/data/make_hf_golden.py

For each family it builds a tiny random model, rounds every weight to bfloat16 (so the bf16
checkpoint holds exactly the float32 model), saves it with `save_pretrained` in bfloat16, and
records transformers' float32 eager-attention logits for two sequences, the second left-padded.
"""

import json
import os

import numpy as np
import torch
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
COMMON = dict(
  vocab_size=64,
  hidden_size=32,
  intermediate_size=48,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  rms_norm_eps=1e-5,
  max_position_embeddings=128,
)
FAMILIES = {
  "qwen2": (transformers.Qwen2Config, dict(rope_theta=1e6, tie_word_embeddings=True)),
  "qwen3": (transformers.Qwen3Config, dict(head_dim=16, rope_theta=1e6, tie_word_embeddings=True)),
  "llama": (transformers.LlamaConfig, dict(rope_theta=5e5, tie_word_embeddings=False)),
}
TOKENS = np.array([[5, 17, 3, 60, 42, 8, 33, 21], [0, 0, 0, 9, 14, 63, 2, 50]], np.int64)
VALID = np.array([[1] * 8, [0, 0, 0, 1, 1, 1, 1, 1]], np.int64)


def main():
  torch.manual_seed(0)
  for family, (config_cls, extra) in FAMILIES.items():
    config = config_cls(**COMMON, **extra, attn_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
      for name, p in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
          p.copy_(1.0 + 0.2 * torch.randn_like(p))
        elif name.endswith(".bias"):
          p.copy_(0.3 * torch.randn_like(p))
        else:
          p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        p.copy_(p.to(torch.bfloat16).to(torch.float32))
      positions = np.maximum(np.cumsum(VALID, axis=1) - 1, 0)
      logits = model(
        input_ids=torch.from_numpy(TOKENS),
        attention_mask=torch.from_numpy(VALID),
        position_ids=torch.from_numpy(positions),
      ).logits.numpy()
    out = os.path.join(HERE, f"hf_{family}")
    model.to(torch.bfloat16).save_pretrained(out)
    for extra_file in ("generation_config.json",):
      if os.path.exists(os.path.join(out, extra_file)):
        os.remove(os.path.join(out, extra_file))
    np.savez_compressed(os.path.join(out, "golden.npz"), tokens=TOKENS, valid=VALID, logits=logits)
    with open(os.path.join(out, "versions.json"), "w") as f:
      json.dump({"torch": torch.__version__, "transformers": transformers.__version__}, f)
    print(family, sorted(os.listdir(out)), float(np.abs(logits).max()))


if __name__ == "__main__":
  main()
