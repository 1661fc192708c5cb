"""Rerun the docs' `cpu` blocks and `sample` commands and rewrite their quoted lines from what they print.

  python3 tests/regenerate_doc_outputs.py                      # every cpu block and sample (slow ones too)
  python3 tests/regenerate_doc_outputs.py --quick              # without the slow ones
  python3 tests/regenerate_doc_outputs.py getting_started/AOT.md:9 First_run   # blocks by id or file
  python3 tests/regenerate_doc_outputs.py --check              # report only, write nothing
  python3 tests/regenerate_doc_outputs.py --samples            # only the samples (tests/doc_samples.py)

One script for both kinds of quoted output: an `output` block is checked against the `cpu` block above
it, a `sample` block against the command tests/doc_samples.py names for it. Each quoted line is
replaced by the printed line it matched (tests/doc_output.py: same shape; figures are rewritten even
within their tolerance, so the docs show one real run). Lines with `...` stay as written: they elide on
purpose. A block whose quoted lines do not match (a line gone, a new line between two quoted ones)
is reported and left alone: change the doc by hand then (add a `...` line where it leaves lines out).
Runs one block at a time; --log-dir keeps each run's full output.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests import doc_blocks, doc_output, doc_samples  # noqa: E402


def rewrite(path: str, edits: list[tuple[doc_blocks.Block, list[tuple[str, str]]]]) -> None:
  """Replaces, in each quoted block, the quoted lines by the printed lines they matched."""
  lines = (doc_blocks.REPO_ROOT / path).read_text().splitlines(keepends=True)
  for quoted_block, pairs in edits:
    at = quoted_block.line  # the first line after the opening fence (0-based)
    for quoted, printed in pairs:
      while lines[at].strip() != quoted:
        at += 1
      if "..." not in quoted:
        lines[at] = printed.rstrip() + "\n"
      at += 1
  (doc_blocks.REPO_ROOT / path).write_text("".join(lines))


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("select", nargs="*", help="block ids (file:line) or parts of file names; default all")
  parser.add_argument("--quick", action="store_true", help="leave out the slow blocks")
  parser.add_argument("--check", action="store_true", help="run and report, rewrite nothing")
  parser.add_argument("--samples", action="store_true", help="only the sample blocks")
  parser.add_argument("--log-dir", type=Path, help="write each block's output to LOG_DIR/<file>_<line>.log")
  args = parser.parse_args()

  blocks, errors = doc_blocks.all_blocks()
  sources, sample_errors = doc_samples.sources(blocks)
  if errors or sample_errors:
    print("\n".join(errors + sample_errors))
    return 2
  # (what runs, the quoted blocks it checks)
  jobs = [] if args.samples else [(b, b.outputs) for b in blocks if "cpu" in b.kinds]
  jobs += [(doc_samples.as_block(sample, source), [sample]) for sample, source in sources]
  chosen = [(b, quoted) for b, quoted in jobs if not (args.quick and b.slow) and (
      not args.select or any(s in (b.id, *(q.id for q in quoted)) or (":" not in s and s in b.path)
                             for s in args.select))]
  edits: dict[str, list[tuple[doc_blocks.Block, list[tuple[str, str]]]]] = {}
  failed = 0
  for block, quoted_blocks in chosen:
    print(f"{block.id}: running{' (slow)' if block.slow else ''} ...", flush=True)
    with tempfile.TemporaryDirectory(prefix="docrun") as tmp:
      result = doc_blocks.run(block, Path(tmp))
    if args.log_dir:
      args.log_dir.mkdir(parents=True, exist_ok=True)
      (args.log_dir / f"{block.id.replace('/', '_').replace(':', '_')}.log").write_text(result.output)
    print(f"{block.id}: exit status {result.returncode} in {result.seconds:.0f} s", flush=True)
    if result.returncode != block.exit_code:
      failed += 1
      print(doc_blocks.check(block, result))
      continue
    for quoted in quoted_blocks:
      # Shape first: the figures are what this script rewrites.
      match = doc_output.match_output(quoted.body, result.output, {"*": doc_output.Tolerance(any=True)})
      if match.problem is not None:
        failed += 1
        print(f"{quoted.id}: FAILED: {match.problem}")
        continue
      within = doc_blocks.compare(quoted, result.output, block.id)
      print(f"{quoted.id}: {'ok' if within is None else 'figures beyond their tolerance, rewritten: ' + within}")
      edits.setdefault(quoted.path, []).append((quoted, match.pairs))

  if not args.check:
    for path, file_edits in edits.items():
      rewrite(path, file_edits)
      print(f"rewrote the quoted output in {path}")
  print(f"{len(chosen) - failed} of {len(chosen)} runs ok")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
