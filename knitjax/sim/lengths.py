"""Response-length distributions: clipped lognormal or a trace file, sampled in NumPy batches.

The simulator needs one length per sample (a million per benchmark run), so lengths are drawn
in large vectorised chunks per class and handed out as slices; the event loop never calls the
random generator per sample.
"""

import math
import os

import numpy as np

# Large chunks amortise the NumPy call; 64 Ki lengths is 512 KiB per class.
_CHUNK = 1 << 16


def lognormal_params(mean: float, cv: float) -> tuple[float, float]:
  """Returns ``(mu, sigma)`` of the lognormal with the given mean and coefficient of variation."""
  sigma2 = math.log1p(cv * cv)
  return math.log(mean) - sigma2 / 2, math.sqrt(sigma2)


def clipped_lognormal_mean(mean: float, cv: float, max_len: int) -> float:
  """``E[min(X, max_len)]`` for X lognormal(mean, cv), in closed form.

  Generation stops at ``max_len`` tokens, so the cap clips (it does not truncate and resample).
  Used to calibrate the trainer cost from the workload without simulating it.
  """
  if cv == 0:
    return float(min(mean, max_len))
  mu, s = lognormal_params(mean, cv)
  z = (math.log(max_len) - mu) / s
  phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))
  # E[X; X < c] = mean * Phi(z - s); plus c * P(X >= c).
  return mean * phi(z - s) + max_len * (1 - phi(z))


def load_trace(path: str) -> np.ndarray:
  """Reads a trace file: one response length (tokens, int >= 1) per line; '#' starts a comment."""
  if not os.path.exists(path):
    raise ValueError(
      f"length trace {path!r} does not exist; give a text file of one length a line."
    )
  values = np.loadtxt(path, dtype=np.int64, comments="#", ndmin=1)
  if values.size == 0 or (values < 1).any():
    raise ValueError(f"length trace {path!r} must hold at least one length, all >= 1.")
  return values


class LengthSampler:
  """Hands out response lengths per class from pre-drawn NumPy chunks.

  Each class draws from its own `numpy.random.Generator` stream (spawned from ``seed``), so the
  lengths a class sees do not depend on how the scheduler interleaves classes.
  """

  def __init__(self, classes, seed: int):
    """Args: classes: `ClassSpec`s (see `knitjax.sim.workload`); seed: the base seed."""
    children = np.random.SeedSequence(seed).spawn(len(classes))
    self._draw = []
    for spec, ss in zip(classes, children, strict=True):
      rng = np.random.default_rng(ss)
      if spec.length_trace:
        trace = load_trace(spec.length_trace)
        self._draw.append(lambda n, rng=rng, trace=trace: trace[rng.integers(0, trace.size, n)])
      else:
        mu, sigma = lognormal_params(spec.length_mean, spec.length_cv)
        cap = spec.length_max
        self._draw.append(
          lambda n, rng=rng, mu=mu, sigma=sigma, cap=cap: np.clip(
            np.rint(rng.lognormal(mu, sigma, n)), 1, cap
          ).astype(np.int64)
        )
    self._buf = [np.empty(0, np.int64) for _ in classes]
    self._pos = [0] * len(classes)

  def take(self, cls_index: int, n: int) -> np.ndarray:
    """Returns the next ``n`` lengths of class ``cls_index`` (int64 array)."""
    pos = self._pos[cls_index]
    buf = self._buf[cls_index]
    if pos + n > buf.size:
      buf = np.concatenate([buf[pos:], self._draw[cls_index](max(_CHUNK, n))])
      self._buf[cls_index] = buf
      pos = 0
    self._pos[cls_index] = pos + n
    return buf[pos : pos + n]
