"""The commands in README.md and getting_started/*.md run as written and print what the docs quote.

Each fenced block is tagged (tests/doc_blocks.py lists the tags). One test per command block, id
file:line: `cpu` blocks run with bash in a fresh copy of the repository in a temporary directory
(the docs' commands assume the repository root as the current folder and write outputs/ there),
with only PATH and HOME from this process's environment (not the 8-device XLA_FLAGS of
conftest.py), within a time limit; the exit status and every `output` block after it are checked
(tests/doc_output.py: the quoted lines in order, `...` lines where the doc leaves lines out, figures
within the block's tol=). `slow` blocks run under -m slow. tpu/gpu/cloud/manual blocks are skipped
with the reason their why= gives (test_kept_out_blocks_say_why lists them all), and where the docs
give a runnable form (a `cpu dry-run` or `cpu local` block after them) that block is what runs.
`sample` blocks are compared with what the command tests/doc_samples.py names for them prints.
`ci` blocks must be commands .ci/run runs. The checker itself is shown to fail on a renamed key,
a quoted line the command does not print, a figure beyond its tolerance and a line left out.

`python3 tests/regenerate_doc_outputs.py` reruns the blocks and sample commands and rewrites the
quoted lines from what they print.
"""

from __future__ import annotations

import pytest

from tests import doc_blocks, doc_installs, doc_output, doc_prose, doc_samples, venv_install
from tests.doc_blocks import Block

BLOCKS, TAG_ERRORS = doc_blocks.all_blocks()
COMMANDS = [b for b in BLOCKS if b.kinds & doc_blocks.COMMAND_KINDS]
OWN_INSTALL = doc_installs.after_own_install(BLOCKS)
SAMPLES, SAMPLE_ERRORS = doc_samples.sources(BLOCKS)


def _param(block: Block):
  return pytest.param(block, id=block.id, marks=[pytest.mark.slow] if block.slow else [])


def test_every_block_says_what_it_is():
  assert not TAG_ERRORS, "\n".join(TAG_ERRORS)
  assert COMMANDS and any("cpu" in b.kinds for b in COMMANDS)


def test_every_sample_names_its_command_or_says_why_not():
  assert not SAMPLE_ERRORS, "\n".join(SAMPLE_ERRORS)


@pytest.mark.parametrize("sample,source", [
    pytest.param(b, s, id=b.id, marks=[pytest.mark.slow] if s.slow else []) for b, s in SAMPLES])
def test_doc_sample(sample: Block, source: doc_samples.Sample, tmp_path):
  """A sample is what its command prints now, within the block's tolerances: a stale one fails
  (`python3 tests/regenerate_doc_outputs.py --samples` rewrites them)."""
  if source.corpus and not doc_blocks.CORPUS.exists():
    pytest.skip(f"needs {doc_blocks.CORPUS} (the shared data beside the repository), which is absent")
  block = doc_samples.as_block(sample, source)
  problem = doc_blocks.check(block, doc_blocks.run(block, tmp_path))
  assert problem is None, problem


def test_no_command_stands_only_in_prose():
  found = doc_prose.prose_commands()
  assert not found, ("commands in prose that no tagged block holds (put each in a block: cpu, or kept out "
                     "with why=):\n" + "\n".join(f"  {where}: {code}" for where, code in found))


def test_every_script_a_page_names_stands_in_a_block():
  found = doc_prose.scripts_without_block()
  assert not found, ("end-to-end scripts and benchmarks a page names but runs in no tagged block (add one: cpu, "
                     "or kept out with why=):\n" + "\n".join(f"  {page}: {script}" for page, script in found))


def test_a_prose_command_is_found():
  assert doc_prose.COMMAND_START.match("python3 -m MaxText.train configs/base.yml")
  assert doc_prose.COMMAND_START.match("XLA_FLAGS=x python3 benchmarks/decode_bench.py slots=1")
  assert doc_prose.COMMAND_START.match("bash end_to_end/cpu/grpo.sh /tmp/x")
  assert not doc_prose.COMMAND_START.match("configs/base.yml")


