"""Times full Tunix GRPO steps on the tiny Qwen3 shape of configs/bench/step_time.py.

Standalone: run it with the python of a throwaway venv that has `google-tunix==0.1.7`
(see lab/bench/external/README.md). knitjax never imports this file and does not
depend on Tunix.

One timed step is one iteration of Tunix's own `GRPOLearner.train` loop (one global
step): vanilla-rollout generation of 4 prompts x G=4 (16 sequences, 8-token prompts,
32 new tokens), the trivial reward, GRPO advantages, the reference-model forward
(beta != 0, Tunix's default beta=0.04; beta=0 skips it), and one optimizer update
(AdamW, the whole batch is one mini-batch and one micro-batch). Steps are timed
end to end: the wall-clock time between the ends of consecutive global steps, each end
taken after blocking on the updated actor parameters, so compile (warm-up steps) is
excluded and nothing dispatched asynchronously leaks out of a step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# The device count must be fixed before jax is imported anywhere.
_N_DEVICES = 2
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_N_DEVICES}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

# The tiny shape of configs/bench/step_time.py.
SHAPE = {
  "num_layers": 2,
  "d_model": 128,
  "ffn": 256,
  "num_heads": 4,
  "head_dim": 32,
  "num_kv_heads": 2,
  "vocab_size": 256,
  "tied_embeddings": True,
  "num_prompts": 4,
  "group_size": 4,
  "prompt_len": 8,
  "new_tokens": 32,
  "devices": _N_DEVICES,
}

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_FIRST_TEXT_ID = 3


class TinyTokenizer:
  """Stand-in tokenizer: one character per token id (no downloads).

  Ids 0, 1, 2 are pad, bos and eos; every other id i is the character chr(i), so
  decode(encode(s)) == s and len(completion text) == number of completion tokens.
  """

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size

  def encode(self, text: str, **kwargs) -> list[int]:
    del kwargs
    ids = [ord(c) for c in text]
    if any(not _FIRST_TEXT_ID <= i < self.vocab_size for i in ids):
      raise ValueError(f"text {text!r} has characters outside the tiny vocabulary")
    return ids

  def decode(self, ids, **kwargs) -> str:
    del kwargs
    return "".join(chr(int(i)) for i in ids if int(i) >= _FIRST_TEXT_ID)

  def bos_id(self) -> int:
    return BOS_ID

  def eos_id(self) -> int:
    return EOS_ID

  def pad_id(self) -> int:
    return PAD_ID


def make_model(mesh, seed: int):
  """Random-init Tunix Qwen3 of the tiny shape, sharded by Tunix's own partition specs."""
  from tunix.models.qwen3 import model as qwen3_lib

  config = qwen3_lib.ModelConfig(
    num_layers=SHAPE["num_layers"],
    vocab_size=SHAPE["vocab_size"],
    embed_dim=SHAPE["d_model"],
    hidden_dim=SHAPE["ffn"],
    num_heads=SHAPE["num_heads"],
    head_dim=SHAPE["head_dim"],
    num_kv_heads=SHAPE["num_kv_heads"],
    rope_theta=1_000_000,
    norm_eps=1e-6,
    use_tied_embedding=SHAPE["tied_embeddings"],
  )
  model = qwen3_lib.Qwen3(config, rngs=nnx.Rngs(seed))
  graph, state = nnx.split(model)
  pspecs = nnx.get_partition_spec(state)
  shardings = jax.tree.map(
    lambda p: jax.sharding.NamedSharding(
      mesh, p if p is not None else jax.sharding.PartitionSpec()
    ),
    pspecs,
    is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec) or x is None,
  )
  state = jax.device_put(state, shardings)
  return nnx.merge(graph, state)


