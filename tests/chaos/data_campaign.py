"""A seeded fault campaign over the data readers: for every dataset_type that reads the user's files
(hf: JSONL, JSON, parquet, text, CSV; stream: JSONL, JSON, parquet, ArrayRecord; grain: ArrayRecord;
tfds: a prepared dataset's shard and its dataset_info.json; GRPO's prompt records), a file of good
documents is damaged by each fault and read back. Every case must either give the right documents
or fail with one UserError line naming the damaged file: no traceback, no documents silently wrong.

    python3 -m tests.chaos.data_campaign --seed 0 [--cli]

Faults: garbage (the whole file random bytes), garbage_inside (a run of random bytes over the middle
of a good file), bom (a UTF-8 byte order mark before the content), truncated (the file cut inside
its last record), empty (0 bytes), wrong_format (another format's bytes under this file's suffix).
The right documents are the file's own: all of them after a BOM; after a cut, those before it (a
text line may keep its cut-off start); after garbage inside, all of them (the bytes hit padding
or an index the reader does not need), never others.

Most cases call the reader directly (the same code train.py runs, with an encoder that keeps the
text); CLI_CASES run `MaxText.train` in a subprocess and also check exit code 2, one `error:` line
on stderr, no traceback, and that the run directory holds no file.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from tests.compile_settings import cpu_xla_flags, jax_cache_env

REPO_ROOT = Path(__file__).resolve().parents[2]
FAULTS = ("garbage", "garbage_inside", "bom", "truncated", "empty", "wrong_format")
# The formats each reader takes (tfds: "array_record" is the train shard, "dataset_info" its metadata).
READERS = {"hf": ("jsonl", "json", "parquet", "txt", "csv"), "stream": ("jsonl", "json", "parquet", "array_record"),
           "grain": ("array_record",), "tfds": ("array_record", "dataset_info"), "grpo": ("jsonl", "json", "parquet")}
TEXT_FORMATS = ("jsonl", "json", "txt", "csv", "dataset_info")
NUM_DOCS = 40
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()
BOM = b"\xef\xbb\xbf"
# Train runs that must stop with one line: (reader, format, fault, what the line says, whether the
# run stops before it writes anything). A stream parses a record only when it reaches it: a bad line
# in the middle of a shard stops a run that has already trained on the records before it.
CLI_CASES = (("stream", "parquet", "garbage", "is not a readable parquet file", True),
             ("stream", "jsonl", "garbage", "line 1: not valid JSON", True),
             ("stream", "jsonl", "garbage_inside", "not valid JSON", False),
             ("mixture", "jsonl", "empty", "is empty", True),
             ("grpo", "jsonl", "empty", "is empty", True))
MODEL_SHAPE = dict(base_emb_dim=64, base_num_decoder_layers=1, base_mlp_dim=128, head_dim=16, vocab_size=320)
CLI_MODEL = [*(f"{k}={v}" for k, v in MODEL_SHAPE.items()), "max_target_length=32", "print_config=False",
             "cpu_peak_tflops=0.1", "steps=2", "learning_rate_schedule_steps=2", "tokenizer_type=huggingface"]


@dataclasses.dataclass(frozen=True)
class Case:
  reader: str
  format: str
  fault: str

  def __str__(self) -> str:
    return f"{self.reader}/{self.format}/{self.fault}"


@dataclasses.dataclass
class Outcome:
  case: Case
  result: str = ""  # "documents" | "error" | "crash"
  message: str = ""
  problems: list[str] = dataclasses.field(default_factory=list)


def documents(rng: random.Random) -> list[str]:
  """Texts of a few words each: no commas, quotes or newlines, so every format holds them as is."""
  return [f"doc {i} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) for i in range(NUM_DOCS)]


def _array_record_bytes(records: list[bytes], scratch: Path) -> bytes:
  from array_record.python.array_record_module import ArrayRecordWriter

  path = scratch / "scratch.array_record"
  writer = ArrayRecordWriter(str(path), "group_size:1")
  for record in records:
    writer.write(record)
  writer.close()
  data = path.read_bytes()
  path.unlink()
  return data


def encode(fmt: str, docs: list[str], scratch: Path, column: str = "text") -> bytes:
  """The good file of `docs` in `fmt`, their text under `column`."""
  if fmt == "jsonl":
    return "".join(json.dumps({column: d}) + "\n" for d in docs).encode()
  if fmt == "json":  # one pretty-printed array, as `datasets` also reads
    return (json.dumps([{column: d} for d in docs], indent=2) + "\n").encode()
  if fmt == "txt":
    return "".join(d + "\n" for d in docs).encode()
  if fmt == "csv":
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([column])
    writer.writerows([d] for d in docs)
    return out.getvalue().encode()
  if fmt == "parquet":
    out = io.BytesIO()
    pq.write_table(pa.table({column: docs}), out)
    return out.getvalue()
  assert fmt == "array_record", fmt
  return _array_record_bytes([json.dumps({column: d}).encode() for d in docs], scratch)


def garbage(rng: random.Random, size: int) -> bytes:
  # 0xFF never occurs in UTF-8: the bytes cannot pass for text by chance.
  return b"\xff" + bytes(rng.randrange(256) for _ in range(size - 1))


def damage(fault: str, fmt: str, good: bytes, rng: random.Random, scratch: Path) -> bytes:
  if fault == "garbage":
    return garbage(rng, rng.randint(64, 4096))
  if fault == "garbage_inside":
    at, size = rng.randint(len(good) // 4, len(good) // 2), rng.randint(8, 64)
    return good[:at] + garbage(rng, size) + good[at + size:]
  if fault == "bom":
    return BOM + good
  if fault == "truncated":
    body = good.rstrip(b"\n")
    if fmt in ("json", "dataset_info"):  # somewhere in the last third, before the closing bracket
      return body[:rng.randint(len(body) * 2 // 3, len(body) - 2)]
    if fmt in TEXT_FORMATS:  # inside the last line
      last = body.rfind(b"\n") + 1
      return body[:rng.randint(last + 1, len(body) - 1)]
    return good[:len(good) - rng.randint(1, len(good) // 2)]
  if fault == "empty":
    return b""
  assert fault == "wrong_format", fault
  if fmt in ("parquet", "array_record"):
    return encode("jsonl", ["some text"], scratch)
  return encode("parquet", ["some text"], scratch)


def right_documents(fault: str, docs: list[str], got: list[Any]) -> bool:
  if fault in ("bom", "garbage_inside"):
    return got == docs
  if fault == "truncated":
    head, tail = got[:len(docs) - 1], got[len(docs) - 1:]
    return head == docs[:-1] and (not tail or (len(tail) == 1 and docs[-1].startswith(tail[0]) and tail[0] != ""))
  return False  # garbage, an empty file, another format: there is nothing right to train on


class Campaign:
  """Writes each case's files under `workdir` and reads them with the reader under test."""

  def __init__(self, seed: int, workdir: Path):
    self.seed, self.workdir = seed, workdir
    self.docs = documents(random.Random(seed))
    self._tfds: Path | None = None
    self._tfds_docs: list[str] = []
    self._grpo_tokenizer: Path | None = None

  # ---- readers, called directly ------------------------------------------------------------------

  def read(self, case: Case, path: Path, root: Path) -> list[Any]:
    """Every document the reader gives for `path` (tfds: the dataset under `root`)."""
    from MaxText.input_pipeline import grain, hf, pipeline, streaming, tfds

    shard = pipeline.HostShard(0, 1, 1)
    if case.reader == "stream":
      stream = streaming.ShardStream("stream_train_files", str(path), shard, _keep, "text", None, False,
                                     f"the train data (stream {path})")
      return [located.document for located in stream.read_from(0)]
    if case.reader == "grpo":
      return self._prompts(path)
    locate = None
    if case.reader == "hf":
      source, describe = hf.open_split("", str(path), "train", "hf_data_files")
      locate = hf.record_locator("", "hf_data_files", str(path))
    elif case.reader == "grain":
      source, describe = grain.open_files("grain_train_files", str(path))
    else:
      source, describe = tfds.open_split("local_text/corpus", str(root), "train")
    dataset = pipeline.document_dataset(source, shard, _keep, "text", None, False, f"the train data ({describe})",
                                        locate)
    return [dataset[i] for i in range(len(dataset))]

  def _prompts(self, path: Path) -> list[Any]:
    from MaxText.configuration.config import Config
    from MaxText.input_pipeline import chat
    from MaxText.rl import prompts

    tokenizer = self.grpo_tokenizer()
    config = Config.for_testing(objective="grpo", dataset_type="hf", hf_data_files=str(path),
                                tokenizer_path=str(tokenizer), tokenizer_type="huggingface", vocab_size=320,
                                reward_functions="exact_match", num_generations=4, max_prefill_predict_length=200,
                                max_completion_length=8, max_target_length=256, eval_interval=-1, print_config=False,
                                rl_prompt_column="text", enable_data_shuffling=False)
    prompt_set = prompts.PromptSet(config, chat.load_chat_tokenizer(str(tokenizer), require_template=False))
    return [p.prompt for p in prompt_set.prompts]

  def grpo_tokenizer(self) -> Path:
    if self._grpo_tokenizer is None:
      from tests.input_pipeline.sft_fixtures import write_tokenizer

      self._grpo_tokenizer = write_tokenizer(self.workdir / "tokenizer", None)
    return self._grpo_tokenizer

  def _prepared_tfds(self) -> tuple[Path, list[str]]:
    """The documents prepared once as a TFDS dataset, and those of its train split (as read undamaged)."""
    if self._tfds is None:
      from MaxText.input_pipeline import prepare_data

      source = self.workdir / "tfds-source" / "corpus.txt"
      source.parent.mkdir(parents=True)
      source.write_text("\n\n".join(self.docs) + "\n")
      assert prepare_data.main(["prepare_data", "--input", str(source), "--output_dir", str(source.parent / "out"),
                                "--formats", "tfds", "--eval_fraction", "0.1"]) == 0
      self._tfds = source.parent / "out" / "tfds"
      self._tfds_docs = sorted(self.read(Case("tfds", "", ""), self._tfds, self._tfds))
    return self._tfds, self._tfds_docs

  # ---- one case --------------------------------------------------------------------------------

  def files(self, case: Case, rng: random.Random) -> tuple[Path, Path, list[str]]:
    """(the damaged file, the directory to read, the documents it held before the damage)."""
    root = self.workdir / str(case).replace("/", "-")
    root.mkdir(parents=True)
    if case.reader == "tfds":
      prepared, docs = self._prepared_tfds()
      shutil.copytree(prepared, root, dirs_exist_ok=True)
      name = "dataset_info.json" if case.format == "dataset_info" else "local_text-train.array_record-00000-of-00001"
      path = next(root.rglob(name))
      path.write_bytes(damage(case.fault, case.format, path.read_bytes(), rng, root))
      return path, root, docs
    suffix = {"jsonl": ".jsonl", "json": ".json", "parquet": ".parquet", "txt": ".txt", "csv": ".csv",
              "array_record": ".array_record"}[case.format]
    path = root / f"data{suffix}"
    path.write_bytes(damage(case.fault, case.format, encode(case.format, self.docs, root), rng, root))
    return path, root, self.docs

  def run(self, case: Case) -> Outcome:
    from MaxText.errors import UserError

    rng = random.Random(f"{self.seed}/{case}")
    path, root, docs = self.files(case, rng)
    outcome = Outcome(case)
    try:
      got = self.read(case, path, root)
    except UserError as e:
      outcome.result, outcome.message = "error", str(e)
      if "\n" in outcome.message:
        outcome.problems.append(f"the error spans {outcome.message.count(chr(10)) + 1} lines")
      if str(path) not in outcome.message:
        outcome.problems.append(f"the error does not name {path.name}: {outcome.message[:300]}")
      return outcome
    except Exception as e:  # noqa: BLE001 - what the campaign looks for: a traceback instead of a line
      outcome.result, outcome.message = "crash", f"{type(e).__name__}: {str(e)[:300]}"
      outcome.problems.append(f"raised {outcome.message}, not one error line")
      return outcome
    outcome.result = "documents"
    if case.reader == "tfds":  # TFDS keeps its own record order
      got = sorted(got)
    if not right_documents(case.fault, docs, got):
      outcome.problems.append(f"trained {len(got)} documents that are not the file's ({got[:2]}...)")
    return outcome

  # ---- through train.py ----------------------------------------------------------------------------

  def run_cli(self, reader: str, fmt: str, fault: str, expected: str, before_writing: bool) -> Outcome:
    case = Case(reader, fmt, fault)
    outcome = Outcome(case)
    rng = random.Random(f"{self.seed}/cli/{case}")
    root = self.workdir / f"cli-{reader}-{fmt}-{fault}"
    root.mkdir(parents=True)
    path = root / f"data.{fmt}"
    tokenizer = self.grpo_tokenizer()
    column = "prompt" if reader == "grpo" else "text"
    path.write_bytes(damage(fault, fmt, encode(fmt, self.docs, root, column), rng, root))
    out = root / "out"
    config, data = "configs/base.yml", [f"tokenizer_path={tokenizer}"]
    if reader == "stream":
      data += ["dataset_type=stream", f"stream_train_files={path}"]
    elif reader == "mixture":
      good = root / "good.jsonl"
      good.write_bytes(encode("jsonl", self.docs, root))
      data += ["dataset_type=hf", f"hf_data_files={good}",
               f"data_mixture=[{{name: good, weight: 1, hf_data_files: {good}}}, "
               f"{{name: bad, weight: 1, hf_data_files: {path}}}]"]
    else:
      config = "configs/grpo.yml"
      data += [f"hf_data_files={path}", "reward_functions=exact_match", "num_generations=4",
               "max_prefill_predict_length=16", "max_completion_length=8", "per_device_batch_size=4",
               f"load_parameters_path={self.grpo_policy()}"]
    command = [sys.executable, "-m", "MaxText.train", config, "run_name=bad", f"base_output_directory={out}",
               *CLI_MODEL, *data]
    environment = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(1), "PATH": "/usr/bin:/bin",
                   "HOME": str(Path.home()), "PYTHONPATH": str(REPO_ROOT), **jax_cache_env()}
    proc = subprocess.run(command, cwd=REPO_ROOT, env=environment, capture_output=True, text=True, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    outcome.result, outcome.message = "error" if proc.returncode == 2 else "crash", " | ".join(errors)
    if proc.returncode != 2:
      outcome.problems.append(f"exit code {proc.returncode}, not 2: {proc.stderr[-1500:]}")
    if len(errors) != 1:
      outcome.problems.append(f"{len(errors)} error lines: {errors[:3]}")
    elif str(path) not in errors[0] or expected not in errors[0]:
      outcome.problems.append(f"the error line does not name {path} or say {expected!r}: {errors[0][:300]}")
    if "Traceback" in proc.stderr:
      outcome.problems.append("a traceback on stderr")
    written = [str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()] if out.exists() else []
    if written and before_writing:
      outcome.problems.append(f"the failed run wrote {written[:5]}")
    return outcome

  def grpo_policy(self) -> Path:
    """Initial parameters of CLI_MODEL's model (GRPO starts from a policy's weights)."""
    path = self.workdir / "policy"
    if not path.exists():
      import jax

      from MaxText.configuration.config import Config
      from MaxText import models
      from MaxText.training import params_io

      config = Config.for_testing(**MODEL_SHAPE)
      params_io.save_params(str(path), jax.jit(models.build_model_spec(config.model).init_params)(jax.random.key(0)))
    return path


def _keep(text: Any) -> Any:
  return text


def cases() -> list[Case]:
  return [Case(reader, fmt, fault) for reader, formats in READERS.items() for fmt in formats for fault in FAULTS]


def run_campaign(seed: int, workdir: Path, cli: bool = True,
                 report: Callable[[Outcome], None] | None = None) -> tuple[list[Outcome], dict[str, Any]]:
  started = time.time()
  campaign = Campaign(seed, workdir)
  outcomes = []
  for case in cases():
    outcomes.append(campaign.run(case))
    if report:
      report(outcomes[-1])
  if cli:
    for cli_case in CLI_CASES:
      outcomes.append(campaign.run_cli(*cli_case))
      if report:
        report(outcomes[-1])
  summary = {"seed": seed, "cases": len(outcomes), "seconds": round(time.time() - started, 1),
             "documents": sum(o.result == "documents" for o in outcomes),
             "errors": sum(o.result == "error" for o in outcomes),
             "failed": [str(o.case) for o in outcomes if o.problems]}
  return outcomes, summary


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--cli", action="store_true", help="also run the train.py cases (a few seconds each)")
  parser.add_argument("--workdir", default="", help="where the damaged files go (default: a temporary directory)")
  args = parser.parse_args()
  import tempfile

  with tempfile.TemporaryDirectory(prefix="data-campaign-") as tmp:
    workdir = Path(args.workdir or tmp)

    def report(o: Outcome) -> None:
      status = "ok " if not o.problems else "BAD"
      print(f"{status} {o.case}: {o.result}: {'; '.join(o.problems) or o.message[:160]}", flush=True)

    _, summary = run_campaign(args.seed, workdir, args.cli, report)
  print(json.dumps(summary))
  return 1 if summary["failed"] else 0


if __name__ == "__main__":
  sys.exit(main())
