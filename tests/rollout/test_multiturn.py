"""Multi-turn rollout: turns and observations, masks, budgets, group completion, versions, and
behaviour log-probs equal to the trainer's on the whole multi-turn sequence."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from knitjax import sharding
from knitjax.models.transformer import Transformer, TransformerConfig
from knitjax.rollout.contract import Rollout, generate
from knitjax.rollout.multiturn import MultiTurnRollout, bucket, stop_ids
from knitjax.rollout.sampler import Sampler, Samples, SamplingConfig
from knitjax.tasks import calc_tool
from knitjax.tasks.environment import EnvironmentSpec
from knitjax.train import losses
from knitjax.train.step import StepHParams, micro_batch_loss, sequence_logprobs
from knitjax.transfer.access import RowSpec, env_token_rows, layout_groups
from knitjax.transfer.payload import GroupPayload
from knitjax.transfer.storage import InProcessStorageUnit, StorageLimits

TOK = calc_tool.make_tokenizer()
EQ = TOK.encode("=", bos=False)[0]
P = 6  # BOS + "47*86"


def _prompt():
  return next(p for p in calc_tool.make_examples(TOK) if p.text == "47*86")


def _unit(n):
  return InProcessStorageUnit(
    StorageLimits.for_steps(vocab_size=32, max_seq_len=P + n, groups_per_step=4, group_size=8)
  )


class ScriptedSampler:
  """The sampler's interface with scripted turns: ``script(response ids so far) -> turn ids``;
  cut at the first stop token and at the turn budget, log-prob ``-0.1 x (k + 1)`` at token k."""

  def __init__(self, script, *, n, turn_tokens, stops, shards=2):
    self.script, self.prompt_len, self.eos_ids = script, P + n, stops
    self.batch_shards = shards
    self.sampling = SamplingConfig(max_new_tokens=turn_tokens)
    self.calls = []  # (params, rows) per call

  def __call__(self, params, prompts, lens, rng, embeddings=None):
    b, w = prompts.shape
    assert w == self.prompt_len and b % self.batch_shards == 0
    self.calls.append((params, b))
    n = self.sampling.max_new_tokens
    tokens, logprobs = np.zeros((b, n), np.int32), np.zeros((b, n), np.float32)
    lengths = np.zeros(b, np.int32)
    for i in range(b):
      turn = list(self.script(prompts[i, w - lens[i] :][P:].tolist()))[:n]
      stop = [k for k, t in enumerate(turn) if t in self.eos_ids]
      turn = turn[: stop[0] + 1] if stop else turn
      lengths[i] = len(turn)
      tokens[i, : len(turn)] = turn
      logprobs[i, : len(turn)] = -0.1 * np.arange(1, len(turn) + 1)
    return Samples(tokens=tokens, lengths=lengths, logprobs=logprobs)


def _ids(text, eos=False):
  return TOK.encode(text, bos=False) + [TOK.eos_id] * eos


def call_then_answer(response):
  """Calls the calculator, then answers what it returned."""
  if EQ not in response:
    return _ids("C=")
  return _ids(TOK.decode(response[response.index(EQ) + 1 :]), eos=True)


def _rollout(script, *, n=16, turn_tokens=6, max_turns=3, env=None, g=2, **kw):
  env = env or calc_tool.environment()
  sampler = ScriptedSampler(script, n=n, turn_tokens=turn_tokens, stops=stop_ids(env, TOK))
  rollout = MultiTurnRollout(
    sampler,
    _unit(n),
    environment=env,
    tokenizer=TOK,
    group_size=g,
    prompt_len=P,
    max_new_tokens=n,
    max_turns=max_turns,
    **kw,
  )
  return rollout, sampler


def _payload(rollout, gid) -> GroupPayload:
  return rollout.storage[0].get([gid])[0]


def test_tool_call_observation_then_answer():
  rollout, sampler = _rollout(call_then_answer)
  assert isinstance(rollout, Rollout)
  rollout.adopt("params", 0)
  rollout.start(_prompt(), 7)
  assert rollout.step(jax.random.key(0)) == [] and rollout.inflight == 1  # the call, answered
  (meta,) = rollout.step(jax.random.key(1))  # the answer: the group is complete
  assert rollout.inflight == 0 and [b for _, b in sampler.calls] == [2, 2]
  p = _payload(rollout, 7)
  text = "C=" + "4042" + "4042"
  for k in range(2):
    n = p.response_lengths[k]
    assert TOK.decode(p.response_tokens[k, :n]) == text and n == len(text) + 1  # and the EOS
    model = [True] * 2 + [False] * 4 + [True] * 5
    assert p.response_mask[k, :n].tolist() == model and not p.response_mask[k, n:].any()
    # log-probs: the sampler's per turn on model tokens, exactly 0 on environment tokens
    want = [-0.1, -0.2, 0, 0, 0, 0, -0.1, -0.2, -0.3, -0.4, -0.5]
    np.testing.assert_allclose(p.logprobs[k, :n], want, rtol=1e-6)
  assert p.rewards.tolist() == [1.0, 1.0] and meta.reward_mean == 1.0
  assert meta.response_tokens == (11, 11) and meta.prompt_tokens == (P, P)
  assert meta.group_id == 7 and meta.gen_version == 0 and meta.gen_version_newest is None


def test_turn_budget_total_budget_and_cut_observation():
  # A turn longer than turn_tokens is cut there (and, without a stop, is the final answer).
  rollout, _ = _rollout(lambda r: _ids("40424042"), turn_tokens=4)
  rollout.adopt(None, 0)
  rollout.start(_prompt(), 0)
  rollout.step(jax.random.key(0))
  p = _payload(rollout, 0)
  assert p.response_lengths.tolist() == [4, 4] and p.rewards.tolist() == [0.0, 0.0]
  # The response budget: call (2) + result (4), then only 2 tokens are left for the answer.
  rollout, _ = _rollout(call_then_answer, n=8)
  rollout.adopt(None, 0)
  rollout.start(_prompt(), 0)
  metas = [m for k in range(3) for m in rollout.step(jax.random.key(k))]
  p = _payload(rollout, 0)
  assert len(metas) == 1 and p.response_lengths.tolist() == [8, 8]
  assert TOK.decode(p.response_tokens[0]) == "C=404240"
  assert p.rewards[0] == pytest.approx(calc_tool.CALL_CREDIT + calc_tool.DIGIT_CREDIT * 2 / 5)
  # An observation longer than the budget left is cut, and the trajectory ends.
  rollout, sampler = _rollout(call_then_answer, n=4)
  rollout.adopt(None, 0)
  rollout.start(_prompt(), 0)
  (meta,) = rollout.step(jax.random.key(0))
  p = _payload(rollout, 0)
  assert TOK.decode(p.response_tokens[0]) == "C=40" and p.response_mask[0].tolist() == [1, 1, 0, 0]
  assert meta.response_tokens == (4, 4) and p.rewards.tolist() == [0.0, 0.0]
  assert len(sampler.calls) == 1


def test_max_turns_ends_a_trajectory_that_keeps_calling():
  rollout, sampler = _rollout(lambda r: _ids("C="), max_turns=3)
  rollout.adopt(None, 0)
  rollout.start(_prompt(), 0)
  metas = [m for k in range(3) for m in rollout.step(jax.random.key(k))]
  assert len(metas) == 1 and len(sampler.calls) == 3
  p = _payload(rollout, 0)
  # Three calls, two results; no result after the last turn; never a final answer: reward 0.
  assert TOK.decode(p.response_tokens[0]) == "C=4042C=4042C="
  assert p.response_mask[0, :14].tolist() == ([1] * 2 + [0] * 4) * 2 + [1] * 2
  assert p.rewards.tolist() == [0.0, 0.0]


class Countdown:
  """Trajectory k of the test (in creation order) is done after k + 1 turns; observation '1'."""

  counter = itertools.count()

  def __init__(self):
    self.left = next(self.counter) % 4 + 1

  def reset(self, prompt):
    return "9"  # an observation before the first model turn

  def step(self, action_text):
    self.left -= 1
    return "1", 0.25, self.left == 0


def test_a_group_is_complete_only_when_all_its_trajectories_are_done():
  Countdown.counter = itertools.count()
  env = EnvironmentSpec(make=Countdown, stop_texts=("=",))
  rollout, sampler = _rollout(
    lambda r: _ids("2", eos=True), env=env, g=4, max_turns=4, max_groups=2
  )
  rollout.adopt(None, 0)
  rollout.start(_prompt(), 0)
  assert rollout.capacity() == 1
  assert rollout.step(jax.random.key(0)) == []
  rollout.start(_prompt(), 1)  # joins the live set at the next turn
  assert rollout.capacity() == 0 and rollout.inflight == 2
  assert rollout.step(jax.random.key(1)) == [] and rollout.step(jax.random.key(2)) == []
  (first,) = rollout.step(jax.random.key(3))  # group 0's slowest trajectory took 4 turns
  assert first.group_id == 0 and rollout.inflight == 1 and rollout.capacity() == 1
  # Live rows per call: 4, then 3 + 4 of the new group, 2 + 3, 1 + 2 (bucketed: 4, 8, 8, 4).
  assert [b for _, b in sampler.calls] == [4, 8, 8, 4]
  p = _payload(rollout, 0)
  # '9', then per turn '2' EOS and the observation '1', none after the last turn: 3 per turn.
  assert p.response_lengths.tolist() == [3, 6, 9, 12]
  assert p.rewards.tolist() == [0.25, 0.5, 0.75, 1.0]
  assert p.response_mask[3, :12].tolist() == [0] + [1, 1, 0] * 3 + [1, 1]
  assert [m.group_id for k in range(4, 7) for m in rollout.step(jax.random.key(k))] == [1]


@pytest.mark.parametrize("adoption", ["new_groups", "mid_generation"])
def test_groups_keep_their_version_or_move_to_the_newest(adoption):
  rollout, sampler = _rollout(call_then_answer, adoption=adoption)
  rollout.adopt("v0", 0)
  rollout.start(_prompt(), 0)
  rollout.step(jax.random.key(0))
  rollout.adopt("v1", 1)
  rollout.start(_prompt(), 1)
  (old,) = rollout.step(jax.random.key(1))
  (new,) = rollout.step(jax.random.key(2))
  params = [p for p, _ in sampler.calls]
  assert (new.group_id, new.gen_version, new.gen_version_newest) == (1, 1, None)
  if adoption == "new_groups":  # the old group's answer turn still samples with v0
    assert params == ["v0", "v0", "v1", "v1"]
    assert (old.gen_version, old.gen_version_newest) == (0, None)
  else:
    assert params == ["v0", "v1", "v1"]
    assert (old.gen_version, old.gen_version_newest) == (0, 1)
  assert rollout._params.keys() == {1}  # versions no group uses are let go


def test_generate_drives_turns_to_completion_through_the_contract():
  rollout, _ = _rollout(call_then_answer, g=3)
  metas = generate(
    rollout, "p", [_prompt()] * 3, version=4, rng=jax.random.key(0), first_group_id=10
  )
  assert [m.group_id for m in metas] == [10, 11, 12] and all(m.reward_mean == 1 for m in metas)


def test_bucket_and_bad_arguments():
  assert [bucket(n, 2) for n in (1, 2, 3, 5, 8, 9)] == [2, 2, 4, 8, 8, 16]
  assert bucket(9, 4) == 16 and bucket(4, 4) == 4
  env = calc_tool.environment()
  sampler = ScriptedSampler(call_then_answer, n=16, turn_tokens=6, stops=stop_ids(env, TOK))
  kw = dict(environment=env, tokenizer=TOK, group_size=2, prompt_len=P, max_turns=2)
  with pytest.raises(ValueError, match="prompt_len \\+ max_new_tokens = 14"):
    MultiTurnRollout(sampler, _unit(8), max_new_tokens=8, **kw)
  sampler.eos_ids = (TOK.eos_id,)
  with pytest.raises(ValueError, match="include the environment's"):
    MultiTurnRollout(sampler, _unit(16), max_new_tokens=16, **kw)
  with pytest.raises(ValueError, match="exactly one token"):
    stop_ids(EnvironmentSpec(make=calc_tool.CalculatorEnv, stop_texts=("C=",)), TOK)
  rollout, _ = _rollout(call_then_answer)
  with pytest.raises(RuntimeError, match="adopt"):
    rollout.start(_prompt(), 0)


# ---- the real sampler against the trainer ---------------------------------------------------

TINY = TransformerConfig(
  vocab_size=TOK.vocab_size,
  num_layers=2,
  d_model=64,
  num_heads=4,
  num_kv_heads=2,
  head_dim=16,
  ffn_dim=128,
  qk_norm=True,
)
N, TEMPERATURE = 20, 0.8


class Chatty:
  """Answers every turn with '12' (ending the trajectory at the third turn), reward 0.5 a turn."""

  def __init__(self):
    self.turns = 0

  def reset(self, prompt):
    return ""

  def step(self, action_text):
    self.turns += 1
    return "12", 0.5, self.turns == 3


@pytest.fixture(scope="module")
def sampled():
  """A group of 8 real multi-turn trajectories, its batch as the trainer lays it out."""
  mesh = sharding.make_mesh((-1, 1, 1), devices=jax.devices()[:2])
  graphdef, params = sharding.init_sharded(lambda: Transformer(TINY, rngs=nnx.Rngs(0)), mesh)
  env = EnvironmentSpec(make=Chatty, stop_texts=("=",))
  sampler = Sampler(
    graphdef,
    mesh=mesh,
    sampling=SamplingConfig(max_new_tokens=4, temperature=TEMPERATURE),
    eos_id=stop_ids(env, TOK),
    pad_id=TOK.pad_id,
    prompt_len=P + N,
  )
  unit = _unit(N)
  rollout = MultiTurnRollout(
    sampler,
    unit,
    environment=env,
    tokenizer=TOK,
    group_size=8,
    prompt_len=P,
    max_new_tokens=N,
    max_turns=3,
  )
  (meta,) = generate(
    rollout, params, [_prompt()], version=0, rng=jax.random.key(3), first_group_id=0
  )
  (payload,) = unit.get([0])
  row_spec = RowSpec(estimator="grpo", prompt_len=P, max_new_tokens=N, pad_id=TOK.pad_id)
  batch, info = layout_groups([payload], row_spec)
  return graphdef, params, payload, batch, info


def _trainer_logprobs(graphdef, params, batch):
  """The train step's teacher-forced log-probs and entropies of the targets (jitted)."""
  return jax.jit(sequence_logprobs, static_argnums=(0, 3))(graphdef, params, batch, TEMPERATURE)


