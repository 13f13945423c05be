"""FLOPs, counted one way for every benchmark, script and the emulated cluster's scale.

A multiply-add is 2 FLOPs, so a forward pass costs 2 FLOPs per matmul param per token, and a
train pass (forward and backward, the backward two forwards' worth) ``TRAIN_PASSES`` = 3 times
that (PaLM's ``6 N``, Chowdhery et al. 2022, appendix B). Attention adds its two
``[T, T]`` products per layer (scores and the weighted sum of values), ``4 x width x T^2`` FLOPs
forward, which PaLM writes ``12 L H Q T`` per trained token. Norms, activations and the softmax
are left out, as PaLM leaves them out.
"""

from __future__ import annotations

from knitjax.models.transformer import TransformerConfig
from knitjax.models.vision import VisionConfig

TRAIN_PASSES = 3  # forward + backward, in forward-equivalents


def matmul_flops(params, tokens, *, passes: int = 1):
  """FLOPs of ``params`` matmul params applied to ``tokens`` tokens, ``passes`` forward-equivalents
  (``TRAIN_PASSES`` for a train pass)."""
  return 2 * params * tokens * passes


def attention_flops(layers: int, width: int, tokens: int):
  """Forward FLOPs of the attention products of ``layers`` layers of ``width`` (heads x head
  dim) over ``tokens`` tokens that all see each other (the causal mask is not subtracted)."""
  return layers * 4 * tokens**2 * width


def matmul_params(model: TransformerConfig) -> int:
  """The decoder's params that take part in a matmul per token: every layer's projections and
  the unembedding (the tied embedding counts once, as the output projection)."""
  d, hd = model.d_model, model.head_dim
  attention = d * (model.num_heads + 2 * model.num_kv_heads) * hd + model.num_heads * hd * d
  mlp = 3 * d * model.ffn_dim
  return model.num_layers * (attention + mlp) + d * model.vocab_size


def train_flops_per_token(model: TransformerConfig, seq_len: int) -> float:
  """PaLM's ``6 N + 12 L H Q T`` FLOPs per trained token (forward and backward)."""
  attention = 12 * model.num_layers * model.num_heads * model.head_dim * seq_len
  return 6.0 * matmul_params(model) + attention


def decoder_forward_flops(model: TransformerConfig, tokens: int) -> int:
  """Forward FLOPs of the decoder over one row of ``tokens`` tokens."""
  width = model.num_heads * model.head_dim
  return matmul_flops(matmul_params(model), tokens) + attention_flops(
    model.num_layers, width, tokens
  )


def encoder_forward_flops(vision: VisionConfig, d_out: int) -> int:
  """Forward FLOPs of the vision encoder and its projector (to ``d_out``) for one image, every
  matmul counted over the image's patches."""
  dv, width = vision.d_model, vision.num_heads * vision.head_dim
  patch = vision.patch_size**2 * vision.channels * dv
  layer = 4 * dv * width + 2 * dv * vision.mlp_dim
  projector = dv * vision.projector_dim + vision.projector_dim * d_out
  n = vision.num_patches
  params = patch + vision.num_layers * layer + projector
  return matmul_flops(params, n) + attention_flops(vision.num_layers, width, n)