def test_kept_out_blocks_say_why():
  """Lists every block the docs test does not run, with its reason; fails where one gives none."""
  listed = doc_blocks.kept_out(BLOCKS)
  print(f"\n{len(listed)} blocks are kept out of the run:")
  for b in listed:
    print(f"  {b.id} [{' '.join(sorted(b.kinds))}]: {b.why or 'NO REASON GIVEN'}"
          + (f" (its runnable form: {b.dry_run.id})" if b.dry_run else ""))
  assert all(b.why for b in listed), "blocks kept out without why=: " + ", ".join(b.id for b in listed if not b.why)


@pytest.mark.parametrize("block", [_param(b) for b in COMMANDS])
def test_doc_command(block: Block, tmp_path):
  if "ci" in block.kinds:
    missing = doc_blocks.ci_commands_missing(block)
    assert not missing, f"{block.id}: .ci/run does not run {missing}; the docs promise CI runs it"
    return
  if "cpu" not in block.kinds:
    dry = f"; its runnable form {block.dry_run.id} is tested" if block.dry_run else ""
    pytest.skip(f"{' '.join(sorted(block.kinds))}: {block.why or 'no reason given'}{dry}")
  if "corpus" in block.tags and not doc_blocks.CORPUS.exists():
    pytest.skip(f"needs {doc_blocks.CORPUS} (the shared data beside the repository), which is absent")
  if block.id in OWN_INSTALL and venv_install.skip_reason() is None:
    pytest.skip(f"runs after {doc_installs.describe(OWN_INSTALL[block.id])} alone, in tests/test_page_installs.py")
  problem = doc_blocks.check(block, doc_blocks.run(block, tmp_path))
  assert problem is None, problem


# The checker can fail.

BROKEN_DOC = """\
```bash cpu
python3 -m MaxText.train configs/base.yml run_name=doc steps=2 log_every=1 print_config=False
```

```text output
done: steps 1..2, loss 6.0686 -> 6.0455; metrics in outputs/doc
```
"""

WRONG_OUTPUT_DOC = """\
```bash cpu
echo "done: steps 1..100, loss 6.1 -> 0.09"
```

```text output
done: steps 1..200, loss 6.0686 -> 0.0915
```
"""


def test_a_renamed_key_in_a_doc_fails_the_check(tmp_path):
  (block, _), errors = doc_blocks.parse(BROKEN_DOC, "broken.md")
  assert not errors
  problem = doc_blocks.check(block, doc_blocks.run(block, tmp_path))
  assert problem is not None and "exit status 2" in problem and "unknown config key 'log_every'" in problem


def test_a_quoted_line_the_command_does_not_print_fails_the_check(tmp_path):
  (block, out), _ = doc_blocks.parse(WRONG_OUTPUT_DOC, "wrong.md")
  result = doc_blocks.run(block, tmp_path)
  assert result.returncode == 0
  problem = doc_blocks.check(block, result)
  assert problem is not None and "done: steps 1..200" in problem
  out.body = "done: steps 1..100, loss 6.0686 -> 0.0915\n"  # figures exact without tol=
  assert "6.0686 is printed as 6.1" in doc_blocks.check(block, result)
  out.tolerances = doc_output.parse_tolerances("loss:0.1")  # the figure after `loss` only
  assert "0.0915 is printed as 0.09, beyond its no tolerance" in doc_blocks.check(block, result)
  out.tolerances = doc_output.parse_tolerances("loss:0.1,*:0.002")
  assert doc_blocks.check(block, result) is None


def test_untagged_and_misplaced_blocks_are_errors():
  _, errors = doc_blocks.parse("```\nls\n```\n\n```bash gpu why=x\nnvidia-smi\n```\n```text output\nx\n```\n"
                               "```bash cpu fast\nls\n```\n```bash tpu\nls\n```\n```text output tol=loss\nx\n```\n"
                               "```bash cpu after=nobody\nls\n```\n", "bad.md")
  assert [e.split(": ", 1)[1][:20] for e in errors] == [
      "untagged block (```L", "an `output` block mu", "unknown tag 'fast'", "tpu block without wh",
      "tolerance entry 'los", "an `output` block mu", "after=nobody: no blo"]


