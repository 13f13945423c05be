"""Tears a cluster down when its owner dies: ``python -m lab.cluster.reaper TAG``.

Started by `Cluster.start` in a session of its own, with its stdin the read end of a pipe whose
write end only the owner holds. The read returns when the owner closes it or dies, by any
signal, kill -9 included; the reaper then removes every process, namespace and link of ``TAG``.
"""

import signal
import sys

from lab.cluster import net


def main(tag: str) -> None:
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGHUP, signal.SIG_IGN)
  while sys.stdin.buffer.read(4096):
    pass
  net.teardown(tag)


if __name__ == "__main__":
  main(sys.argv[1])
