"""The fenced blocks of README.md and getting_started/*.md: their tags, running them, checking their output.

Every fenced block says what it is in its info string, after the language word that GitHub uses for
highlighting (GitHub ignores the rest, so the tags do not show):

  ```bash cpu              a command that runs on a CPU machine after the README's install; tested
  ```bash cpu slow         the same, taking more than ~20 s on a 2-core machine (tested under -m slow)
  ```bash cpu exit=2       the same, expected to end with this exit status (an error example)
  ```bash cpu timeout=900  the same, with its own time limit in seconds
  ```bash cpu corpus       the block reads ../shared/data/tinyshakespeare.txt (the shared data beside the
                           repository, never copied into it): skipped, saying so, where it is absent
  ```bash cpu install      the block runs setup.sh: the test runs it with DRY_RUN=1 (setup.sh then
                           prints its pip commands): the install itself is what the test runs after
  ```bash cpu dry-run      the dry-run form of the tpu/gpu/cloud block before it
  ```bash tpu / gpu        needs that accelerator (`tpu gpu`: either); not run
  ```bash cloud            needs gcloud, a bucket, a cluster or docker; not run
  ```bash manual           needs something only the reader has (their own files, a placeholder
                           such as CKPT or `...`, an earlier run) or never ends (a server); not run
  ```bash ci               a command .ci/run runs (the install and the test suite): checked to be there
  ```text output           what the nearest `cpu` block above prints: checked (see `line_pattern`)
  ```text sample           output shown for illustration, not produced by a block of the page
  ```text diagram          a picture
  ```python sketch         a code fragment, not a program

A block without tags, with an unknown tag or with an `output` that follows no `cpu` block is an
error (`parse` returns it), so a new block cannot go untested without saying why.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "getting_started/*.md")

COMMAND_KINDS = {"cpu", "tpu", "gpu", "cloud", "manual", "ci"}
TEXT_KINDS = {"output", "sample", "diagram", "sketch"}
MODIFIERS = {"slow", "install", "dry-run", "corpus"}
# The shared data a `corpus` block reads, beside the repository.
SHARED = REPO_ROOT.parent / "shared"
CORPUS = SHARED / "data" / "tinyshakespeare.txt"
CPU_TIMEOUT_S = 180
SLOW_TIMEOUT_S = 1500
# What a run copies of the repository: the tracked tree as a fresh clone has it, not the run outputs.
COPY_IGNORE = shutil.ignore_patterns(".git", "outputs", "__pycache__", ".pytest_cache", "*.egg-info", "build",
                                     ".venv", ".mypy_cache")


@dataclasses.dataclass
class Block:
  path: str  # relative to the repository root
  line: int  # of the opening fence, 1-based
  lang: str
  tags: list[str]
  body: str
  kinds: set[str] = dataclasses.field(default_factory=set)
  exit_code: int = 0
  timeout_s: int = CPU_TIMEOUT_S
  output: Block | None = None  # the `output` block that checks this one
  dry_run: Block | None = None  # the `cpu dry-run` block standing in for this one

  @property
  def id(self) -> str:
    return f"{self.path}:{self.line}"

  @property
  def slow(self) -> bool:
    return "slow" in self.tags


_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")


def parse(text: str, path: str) -> tuple[list[Block], list[str]]:
  """The fenced blocks of one Markdown text, and what is wrong with their tags."""
  blocks: list[Block] = []
  errors: list[str] = []
  lines = text.splitlines()
  i = 0
  while i < len(lines):
    m = _FENCE.match(lines[i])
    if not m:
      i += 1
      continue
    indent, fence, info = m.groups()
    end = i + 1
    while end < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[end]):
      end += 1
    body = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines[i + 1:end])
    words = info.split()
    blocks.append(Block(path, i + 1, words[0] if words else "", words[1:], body + "\n"))
    i = end + 1

  last_command: Block | None = None
  for b in blocks:
    where = f"{b.id}: "
    if not b.tags:
      errors.append(where + f"untagged block (```{b.lang or 'LANG'} cpu|tpu|gpu|cloud|manual|ci|output|sample|"
                    "diagram|sketch; see tests/doc_blocks.py)")
      continue
    for tag in b.tags:
      if tag in COMMAND_KINDS or tag in TEXT_KINDS:
        b.kinds.add(tag)
      elif tag.startswith("exit=") and tag[5:].isdigit():
        b.exit_code = int(tag[5:])
      elif tag.startswith("timeout=") and tag[8:].isdigit():
        b.timeout_s = int(tag[8:])
      elif tag not in MODIFIERS:
        errors.append(where + f"unknown tag {tag!r}")
    if not b.kinds:
      errors.append(where + f"no kind among the tags {b.tags}")
      continue
    if b.kinds & TEXT_KINDS and len(b.kinds) > 1:
      errors.append(where + f"{sorted(b.kinds)}: a text block has one kind")
    if "cpu" in b.kinds and len(b.kinds) > 1:
      errors.append(where + f"{sorted(b.kinds)}: `cpu` means it runs here; it takes no other kind")
    if b.kinds & {"tpu", "gpu"} and b.kinds - {"tpu", "gpu"}:
      errors.append(where + f"{sorted(b.kinds)}: mixes hardware with another kind")
    if "cpu" not in b.kinds and {t for t in b.tags if t in ("slow", "dry-run") or "=" in t}:
      errors.append(where + "slow, dry-run, exit= and timeout= apply to `cpu` blocks only")
    if b.slow and not any(t.startswith("timeout=") for t in b.tags):
      b.timeout_s = SLOW_TIMEOUT_S

    if b.kinds & COMMAND_KINDS:
      if "dry-run" in b.tags:
        if last_command is None or not last_command.kinds & {"tpu", "gpu", "cloud"}:
          errors.append(where + "`dry-run` follows no tpu/gpu/cloud block")
        else:
          last_command.dry_run = b
      last_command = b
    elif "output" in b.kinds:
      if last_command is None or "cpu" not in last_command.kinds:
        errors.append(where + "an `output` block must come after a `cpu` block (use `sample` otherwise)")
      elif last_command.output is not None:
        errors.append(where + f"{last_command.id} already has its output block")
      else:
        last_command.output = b
  return blocks, errors


def doc_paths(root: Path = REPO_ROOT) -> list[Path]:
  return sorted(p for pattern in DOCS for p in root.glob(pattern))


def all_blocks(root: Path = REPO_ROOT) -> tuple[list[Block], list[str]]:
  blocks, errors = [], []
  for p in doc_paths(root):
    b, e = parse(p.read_text(), str(p.relative_to(root)))
    blocks += b
    errors += e
  return blocks, errors


# Matching quoted output. A quoted line matches a printed line when they are equal except that
#   - runs of white space match any run of white space (columns move with the numbers),
#   - a number with a decimal point or an exponent (a loss, a time, a rate) matches any number,
#   - `...` inside a line matches any text, and a line that is only `...` is skipped.
# Integers must match exactly: step counts, device counts, shapes and byte counts are what the docs
# promise. The quoted lines must appear in this order; other printed lines may come between them.
_TOKEN = re.compile(r"(\.\.\.)|(?<![\w.])([-+]?\d[\d,]*(?:\.\d+(?:[eE][-+]?\d+)?|[eE][-+]?\d+|(?:\.\d+)?))|(\s+)")
_ANY_NUMBER = r"[-+]?(?:\d[\d,]*(?:\.\d*)?(?:[eE][-+]?\d+)?|nan|inf)"


def line_pattern(quoted: str) -> re.Pattern[str] | None:
  """The regular expression one quoted output line stands for; None for a `...` line."""
  quoted = quoted.strip()
  if quoted in ("", "..."):
    return None
  parts, pos = [], 0
  for m in _TOKEN.finditer(quoted):
    parts.append(re.escape(quoted[pos:m.start()]))
    ellipsis, number, space = m.groups()
    if ellipsis:
      parts.append(".*?")
    elif space:
      parts.append(r"\s+")
    elif number and re.search(r"[.eE]", number):
      parts.append(_ANY_NUMBER)
    else:
      parts.append(re.escape(number))
    pos = m.end()
  parts.append(re.escape(quoted[pos:]))
  return re.compile("".join(parts))


def match_output(quoted: str, printed: str) -> tuple[list[tuple[str, str]], str | None]:
  """(quoted line, printed line) pairs in order, and the first quoted line not found (or None)."""
  actual = [line.strip() for line in printed.splitlines()]
  pairs, at = [], 0
  for q in quoted.splitlines():
    pattern = line_pattern(q)
    if pattern is None:
      continue
    while at < len(actual) and not pattern.fullmatch(actual[at]):
      at += 1
    if at == len(actual):
      return pairs, q
    pairs.append((q, printed.splitlines()[at]))
    at += 1
  return pairs, None


@dataclasses.dataclass
class Run:
  returncode: int | None  # None: killed at the time limit
  output: str
  seconds: float


def run(block: Block, workdir: Path, root: Path = REPO_ROOT) -> Run:
  """Runs a `cpu` block as written with bash -e in a fresh copy of the repository under `workdir`.

  The copy is what the docs assume: the current folder is the repository root (configs/base.yml,
  setup.sh), and whatever the command writes (outputs/, step.aot, ...) lands in the copy, not in the
  repository. `python3 -m MaxText...` imports the copy's MaxText (the current folder comes first
  on sys.path). The environment is PATH and HOME only, plus what the command sets itself: the
  8-device XLA_FLAGS and JAX_PLATFORMS of tests/conftest.py do not leak in.
  """
  repo = workdir / "repo"
  shutil.copytree(root, repo, ignore=COPY_IGNORE, symlinks=True)
  if "corpus" in block.tags:
    (workdir / "shared").symlink_to(SHARED)  # ../shared from the copy, as beside the repository
  env = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
  if "install" in block.tags:
    env["DRY_RUN"] = "1"
  start = time.monotonic()
  proc = subprocess.Popen(["bash", "-e", "-c", block.body], cwd=repo, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=block.timeout_s)
    code: int | None = proc.returncode
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)  # the whole group: python3 under bash
    out, _ = proc.communicate()
    code = None
  return Run(code, out, time.monotonic() - start)


def check(block: Block, result: Run) -> str | None:
  """Why the run disagrees with the docs, or None."""
  tail = "\n".join(result.output.splitlines()[-40:])
  if result.returncode is None:
    return f"{block.id}: no result after {block.timeout_s} s (the time limit); last lines:\n{tail}"
  if result.returncode != block.exit_code:
    return f"{block.id}: exit status {result.returncode}, the docs expect {block.exit_code}; last lines:\n{tail}"
  if block.output is not None:
    _, missing = match_output(block.output.body, result.output)
    if missing is not None:
      return (f"{block.id}: the output quoted at {block.output.id} has {missing.strip()!r}, which the command did "
              f"not print (in that order); last lines:\n{tail}")
  return None


def ci_commands_missing(block: Block, ci_script: Path = REPO_ROOT / ".ci" / "run") -> list[str]:
  """The commands of a `ci` block (lines, split at &&) that are not lines of .ci/run."""
  ci_lines = {line.split("#")[0].strip() for line in ci_script.read_text().splitlines()}
  commands = [c.strip() for line in block.body.splitlines() for c in line.split("&&") if c.strip()]
  return [c for c in commands if c not in ci_lines]
