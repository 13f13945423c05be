"""The import graph of knitjax and its lab has layers, and imports only point down
(docs/architecture.md).

Every module under knitjax/ (the library) and lab/ (benchmarks, the fault suite, the emulated
cluster, local launchers: beside the library, never imported by it) is parsed with `ast`; each
`import` anywhere in the file (inside functions too, except under `if TYPE_CHECKING:`) is an edge
of the graph of project-internal imports. The graph must have no cycle, and no module may import
one of a higher layer: the lab is the top layer, so nothing in knitjax/ imports it.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("knitjax", "lab")

# Layers, lowest first: a module may import modules of its own layer or lower ones, never
# higher. Same-layer imports are allowed as long as they form no cycle. Each entry is a module
# name or a package prefix ending in ".*" (the package's __init__ and everything below it).
#   0  the package itself, the mesh / logical-axis rules everything else shards by, and the
#      codec of host records (checkpoints and Ray), fault points, how a config section is built
#      and checked (config_fields), where a run's files go (workdir: local or gs://), the
#      private JAX knitjax needs (jax_compat): foundations that import no other layer.
#   1  the parts that know nothing of RL: models, and tasks (prompts, rewards).
#   2  RL training: losses, advantages, train step, optimizer, checkpoints.
#   3  trajectory transfer: storage, admission, consumer plans, on-demand access.
#   4  rollout: samplers and workers, which write into storage.
#   5  config: typed views of the ConfigDict. Validation names the registries of the parts
#      below, and only runtime and entry points receive a Config.
#   6  the loops (runtime) and the simulator (sim), side by side; see FORBIDDEN.
#   7  distribution: where things run (the topologies), Ray rollout actors and storage units,
#      the trainer's processes, weights out of a mesh that spans processes. The loops declare
#      the Topology protocol they take (runtime/loop.py) and never import this layer.
#   8  entry points: main, run (the one library call), eval, export, chat, cli, scale, supervise.
#   9  the lab: benchmarks, the fault suite, the emulated cluster, local launchers, scripts.
LAYERS = (
  (
    "knitjax",
    "knitjax.sharding",
    "knitjax.records",
    "knitjax.faultpoints",
    "knitjax.config_fields",
    "knitjax.workdir",
    "knitjax.jax_compat",
  ),
  ("knitjax.models.*", "knitjax.tasks.*"),
  ("knitjax.train.*",),
  ("knitjax.transfer.*",),
  ("knitjax.rollout.*",),
  (
    "knitjax.config",
    "knitjax.config_sections",
    "knitjax.config_train",
    "knitjax.config_run",
    "knitjax.config_checkpoint",
    "knitjax.config_memory",
  ),
  ("knitjax.runtime.*", "knitjax.sim.*"),
  ("knitjax.distributed.*",),
  (
    "knitjax.main",
    "knitjax.run",
    "knitjax.eval",
    "knitjax.export",
    "knitjax.chat",
    "knitjax.cli",
    "knitjax.scale",
    "knitjax.supervise",
  ),
  ("lab.*",),
)

# Same-layer imports that are still forbidden, (importer prefix, imported prefix): the simulator
# models the runtime with the real admission index and planner, and neither may reach the other.
FORBIDDEN = (
  ("knitjax.sim.*", "knitjax.runtime.*"),
  ("knitjax.runtime.*", "knitjax.sim.*"),
)


def _matches(module: str, pattern: str) -> bool:
  if pattern.endswith(".*"):
    package = pattern[:-2]
    return module == package or module.startswith(package + ".")
  return module == pattern


def layer_of(module: str) -> int | None:
  """The layer of a knitjax module, or None if the table does not cover it."""
  for rank, patterns in enumerate(LAYERS):
    if any(_matches(module, p) for p in patterns):
      return rank
  return None


def _modules() -> dict[str, pathlib.Path]:
  """Every module under knitjax/ and lab/, by dotted name (a package by its own name)."""
  out = {}
  for path in sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py")):
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path
  return out


def _is_type_checking(test: ast.expr) -> bool:
  return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
    isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
  )


def _import_nodes(tree: ast.AST):
  """All import statements in a tree, skipping the bodies of `if TYPE_CHECKING:`."""
  stack = [tree]
  while stack:
    node = stack.pop()
    if isinstance(node, ast.Import | ast.ImportFrom):
      yield node
    if isinstance(node, ast.If) and _is_type_checking(node.test):
      children = node.orelse
    else:
      children = list(ast.iter_child_nodes(node))
    stack.extend(children)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
  """The absolute name of the module a `from ... import` statement names."""
  if not node.level:
    return node.module or ""
  base = module.split(".") if is_package else module.split(".")[:-1]
  base = base[: len(base) - (node.level - 1)]
  return ".".join([*base, node.module] if node.module else base)


def _internal(name: str, modules: dict[str, pathlib.Path]) -> str | None:
  """The longest prefix of `name` that is a project module (`a.b.c` of `a.b` -> `a.b`)."""
  parts = name.split(".")
  while parts:
    candidate = ".".join(parts)
    if candidate in modules:
      return candidate
    parts.pop()
  return None


def import_graph() -> dict[str, set[str]]:
  """Module -> the project modules it imports (itself excluded)."""
  modules = _modules()
  graph = {}
  for module, path in modules.items():
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    targets = set()
    for node in _import_nodes(tree):
      if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
      else:
        base = _resolve(module, is_package, node)
        # `from pkg import mod` imports pkg.mod when that is a module, else a name of pkg.
        names = [
          f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
          for alias in node.names
        ]
      for name in names:
        target = _internal(name, modules)
        if target is not None and target != module:
          targets.add(target)
    graph[module] = targets
  return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """One cycle per strongly connected component with more than one module (Tarjan)."""
  index, low, on_stack, stack, components = {}, {}, set(), [], []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        components.append(set(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return [_cycle_in(graph, component) for component in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
  """A shortest cycle through the component's first module (breadth-first search)."""
  start = min(component)
  parent = {start: None}
  frontier = [start]
  while frontier:
    nxt = []
    for v in frontier:
      for w in sorted(graph[v] & component):
        if w == start:
          path = [v]
          while parent[path[-1]] is not None:
            path.append(parent[path[-1]])
          return [*reversed(path), start]
        if w not in parent:
          parent[w] = v
          nxt.append(w)
    frontier = nxt
  raise AssertionError(f"no cycle through {start} in its component")


