"""Where each `sample` block of the docs comes from: the command that prints it.

A `sample` block shows output of a command the page does not give as a block of its own (a second run
that fails on purpose, an evaluation of a run, ...). Each one is either listed here, with the command
that prints it (run like a `cpu` block: bash -e in a fresh copy of the repository, the repository root
as the current folder), or says in its why= tag why no command here can print it. The
`test_docs_run.py::test_doc_sample` tests run the listed commands and compare (tolerances from the
block's tol= tag); `python3 tests/regenerate_doc_outputs.py --samples` rewrites the blocks from them.
A sample is found by its page and the start of its first line, which must pick exactly one block.
"""

from __future__ import annotations

import dataclasses

from tests import doc_blocks


@dataclasses.dataclass(frozen=True)
class Sample:
  path: str  # the page, relative to the repository root
  starts: str  # the sample block's first line starts with this
  command: str  # bash, from the repository root
  slow: bool = True  # over ~20 s on a 2-core machine: under -m slow
  corpus: bool = False  # reads ../shared/data/tinyshakespeare.txt
  timeout_s: int = doc_blocks.SLOW_TIMEOUT_S


_TINY = ("base_emb_dim=256 base_num_query_heads=4 base_num_kv_heads=4 base_mlp_dim=512 base_num_decoder_layers=2 "
         "vocab_size=256 max_target_length=256 per_device_batch_size=4")

SAMPLES: list[Sample] = [
    # A resume whose shape keys changed: the second start stops with exit 2 before touching anything.
    Sample("getting_started/Checkpoints.md", "error: cannot resume",
           "python3 -m MaxText.train configs/base.yml run_name=shape steps=6 checkpoint_period=6 base_emb_dim=256 "
           "print_config=False >/dev/null\n"
           "python3 -m MaxText.train configs/base.yml run_name=shape steps=8 base_emb_dim=128 print_config=False "
           "|| echo \"exit status $?\""),
    # The summary line every training run ends with.
    Sample("getting_started/Fault_tolerance.md", "goodput:",
           "python3 -m MaxText.train configs/base.yml run_name=goodput print_config=False"),
    # The evaluation line of First_run.md's run with eval_interval.
    Sample("getting_started/First_run.md", "eval ",
           "python3 -m MaxText.train configs/base.yml run_name=first eval_interval=100 print_config=False"),
    # A compiled step (for this machine's devices) loaded by a run with another width: refused before unpickling.
    Sample("getting_started/AOT.md", "error: compiled_trainstep_file",
           f"python3 -m MaxText.train_compile configs/base.yml compile_topology=local {_TINY} "
           "compiled_trainstep_file=step.aot >/dev/null\n"
           f"python3 -m MaxText.train configs/base.yml {_TINY.replace('base_emb_dim=256', 'base_emb_dim=128')} "
           "compiled_trainstep_file=step.aot print_config=False || echo \"exit status $?\""),
]


def sources(blocks: list[doc_blocks.Block], registry: list[Sample] | None = None,
            ) -> tuple[list[tuple[doc_blocks.Block, Sample]], list[str]]:
  """(sample block, where it comes from) for every listed sample, and what is wrong: a sample block with
  neither a listed command nor why=, with both, or a listed sample that picks no block or several."""
  samples = [b for b in blocks if "sample" in b.kinds]
  found: list[tuple[doc_blocks.Block, Sample]] = []
  errors: list[str] = []
  for s in SAMPLES if registry is None else registry:
    picked = [b for b in samples if b.path == s.path and b.body.lstrip().startswith(s.starts)]
    if len(picked) != 1:
      errors.append(f"tests/doc_samples.py: {s.path} sample starting {s.starts!r} picks {len(picked)} blocks, not 1")
    else:
      found.append((picked[0], s))
  listed = {b.id for b, _ in found}
  for b in samples:
    if b.id in listed and b.why:
      errors.append(f"{b.id}: a sample listed in tests/doc_samples.py takes no why=")
    elif b.id not in listed and not b.why:
      errors.append(f"{b.id}: a sample needs its command in tests/doc_samples.py or a why= saying why none can "
                    "print it here")
  return found, errors


def as_block(sample_block: doc_blocks.Block, source: Sample) -> doc_blocks.Block:
  """A `cpu` block running the sample's command, with the sample block as its output."""
  tags = ["cpu"] + (["slow"] if source.slow else []) + (["corpus"] if source.corpus else [])
  block = doc_blocks.Block(sample_block.path, sample_block.line, "bash", tags, source.command + "\n",
                           kinds={"cpu"}, timeout_s=source.timeout_s if source.slow else doc_blocks.CPU_TIMEOUT_S)
  block.outputs.append(sample_block)
  return block