def optax_norm(tree):
  return optax.tree.norm(tree)


def _env_positions(payload):
  """[G, P + N] positions of the trainer row that predict an environment token."""
  inside = np.arange(N)[None] < payload.response_lengths[:, None]
  env = np.zeros((len(inside), P + N), bool)
  env[:, P - 1 : P + N - 1] = inside & ~payload.response_mask
  return env


def test_behaviour_logprobs_equal_the_trainers_on_the_multi_turn_sequence(sampled):
  graphdef, params, payload, batch, info = sampled
  env = _env_positions(payload)
  # Every trajectory holds environment tokens with model tokens after them (holes in the mask).
  assert env.any(axis=1).all() and info["env_token_rows"] == 1.0
  # 3 turns of <= 4 tokens and two '12's fit N = 20: the environment's 3 rewards every time.
  assert payload.rewards.tolist() == [1.5] * 8 and (env.sum(axis=1) == 4).all()
  last_env = np.array([np.flatnonzero(row).max() for row in env])
  assert (batch["loss_mask"][np.arange(8), last_env + 1] == 1).all()
  logp, _ = _trainer_logprobs(graphdef, params, jax.tree.map(jnp.asarray, batch))
  on = batch["loss_mask"] > 0
  assert on.sum() > 8 and (batch["loss_mask"][env] == 0).all()
  assert (on | env).sum() == payload.response_lengths.sum()  # every response token is one of both
  # float32, prefill/decode with a KV cache vs one forward: tolerance 1e-4 (as the sampler's test)
  np.testing.assert_allclose(np.asarray(logp)[on], batch["behavior_logp"][on], atol=1e-4)
  assert (batch["behavior_logp"][env] == 0).all() and (
    batch["valid"][:, P:][env[:, P - 1 : -1]]
  ).all()


