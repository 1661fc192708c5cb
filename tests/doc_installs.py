"""The install each documented command runs after, what that install provides, and what the command needs.

The install: README's plain `bash setup.sh`, plus the extras of every `install` block that holds
the install alone (`EXTRAS=hf,eval bash setup.sh`) at or above the command on its page: a reader goes
down the page. A block that starts with its own install (`EXTRAS=tracking bash setup.sh` and then
its commands) adds those extras for itself only. An end-to-end script states its install in its
header (`# Needs the hf extra (EXTRAS=hf bash setup.sh)`).

What an install provides: the requirements setup.sh installs for those extras (read from its own
DRY_RUN=1 output, so the two cannot drift apart) and everything they depend on, resolved through the
metadata of the packages installed here (EXTRAS=test, a superset), with the top-level modules each
distribution ships.

What a command needs, read without running it: the modules imported by the Python it runs
(`python3 x.py`, `python3 -m tests.x`, heredocs, `-c`, and the repository's non-package modules they
import in turn; an import inside `try: ... except ImportError` is optional), the tools it calls
(`lm_eval`, `wandb`, `pytest`), what `MaxText` entry points load for the keys given (W&B for
`metric_trackers=wandb`, lm-eval for `eval_tasks=`, transformers for chat templates and the logit
checker), and what the scripts it runs (`bash end_to_end/...sh`) need. `MaxText` itself is not
followed: it loads its optional libraries only for the keys above.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata as metadata
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests import doc_blocks, shell_text
from tests.doc_blocks import Block

REPO_ROOT = doc_blocks.REPO_ROOT
EXTRAS = ("test", "hf", "eval", "tracking")
_SETUP = re.compile(r"(?:EXTRAS=([\w,]*)\s+)?bash setup\.sh\b")
_REPO_PACKAGES = {"tests", "benchmarks", "end_to_end"}
# What a MaxText command loads for the keys it is given (the package loads these lazily).
_KEY_NEEDS = [
    (re.compile(r"\bmetric_trackers=\S*wandb"), "wandb", "metric_trackers=wandb"),
    (re.compile(r"\beval_tasks=(?!\"\"|''|\s|$)"), "lm-eval", "eval_tasks="),
    (re.compile(r"configs/(?:sft|dpo|grpo)\.yml|\buse_sft=[Tt]rue|\bobjective=(?:sft|dpo|grpo)\b|\bMaxText\.rl\."), "transformers",
     "a chat template (rendered by transformers)"),
    (re.compile(r"\bMaxText\.logit_checker\b"), "transformers", "the logit checker"),
    (re.compile(r"\bMaxText\.logit_checker\b"), "torch", "the logit checker"),
]
# lm-eval's clients of a served model are its `api` extra.
_LM_EVAL_API = re.compile(r"--model\s+(?:local-completions|local-chat-completions|openai-\S+)")


def extras_of(body: str) -> frozenset[str] | None:
  """The extras of the `EXTRAS=... bash setup.sh` in a text (the plain install: none), or None."""
  m = _SETUP.search(body)
  if m is None:
    return None
  return frozenset(e for e in (m.group(1) or "").split(",") if e)


def installs(blocks: list[Block]) -> dict[str, frozenset[str]]:
  """Block id -> the extras installed when a reader runs it (see the module docstring)."""
  out: dict[str, frozenset[str]] = {}
  page, extras = "", frozenset[str]()
  for b in blocks:
    if b.path != page:
      page, extras = b.path, frozenset()
    own = (extras_of(b.body) if "install" in b.tags else None) or frozenset()
    if page_wide(b):
      extras = extras | own
    out[b.id] = extras | own
  return out


def page_wide(block: Block) -> bool:
  """An `install` block that holds the install alone: it holds for the rest of its page."""
  return "install" in block.tags and _SETUP.fullmatch(block.body.strip()) is not None


def script_extras(text: str) -> frozenset[str]:
  """The extras a script's header comment says it needs."""
  header = "\n".join(line for line in text.splitlines()[:30] if line.startswith("#"))
  return extras_of(header) or frozenset()


# What an install provides.