def test_figures_are_compared_within_their_tolerance():
  printed = "step      1 | loss   6.0686 |   5.438 s | MFU 39.93%\nfits: 6.640 GiB of 16 GiB\n"
  tol = doc_output.parse_tolerances("loss:2e-3,GiB:1%,MFU:0.5,s:any")
  match = doc_output.match_output
  assert match("step 1 | loss 6.0700 | 0.4 s | MFU 40.4%\nfits: 6.7 GiB of 16 GiB\n", printed, tol).problem is None
  assert "6.0800 is printed as 6.0686" in match("step 1 | loss 6.0800 | 0.4 s | MFU 40%\n", printed, tol).problem
  assert "40.5 is printed as 39.93" in match("step 1 | loss 6.07 | 0.4 s | MFU 40.5%\n", printed, tol).problem
  assert "6.8 is printed as 6.640" in match("fits: 6.8 GiB of 16 GiB\n", printed, tol).problem
  assert match("fits: 6.640 GiB of 17 GiB\n", printed, tol).problem is not None  # GiB:1% allows 16.17 only
  assert match("fits: 6.64 GiB of 16 GiB\n", printed).problem is None  # exact by value
  assert match("fits: 6.65 GiB of 16 GiB\n", printed).problem is not None
  assert match("step 1 | loss 6.0686 | 5.438 s | MFU 39.93%\n", printed, {"*": doc_output.Tolerance(any=True)},
               ).problem is None


def test_quoted_lines_match_in_order_and_elisions_are_marked():
  printed = "noise\nstep      1 | loss   6.0686\nmesh: fsdp=4, tensor=2\nfits: 6.640 GiB of 16 GiB\nend\n"
  match = doc_output.match_output
  assert match("step 1 | loss 6.0686\n...\nfits: 6.640 GiB of 16 GiB\n", printed).problem is None
  assert match("step 1 | loss 6.0686\nmesh: ...tensor=2\n\nfits: ... of 16 GiB\n", printed).problem is None
  problem = match("step 1 | loss 6.0686\nfits: 6.640 GiB of 16 GiB\n", printed).problem  # a line left out, no ...
  assert problem is not None and "mesh: fsdp=4" in problem and "`...`" in problem
  assert match("mesh: fsdp=4, tensor=2\nstep 1 | loss 6.0686\n", printed).problem is not None  # order
  assert match("mesh: fsdp=8, tensor=2\n", printed).problem is not None
  assert match("...\nfits: 6.640 GiB of 16 GiB\n...\n", printed).problem is None
  assert [q for q, _ in match("mesh: fsdp=4, tensor=2\n...\nend\n", printed).pairs] == [
      "mesh: fsdp=4, tensor=2", "end"]


def test_after_runs_the_named_block_first_in_the_same_directory(tmp_path):
  doc = ("```bash cpu name=make\necho made > made.txt\n```\n\n```bash cpu after=make\ncat made.txt\n```\n\n"
         "```text output\nmade\n```\n")
  blocks, errors = doc_blocks.parse(doc, "after.md")
  assert not errors and blocks[1].after is blocks[0] and blocks[1].outputs == [blocks[2]]
  assert doc_blocks.check(blocks[1], doc_blocks.run(blocks[1], tmp_path)) is None


def test_a_sample_needs_its_command_or_a_reason():
  blocks, _ = doc_blocks.parse("```text sample\nx\n```\n\n```text sample why=\"a fault the tests inject\"\ny\n```\n",
                               "samples.md")
  found, errors = doc_samples.sources(blocks, registry=[])
  assert not found and len(errors) == 1 and errors[0].startswith("samples.md:1: a sample needs its command")
  assert [b.id for b in doc_blocks.kept_out(blocks)] == ["samples.md:5"]