def test_environment_tokens_never_get_a_gradient(sampled):
  graphdef, params, payload, batch, _ = sampled
  env = _env_positions(payload)
  # Through storage: garbage log-probs on environment tokens are zeroed where a payload enters.
  noisy = {k: v for k, v in payload.to_arrays().items() if k != "prompt_lengths"}  # derived
  noisy["logprobs"] = np.where(payload.response_mask, payload.logprobs, -7.0).astype(np.float32)
  unit = _unit(N)
  unit.put(5, noisy)
  row_spec = RowSpec(estimator="grpo", prompt_len=P, max_new_tokens=N, pad_id=TOK.pad_id)
  again, _ = layout_groups(unit.get([5]), row_spec)
  for k in batch:
    np.testing.assert_array_equal(again[k], batch[k])
  # In the loss: perturbing behaviour log-probs on environment tokens changes neither the loss
  # nor the gradient, and the loss's gradient w.r.t. their log-probs is exactly 0.
  config = losses.LossConfig(kl_coef=0.0, entropy_coef=0.01)
  hparams = StepHParams(loss=config, temperature=TEMPERATURE, max_new_tokens=N)
  norm = losses.Normalizer.from_mask(batch["loss_mask"], max_len=float(N))
  # Every reward is 1.5 here, so GRPO's advantages are 0: give the rows advantages of both signs.
  mb = {**jax.tree.map(jnp.asarray, batch), "advantages": jnp.linspace(-1.0, 1.0, 8)}
  perturbed = {**mb, "behavior_logp": jnp.where(env, -5.0, mb["behavior_logp"])}
  grad_fn = jax.jit(
    jax.value_and_grad(
      lambda p, b: micro_batch_loss(p, b, norm, graphdef=graphdef, hparams=hparams)[0]
    )
  )
  loss, grads = grad_fn(params, mb)
  loss2, grads2 = grad_fn(params, perturbed)
  assert float(loss) == float(loss2) and float(optax_norm(grads)) > 0
  jax.tree.map(np.testing.assert_array_equal, grads, grads2)
  logp, entropy = _trainer_logprobs(graphdef, params, mb)
  d_logp = jax.grad(
    lambda lp: losses.policy_loss(
      lp,
      mb["behavior_logp"],
      mb["advantages"],
      mb["loss_mask"],
      config=config,
      norm=norm,
      entropy_bt=entropy,
    )[0]
  )(logp)
  d_logp = np.asarray(d_logp)
  assert (d_logp[env] == 0).all() and (d_logp[batch["loss_mask"] > 0] != 0).all()


def test_env_token_rows_counts_samples_with_holes():
  rows = {
    "response_mask": np.array([[1, 0, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], bool),
    "response_lengths": np.array([3, 2, 4]),
  }
  assert env_token_rows(rows) == pytest.approx(1 / 3)  # only row 0 has a hole inside its length
