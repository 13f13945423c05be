"""Train-step time with shared prompts against padded rows: speedup next to the token ratio.

A GRPO group is G responses to one prompt. Padded rows (`knitjax.train.batch.make_batch`) run
that prompt G times through every forward and backward of the step; the shared layout
(`knitjax.train.prompt_sharing`, ``layout.prompt_sharing="group"``) lays a group out as one
sequence, its prompt once followed by its G responses, under a tree mask. With prompts of exactly
P tokens and responses of exactly R tokens, the tokens a step processes drop by the **token
ratio** ``G (P + R) / (P + G R)``; this benchmark measures how much of it the step time follows.

Workload per point: ``groups`` groups of G rows, each group one random prompt of P tokens and G
random responses of R tokens, random behaviour log-probs, GRPO advantages of random 0/1
rewards. The same rows are laid out twice: padded (``off``: ``[groups G, P + R]``) and shared
(``group``: ``ShareSpec(prompt_len=P, seq_len=P + G R, multiple=micro_batches x batch shards)``,
one group a sequence), and the real jitted train step runs each
(`knitjax.train.step.compile_train_step`: AdamW, a k3 KL term of ``kl_coef`` against a reference
policy, the initial params, so the reference forward is included; ``micro_batches``
micro-batches; ``packed=False`` and ``packed=True, shared=True``), both from the same init.

Timing: each layout's step is compiled (``lower(...).compile()``, which also gives XLA's memory
analysis, `lab.bench.compiled_memory.memory_stats`) and run once to warm up (that run's loss
is ``loss_off`` / ``loss_group``: the two layouts' first-step losses, equal up to float32
summation order); then ``repeats`` rounds alternate the layouts (off, group, off, group, ...),
one timed step each, so drifts in the machine's speed fall on both. ``speedup`` is the median of
the rounds' off / group ratios; ``speedup_over_ratio`` divides it by the token ratio (the goal:
>= ``goal``, 0.85).

Points: P / R in ``prompt_ratios`` x G in ``group_sizes``, for each model shape of ``models``
(``"arith"``: configs/arith_tiny.py's decoder; ``"smollm2"``: SmolLM2-135M's layer shape with
``num_layers`` cut to 2 by default, since the ratio measures per-layer work that every layer
repeats: ``--config.models.smollm2.model.num_layers=30`` runs the whole depth).

Prompts once per mini-batch (``config.layouts = ("off", "prefix")``, the config's ``:prefix``
variant; `knitjax.train.prefix`, ``layout.prompt_sharing="prefix"``): the second layout keeps a
row per response and runs each prompt once per mini-batch, so a group's rows may span
micro-batches. Its points are ``config.points``, each ``(P, R, G, micro_batches_per_group)``: a
mini-batch of ``groups`` groups split into ``groups x micro_batches_per_group`` micro-batches
(rows in group order, so each group's G rows fill ``micro_batches_per_group`` of them), the same
micro-batches for both layouts. Its tokens are ``P - 1 + G R`` a group (``tokens_prefix``);
``token_ratio`` stays the formula ``G (P + R) / (P + G R)``.

Usage: python -m lab.bench --config configs/bench/prompt_sharing.py --workdir DIR
"""

from __future__ import annotations

import math
import os
import time

import jax
import numpy as np
from flax import nnx

from knitjax import sharding
from knitjax.models.transformer import Transformer, TransformerConfig
from knitjax.train import advantages, losses, prefix
from knitjax.train.batch import make_batch, pad_rows
from knitjax.train.optimizer import make_optimizer
from knitjax.train.prompt_sharing import ShareSpec, sharing_metrics
from knitjax.train.step import (
  StepHParams,
  batch_shardings,
  compile_train_step,
  host_metrics,
  init_train_state,
)
from lab.bench.compiled_memory import MIB, memory_stats
from lab.bench.report import format_table, write_json

LAYOUTS = ("off", "group")  # config.layouts: the padded rows, then the layout measured against


def token_ratio(prompt_len: int, response_len: int, group_size: int) -> float:
  """Tokens of G padded rows over those of one shared unit: ``G (P + R) / (P + G R)``."""
  g = group_size
  return g * (prompt_len + response_len) / (prompt_len + g * response_len)


