"""XLA's own memory figures for a jitted function: what the compiler allocates, not a guess.

`compiled_memory(fn, *args)` lowers and compiles ``fn`` for the given shapes
(``jax.ShapeDtypeStruct`` or arrays; nothing runs) and reads the executable's memory analysis:
argument, output and temporary bytes. Memory benchmarks (attention, log-probs, LoRA) compare two
implementations at the same shapes with it, on any backend, the CPU included.
"""

from collections.abc import Callable

import jax

MIB = 2**20


def compiled_memory(fn: Callable, *args, **jit_kwargs) -> dict[str, int]:
  """Bytes XLA assigns to ``jax.jit(fn, **jit_kwargs)`` at the shapes of ``args``.

  Returns:
    ``argument_bytes``, ``output_bytes``, ``alias_bytes``, ``temp_bytes`` (scratch the
    executable needs) and ``peak_bytes`` (their sum minus outputs aliased to donated
    arguments: an upper bound on what the call holds at once).
  """
  return memory_stats(jax.jit(fn, **jit_kwargs).lower(*args).compile())


def memory_stats(compiled) -> dict[str, int]:
  """The memory analysis of an already compiled executable (``jitted.lower(...).compile()``),
  in the keys `compiled_memory` returns."""
  stats = compiled.memory_analysis()
  if stats is None:
    raise ValueError(f"the {jax.default_backend()} backend gives no compiled memory analysis.")
  argument, output = stats.argument_size_in_bytes, stats.output_size_in_bytes
  temp, alias = stats.temp_size_in_bytes, stats.alias_size_in_bytes
  return {
    "argument_bytes": int(argument),
    "output_bytes": int(output),
    "alias_bytes": int(alias),
    "temp_bytes": int(temp),
    "peak_bytes": int(argument + output + temp - alias),
  }
