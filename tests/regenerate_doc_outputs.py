"""Rerun the docs' `cpu` blocks and rewrite their quoted output lines from what they print.

  python3 tests/regenerate_doc_outputs.py                      # every cpu block (slow ones too)
  python3 tests/regenerate_doc_outputs.py --quick              # without the slow ones
  python3 tests/regenerate_doc_outputs.py getting_started/AOT.md:9 First_run   # blocks by id or file
  python3 tests/regenerate_doc_outputs.py --check              # report only, write nothing

Each quoted line of an `output` block is replaced by the printed line it matches (tests/doc_blocks.py:
same text, any number where the doc has a decimal one). Lines with `...` stay as written: they
elide on purpose. A quoted line that no printed line matches is reported and its block left alone;
change the doc by hand then. Runs one block at a time; --log-dir keeps each block's full output.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests import doc_blocks  # noqa: E402


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("select", nargs="*", help="block ids (file:line) or parts of file names; default all")
  parser.add_argument("--quick", action="store_true", help="leave out the slow blocks")
  parser.add_argument("--check", action="store_true", help="run and report, rewrite nothing")
  parser.add_argument("--log-dir", type=Path, help="write each block's output to LOG_DIR/<file>_<line>.log")
  args = parser.parse_args()

  blocks, errors = doc_blocks.all_blocks()
  if errors:
    print("\n".join(errors))
    return 2
  chosen = [b for b in blocks if "cpu" in b.kinds and not (args.quick and b.slow)
            and (not args.select or any(s == b.id or (":" not in s and s in b.path) for s in args.select))]
  edits: dict[str, list[tuple[doc_blocks.Block, list[tuple[str, str]]]]] = {}
  failed = 0
  for block in chosen:
    print(f"{block.id}: running{' (slow)' if block.slow else ''} ...", flush=True)
    with tempfile.TemporaryDirectory(prefix="docrun") as tmp:
      result = doc_blocks.run(block, Path(tmp))
    if args.log_dir:
      args.log_dir.mkdir(parents=True, exist_ok=True)
      (args.log_dir / f"{block.id.replace('/', '_').replace(':', '_')}.log").write_text(result.output)
    problem = doc_blocks.check(block, result)
    print(f"{block.id}: {'ok' if problem is None else 'FAILED'} in {result.seconds:.0f} s", flush=True)
    if problem is not None:
      failed += 1
      print(problem)
      continue
    if block.output is not None:
      pairs, _ = doc_blocks.match_output(block.output.body, result.output)
      edits.setdefault(block.path, []).append((block, pairs))

  if not args.check:
    for path, file_edits in edits.items():
      lines = (doc_blocks.REPO_ROOT / path).read_text().splitlines(keepends=True)
      for block, pairs in file_edits:
        # The output block's lines follow its fence; each quoted line is replaced once, in order.
        at = block.output.line
        for quoted, printed in pairs:
          if "..." in quoted:
            continue
          while lines[at].rstrip("\n") != quoted:
            at += 1
          lines[at] = printed.rstrip() + "\n"
          at += 1
      (doc_blocks.REPO_ROOT / path).write_text("".join(lines))
      print(f"rewrote the quoted output in {path}")
  print(f"{len(chosen) - failed} of {len(chosen)} blocks ok")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