def score_ratio(prompt_len: int, response_len: int, group_size: int) -> float:
  """Causal attention scores of G padded rows over those of a group whose prompt runs once (a
  unit or a prefix): ``G (P + R)^2 / (P^2 + G R (2 P + R))``. With a narrow model attention
  outweighs the tokens' linear work, and the step follows this ratio rather than the tokens'."""
  p, r, g = prompt_len, response_len, group_size
  return g * (p + r) ** 2 / (p * p + g * r * (2 * p + r))


def workload(
  rng: np.random.Generator, *, groups: int, group_size: int, prompt_len: int, response_len: int,
  vocab_size: int,
) -> dict[str, np.ndarray]:  # fmt: skip
  """The padded mini-batch of one point (the module docstring's rows)."""
  rows = groups * group_size
  prompts, responses, logps = [], [], []
  for _ in range(groups):
    prompt = rng.integers(1, vocab_size, prompt_len).astype(np.int32)
    for _ in range(group_size):
      prompts.append(prompt)
      responses.append(rng.integers(1, vocab_size, response_len).astype(np.int32))
      logps.append(rng.normal(-2.0, 0.5, response_len).astype(np.float32))
  rewards = rng.integers(0, 2, rows).astype(np.float32)
  adv = advantages.compute_advantages(rewards.reshape(groups, group_size), "grpo").reshape(-1)
  return make_batch(
    pad_rows(prompts, responses, logps), np.asarray(adv, np.float32), prompt_len=prompt_len,
    max_new_tokens=response_len, pad_id=0, rewards=rewards,
    group_ids=np.repeat(np.arange(groups), group_size),
  )  # fmt: skip


class _Layout:
  """One layout's compiled step, its live state and its device batch."""

  def __init__(
    self, config, mesh, graphdef, params, batch, *, prompt_len: int, response_len: int,
    layout: str, micro_batches: int,
  ):  # fmt: skip
    shared, prefixed = layout == "group", layout == "prefix"
    optimizer = make_optimizer(config.optimizer)
    fresh = jax.tree.map(lambda x: x.copy(), params)  # the state is donated; the ref is not
    self.state, shardings = init_train_state(fresh, optimizer, mesh)
    self.ref = params
    hparams = StepHParams(
      loss=losses.LossConfig(kl_coef=config.kl_coef),
      max_new_tokens=response_len,
      # Fixed spans attend span by span, as the runtime's step does (layout_choice.shared_spans).
      shared_spans=(prompt_len, response_len) if shared else None,
    )
    step = compile_train_step(
      graphdef=graphdef, optimizer=optimizer, hparams=hparams, state_shardings=shardings,
      mesh=mesh, with_ref=True, packed=shared, shared=shared, prefixed=prefixed,
    )  # fmt: skip
    self.batch = jax.device_put(
      prefix.split_micro_batches(batch, micro_batches),
      batch_shardings(mesh, shared=shared, prefixed=prefixed),
    )
    self.mesh = mesh
    with jax.set_mesh(mesh):
      t0 = time.perf_counter()
      self.step = step.lower(self.state, self.batch, self.ref).compile()
      self.compile_s = time.perf_counter() - t0
    self.memory = memory_stats(self.step)

  def run(self) -> tuple[float, dict]:
    """One step, timed to its results on the host side: (seconds, device metrics)."""
    with jax.set_mesh(self.mesh):
      t0 = time.perf_counter()
      self.state, metrics = self.step(self.state, self.batch, self.ref)
      jax.block_until_ready((self.state, metrics))
      return time.perf_counter() - t0, metrics


def _layouts(config) -> tuple[str, str]:
  return tuple(config.get("layouts", LAYOUTS))


