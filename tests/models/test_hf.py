"""Hugging Face checkpoint tests: an independent NumPy forward, golden logits of real transformers,
bitwise round trips, sharded layouts, bf16, and a clear error for every bad input."""

import dataclasses
import json
import os
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from knitjax import sharding
from knitjax.models import hf, safetensors_io
from knitjax.models.transformer import Transformer

DATA = os.path.join(os.path.dirname(__file__), "data")
# Float32 knitjax vs the float64 reference / transformers' float32 eager forward, logits of O(1).
ATOL = RTOL = 1e-5

# Tiny configs in Hugging Face's own terms: GQA everywhere; qwen3 with head_dim != hidden/heads.
BASE = dict(
  vocab_size=64,
  hidden_size=32,
  intermediate_size=48,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  hidden_act="silu",
  rms_norm_eps=1e-5,
)
HF_CONFIGS = {
  "qwen2": dict(BASE, model_type="qwen2", rope_theta=1e6, tie_word_embeddings=True),
  "qwen3": dict(BASE, model_type="qwen3", head_dim=16, rope_theta=1e6, tie_word_embeddings=True),
  "llama": dict(BASE, model_type="llama", rope_theta=5e5, tie_word_embeddings=False),
}
FAMILIES = sorted(HF_CONFIGS)


def _dims(c):
  heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
  return c["hidden_size"], heads, kv, c.get("head_dim") or c["hidden_size"] // heads


def _random_hf_tensors(c: dict, seed: int = 0) -> dict[str, np.ndarray]:
  """Random weights by Hugging Face name and shape ([out, in] Linear weights), float32."""
  rng = np.random.default_rng(seed)
  d, heads, kv, hd = _dims(c)
  f, v = c["intermediate_size"], c["vocab_size"]

  def w(*shape):
    return (rng.standard_normal(shape) * shape[-1] ** -0.5).astype(np.float32)

  def norm(n):
    return (1 + 0.2 * rng.standard_normal(n)).astype(np.float32)

  t = {"model.embed_tokens.weight": w(v, d), "model.norm.weight": norm(d)}
  for i in range(c["num_hidden_layers"]):
    p = f"model.layers.{i}."
    t[p + "input_layernorm.weight"] = norm(d)
    t[p + "post_attention_layernorm.weight"] = norm(d)
    for proj, n in (("q", heads), ("k", kv), ("v", kv)):
      t[p + f"self_attn.{proj}_proj.weight"] = w(n * hd, d)
      if c["model_type"] == "qwen2":
        t[p + f"self_attn.{proj}_proj.bias"] = (0.3 * rng.standard_normal(n * hd)).astype(
          np.float32
        )
    t[p + "self_attn.o_proj.weight"] = w(d, heads * hd)
    if c["model_type"] == "qwen3":
      t[p + "self_attn.q_norm.weight"] = norm(hd)
      t[p + "self_attn.k_norm.weight"] = norm(hd)
    t[p + "mlp.gate_proj.weight"] = w(f, d)
    t[p + "mlp.up_proj.weight"] = w(f, d)
    t[p + "mlp.down_proj.weight"] = w(d, f)
  if not c["tie_word_embeddings"]:
    t["lm_head.weight"] = w(v, d)
  return t


