"""``python -m knitjax.main`` that also writes each process's shards of every train batch.

  python -m lab.batch_dump --dump_batches=DIR <the flags of knitjax.main>

A test of a trainer of several processes replays the global batches in one process and checks it
ends with the same parameters (tests/distributed/test_trainer_processes.py). The library passes each
prepared mini-batch to a callback (``knitjax.run.train(on_batch=)``); this is the callback.
"""

from __future__ import annotations

import functools
import os

import jax
import numpy as np
from absl import flags

from knitjax import cli
from knitjax import main as knitjax_main

_DUMP = flags.DEFINE_string(
  "dump_batches", None, "folder for <step>-<index>.p<k>.npz", required=True
)


def dump_shards(folder: str, mb, batch) -> None:
  """``<folder>/<step>-<index>.p<k>.npz``: per key, this process's first-hand shards and where
  they sit in the global array (``<key>|<shard>|index`` holds (start, stop) per dimension)."""
  arrays = {}
  for key, x in batch.items():
    for n, shard in enumerate(s for s in x.addressable_shards if s.replica_id == 0):
      dims = zip(shard.index, x.shape, strict=True)
      arrays[f"{key}|{n}|index"] = np.array([(s.start or 0, s.stop or d) for s, d in dims])
      arrays[f"{key}|{n}|data"] = np.asarray(shard.data)
      arrays[f"{key}|shape"] = np.array(x.shape)
  os.makedirs(folder, exist_ok=True)
  name = f"{mb.step}-{mb.index}.p{jax.process_index()}.npz"
  np.savez(os.path.join(folder, name), **arrays)


def main(argv):
  knitjax_main.main(argv, on_batch=functools.partial(dump_shards, _DUMP.value))


if __name__ == "__main__":
  cli.run(main, stopped=knitjax_main.stopped)