def _lay_out(name, padded, *, prompt_len, response_len, group_size, groups, multiple):
  """The padded rows of a point laid out as ``name`` (``off``: as they are)."""
  if name == "group":
    spec = ShareSpec(prompt_len, prompt_len + group_size * response_len, multiple)
    shared = spec(padded)
    metrics = sharing_metrics(padded, shared)
    ratio = token_ratio(prompt_len, response_len, group_size)
    if not math.isclose(ratio, metrics["share_token_ratio"], rel_tol=1e-12):
      raise AssertionError(
        f"token ratio {ratio} by the formula, {metrics['share_token_ratio']} by sharing_metrics."
      )
    return shared
  if name == "prefix":
    slots = -(-groups // multiple) * multiple  # the prompts split over the batch shards
    return prefix.prefix_batch(padded, prompt_len=prompt_len, slots=slots)
  return padded


def measure_point(
  config, mesh, model: str, graphdef, params, *, vocab_size: int, prompt_len: int,
  response_len: int, group_size: int, groups: int, micro_batches_per_group: int = 0,
) -> dict:  # fmt: skip
  """Both layouts of one point: compile, a warm-up step each, then alternating timed rounds.

  ``micro_batches_per_group``: split the mini-batch into ``groups`` times this many
  micro-batches, each group's rows over this many (0: ``config.micro_batches``)."""
  rng = np.random.default_rng([config.seed, prompt_len, response_len, group_size])
  padded = workload(
    rng, groups=groups, group_size=group_size, prompt_len=prompt_len,
    response_len=response_len, vocab_size=vocab_size,
  )  # fmt: skip
  k = groups * micro_batches_per_group if micro_batches_per_group else config.micro_batches
  shards = int(np.prod([mesh.shape[a] for a in sharding.BATCH_AXES]))
  names = _layouts(config)
  batches = {
    name: _lay_out(
      name,
      padded,
      prompt_len=prompt_len,
      response_len=response_len,
      group_size=group_size,
      groups=groups,
      multiple=k * shards if name == "group" else shards,
    )  # fmt: skip
    for name in names
  }
  layouts = {
    name: _Layout(
      config,
      mesh,
      graphdef,
      params,
      batches[name],
      prompt_len=prompt_len,
      response_len=response_len,
      layout=name,
      micro_batches=k,
    )  # fmt: skip
    for name in names
  }
  first = {name: host_metrics(layout.run()[1])["loss"] for name, layout in layouts.items()}
  rounds = [[layouts[name].run()[0] for name in names] for _ in range(config.repeats)]
  times = np.asarray(rounds)
  speedup = float(np.median(times[:, 0] / times[:, 1]))
  ratio = token_ratio(prompt_len, response_len, group_size)
  point = {
    "model": model,
    "prompt_len": prompt_len,
    "response_len": response_len,
    "group_size": group_size,
    "groups": groups,
    "micro_batches": k,
    "token_ratio": ratio,
    "score_ratio": score_ratio(prompt_len, response_len, group_size),
    "rounds": rounds,
    "speedup": speedup,
    "speedup_over_ratio": speedup / ratio,
    "memory": {name: layout.memory for name, layout in layouts.items()},
  }
  if micro_batches_per_group:
    point["micro_batches_per_group"] = micro_batches_per_group
  for (name, layout), column in zip(layouts.items(), times.T, strict=True):
    valid = batches[name]["valid"]
    point.update({
      f"tokens_{name}": int(np.count_nonzero(valid)) + _prompt_tokens(batches[name]),
      f"positions_{name}": int(valid.size) + _prompt_tokens(batches[name], positions=True),
      f"shape_{name}": list(valid.shape),
      f"step_s_{name}": float(np.median(column)),
      f"loss_{name}": first[name],
      f"compile_s_{name}": layout.compile_s,
    })  # fmt: skip
  return point


def _prompt_tokens(batch, *, positions=False) -> int:
  """A prefix layout's prompts: their tokens (or positions), laid out beside the rows."""
  if "prefix_valid" not in batch:
    return 0
  valid = batch["prefix_valid"]
  return int(valid.size if positions else np.count_nonzero(valid))


def _prompt_len(ratio: float, response_len: int) -> int:
  prompt_len = ratio * response_len
  if prompt_len != int(prompt_len) or prompt_len < 1:
    raise ValueError(
      f"prompt ratio {ratio} x response_len {response_len} = {prompt_len} is not a whole number "
      "of tokens >= 1; choose ratios and response lengths whose product is."
    )
  return int(prompt_len)


def run(config, workdir: str) -> dict:
  mesh = sharding.make_mesh(tuple(config.mesh_shape), devices=jax.devices()[: config.devices])
  points, models = [], {}
  second = _layouts(config)[1]
  for name, spec in config.models.items():
    model = TransformerConfig(**spec.model)
    models[name] = {
      "response_len": spec.response_len,
      "groups": spec.groups,
      "config": spec.model.to_dict(),
    }
    graphdef, params = sharding.init_sharded(lambda m=model: Transformer(m, rngs=nnx.Rngs(0)), mesh)
    for p in config.get("points", None) or ():  # (P, R, G, micro-batches per group)
      point = measure_point(
        config, mesh, name, graphdef, params, vocab_size=model.vocab_size, prompt_len=p[0],
        response_len=p[1], group_size=p[2], groups=spec.groups, micro_batches_per_group=p[3],
      )  # fmt: skip
      points.append(point)
      _print_point(point, second)
    for group_size in config.get("group_sizes", ()):
      for ratio in config.prompt_ratios:
        point = measure_point(
          config, mesh, name, graphdef, params, vocab_size=model.vocab_size,
          prompt_len=_prompt_len(ratio, spec.response_len), response_len=spec.response_len,
          group_size=group_size, groups=spec.groups,
        )  # fmt: skip
        points.append(point)
        _print_point(point, second)
  _print_tables(points, config.goal, second)
  result = {
    "points": points,
    "goal_speedup_over_ratio": config.goal,
    "layouts": list(_layouts(config)),
    "group_sizes": list(config.get("group_sizes", ())),
    "prompt_ratios": list(config.get("prompt_ratios", ())),
    "points_spec": [list(p) for p in config.get("points", None) or ()],
    "micro_batches": config.micro_batches,
    "repeats": config.repeats,
    "kl_coef": config.kl_coef,
    "optimizer": config.optimizer.to_dict(),
    "models": models,
    "mesh_shape": list(config.mesh_shape),
    "devices": config.devices,
    "backend": jax.default_backend(),
  }
  write_json(workdir, "prompt_sharing", result)
  _plot(workdir, points, config.goal)
  return result


def _print_point(point: dict, second: str) -> None:
  print(
    f"{point['model']} G={point['group_size']} P={point['prompt_len']} "
    f"R={point['response_len']} K={point['micro_batches']}: off {point['step_s_off']:.3f} s, "
    f"{second} {point[f'step_s_{second}']:.3f} s, "
    f"{point['speedup']:.2f}x of {point['token_ratio']:.2f}x",
    flush=True,
  )


def _print_tables(points: list[dict], goal: float, second: str = "group") -> None:
  columns = ["model", "group_size", "prompt_len", "response_len", "micro_batches", "token_ratio",
             "score_ratio", "step_s_off", f"step_s_{second}", "speedup", "speedup_over_ratio",
             "loss_off", f"loss_{second}"]  # fmt: skip
  print(format_table(points, columns))
  met = sum(p["speedup_over_ratio"] >= goal for p in points)
  print(f"speedup / token ratio >= {goal}: {met} of {len(points)} points")
  memory = [
    {
      "model": p["model"], "group_size": p["group_size"], "prompt_len": p["prompt_len"],
      **{f"{k}_mib_{name}": p["memory"][name][f"{k}_bytes"] / MIB
         for k in ("peak", "temp") for name in ("off", second)},
    }
    for p in points
  ]  # fmt: skip
  print(format_table(memory, list(memory[0]) if memory else []))


def _plot(workdir: str, points: list[dict], goal: float) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  models = list(dict.fromkeys(p["model"] for p in points))
  markers = dict(zip(sorted({p["group_size"] for p in points}), "os^Dv<>", strict=False))
  fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 4), squeeze=False)
  top = max([p["token_ratio"] for p in points] + [p["speedup"] for p in points] + [1.0]) * 1.1
  for ax, model in zip(axes[0], models, strict=True):
    line = np.array([0.0, top])
    ax.plot(line, line, color="tab:gray", lw=1, label="speedup = token ratio")
    ax.plot(line, goal * line, color="tab:gray", lw=1, ls="--", label=f"{goal} x token ratio")
    for g, marker in markers.items():
      mine = [p for p in points if p["model"] == model and p["group_size"] == g]
      if mine:
        ax.scatter([p["token_ratio"] for p in mine], [p["speedup"] for p in mine],
                   marker=marker, s=40, label=f"G = {g}", zorder=3)  # fmt: skip
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("token ratio G (P + R) / (P + G R)")
    ax.set_ylabel("train-step speedup (padded / shared)")
    ax.set_title(model)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, "prompt_sharing.png"), dpi=120)
  plt.close(fig)
