"""What an emulated cluster's shaped links deliver.

    python -m lab.scripts.cluster_links [RATE_MBIT ...]

For each rate: two hosts (`lab.cluster.hosts.Cluster`, root and iproute2 needed), a TCP
server on host 0, a client on host 1 sending two 300 KB messages (one weight version of the
long-tail task's model) and one 50 MB stream, each timed until the server's one-byte answer.
Prints the milliseconds and the Mbit/s each achieved (docs/cluster.md quotes them).
"""

import subprocess
import sys

from lab.cluster.hosts import Cluster, HostSpec

SERVER = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 7001)); s.listen(1)
while True:
  c, _ = s.accept(); n = int.from_bytes(c.recv(8), "big"); got = 0
  while got < n:
    got += len(c.recv(1 << 20))
  c.sendall(b"k"); c.close()
"""

CLIENT = r"""
import socket, sys, time
for _ in range(50):
  try:
    socket.create_connection((sys.argv[1], 7001)).close(); break
  except OSError:
    time.sleep(0.1)
for n in (300_000, 300_000, 50_000_000):
  c = socket.create_connection((sys.argv[1], 7001)); t = time.time()
  c.sendall(n.to_bytes(8, "big")); c.sendall(b"x" * n); c.recv(1); dt = time.time() - t
  print(f"  {n:>10,} bytes: {dt * 1e3:7.1f} ms = {n * 8 / dt / 1e6:6.0f} Mbit/s", flush=True)
  time.sleep(0.5)
"""


def main(rates: list[float]) -> None:
  for rate in rates:
    hosts = [HostSpec(cores=(0,), rate_mbit=rate), HostSpec(cores=(1,), rate_mbit=rate)]
    with Cluster(hosts, log=lambda m: None) as cluster:
      address = cluster.hosts[0].address
      cluster.spawn(0, [sys.executable, "-c", SERVER, address])
      client = cluster.spawn(1, [sys.executable, "-c", CLIENT, address], stdout=subprocess.PIPE)
      ideal = 300_000 * 8 / rate / 1e3
      print(f"links at {rate:g} Mbit/s (the rate says {ideal:.1f} ms a 300 KB message):")
      print(client.communicate(timeout=120)[0].decode(), end="")


if __name__ == "__main__":
  main([float(r) for r in sys.argv[1:]] or [250.0, 1119.0, 4476.0])
