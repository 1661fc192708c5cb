"""The commands in README.md and getting_started/*.md run as written and print what the docs quote.

Each fenced block is tagged (tests/doc_blocks.py lists the tags). One test per command block, id
file:line: `cpu` blocks run with bash in a fresh copy of the repository in a temporary directory
(the docs' commands assume the repository root as the current folder and write outputs/ there),
with only PATH and HOME from this process's environment (not the 8-device XLA_FLAGS of
conftest.py), within a time limit; the exit status and the quoted `output` lines are checked.
`slow` blocks run under -m slow. tpu/gpu/cloud/manual blocks are skipped with the reason, and
where the docs give a dry-run form (a `cpu dry-run` block after them) that block is what runs.
`ci` blocks must be commands .ci/run runs. The checker itself is shown to fail on a renamed key
and on a quoted line the command does not print.

The sample outputs come from the code: `python3 tests/regenerate_doc_outputs.py` reruns the blocks
with an output block and rewrites the quoted lines from what they print.
"""

from __future__ import annotations

import pytest

from tests import doc_blocks
from tests.doc_blocks import Block

BLOCKS, TAG_ERRORS = doc_blocks.all_blocks()
COMMANDS = [b for b in BLOCKS if b.kinds & doc_blocks.COMMAND_KINDS]


def _param(block: Block):
  return pytest.param(block, id=block.id, marks=[pytest.mark.slow] if block.slow else [])


def test_every_block_says_what_it_is():
  assert not TAG_ERRORS, "\n".join(TAG_ERRORS)
  assert COMMANDS and any("cpu" in b.kinds for b in COMMANDS)


@pytest.mark.parametrize("block", [_param(b) for b in COMMANDS])
def test_doc_command(block: Block, tmp_path):
  if "ci" in block.kinds:
    missing = doc_blocks.ci_commands_missing(block)
    assert not missing, f"{block.id}: .ci/run does not run {missing}; the docs promise CI runs it"
    return
  if "cpu" not in block.kinds:
    why = {"tpu": "needs a TPU", "gpu": "needs a GPU", "cloud": "needs gcloud, a bucket, a cluster or docker",
           "manual": "needs the reader's own files or an earlier run, or does not end"}
    reason = "needs a TPU or a GPU" if block.kinds == {"tpu", "gpu"} else why[min(block.kinds)]
    dry = f"; its dry-run form {block.dry_run.id} is tested" if block.dry_run else "; the docs give no dry-run form"
    pytest.skip(reason + dry)
  if "corpus" in block.tags and not doc_blocks.CORPUS.exists():
    pytest.skip(f"needs {doc_blocks.CORPUS} (the shared data beside the repository), which is absent")
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
  (block, _), _ = doc_blocks.parse(WRONG_OUTPUT_DOC, "wrong.md")
  result = doc_blocks.run(block, tmp_path)
  assert result.returncode == 0
  problem = doc_blocks.check(block, result)
  assert problem is not None and "done: steps 1..200" in problem
  block.output.body = "done: steps 1..100, loss 6.0686 -> 0.0915\n"  # floats may differ, integers not
  assert doc_blocks.check(block, result) is None


def test_untagged_and_misplaced_blocks_are_errors():
  _, errors = doc_blocks.parse("```\nls\n```\n\n```bash gpu\nnvidia-smi\n```\n```text output\nx\n```\n"
                               "```bash cpu fast\nls\n```\n", "bad.md")
  assert [e.split(": ", 1)[1][:20] for e in errors] == ["untagged block (```L", "an `output` block mu",
                                                         "unknown tag 'fast'"]


def test_quoted_lines_match_by_shape():
  printed = "noise\nstep      1 | loss   6.0686 |   5.438 s\nmesh: fsdp=4, tensor=2\nfits: 6.640 GiB of 16 GiB\n"
  assert doc_blocks.match_output("step 1 | loss 5.0000 | 0.4 s\n...\nfits: 7.1 GiB of 16 GiB\n", printed)[1] is None
  assert doc_blocks.match_output("mesh: fsdp=4, tensor=2\nstep 1 | loss 5.0 | 0.4 s\n", printed)[1] is not None
  assert doc_blocks.match_output("mesh: fsdp=8, tensor=2\n", printed)[1] is not None
  assert doc_blocks.match_output("mesh: ...tensor=2\nfits: ... of 16 GiB\n", printed)[1] is None