def _hf_reference_logits(c: dict, tensors: dict, tokens_t: np.ndarray) -> np.ndarray:
  """Float64 NumPy forward of one unpadded sequence, following transformers' modeling_llama /
  modeling_qwen2 / modeling_qwen3, consuming the checkpoint tensors by Hugging Face name."""
  w = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
  d, heads, kv, hd = _dims(c)
  eps, theta = c["rms_norm_eps"], c.get("rope_theta") or c["rope_parameters"]["rope_theta"]
  t = len(tokens_t)

  def rms(x, weight):  # eps inside the sqrt, then times the weight
    return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))

  def linear(x, name):  # nn.Linear: x @ W.T (+ b)
    y = x @ w[name + ".weight"].T
    return y + w[name + ".bias"] if name + ".bias" in w else y

  inv_freq = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
  emb = np.concatenate([np.outer(np.arange(t), inv_freq)] * 2, axis=-1)  # [T, hd]
  cos, sin = np.cos(emb), np.sin(emb)

  def rope(x):  # x [heads, T, hd]; q * cos + rotate_half(q) * sin
    return x * cos + np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], axis=-1) * sin

  causal = np.where(np.tril(np.ones((t, t), bool)), 0.0, -np.inf)
  x = w["model.embed_tokens.weight"][tokens_t]
  for i in range(c["num_hidden_layers"]):
    p = f"model.layers.{i}."
    h = rms(x, w[p + "input_layernorm.weight"])
    q = linear(h, p + "self_attn.q_proj").reshape(t, heads, hd).transpose(1, 0, 2)
    k = linear(h, p + "self_attn.k_proj").reshape(t, kv, hd).transpose(1, 0, 2)
    v = linear(h, p + "self_attn.v_proj").reshape(t, kv, hd).transpose(1, 0, 2)
    if c["model_type"] == "qwen3":  # per-head RMSNorm before RoPE
      q, k = rms(q, w[p + "self_attn.q_norm.weight"]), rms(k, w[p + "self_attn.k_norm.weight"])
    q, k = rope(q), rope(k)
    k, v = np.repeat(k, heads // kv, axis=0), np.repeat(v, heads // kv, axis=0)  # repeat_kv
    scores = q @ k.transpose(0, 2, 1) * hd**-0.5 + causal
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = (probs @ v).transpose(1, 0, 2).reshape(t, heads * hd)
    x = x + linear(out, p + "self_attn.o_proj")
    h = rms(x, w[p + "post_attention_layernorm.weight"])
    gate = linear(h, p + "mlp.gate_proj")
    x = x + linear(gate / (1 + np.exp(-gate)) * linear(h, p + "mlp.up_proj"), p + "mlp.down_proj")
  x = rms(x, w["model.norm.weight"])
  head = w["model.embed_tokens.weight"] if c["tie_word_embeddings"] else w["lm_head.weight"]
  return x @ head.T


def _write(path, config: dict, tensors: dict) -> str:
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  safetensors_io.write_safetensors(os.path.join(path, "model.safetensors"), tensors)
  return str(path)


@nnx.jit
def _forward(model, tokens, positions, valid):
  return model(tokens, positions, valid)


def _knitjax_logits(path: str, tokens: np.ndarray, valid: np.ndarray) -> np.ndarray:
  model = Transformer(hf.config_from_hf(path), rngs=nnx.Rngs(0))
  hf.load_hf_params(path, model)
  positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0)
  return np.asarray(_forward(model, tokens, positions, valid.astype(bool)))


TOKENS = np.array([[5, 17, 3, 60, 42, 8, 33, 21], [0, 0, 0, 9, 14, 63, 2, 50]], np.int32)
VALID = np.array([[1] * 8, [0, 0, 0, 1, 1, 1, 1, 1]], np.int32)


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_matches_independent_hf_reference(tmp_path, family):
  c, tensors = HF_CONFIGS[family], _random_hf_tensors(HF_CONFIGS[family])
  logits = _knitjax_logits(_write(tmp_path, c, tensors), TOKENS, VALID)
  for b in range(len(TOKENS)):
    keep = VALID[b].astype(bool)
    want = _hf_reference_logits(c, tensors, TOKENS[b][keep])
    np.testing.assert_allclose(logits[b][keep], want, atol=ATOL, rtol=RTOL)
  assert np.abs(want).max() > 1.0  # the comparison is not between near-zero logits


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_matches_transformers_golden(family):
  """bf16 checkpoints written by transformers' save_pretrained; logits from its own forward."""
  path = os.path.join(DATA, f"hf_{family}")
  golden = np.load(os.path.join(path, "golden.npz"))
  valid = golden["valid"].astype(np.int32)
  logits = _knitjax_logits(path, golden["tokens"].astype(np.int32), valid)
  keep = valid.astype(bool)
  np.testing.assert_allclose(logits[keep], golden["logits"][keep], atol=ATOL, rtol=RTOL)
  # The NumPy reference agrees with transformers too, so it is a trustworthy oracle.
  with open(os.path.join(path, "config.json")) as f:
    c = json.load(f)
  want = _hf_reference_logits(c, hf.read_safetensors(path), golden["tokens"][0])
  np.testing.assert_allclose(golden["logits"][0], want, atol=ATOL, rtol=RTOL)


