"""The import graph of the MaxText package, read from the source with `ast` (nothing is imported).

Nodes are the package's modules (a package is its `__init__.py`); an edge A -> B is an `import`
or `from ... import` in A that loads B: `import MaxText.x.y`, `from MaxText.x import y` (B is the
submodule y when it exists, else MaxText.x) and relative imports alike. Imports anywhere in a
module count, at its top level and inside functions (`Import.function_level` tells them apart);
imports under `if TYPE_CHECKING:` are left out, since they never run. A module's parent packages,
which Python loads first, are not edges: every submodule would otherwise join its package's cycle.

    python3 tests/import_graph.py [PACKAGE_DIR]   # default: this checkout's MaxText/

prints the number of modules, of import edges, of levels (the longest chain of imports, counting
modules, with each cycle counted as one module) and every cycle.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import sys
from typing import Iterator

DEFAULT_ROOT = pathlib.Path(__file__).resolve().parent.parent / "MaxText"


@dataclasses.dataclass(frozen=True)
class Import:
  importer: str
  imported: str
  line: int
  function_level: bool


@dataclasses.dataclass
class Graph:
  modules: set[str]
  imports: list[Import]

  @property
  def edges(self) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {m: set() for m in self.modules}
    for imp in self.imports:
      if imp.importer != imp.imported:
        out[imp.importer].add(imp.imported)
    return out

  def function_level(self) -> list[Import]:
    return [imp for imp in self.imports if imp.function_level]


def module_names(root: pathlib.Path) -> dict[str, pathlib.Path]:
  """Module name -> file for every .py under `root`, a package directory (named as it is)."""
  names = {}
  for path in sorted(root.rglob("*.py")):
    parts = (root.name,) + path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    names[".".join(parts)] = path
  return names


def _is_type_checking(test: ast.expr) -> bool:
  return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
      isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(tree: ast.AST, in_function: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
  """Every import statement and whether it sits inside a function, skipping TYPE_CHECKING blocks."""
  for node in ast.iter_child_nodes(tree):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      yield node, in_function
    elif isinstance(node, ast.If) and _is_type_checking(node.test):
      for child in node.orelse:
        yield from _statements(ast.Module(body=[child], type_ignores=[]), in_function)
    else:
      inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
      yield from _statements(node, inner)


def _resolve(name: str, modules: set[str]) -> str | None:
  """The longest prefix of dotted `name` that is a module of the package."""
  parts = name.split(".")
  for end in range(len(parts), 0, -1):
    candidate = ".".join(parts[:end])
    if candidate in modules:
      return candidate
  return None


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]) -> list[str]:
  if isinstance(node, ast.Import):
    found = (_resolve(alias.name, modules) for alias in node.names)
    return [t for t in found if t]
  if node.level:  # relative: from the module's package, one level up per extra dot
    package = module.split(".") if is_package else module.split(".")[:-1]
    base_parts = package[:len(package) - (node.level - 1)]
    base = ".".join(base_parts + ([node.module] if node.module else []))
  else:
    base = node.module or ""
  targets = []
  for alias in node.names:
    submodule = f"{base}.{alias.name}"
    target = submodule if submodule in modules else _resolve(base, modules)
    if target:
      targets.append(target)
  return targets


def build(root: pathlib.Path = DEFAULT_ROOT) -> Graph:
  files = module_names(root)
  modules = set(files)
  imports = []
  for module, path in files.items():
    tree = ast.parse(path.read_text(), filename=str(path))
    for node, in_function in _statements(tree):
      for target in _targets(node, module, path.name == "__init__.py", modules):
        imports.append(Import(module, target, node.lineno, in_function))
  return Graph(modules, imports)


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
  """Tarjan's components, each sorted; singletons included."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  components: list[list[str]] = []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(edges[v]):
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
      components.append(sorted(component))

  limit = sys.getrecursionlimit()
  sys.setrecursionlimit(max(limit, 10 * len(edges) + 100))
  try:
    for v in sorted(edges):
      if v not in index:
        visit(v)
  finally:
    sys.setrecursionlimit(limit)
  return components


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
  """One cycle (a -> ... -> a) through each component of more than one module."""
  found = []
  for component in strongly_connected(edges):
    if len(component) < 2:
      continue
    members, start = set(component), component[0]
    # Breadth-first from start back to start inside the component: the shortest cycle through it.
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier and start not in parent:
      following = []
      for v in frontier:
        for w in sorted(edges[v] & members):
          if w not in parent:
            parent[w] = v
            following.append(w)
      frontier = following
    path = [start]
    v = parent[start]
    while v != start:
      path.append(v)
      v = parent[v]
    found.append([start] + path[:0:-1] + [start])
  return found


def levels(edges: dict[str, set[str]]) -> int:
  """Modules on the longest import chain, each strongly connected component counted once."""
  component_of = {}
  components = strongly_connected(edges)
  for i, component in enumerate(components):
    for m in component:
      component_of[m] = i
  # Tarjan emits a component after every component it imports, so one pass in order suffices.
  depth = [1] * len(components)
  for i, component in enumerate(components):
    below = {component_of[w] for v in component for w in edges[v]} - {i}
    depth[i] = 1 + max((depth[j] for j in below), default=0)
  return max(depth, default=0)


def main(argv: list[str]) -> int:
  root = pathlib.Path(argv[0]).resolve() if argv else DEFAULT_ROOT
  graph = build(root)
  edges = graph.edges
  print(f"package: {root}")
  print(f"modules: {len(graph.modules)}")
  print(f"import edges: {sum(len(targets) for targets in edges.values())}")
  print(f"levels: {levels(edges)}")
  print(f"function-level imports of package modules: {len(graph.function_level())}")
  found = cycles(edges)
  print(f"cycles: {len(found)}")
  for cycle in found:
    print("  " + " -> ".join(cycle))
  return 0


if __name__ == "__main__":
  raise SystemExit(main(sys.argv[1:]))
