import jax
import jax.numpy as jnp

from lab.bench.compiled_memory import compiled_memory


def test_scores_of_a_longer_sequence_take_quadratically_more_scratch():
  def attend(q, k, v):
    p = jax.nn.softmax(jnp.einsum("td,sd->ts", q, k), axis=-1)
    return jnp.einsum("ts,sd->td", p, v)

  def temp(t):
    s = jax.ShapeDtypeStruct((t, 16), jnp.float32)
    return compiled_memory(attend, s, s, s)

  small, large = temp(256), temp(1024)
  assert small["argument_bytes"] == 3 * 256 * 16 * 4
  assert large["output_bytes"] == 1024 * 16 * 4
  # The [T, T] float32 scores dominate the scratch: 16x the elements for 4x the length.
  assert large["temp_bytes"] >= 1024 * 1024 * 4
  assert large["temp_bytes"] > 10 * small["temp_bytes"]
  assert large["peak_bytes"] >= large["temp_bytes"] + large["argument_bytes"]
