"""Commands written in the docs' prose, outside fenced blocks, which the docs test could not run.

An inline code span that starts like a whole command (`python3 -m MaxText.x ...`, `python3 benchmarks/x.py`,
`python3 tests/...`, `bash end_to_end/...`, `bash configs/...`, `sbatch ...`) is a command a reader
may copy. It belongs in a tagged block, where it runs or says why not. A span that shows the
shape of a command rather than one to run (it contains `...` or a placeholder in capitals such as
`KEY=VALUE`) is allowed in prose, and so is one that a fenced block of the same page holds already.
A getting_started page that names an end-to-end script or a benchmark (`end_to_end/cpu/grpo.sh`,
`benchmarks/serve_bench.py`) holds it in a tagged block too (`scripts_without_block`); README.md's
map of the repository is exempt. Also exempt from the first rule: setup.sh's variants (its header
documents them; tests/test_setup_install.py runs the plain install) and the lines of .ci/run.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests import doc_blocks

_INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
COMMAND_START = re.compile(r"^(?:[A-Z_]+=\S+\s+)*(?:python3?\s+(?:-m\s+\S+|\S+\.py)|bash\s+\S+\.sh|sbatch\s)")
_PATTERN = re.compile(r"\.\.\.|\[|\||<|\b[A-Z][A-Z_]{2,}\b(?!=)")


def prose_commands(root: Path = doc_blocks.REPO_ROOT) -> list[tuple[str, str]]:
  """(file:line, command) for each command-like inline code span outside fenced blocks."""
  found = []
  for path in doc_blocks.doc_paths(root):
    text = path.read_text()
    rel = str(path.relative_to(root))
    blocks, _, spans = doc_blocks.fenced_blocks(text, rel)
    in_block = {i for first, last in spans for i in range(first, last + 1)}
    block_text = "\n".join(b.body for b in blocks)
    ci_lines = {line.split("#")[0].strip() for line in (root / ".ci" / "run").read_text().splitlines()}
    for i, line in enumerate(text.splitlines()):
      if i in in_block:
        continue
      for m in _INLINE.finditer(line):
        code = m.group(1).strip()
        exempt = "setup.sh" in code or code in ci_lines or code in block_text or _PATTERN.search(code)
        if COMMAND_START.match(code) and not exempt:
          found.append((f"{rel}:{i + 1}", code))
  return found


_SCRIPT = re.compile(r"\b(end_to_end/[\w/]+\.sh|benchmarks/\w+\.py)\b")


def scripts_without_block(root: Path = doc_blocks.REPO_ROOT) -> list[tuple[str, str]]:
  """(page, script) for each end-to-end script or benchmark a getting_started page names but holds in
  no fenced block."""
  found = []
  for path in doc_blocks.doc_paths(root):
    rel = str(path.relative_to(root))
    if rel == "README.md":
      continue
    text = path.read_text()
    blocks, _, _ = doc_blocks.fenced_blocks(text, rel)
    block_text = "\n".join(b.body for b in blocks)
    for script in sorted(set(_SCRIPT.findall(text))):
      if script not in block_text:
        found.append((rel, script))
  return found
