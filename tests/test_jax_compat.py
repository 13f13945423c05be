"""The private JAX knitjax uses is all in `knitjax.jax_compat`, and the installed JAX has it."""

import os
import pathlib
import socket
import subprocess
import sys
import textwrap

import jax

from knitjax import jax_compat

ROOT = pathlib.Path(__file__).resolve().parent.parent
# What only the compat module may contain: private JAX, the splash kernel's private backward,
# and the private socket of a `multiprocessing.connection.Listener`.
PRIVATE = ("jax._src", "_splash_attention_bwd", "._listener._socket")
# A logger's name, not an import: `knitjax.cli` quiets the start-up records of that logger.
ALLOWED = {"knitjax/cli.py": ('"jax._src.xla_bridge"',)}


def test_the_installed_jax_has_every_private_symbol_knitjax_uses():
  problems = jax_compat.check()
  assert not problems, " ".join(problems)


def test_a_missing_symbol_is_one_sentence_naming_it(monkeypatch):
  monkeypatch.setattr(jax_compat, "PRIVATE", (("jax._src.distributed", "no_such_state"),))
  assert jax_compat.check() == [
    f"jax {jax.__version__} no longer has jax._src.distributed.no_such_state; "
    "knitjax/jax_compat.py was written against jax 0.10.2 — update it."
  ]
  monkeypatch.setattr(jax_compat, "PRIVATE", (("jax._src.no_such_module", "x"),))
  assert jax_compat.check() == [
    f"jax {jax.__version__} no longer has jax._src.no_such_module.x; "
    "knitjax/jax_compat.py was written against jax 0.10.2 — update it."
  ]

  monkeypatch.setattr(jax_compat, "PRIVATE", ())
  monkeypatch.setattr(jax_compat, "_SPLASH_RESIDUALS", 8)
  assert jax_compat.check() == [
    f"jax {jax.__version__} changed the residual layout of {jax_compat._SPLASH}"
    "._splash_attention_bwd; knitjax/jax_compat.py was written against jax 0.10.2 — update it."
  ]


def test_no_other_library_module_uses_private_jax():
  found = []
  for path in sorted((ROOT / "knitjax").rglob("*.py")):
    name = path.relative_to(ROOT).as_posix()
    if name == "knitjax/jax_compat.py":
      continue
    text = path.read_text()
    for allowed in ALLOWED.get(name, ()):
      text = text.replace(allowed, "")
    found += [f"{name}: {p}" for p in PRIVATE if p in text]
  assert not found, f"private JAX outside knitjax/jax_compat.py: {found}"


def test_backends_started_once_jax_runs():
  jax.devices()  # conftest has set up the CPU devices; this starts the backend if not yet
  assert jax_compat.backends_started()


def test_the_key_value_store_of_a_one_process_runtime():
  """Set, get, a get that times out (None), try-get of a missing key (None), increment, delete,
  on a real coordination service; and `coordination` on top of it."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  code = textwrap.dedent(f"""
    import time
    import jax
    from knitjax import jax_compat
    from knitjax.distributed import coordination

    assert jax_compat.key_value_store() is None
    jax.distributed.initialize("127.0.0.1:{port}", num_processes=1, process_id=0)
    store = jax_compat.key_value_store()
    store.set("a", "1")
    assert store.get("a", 1.0) == "1"
    t0 = time.monotonic()
    assert store.get("b", 0.2) is None
    assert time.monotonic() - t0 < 5
    assert store.try_get("b") is None
    assert [store.increment("n", 1), store.increment("n", 2)] == [1, 3]
    assert store.try_get("n") == "3"
    try:
      store.set("a", "2")
      raise AssertionError("a set without overwrite replaced a key")
    except jax.errors.JaxRuntimeError:
      pass
    store.set("a", "2", overwrite=True)
    store.delete("a")
    assert store.try_get("a") is None
    coordination.announce("plan", {{"step": 3}})
    assert coordination.hear("plan", 1.0) == {{"step": 3}}
    coordination.forget("plan")
    assert coordination.hear("plan", 0.2) is None
    jax.distributed.shutdown()
    print("ok")
  """)
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  done = subprocess.run(
    [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
  )
  assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