def _random_model(config, seed=0) -> Transformer:
  """A model whose every param is random (norm scales and biases too), so no slot is trivial."""
  model = Transformer(config, rngs=nnx.Rngs(seed))
  key = jax.random.key(seed)
  for _, p in nnx.iter_graph(model):
    if isinstance(p, nnx.Param):
      key, sub = jax.random.split(key)
      p[...] = jax.random.normal(sub, p.shape)
  return model


def _abstract_state(config):
  return nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))[1]


def _assert_same(state_a, state_b):
  flat_a, flat_b = nnx.to_flat_state(state_a), nnx.to_flat_state(state_b)
  assert [k for k, _ in flat_a] == [k for k, _ in flat_b]
  for (key, a), (_, b) in zip(flat_a, flat_b, strict=True):
    assert np.array_equal(np.asarray(a.get_value()), np.asarray(b.get_value())), key


@pytest.mark.parametrize("family", FAMILIES)
def test_reexport_of_transformers_checkpoint_is_bitwise(tmp_path, family):
  path = os.path.join(DATA, f"hf_{family}")
  config, graphdef, state = hf.init_from_hf(path)
  hf.save_hf_params(state, config, tmp_path, dtype=ml_dtypes.bfloat16)
  original, exported = hf.read_safetensors(path), hf.read_safetensors(tmp_path)
  assert sorted(original) == sorted(exported)
  for name, tensor in original.items():
    assert exported[name].dtype == tensor.dtype and np.array_equal(exported[name], tensor), name


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_bitwise(tmp_path, family):
  config = hf.config_from_hf(HF_CONFIGS[family])
  model = _random_model(config)
  hf.save_hf_params(model, config, tmp_path)
  assert hf.config_from_hf(tmp_path) == config
  loaded = hf.load_hf_params(tmp_path, _abstract_state(config))
  _assert_same(nnx.state(model), loaded)
  assert ("lm_head.weight" in hf.read_safetensors(tmp_path)) == (not config.tie_embeddings)


def test_sharded_index_layout_loads_onto_a_mesh(tmp_path):
  config = hf.config_from_hf(HF_CONFIGS["llama"])
  model = _random_model(config)
  hf.save_hf_params(model, config, tmp_path, max_shard_bytes=20_000)
  shards = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
  assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
  with open(tmp_path / hf.INDEX_FILE) as f:
    index = json.load(f)
  assert set(index["weight_map"].values()) == set(shards)

  mesh = sharding.make_mesh((1, 2, 4))
  abstract = _abstract_state(config)
  loaded = hf.load_hf_params(tmp_path, abstract, mesh=mesh)
  _assert_same(nnx.state(model), loaded)
  want = sharding.state_shardings(abstract, mesh)
  for (key, got), (_, expected) in zip(
    nnx.to_flat_state(loaded), nnx.to_flat_state(want), strict=True
  ):
    assert got.get_value().sharding == expected.get_value(), key
  q = loaded["blocks"][0]["attn"]["q_kernel"].get_value()
  assert q.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)
  assert q.addressable_shards[0].data.shape == (16, 1, 8)