@functools.cache
def requirements(extras: frozenset[str]) -> tuple[str, ...]:
  """The requirement lines setup.sh installs for these extras (its DRY_RUN=1 pip commands)."""
  env = {**os.environ, "DRY_RUN": "1", "EXTRAS": ",".join(sorted(extras)), "DEVICE": "cpu", "MODE": "stable"}
  out = subprocess.run(["bash", "setup.sh"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60,
                       check=True).stdout
  reqs: list[str] = []
  for line in out.splitlines():
    if " -m pip install " not in line:
      continue
    words = shlex.split(line)[4:]
    for i, w in enumerate(words):
      if i > 0 and words[i - 1] == "-r":
        reqs += [r.split("#")[0].strip() for r in (REPO_ROOT / w).read_text().splitlines() if r.split("#")[0].strip()]
      elif not w.startswith("-") and w != "." and not (i > 0 and words[i - 1] in ("-e", "-i", "-f")):
        reqs.append(w)
  return tuple(reqs)


def closure(reqs: tuple[str, ...] | list[str]) -> frozenset[str]:
  """The distributions (canonical names) these requirements install, dependencies included, as the
  packages installed here declare them."""
  return _closure(tuple(reqs))


@functools.cache
def _closure(reqs: tuple[str, ...]) -> frozenset[str]:
  seen: set[tuple[str, str]] = set()
  names: set[str] = set()
  todo = [(Requirement(r), "") for r in reqs]
  while todo:
    req, parent_extra = todo.pop()
    if req.marker is not None and not req.marker.evaluate({"extra": parent_extra}):
      continue
    name = str(canonicalize_name(req.name))
    names.add(name)
    requires = _requires(name)  # None: not installed here, only its own name is known
    for extra in {""} | set(req.extras):
      if requires is None or (name, extra) in seen:
        continue
      seen.add((name, extra))
      todo += [(r, extra) for r in requires]
  return frozenset(names)


@functools.cache
def _requires(name: str) -> tuple[Requirement, ...] | None:
  try:
    return tuple(Requirement(r) for r in metadata.distribution(name).requires or [])
  except metadata.PackageNotFoundError:
    return None


@functools.cache
def provided(extras: frozenset[str]) -> frozenset[str]:
  return closure(requirements(extras))


@functools.cache
def _module_dists() -> dict[str, frozenset[str]]:
  return {m: frozenset(str(canonicalize_name(d)) for d in ds) for m, ds in metadata.packages_distributions().items()}


# What a command needs: {"module:NAME" (a top-level module) or "dist:REQUIREMENT": why}.

Needs = dict[str, str]


def _imports(source: str, where: str) -> Needs:
  """Top-level modules a Python source imports (optional ones, under `except ImportError`, left
  out), and the repository modules it imports, followed."""
  try:
    tree = ast.parse(source)
  except SyntaxError:
    return {}
  optional: set[int] = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
      optional |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
      optional |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
  needs: Needs = {}
  for node in ast.walk(tree):
    if id(node) in optional:
      continue
    names: list[str] = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    for name in names:
      needs.update(_module_needs(name, where))
  return needs


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
  text = ast.unparse(handler.type) if handler.type is not None else "BaseException"
  return any(e in text for e in ("ImportError", "ModuleNotFoundError", "Exception"))


def _module_needs(name: str, where: str) -> Needs:
  top = name.split(".")[0]
  if top in sys.stdlib_module_names or top == "__future__" or top == "MaxText":
    return {}
  if top in _REPO_PACKAGES:
    return _repo_module(name)
  helpers = _helper_modules().get(top)
  if helpers:  # a sibling script or test helper, imported through sys.path
    return {k: v for path in helpers for k, v in _script_needs(path).items()}
  return {f"module:{top}": f"{where} imports {top}"}


@functools.cache
def _helper_modules() -> dict[str, tuple[Path, ...]]:
  """Module name -> the repository's non-package Python files of that name (benchmarks/, tests/...)."""
  found: dict[str, list[Path]] = {}
  for folder in _REPO_PACKAGES:
    for path in sorted((REPO_ROOT / folder).rglob("*.py")):
      found.setdefault(path.stem, []).append(path)
  return {k: tuple(v) for k, v in found.items()}


@functools.cache
def _repo_module(name: str) -> Needs:
  """The needs of a repository module that is not the MaxText package (a test helper, a benchmark)."""
  path = REPO_ROOT / (name.replace(".", "/") + ".py")
  if not path.is_file():
    return {}  # a package folder, or `from tests import helper` (followed as tests.helper)
  return _script_needs(path)


@functools.cache
def _script_needs(path: Path) -> Needs:
  rel = str(path.relative_to(REPO_ROOT))
  if path.suffix == ".py":
    return _imports(path.read_text(), rel)
  return shell_needs(path.read_text(), rel)


def shell_needs(text: str, where: str) -> Needs:
  """What a shell text (a doc block, a script) needs, as the module docstring says."""
  sh = shell_text.read(text)
  needs: Needs = {}
  for opener, body in sh.heredocs:
    if re.search(r"\bpython3?\s+-\s", opener + " "):
      needs.update(_imports(body, f"{where} (its python heredoc)"))
  for number, line in sh.lines:
    here = f"{where}, line {number}"
    for pattern, need, why in _KEY_NEEDS:
      if "MaxText" in line and pattern.search(line):
        needs[f"dist:{need}"] = f"{here}: {why}"
    for seg, _ in shell_text.segments(shell_text.tokens(line)):
      words = shell_text.command_words(seg)
      if not words:
        continue
      tool = words[0]
      if tool in ("python", "python3") and len(words) > 1:
        needs.update(_python_needs(words[1:], here))
      elif tool == "bash" and len(words) > 1 and (REPO_ROOT / words[1]).is_file() and words[1] != "setup.sh":
        needs.update(_script_needs(REPO_ROOT / words[1]))
      elif tool == "lm_eval":
        api = _LM_EVAL_API.search(" ".join(words))
        needs["dist:lm-eval[api]" if api else "dist:lm-eval"] = f"{here}: lm_eval{' against a server' if api else ''}"
      elif tool in ("wandb", "pytest"):
        needs[f"dist:{tool}"] = f"{here}: {tool}"
  return needs


def _python_needs(args: list[str], where: str) -> Needs:
  if args[0] == "-m" and len(args) > 1:
    return _module_needs(args[1], where)
  if args[0] == "-c" and len(args) > 1:
    return _imports(args[1], where)
  if args[0].endswith(".py") and (REPO_ROOT / args[0]).is_file():
    return _script_needs(REPO_ROOT / args[0])
  return {}


def missing(needs: Needs, extras: frozenset[str]) -> list[str]:
  """The needs the install with these extras does not provide, each with why it is needed."""
  have = provided(extras)
  out = []
  for need, why in sorted(needs.items()):
    kind, name = need.split(":", 1)
    if kind == "dist":
      req = Requirement(name)
      lacking = sorted(closure([name]) - have)
      if str(canonicalize_name(req.name)) in lacking:
        lacking = [name]
      elif lacking:  # the package is there, what its extra brings is not
        lacking = [f"{name} ({', '.join(lacking)} of it)"]
    else:  # a module: any distribution that ships it will do
      dists = _module_dists().get(name, frozenset())
      lacking = [] if dists & have else ["/".join(sorted(dists)) or f"{name} (installed by no extra here)"]
    if lacking:
      out.append(f"{why}: needs {', '.join(lacking)}")
  return out


def block_problems(blocks: list[Block]) -> list[str]:
  """For each command block a reader runs (cpu, manual), what its install lacks."""
  extras = installs(blocks)
  found = []
  for b in blocks:
    if b.kinds & {"cpu", "manual"}:
      install = extras[b.id] | (extras_of(b.body) or frozenset() if "install" in b.tags else frozenset())
      found += [f"{b.id} (after {describe(install)}): {m}" for m in missing(shell_needs(b.body, b.id), install)]
  return found


def describe(extras: frozenset[str]) -> str:
  return f"EXTRAS={','.join(sorted(extras))} bash setup.sh" if extras else "bash setup.sh"


def scripts() -> list[Path]:
  """The repository's shell scripts: end-to-end runs, benchmarks' and recipes' shells, setup, CI."""
  found = [p for p in REPO_ROOT.rglob("*.sh") if not {".git", "outputs", ".venv"} & set(p.relative_to(REPO_ROOT).parts)]
  return sorted(found) + [REPO_ROOT / ".ci" / "run"]


def script_problems() -> list[str]:
  """For each end-to-end script, what the install its header states lacks."""
  found = []
  for path in sorted((REPO_ROOT / "end_to_end" / "cpu").glob("*.sh")):
    text = path.read_text()
    extras = script_extras(text)
    rel = str(path.relative_to(REPO_ROOT))
    found += [f"{rel} (its header: {describe(extras)}): {m}" for m in missing(shell_needs(text, rel), extras)]
  return found


def after_own_install(blocks: list[Block]) -> dict[str, frozenset[str]]:
  """Block id -> extras, for the `cpu` blocks whose page or block states an install other than the
  plain one or EXTRAS=test (CI's own, which the docs test runs every block in): the blocks
  tests/test_page_installs.py runs after exactly that install. The install blocks themselves are
  left out: on their own they only run setup.sh, which the docs test does with DRY_RUN=1."""
  extras = installs(blocks)
  return {b.id: extras[b.id] for b in blocks
          if "cpu" in b.kinds and extras[b.id] and "test" not in extras[b.id] and not page_wide(b)}