@pytest.fixture(scope="module")
def graph():
  return import_graph()


def test_every_module_is_in_a_layer(graph):
  missing = sorted(m for m in graph if layer_of(m) is None)
  assert not missing, f"modules not covered by LAYERS in {__file__}: {', '.join(missing)}"


def test_graph_sees_imports(graph):
  # Guards the walker itself: these imports exist, a function-level one among them.
  assert "knitjax.transfer.feasibility" in graph["knitjax.transfer.admission"]
  assert "knitjax.tasks.registry" in graph["knitjax.config"]


def test_no_cycles(graph):
  cycles = find_cycles(graph)
  assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_imports_point_down(graph):
  bad = []
  for module in sorted(graph):
    rank = layer_of(module)
    for target in sorted(graph[module]):
      target_rank = layer_of(target)
      if rank is None or target_rank is None:
        continue  # reported by test_every_module_is_in_a_layer
      forbidden = any(_matches(module, a) and _matches(target, b) for a, b in FORBIDDEN)
      if target_rank > rank or forbidden:
        bad.append(f"{module} ({rank}) imports {target} ({target_rank})")
  assert not bad, "imports that do not point down:\n" + "\n".join(bad)


def test_layer_checks_catch_bad_graphs():
  assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
  assert find_cycles({"a": {"b"}, "b": set()}) == []
  assert layer_of("knitjax.runtime.builder") == 6
  assert layer_of("knitjax.configs") is None
  assert layer_of("knitjax") == 0
  assert layer_of("lab.bench.staleness") == len(LAYERS) - 1


def test_library_imports_no_lab(graph):
  lab = sorted(
    f"{m} imports {t}"
    for m in graph
    if m.startswith("knitjax")
    for t in graph[m]
    if t.startswith("lab")
  )
  assert not lab, "the library imports the lab:\n" + "\n".join(lab)
