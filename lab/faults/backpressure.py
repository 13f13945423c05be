"""A rollout that produces 10x faster than the trainer consumes, against a storage byte budget.

A producer thread puts group payloads into a storage unit (``on_full="block"``) as fast as it
can; a consumer gets and releases them at a tenth of that rate. The byte budget must hold at
every sample, the producer must block instead of growing memory, nothing may deadlock, and the
consumer's throughput is what limits the pair.
"""

from __future__ import annotations

import resource
import threading
import time

import numpy as np

from knitjax.transfer.payload import synthetic_payload
from knitjax.transfer.storage import InProcessStorageUnit, StorageLimits

VOCAB, PROMPT, RESPONSE, G = 32_000, 256, 1024, 8


def _rss_mib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(*, seconds: float = 20.0, ratio: float = 10.0, budget_groups: int = 16, log=print) -> dict:
  """Runs producer and consumer for ``seconds``; returns peaks, rates and whether it held."""
  rng = np.random.default_rng(0)
  payloads = [
    synthetic_payload(rng, group_size=G, prompt_len=PROMPT, response_len=RESPONSE, vocab_size=VOCAB)
    for _ in range(8)
  ]
  group_bytes = max(sum(x.nbytes for x in p.values()) for p in payloads) + 4 * G
  limits = StorageLimits(
    vocab_size=VOCAB,
    max_seq_len=PROMPT + RESPONSE,
    max_bytes=budget_groups * group_bytes,
    on_full="block",
    timeout_s=60.0,
  )
  unit = InProcessStorageUnit(limits)
  stop = threading.Event()
  held: list[int] = []
  lock = threading.Condition()
  put_s: list[float] = []
  errors: list[str] = []

  def produce():
    gid = 0
    try:
      while not stop.is_set():
        t = time.perf_counter()
        unit.put(gid, payloads[gid % len(payloads)])
        put_s.append(time.perf_counter() - t)
        with lock:
          held.append(gid)
          lock.notify()
        gid += 1
    except Exception as e:  # StorageFull after timeout_s would mean a deadlock
      errors.append(f"{type(e).__name__}: {e}")

  # Unthrottled put rate first (into a budget with room): the consumer then runs 10x slower.
  probe = InProcessStorageUnit(
    StorageLimits(vocab_size=VOCAB, max_seq_len=PROMPT + RESPONSE, max_bytes=1 << 34)
  )
  t = time.perf_counter()
  for i in range(50):
    probe.put(i, payloads[i % len(payloads)])
  produce_rate = 50 / (time.perf_counter() - t)
  consume_every = ratio / produce_rate

  peak_bytes, consumed = 0, 0
  rss0 = _rss_mib()
  producer = threading.Thread(target=produce, daemon=True)
  producer.start()
  t_end = time.time() + seconds
  while time.time() < t_end:
    with lock:
      while not held and time.time() < t_end:
        lock.wait(0.1)
      gid = held.pop(0) if held else None
    peak_bytes = max(peak_bytes, unit.stats()["bytes"])
    if gid is not None:
      unit.get([gid])
      time.sleep(consume_every)
      unit.release([gid])
      consumed += 1
  stop.set()
  with lock:
    rest = list(held)
  unit.release(rest)  # wakes a producer blocked on the budget
  producer.join(timeout=limits.timeout_s)
  s = unit.stats()
  out = {
    "produce_rate_groups_per_s": produce_rate,
    "consume_rate_groups_per_s": consumed / seconds,
    "ratio": ratio,
    "max_bytes": limits.max_bytes,
    "peak_bytes": peak_bytes,
    "budget_held": peak_bytes <= limits.max_bytes,
    "blocked_puts": s["blocked_puts"],
    "blocked_s": s["blocked_s"],
    "peak_rss_mib": _rss_mib(),
    "rss_growth_mib": _rss_mib() - rss0,
    "deadlock": producer.is_alive() or bool(errors),
    "errors": errors,
  }
  log(f"[backpressure] {out}")
  return out