def prompt_batches(num_prompts: int, prompt_len: int, vocab_size: int, seed: int):
  """Endless batches of random prompts; the sampler prepends BOS, so text is len - 1 chars."""
  rng = np.random.default_rng(seed)
  while True:
    ids = rng.integers(_FIRST_TEXT_ID, vocab_size, size=(num_prompts, prompt_len - 1))
    # A numpy array, not a list: Tunix repeats each leaf G times with np.repeat, and a
    # list of str would be treated as a pytree of scalar leaves.
    yield {"prompts": np.array(["".join(chr(int(i)) for i in row) for row in ids])}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="path of the JSON result")
  parser.add_argument("--warmup", type=int, default=5, help="untimed steps (compile)")
  parser.add_argument("--steps", type=int, default=30, help="timed steps")
  parser.add_argument("--beta", type=float, default=0.04, help="KL coef; 0 skips the ref forward")
  parser.add_argument("--mesh", default="2,1", help="fsdp,tp mesh shape over the 2 CPU devices")
  parser.add_argument("--lr", type=float, default=1e-5)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--breakdown",
    action="store_true",
    help="also time generation / reference forward / update (adds syncs; separate run)",
  )
  args = parser.parse_args(argv)
  if args.warmup < 1 or args.steps < 1:
    parser.error("--warmup and --steps must be >= 1")

  import tunix
  from tunix.rl import rl_cluster as rl_cluster_lib
  from tunix.rl.grpo import grpo_learner as grpo_lib
  from tunix.rl.rollout import base_rollout

  try:
    from importlib.metadata import version

    tunix_version = version("google-tunix")
  except Exception:  # noqa: BLE001 - version is informative only
    tunix_version = getattr(tunix, "__version__", "unknown")

  if jax.device_count() != _N_DEVICES:
    raise SystemExit(f"expected {_N_DEVICES} CPU devices, got {jax.devices()}")
  fsdp, tp = (int(x) for x in args.mesh.split(","))
  mesh = jax.make_mesh((fsdp, tp), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

  actor = make_model(mesh, args.seed)
  # The reference policy starts equal to the actor (same init seed), as in GRPO.
  reference = make_model(mesh, args.seed) if args.beta != 0.0 else None

  total_steps = args.warmup + args.steps
  n_seq = SHAPE["num_prompts"] * SHAPE["group_size"]
  cluster_config = rl_cluster_lib.ClusterConfig(
    role_to_mesh={
      rl_cluster_lib.Role.ACTOR: mesh,
      rl_cluster_lib.Role.REFERENCE: mesh,
      rl_cluster_lib.Role.ROLLOUT: mesh,
    },
    rollout_engine="vanilla",
    offload_to_cpu=False,
    training_config=rl_cluster_lib.RLTrainingConfig(
      actor_optimizer=optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(args.lr, weight_decay=0.0)
      ),
      eval_every_n_steps=10**9,
      max_steps=total_steps,
      # One optimizer update per global step: the whole batch is one mini-batch.
      mini_batch_size=SHAPE["num_prompts"],
      train_micro_batch_size=SHAPE["num_prompts"],
      rollout_micro_batch_size=SHAPE["num_prompts"],
      compute_logps_micro_batch_size=SHAPE["num_prompts"],
    ),
    rollout_config=base_rollout.RolloutConfig(
      max_tokens_to_generate=SHAPE["new_tokens"],
      max_prompt_length=SHAPE["prompt_len"],
      kv_cache_size=SHAPE["prompt_len"] + SHAPE["new_tokens"],
      temperature=1.0,
      top_p=1.0,
      top_k=None,
    ),
  )
  cluster = rl_cluster_lib.RLCluster(
    actor=actor,
    reference=reference,
    tokenizer=TinyTokenizer(SHAPE["vocab_size"]),
    cluster_config=cluster_config,
  )

  completion_lengths: list[int] = []

  def reward_low_half(prompts, completions, **kwargs):
    """Trivial verifiable reward: fraction of completion tokens with id < vocab/2."""
    del prompts, kwargs
    out = []
    for text in completions:
      completion_lengths.append(len(text))
      out.append(sum(ord(c) < SHAPE["vocab_size"] // 2 for c in text) / SHAPE["new_tokens"])
    return out

  learner = grpo_lib.GRPOLearner(
    rl_cluster=cluster,
    algo_config=grpo_lib.GRPOConfig(
      num_generations=SHAPE["group_size"], num_iterations=1, beta=args.beta
    ),
    reward_fns=reward_low_half,
  )

  # Time each global step end to end, blocking on the updated params at its end.
  step_ends: list[float] = []
  inner = learner._run_global_step  # noqa: SLF001 - the only per-step hook Tunix offers

  def timed_global_step(*a, **kw):
    out = inner(*a, **kw)
    jax.block_until_ready(nnx.state(cluster.actor_trainer.model))
    step_ends.append(time.perf_counter())
    return out

  learner._run_global_step = timed_global_step  # noqa: SLF001

  phases: dict[str, list[float]] = {"generate": [], "reference_logps": [], "update": []}
  if args.breakdown:

    def _timed(name, fn, block):
      def wrapper(*a, **kw):
        start = time.perf_counter()
        out = fn(*a, **kw)
        jax.block_until_ready(block(out))
        phases[name].append(time.perf_counter() - start)
        return out

      return wrapper

    cluster.generate = _timed("generate", cluster.generate, lambda o: o.tokens)
    cluster.get_ref_per_token_logps = _timed(
      "reference_logps", cluster.get_ref_per_token_logps, lambda o: o
    )
    cluster.update_actor = _timed(
      "update", cluster.update_actor, lambda _: nnx.state(cluster.actor_trainer.model)
    )

  load_before = os.getloadavg()
  t0 = time.perf_counter()
  learner.train(
    prompt_batches(SHAPE["num_prompts"], SHAPE["prompt_len"], SHAPE["vocab_size"], args.seed)
  )
  total_s = time.perf_counter() - t0

  if len(step_ends) != total_steps:
    raise SystemExit(f"ran {len(step_ends)} global steps, expected {total_steps}")
  times = np.diff(np.asarray(step_ends[args.warmup - 1 :]))
  assert len(times) == args.steps
  first_step_s = step_ends[0] - t0
  result = {
    "tunix_version": tunix_version,
    "median_s": float(np.median(times)),
    "p90_s": float(np.percentile(times, 90)),
    "mean_s": float(np.mean(times)),
    "min_s": float(np.min(times)),
    "steps": int(args.steps),
    "warmup_steps": int(args.warmup),
    "step_times_s": [float(t) for t in times],
    "first_step_s_incl_compile": float(first_step_s),
    "total_wall_s": float(total_s),
    # Other processes on a 2-core machine inflate step times; a 1-min load average well
    # above the ~1 this benchmark itself adds means the figures are not clean.
    "loadavg_1m_before_after": [float(load_before[0]), float(os.getloadavg()[0])],
    "cpu_count": os.cpu_count(),
    "shape": SHAPE,
    "breakdown_median_s": {
      k: float(np.median(v[args.warmup :])) for k, v in phases.items() if len(v) > args.warmup
    },
    "config": {
      "beta": args.beta,
      "reference_forward": args.beta != 0.0,
      "mesh": {"fsdp": fsdp, "tp": tp},
      "optimizer": f"clip_by_global_norm(1.0) + adamw(lr={args.lr}, weight_decay=0)",
      "temperature": 1.0,
      "top_p": 1.0,
      "sequences_per_step": n_seq,
      "optimizer_updates_per_step": 1,
      "mean_completion_tokens": float(statistics.mean(completion_lengths)),
      "jax": jax.__version__,
      "python": sys.version.split()[0],
    },
    "notes": (
      "One step = one Tunix GRPOLearner global step: vanilla rollout (prefill + "
      "while_loop decode, top-p sampling, 16 sequences) -> trivial reward + GRPO "
      "advantages -> reference-model forward (skipped iff beta == 0) -> one AdamW "
      "update (forward + backward) on all 16 sequences. num_iterations=1, so Tunix "
      "computes no separate old-policy log-probs (ratio taken against stop_gradient "
      "of the current policy). EOS (id 2) may stop a sequence early; decoding runs "
      "until all 16 are done or 32 tokens. Timed as wall-clock between ends of "
      "consecutive global steps after warm-up, blocking on actor params."
    ),
  }
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(
    f"tunix {tunix_version}: median {result['median_s'] * 1e3:.1f} ms, "
    f"p90 {result['p90_s'] * 1e3:.1f} ms over {args.steps} steps "
    f"(first step incl. compile {first_step_s:.1f} s) -> {args.out}"
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
