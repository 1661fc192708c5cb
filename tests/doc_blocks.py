"""The fenced blocks of README.md and getting_started/*.md: their tags, running them, checking their output.

Every fenced block says what it is in its info string, after the language word that GitHub uses for
highlighting (GitHub ignores the rest, so the tags do not show). Tags are words; a value with spaces
is quoted (why="needs a TPU v5e slice").

  ```bash cpu              a command that runs on a CPU machine after the README's install; tested
  ```bash cpu slow         the same, taking more than ~20 s on a 2-core machine (tested under -m slow)
  ```bash cpu exit=2       the same, expected to end with this exit status (an error example)
  ```bash cpu timeout=900  the same, with its own time limit in seconds
  ```bash cpu corpus       the block reads ../shared/data/tinyshakespeare.txt (the shared data beside the
                           repository, never copied into it): skipped, saying so, where it is absent
  ```bash cpu name=first   a name other blocks of the same page can run first with after=first
  ```bash cpu after=first  runs the named block's command first, in the same copy (it reads its outputs)
  ```bash cpu install      the block runs setup.sh: the test runs it with DRY_RUN=1 (setup.sh then
                           prints its pip commands); tests/test_setup_install.py runs the real
                           install in a fresh venv (in CI's docs stage). A block that holds only
                           `EXTRAS=... bash setup.sh` is the install of the blocks below it on its
                           page; one that goes on with commands, of itself (tests/doc_installs.py):
                           tests/test_page_installs.py runs those blocks after that install, in CI
  ```bash cpu dry-run      the dry-run form of the tpu/gpu/cloud/manual block before it
  ```bash cpu local        its local form: the same command on 8 simulated CPU devices or local disk
  ```bash tpu why="..."    needs that accelerator (`tpu gpu`: either); not run
  ```bash gpu why="..."
  ```bash cloud why="..."  needs gcloud, a bucket, a cluster or docker; not run
  ```bash manual why="..." needs something only the reader has (their own files, a placeholder such as
                           CKPT, an earlier run elsewhere) or never ends (a server); not run
  ```bash ci               a command .ci/run runs (the install and the test suite): checked to be there
  ```text output           what the nearest `cpu` block above prints: checked (tests/doc_output.py);
                           several output blocks may follow one command, each an excerpt in order
  ```text output tol=...   the same, its figures compared within these tolerances (tests/doc_output.py:
                           tol=loss:2e-3,GiB:1%,MFU:0.5,s:any; none stated: every figure as quoted)
  ```text sample           output of a command that is not a block of the page: tests/doc_samples.py
                           names the command and regenerate_doc_samples.py reruns it; `tol=` as above
  ```text sample why="..." output no command can reproduce here (a fault the tests inject, a TPU run)
  ```text diagram          a picture
  ```python sketch         a code fragment, not a program

Every block kept out of the run (tpu, gpu, cloud, manual, a sample without a command) says why in its
`why=` tag; `test_docs_run.py::test_kept_out_blocks_say_why` lists them all. A block without tags,
with an unknown tag or with an `output` that follows no `cpu` block is an error (`parse` returns it),
so a new block cannot go untested without saying why.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests import doc_output

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "getting_started/*.md")

COMMAND_KINDS = {"cpu", "tpu", "gpu", "cloud", "manual", "ci"}
TEXT_KINDS = {"output", "sample", "diagram", "sketch"}
KEPT_OUT = {"tpu", "gpu", "cloud", "manual"}  # command kinds that are not run: each needs why=
MODIFIERS = {"slow", "install", "dry-run", "local", "corpus"}
VALUED = {"exit", "timeout", "why", "tol", "name", "after"}
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
  why: str = ""  # why a kept-out block is not run
  tolerances: dict[str, doc_output.Tolerance] = dataclasses.field(default_factory=dict)
  name: str = ""
  after: Block | None = None  # the block whose command runs first
  outputs: list[Block] = dataclasses.field(default_factory=list)  # the `output` blocks that check this one
  dry_run: Block | None = None  # the `cpu dry-run` or `cpu local` block standing in for this one

  @property
  def id(self) -> str:
    return f"{self.path}:{self.line}"

  @property
  def slow(self) -> bool:
    return "slow" in self.tags

  def value(self, key: str) -> str | None:
    return next((t.split("=", 1)[1] for t in self.tags if t.startswith(key + "=")), None)


_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")


def fenced_blocks(text: str, path: str) -> tuple[list[Block], list[str], list[tuple[int, int]]]:
  """The fenced blocks of one Markdown text (tags split, not checked), errors in their info strings,
  and the (first, last) 0-based line of each block, fences included."""
  blocks: list[Block] = []
  errors: list[str] = []
  spans: list[tuple[int, int]] = []
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
    try:
      words = shlex.split(info)
    except ValueError as e:
      errors.append(f"{path}:{i + 1}: info string {info.strip()!r}: {e}")
      words = info.split()
    blocks.append(Block(path, i + 1, words[0] if words else "", words[1:], body + "\n"))
    spans.append((i, end))
    i = end + 1
  return blocks, errors, spans


def parse(text: str, path: str) -> tuple[list[Block], list[str]]:
  """The fenced blocks of one Markdown text, and what is wrong with their tags."""
  blocks, errors, _ = fenced_blocks(text, path)
  named: dict[str, Block] = {}
  last_command: Block | None = None
  for b in blocks:
    where = f"{b.id}: "
    if not b.tags:
      errors.append(where + f"untagged block (```{b.lang or 'LANG'} cpu|tpu|gpu|cloud|manual|ci|output|sample|"
                    "diagram|sketch; see tests/doc_blocks.py)")
      continue
    for tag in b.tags:
      key, eq, value = tag.partition("=")
      if tag in COMMAND_KINDS or tag in TEXT_KINDS:
        b.kinds.add(tag)
      elif tag in MODIFIERS:
        pass
      elif not eq or key not in VALUED:
        errors.append(where + f"unknown tag {tag!r}")
      elif key in ("exit", "timeout") and not value.isdigit():
        errors.append(where + f"{tag!r}: {key}= takes a whole number")
      elif key == "exit":
        b.exit_code = int(value)
      elif key == "timeout":
        b.timeout_s = int(value)
      elif key == "why":
        b.why = value.strip()
      elif key == "tol":
        try:
          b.tolerances = doc_output.parse_tolerances(value)
        except doc_output.ToleranceError as e:
          errors.append(where + str(e))
      elif key == "name":
        named[value] = b
        b.name = value
      elif key == "after":
        if value not in named:
          errors.append(where + f"after={value}: no block above on this page has name={value}")
        else:
          b.after = named[value]
    if not b.kinds:
      errors.append(where + f"no kind among the tags {b.tags}")
      continue
    if b.kinds & TEXT_KINDS and len(b.kinds) > 1:
      errors.append(where + f"{sorted(b.kinds)}: a text block has one kind")
    if "cpu" in b.kinds and len(b.kinds) > 1:
      errors.append(where + f"{sorted(b.kinds)}: `cpu` means it runs here; it takes no other kind")
    if b.kinds & {"tpu", "gpu"} and b.kinds - {"tpu", "gpu"}:
      errors.append(where + f"{sorted(b.kinds)}: mixes hardware with another kind")
    if "cpu" not in b.kinds and {t.split("=")[0] for t in b.tags} & {"slow", "dry-run", "local", "exit", "timeout",
                                                                     "name", "after"}:
      errors.append(where + "slow, dry-run, local, exit=, timeout=, name= and after= apply to `cpu` blocks only")
    if b.tolerances and not b.kinds & {"output", "sample"}:
      errors.append(where + "tol= applies to output and sample blocks only")
    if b.why and not b.kinds & (KEPT_OUT | {"sample"}):
      errors.append(where + "why= explains a block that is not run (tpu, gpu, cloud, manual, sample)")
    if b.kinds & KEPT_OUT and not b.why:
      errors.append(where + f"{' '.join(sorted(b.kinds))} block without why=\"...\": say why it cannot run here")
    if b.slow and b.value("timeout") is None:
      b.timeout_s = SLOW_TIMEOUT_S

    if b.kinds & COMMAND_KINDS:
      if "dry-run" in b.tags or "local" in b.tags:
        if last_command is None or not last_command.kinds & KEPT_OUT:
          errors.append(where + "`dry-run`/`local` follows no tpu/gpu/cloud/manual block")
        else:
          last_command.dry_run = b
      last_command = b
    elif "output" in b.kinds:
      if last_command is None or "cpu" not in last_command.kinds:
        errors.append(where + "an `output` block must come after a `cpu` block (use `sample` otherwise)")
      else:
        last_command.outputs.append(b)
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


@dataclasses.dataclass
class Run:
  returncode: int | None  # None: killed at the time limit
  output: str
  seconds: float


def run(block: Block, workdir: Path, root: Path = REPO_ROOT, bin_dir: Path | None = None) -> Run:
  """Runs a `cpu` block as written with bash -e in a fresh copy of the repository under `workdir`.

  The copy is what the docs assume: the current folder is the repository root (configs/base.yml,
  setup.sh), and whatever the command writes (outputs/, step.aot, ...) lands in the copy, not in the
  repository. `python3 -m MaxText...` imports the copy's MaxText (the current folder comes first
  on sys.path). The environment is PATH and HOME only, plus what the command sets itself: the
  8-device XLA_FLAGS and JAX_PLATFORMS of tests/conftest.py do not leak in. With after=, the named
  block's command runs first in the same copy; only this block's own output is returned. With
  `bin_dir` (a venv's bin/), its python3 and tools come first on PATH.
  """
  repo = workdir / "repo"
  shutil.copytree(root, repo, ignore=COPY_IGNORE, symlinks=True)
  chain = [block]
  while chain[0].after is not None:
    chain.insert(0, chain[0].after)
  if any("corpus" in b.tags for b in chain):
    (workdir / "shared").symlink_to(SHARED)  # ../shared from the copy, as beside the repository
  env = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
  if bin_dir is not None:
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
  if any("install" in b.tags for b in chain):
    env["DRY_RUN"] = "1"
  start = time.monotonic()
  for b in chain:
    result = _run_body(b.body, repo, env, block.timeout_s - (time.monotonic() - start))
    if b is not block and result.returncode != b.exit_code:
      return Run(result.returncode, f"(the block it runs after, {b.id}, failed)\n{result.output}",
                 time.monotonic() - start)
  return Run(result.returncode, result.output, time.monotonic() - start)


def _run_body(body: str, cwd: Path, env: dict[str, str], timeout_s: float) -> Run:
  start = time.monotonic()
  proc = subprocess.Popen(["bash", "-e", "-c", body], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=max(timeout_s, 1))
    code: int | None = proc.returncode
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)  # the whole group: python3 under bash
    out, _ = proc.communicate()
    code = None
  return Run(code, out, time.monotonic() - start)


def compare(quoted: Block, printed: str, command: str) -> str | None:
  """Why the output or sample block `quoted` disagrees with what `command` printed, or None."""
  problem = doc_output.match_output(quoted.body, printed, quoted.tolerances).problem
  if problem is None:
    return None
  tail = "\n".join(printed.splitlines()[-40:])
  return f"{command}: the output quoted at {quoted.id} disagrees: {problem}; last lines printed:\n{tail}"


def check(block: Block, result: Run) -> str | None:
  """Why the run disagrees with the docs, or None."""
  tail = "\n".join(result.output.splitlines()[-40:])
  if result.returncode is None:
    return f"{block.id}: no result after {block.timeout_s} s (the time limit); last lines:\n{tail}"
  if result.returncode != block.exit_code:
    return f"{block.id}: exit status {result.returncode}, the docs expect {block.exit_code}; last lines:\n{tail}"
  for output in block.outputs:
    problem = compare(output, result.output, block.id)
    if problem is not None:
      return problem
  return None


def kept_out(blocks: list[Block]) -> list[Block]:
  """The command and sample blocks the docs test does not run, each with its why= (maybe empty)."""
  return [b for b in blocks if b.kinds & KEPT_OUT or ("sample" in b.kinds and b.why)]


def ci_commands_missing(block: Block, ci_script: Path = REPO_ROOT / ".ci" / "run") -> list[str]:
  """The commands of a `ci` block (lines, split at &&) that are not lines of .ci/run."""
  ci_lines = {line.split("#")[0].strip() for line in ci_script.read_text().splitlines()}
  commands = [c.strip() for line in block.body.splitlines() for c in line.split("&&") if c.strip()]
  return [c for c in commands if c not in ci_lines]