def test_bf16_checkpoint_loads_exactly(tmp_path):
  config = hf.config_from_hf(HF_CONFIGS["qwen3"])
  model = _random_model(config)
  hf.save_hf_params(model, config, tmp_path, dtype=ml_dtypes.bfloat16)
  with open(tmp_path / "model.safetensors", "rb") as f:
    header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
  assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
  loaded = hf.load_hf_params(tmp_path, _abstract_state(config))
  rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), nnx.state(model))
  _assert_same(rounded, loaded)
  assert loaded["embedder"]["embedding"].get_value().dtype == jnp.float32


def test_loading_into_a_module_checks_its_config(tmp_path):
  path = _write(tmp_path, HF_CONFIGS["qwen2"], _random_hf_tensors(HF_CONFIGS["qwen2"]))
  other = hf.config_from_hf(dict(HF_CONFIGS["qwen2"], rope_theta=1e4))
  with pytest.raises(ValueError, match="rope_theta=10000.0 but .* says 1000000.0"):
    hf.load_hf_params(path, Transformer(other, rngs=nnx.Rngs(0)))


def test_init_from_hf_places_params_on_the_mesh(tmp_path):
  c = HF_CONFIGS["qwen3"]
  tensors = _random_hf_tensors(c)
  mesh = sharding.make_mesh((1, 2, 4))
  config, graphdef, state = hf.init_from_hf(_write(tmp_path, c, tensors), mesh)
  sharding.assert_params_sharded(state, mesh, min_size=1024)
  down = state["blocks"][1]["mlp"]["down_kernel"].get_value()
  np.testing.assert_array_equal(down, tensors["model.layers.1.mlp.down_proj.weight"].T)
  assert nnx.merge(graphdef, state).config == config


def test_init_from_hf_takes_the_runs_execution_fields(tmp_path):
  # config.model may set how the model runs (Config's contract for init_from); the shapes stay
  # the folder's.
  c = HF_CONFIGS["qwen2"]
  path = _write(tmp_path, c, _random_hf_tensors(c))
  chosen = dataclasses.replace(
    hf.config_from_hf(path), remat="block", scan_layers=True, attention="dense"
  )
  config, graphdef, state = hf.init_from_hf(path, config=chosen)
  assert (config.remat, config.scan_layers, config.attention) == ("block", True, "dense")
  with pytest.raises(ValueError, match="d_model=.* but .* says"):
    hf.init_from_hf(path, config=dataclasses.replace(chosen, d_model=chosen.d_model * 2))


def test_tied_head_copy_is_accepted_and_a_different_one_rejected(tmp_path):
  c = HF_CONFIGS["qwen2"]
  tensors = _random_hf_tensors(c)
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
  tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
  hf.load_hf_params(_write(tmp_path / "copy", c, tensors), _abstract_state(hf.config_from_hf(c)))
  tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
  with pytest.raises(ValueError, match="'lm_head.weight' .* differs from the embedding"):
    hf.load_hf_params(_write(tmp_path / "diff", c, tensors), _abstract_state(hf.config_from_hf(c)))


def _drop(name):
  return lambda t: t.pop(name)


def _reshape(name):
  return lambda t: t.update({name: t[name][:-1]})


def _add(name):
  return lambda t: t.update({name: np.zeros(3, np.float32)})


@pytest.mark.parametrize(
  ("family", "mutate", "message"),
  [
    ("qwen2", _drop("model.layers.1.self_attn.k_proj.bias"), "lacks tensor 'model.layers.1.self_"),
    ("llama", _drop("lm_head.weight"), "lacks tensor 'lm_head.weight'"),
    ("qwen3", _reshape("model.layers.0.self_attn.o_proj.weight"), r"has shape \(31, 64\) but"),
    ("qwen3", _add("model.layers.0.self_attn.o_proj.bias"), "'model.layers.0.self_attn.o_proj.bi"),
    ("llama", _add("model.layers.2.mlp.up_proj.weight"), "layers.2.mlp.up_proj.weight' in .* not"),
  ],
)
def test_bad_tensors_are_named(tmp_path, family, mutate, message):
  c = HF_CONFIGS[family]
  tensors = _random_hf_tensors(c)
  mutate(tensors)
  with pytest.raises(ValueError, match=message):
    hf.load_hf_params(_write(tmp_path, c, tensors), _abstract_state(hf.config_from_hf(c)))


@pytest.mark.parametrize(
  ("change", "message"),
  [
    (dict(model_type="mistral"), "model_type='mistral' is not supported; accepted: .'llama'"),
    (
      dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
      "rope_scaling has rope type 'dynamic'; accepted: null, 'default', 'linear', 'llama3', 'yarn'",
    ),
    (
      dict(rope_scaling={"type": "longrope", "factor": 2.0}),
      "rope type 'longrope'; accepted: null",
    ),
    (dict(rope_parameters={"rope_type": "yarn"}), "rope_parameters has rope type 'yarn'"),
    (dict(use_sliding_window=True), "use_sliding_window=true is not supported"),
    (dict(attention_bias=True), r"attention_bias=true \(llama\) is not supported"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    (dict(hidden_size=0), "hidden_size must be a positive integer, got 0"),
    (dict(head_dim=7), r"head_dim must be an even integer >= 2 \(RoPE\), got 7\.$"),
  ],
)
def test_unsupported_configs_are_rejected(change, message):
  with pytest.raises(ValueError, match=message):
    hf.config_from_hf(dict(HF_CONFIGS["llama"], **change))


# Corruptions the bad-input generator (lab.faults.bad_inputs, kind hf_checkpoints) found to
# crash with another exception, to be accepted silently, or to be refused without naming the field.
@pytest.mark.parametrize(
  ("change", "message"),
  [
    (dict(model_type=[1]), r"model_type=\[1\] is not supported; accepted: \['llama'"),
    (dict(model_type=None), "model_type=None is not supported"),
    (dict(rope_scaling="linear"), "rope_scaling must be an object or null, got 'linear'"),
    (dict(rope_scaling=[1]), r"rope_scaling must be an object or null, got \[1\]"),
    (dict(rope_parameters=3), "rope_parameters must be an object or null, got 3"),
    (dict(rms_norm_eps=[3]), r"rms_norm_eps must be a finite number > 0, got \[3\]"),
    (dict(rms_norm_eps=float("inf")), "rms_norm_eps must be a finite number > 0, got inf"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be a finite number > 0, got nan"),
    (dict(rms_norm_eps=None), "rms_norm_eps must be a finite number > 0, got None"),
    (dict(rope_theta={"a": 1}), "rope_theta must be a finite number > 0, got {'a': 1}"),
    (dict(rope_theta="x"), "rope_theta must be a finite number > 0, got 'x'"),
    (dict(rope_theta="1e4"), "rope_theta must be a finite number > 0, got '1e4'"),
    (dict(rope_theta=float("inf")), "rope_theta must be a finite number > 0, got inf"),
    (dict(rope_theta=0), "rope_theta must be a finite number > 0, got 0"),
    (dict(rope_theta=True), "rope_theta must be a finite number > 0, got True"),
    (dict(rope_theta=10**400), "rope_theta must be a finite number > 0, got 1000"),
    (
      dict(rope_theta=None, rope_parameters={"rope_theta": "x"}),
      "rope_theta must be a finite number > 0, got None",
    ),
    (dict(num_key_value_heads=0), "num_key_value_heads must be a positive integer, got 0"),
    (dict(num_key_value_heads=-2), "num_key_value_heads must be a positive integer, got -2"),
    (dict(num_key_value_heads=True), "num_key_value_heads must be a positive integer, got True"),
    (dict(num_key_value_heads=2.0), "num_key_value_heads must be a positive integer, got 2.0"),
    (dict(num_key_value_heads=3), "num_key_value_heads=3 must divide num_attention_heads=4"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings must be true or false, got 'false'"),
    (dict(tie_word_embeddings=0), "tie_word_embeddings must be true or false, got 0"),
    (dict(use_sliding_window="no"), "use_sliding_window must be true or false, got 'no'"),
    (dict(hidden_size=True), "hidden_size must be a positive integer, got True"),
    (dict(vocab_size=None), "vocab_size must be a positive integer, got None"),
    (dict(num_attention_heads=4.0), "num_attention_heads must be a positive integer, got 4.0"),
    (dict(head_dim=0), "head_dim must be a positive integer, got 0"),
    (dict(head_dim=True), "head_dim must be a positive integer, got True"),
    (dict(hidden_size=12), r"got 3 \(hidden_size // num_attention_heads\)"),
    (dict(partial_rotary_factor=True), "partial_rotary_factor must be 1.0 .* got True"),
    (dict(layer_types=5), "layer_types must all be 'full_attention'"),
  ],
)
def test_bad_config_fields_are_one_named_sentence(tmp_path, change, message):
  with open(tmp_path / "config.json", "w") as f:
    json.dump(dict(HF_CONFIGS["llama"], **change), f)  # allow_nan: Python's json writes inf, nan
  with pytest.raises(ValueError, match=f"^config.json .*{message}") as err:
    hf.config_from_hf(tmp_path)
  assert "\n" not in str(err.value)


def test_v5_rope_theta_is_checked_under_its_own_name():
  v5 = {k: v for k, v in HF_CONFIGS["llama"].items() if k != "rope_theta"}
  with pytest.raises(ValueError, match="rope_parameters.rope_theta must be a finite number > 0"):
    hf.config_from_hf(dict(v5, rope_parameters={"rope_theta": float("inf")}))


def test_null_means_the_hugging_face_default():
  nulls = dict(
    HF_CONFIGS["llama"],
    num_key_value_heads=None,
    head_dim=None,
    rope_scaling=None,
    tie_word_embeddings=None,
    layer_types=None,
  )
  config = hf.config_from_hf(nulls)
  assert (config.num_kv_heads, config.head_dim, config.tie_embeddings) == (4, 8, False)


@pytest.mark.parametrize(
  ("content", "message"),
  [
    (b"", r"config.json is not UTF-8 JSON \(Expecting value"),
    (b'{"model_type": "llama"', r"config.json is not UTF-8 JSON \("),
    (b"\xff\xfe{}", r"config.json is not UTF-8 JSON \('utf-8' codec can't decode"),
    (b"null", "config.json holds null; accepted: a JSON object"),
    (b"[]", r"config.json holds \[\]; accepted: a JSON object"),
    (b"100", "config.json holds 100; accepted: a JSON object"),
    (b"[" * 100_000, r"config.json is not UTF-8 JSON \("),
  ],
)
def test_unreadable_config_json_is_one_named_sentence(tmp_path, content, message):
  (tmp_path / "config.json").write_bytes(content)
  with pytest.raises(ValueError, match=message) as err:
    hf.config_from_hf(tmp_path)
  assert "\n" not in str(err.value)


def _shards(path, index: bytes | dict) -> str:
  """A folder with two one-tensor shards and the given `model.safetensors.index.json`."""
  os.makedirs(path, exist_ok=True)
  for i in (1, 2):
    safetensors_io.write_safetensors(path / f"s{i}.safetensors", {f"t{i}": np.ones(2, np.float32)})
  blob = index if isinstance(index, bytes) else json.dumps(index).encode()
  (path / hf.INDEX_FILE).write_bytes(blob)
  return str(path)


@pytest.mark.parametrize(
  ("index", "message"),
  [
    (b'{"weight_map": {"t1": "s1.safe', r"index.json is not UTF-8 JSON \("),
    (b"\xff", r"index.json is not UTF-8 JSON \("),
    (b"[1]", r"index.json holds \[1\]; accepted: a JSON object"),
    ({"metadata": {}}, r"index.json has no weight_map; accepted: an object of tensor name"),
    ({"weight_map": ["s1.safetensors"]}, r"index.json has weight_map \[\"s1.safetensors"),
    ({"weight_map": {"t1": 1}}, r"index.json maps tensor 't1' to 1; accepted: a file name"),
    ({"weight_map": {"t1": None}}, "index.json maps tensor 't1' to None; accepted: a file name"),
    ({"weight_map": {"t1": "../s1.safetensors"}}, r"maps tensor 't1' to '\.\./s1.safetensors'"),
    ({"weight_map": {"t1": "s3.safetensors"}}, r"s3.safetensors does not exist\.$"),
    ({"weight_map": {"t1": "s2.safetensors"}}, "maps tensor 't1' to s2.safetensors, which does"),
  ],
)
def test_bad_index_json_is_one_named_sentence(tmp_path, index, message):
  path = _shards(tmp_path, index)
  with pytest.raises(ValueError, match=message) as err:
    hf.read_safetensors(path)
  assert "\n" not in str(err.value)
  good = _shards(
    tmp_path / "good", {"weight_map": {"t1": "s1.safetensors", "t2": "s2.safetensors"}}
  )
  assert sorted(hf.read_safetensors(good)) == ["t1", "t2"]


_ENTRY = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


def _entry(**change):
  return {"__metadata__": {"format": "pt"}, "w": {**_ENTRY, **change}}


def _without(key):
  return {"w": {k: v for k, v in _ENTRY.items() if k != key}}


@pytest.mark.parametrize(
  ("header", "data", "message"),
  [
    (b"\xff\xfe", 8, r"is not a safetensors file: its header is not UTF-8 JSON \('utf-8'"),
    (b"{", 8, r"is not a safetensors file: its header is not UTF-8 JSON \(Expecting"),
    (b"[]", 8, r"is not a safetensors file: its header is \[\], not an object"),
    (b"null", 8, "is not a safetensors file: its header is null, not an object"),
    (_without("dtype"), 8, "tensor 'w' in .*model.safetensors lacks dtype; accepted: an object"),
    (_without("shape"), 8, "tensor 'w' in .*model.safetensors lacks shape"),
    (_without("data_offsets"), 8, "tensor 'w' in .*model.safetensors lacks data_offsets"),
    ({"w": 5}, 8, "tensor 'w' in .*model.safetensors is 5; accepted: an object with dtype"),
    (_entry(shape=None), 8, "tensor 'w' in .*model.safetensors has shape None; accepted"),
    (_entry(shape=[-2]), 8, r"has shape \[-2\]; accepted: a list of integers >= 0"),
    (_entry(shape=["2"]), 8, r"has shape \['2'\]; accepted"),
    (_entry(shape=[True, 2]), 8, r"has shape \[True, 2\]; accepted"),
    (_entry(data_offsets=[0]), 8, r"'w' in .*model.safetensors has data_offsets \[0\]; accep"),
    (_entry(data_offsets=[8, 0]), 8, r"has data_offsets \[8, 0\]; accepted: \[begin, end\]"),
    (_entry(data_offsets=None), 8, "has data_offsets None; accepted"),
    (_entry(data_offsets=[0, 4]), 8, r"data_offsets \[0, 4\] \(4 bytes\) but F32\[2\] needs 8"),
    (_entry(data_offsets=[8, 16]), 8, r"data_offsets \[8, 16\] but the file holds only 8 bytes"),
    (_entry(), 5, r"'w' in .*model.safetensors has data_offsets \[0, 8\] but the file holds on"),
    (_entry(dtype="I32"), 8, r"has dtype 'I32'; accepted: \['BF16', 'F16', 'F32', 'F64'\]"),
    (_entry(dtype=[1]), 8, r"'w' in .*model.safetensors has dtype \[1\]; accepted"),
    (_entry(dtype="x" * 100), 8, "has dtype 'x{59}; accepted"),  # a junk value is cut short
  ],
)
def test_bad_safetensors_header_is_one_named_sentence(tmp_path, header, data, message):
  blob = header if isinstance(header, bytes) else json.dumps(header).encode()
  file = tmp_path / "model.safetensors"
  file.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(data))
  with pytest.raises(ValueError, match=message) as err:
    safetensors_io.read_header(str(file))
  assert "\n" not in str(err.value)


def test_truncated_or_missing_safetensors_is_one_named_sentence(tmp_path):
  file = tmp_path / "model.safetensors"
  safetensors_io.write_safetensors(file, {"w": np.arange(4, dtype=np.float32)})
  blob = file.read_bytes()
  assert safetensors_io.read_header(str(file))["w"].shape == (4,)
  for size, message in [
    (
      len(blob) - 1,
      "'w' in .*model.safetensors has data_offsets .0, 16. but the file holds only 15",
    ),
    (
      20,
      "model.safetensors is not a safetensors file: its header length is .*; accepted: 1 to 12 ",
    ),
    (8, "model.safetensors is not a safetensors file: its header length is .*; accepted: 1 to 0 "),
    (3, "model.safetensors has 3 bytes, too few to be a safetensors file"),
  ]:
    file.write_bytes(blob[:size])
    with pytest.raises(ValueError, match=message):
      safetensors_io.read_header(str(file))
  file.write_bytes(struct.pack("<Q", 0) + blob[8:])
  with pytest.raises(ValueError, match="its header length is 0; accepted: 1 to "):
    safetensors_io.read_header(str(file))
  with pytest.raises(ValueError, match="other.safetensors does not exist"):
    safetensors_io.read_header(str(tmp_path / "other.safetensors"))
  with pytest.raises(ValueError, match=f"{tmp_path} cannot be read"):
    safetensors_io.read_header(str(tmp_path))


def test_config_fields_and_hugging_face_defaults():
  qwen3 = hf.config_from_hf({k: v for k, v in HF_CONFIGS["qwen3"].items() if k != "head_dim"})
  assert (qwen3.head_dim, qwen3.qk_norm, qwen3.qkv_bias) == (128, True, False)  # Qwen3Config
  qwen2 = hf.config_from_hf(HF_CONFIGS["qwen2"])
  assert (qwen2.head_dim, qwen2.qkv_bias, qwen2.tie_embeddings, qwen2.norm_eps) == (
    8,
    True,
    True,
    1e-5,
  )
  v5 = dict(HF_CONFIGS["llama"], rope_parameters={"rope_type": "default", "rope_theta": 123.0})
  del v5["rope_theta"]
  llama = hf.config_from_hf(v5, dtype="bfloat16")
  assert (llama.rope_theta, llama.num_kv_heads, llama.ffn_dim, llama.dtype) == (
    123.0,
    2,
    48,
    "bfloat16",
  )
  with pytest.raises(ValueError, match="lacks the required field 'vocab_size'"):
    hf.config_from_hf({"model_type": "qwen2"})


def test_overlapping_data_offsets_name_both_tensors(tmp_path):
  header = {
    "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
    "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
    "empty": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]},  # no bytes: no overlap
  }
  blob = json.dumps(header).encode()
  file = tmp_path / "model.safetensors"
  file.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(16))
  with pytest.raises(
    ValueError,
    match=r"^tensors 'a' and 'b' in .*model.safetensors have overlapping data_offsets; accepted",
  ):
    safetensors_io.read_header(str(file))
  header["b"]["data_offsets"] = [16, 24]
  blob = json.dumps(header).encode()
  file.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(24))
  assert sorted(safetensors_io.read_header(str(file))) == ["a", "b", "empty"]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_a_damaged_checkpoint(tmp_path, bad):
  c = HF_CONFIGS["llama"]
  tensors = _random_hf_tensors(c)
  tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = bad
  path = _write(tmp_path, c, tensors)
  with pytest.raises(
    ValueError,
    match=r"^tensor 'model.layers.1.mlp.up_proj.weight' in .*model.safetensors holds 1 "
    r"non-finite values \(NaN or inf\); the checkpoint is damaged\.$",
  ):
    hf.init_from_hf(path)
