"""train.py with configs/sft.yml on generated "continue this line" conversations: the loss counts
exactly the assistant's tokens (prompt tokens carry zero weight), and the assistant-token
eval loss falls."""

from __future__ import annotations

import ast
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from MaxText.input_pipeline import chat
from tests.conftest import REPO_ROOT
from tests.compile_settings import cpu_xla_flags, jax_cache_env

pytest.importorskip("transformers", reason="needs transformers (EXTRAS=test bash setup.sh)")
sys.path.insert(0, str(Path(__file__).parent / "input_pipeline"))
from sft_fixtures import CHATML, WORDS, write_tokenizer, without_markers  # noqa: E402

# One device: the subject is the data and the loss, not sharding (and a starved 2-core machine
# can stall XLA:CPU's in-process collectives past their timeout).
MODEL = ["base_emb_dim=64", "base_num_decoder_layers=2", "base_mlp_dim=128", "head_dim=16", "max_target_length=96",
         "vocab_size=320", "print_config=False", "cpu_peak_tflops=0.1", "per_device_batch_size=4",
         "learning_rate=3e-3", "enable_checkpointing=False", "eval_steps=2", "data_prefetch_batches=0"]


def conversations(count: int, seed: int) -> list[dict]:
  rng = random.Random(seed)
  records = []
  for _ in range(count):
    start = rng.randrange(len(WORDS))
    line = [WORDS[(start + i) % len(WORDS)] for i in range(6)]  # the next words of a fixed cycle
    records.append({"messages": [{"role": "user", "content": "continue this line: " + " ".join(line[:3])},
                                 {"role": "assistant", "content": " ".join(line[3:])}]})
  return records


def write_jsonl(path: Path, records: list[dict]) -> Path:
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return path


def train(tmp_path: Path, *extra: str, records: list[dict] | None = None) -> subprocess.CompletedProcess:
  tokenizer = write_tokenizer(tmp_path / "tokenizer", without_markers(CHATML))
  records = conversations(512, 0) if records is None else records
  files = [f"hf_data_files={write_jsonl(tmp_path / 'train.jsonl', records)}",
           f"hf_eval_files={write_jsonl(tmp_path / 'eval.jsonl', conversations(16, 1))}"]
  command = [sys.executable, "-m", "MaxText.train", "configs/sft.yml", "run_name=sft", f"base_output_directory={tmp_path}",
             f"tokenizer_path={tokenizer}", *files, *MODEL, *extra]
  env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(1), "PATH": "/usr/bin:/bin",
         "HOME": str(Path.home()), "PYTHONPATH": str(REPO_ROOT), **jax_cache_env()}
  return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_sft_trains_on_assistant_tokens_only_and_eval_loss_falls(tmp_path):
  proc = train(tmp_path, "steps=40", "eval_interval=20")
  assert proc.returncode == 0, proc.stderr[-3000:]
  records = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
  # Each conversation's assistant turn is 3 words + <|im_end|> (the tokenizer is about one
  # character per token), far fewer than the prompt's tokens: packed rows of 96 tokens x 4 rows.
  counted = [r["num_tokens"] for r in records if "num_tokens" in r]
  assert counted and all(0 < n < 0.5 * 4 * 96 for n in counted), counted
  evals = [r["eval_loss"] for r in records if "eval_loss" in r]
  # Uniform guessing over the vocabulary scores ln(320) = 5.77.
  assert len(evals) == 2 and evals[0] < 0.6 * math.log(320) and evals[1] < 0.9 * evals[0], evals


@pytest.mark.parametrize("extra, message", [
    (["tokenizer_type=sentencepiece"], "objective=sft renders the model's chat template"),
    (["dataset_type=synthetic"], "objective=sft reads conversation records with dataset_type=hf"),
])
def test_sft_configuration_errors_are_one_line(tmp_path, extra, message):
  proc = train(tmp_path, "steps=1", *extra)
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
  assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], proc.stderr[-2000:]


@pytest.mark.slow  # the record-level error is in the default run (tests/input_pipeline/test_sft_data.py)
def test_a_conversation_without_an_assistant_turn_stops_the_run_in_one_line(tmp_path):
  records = conversations(8, 0) + [{"messages": [{"role": "user", "content": "to be"}]}]
  proc = train(tmp_path, "steps=4", "eval_interval=-1", "enable_data_shuffling=False", records=records)
  message = "an sft conversation has no assistant turn to train on (roles: user)"
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
  assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], proc.stderr[-2000:]


def _run(tmp_path: Path, module: str, *args: str) -> subprocess.CompletedProcess:
  env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(1), "PATH": "/usr/bin:/bin",
         "HOME": str(Path.home()), "PYTHONPATH": str(REPO_ROOT), **jax_cache_env()}
  proc = subprocess.run([sys.executable, "-m", module, "configs/base.yml", *args], cwd=REPO_ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


@pytest.mark.slow  # three processes: fine-tune, export parameters, decode
def test_fine_tuned_model_exports_and_answers_through_its_chat_template(tmp_path):
  proc = train(tmp_path, "steps=150", "eval_interval=-1", "enable_checkpointing=True", "checkpoint_period=150",
               "async_checkpointing=False")
  assert proc.returncode == 0, proc.stderr[-3000:]
  params = tmp_path / "params"
  common = [f"base_output_directory={tmp_path}", "run_name=sft", "tokenizer_type=huggingface",
            f"tokenizer_path={tmp_path / 'tokenizer'}",
            *MODEL[:-1]]
  _run(tmp_path, "MaxText.generate_param_only_checkpoint", *common, f"param_only_checkpoint_path={params}")
  out = _run(tmp_path, "MaxText.decode", *common, f"load_parameters_path={params}", "prompt_chat_template=True",
             f"prompt=continue this line: {' '.join(WORDS[:3])}", "max_prefill_predict_length=64").stdout
  tokenizer = chat.load_chat_tokenizer(str(tmp_path / "tokenizer"))
  ids = lambda name: ast.literal_eval(next(l for l in out.splitlines() if l.startswith(name)).removeprefix(name))  # noqa: E731
  rendered = f"<|im_start|>user\ncontinue this line: {' '.join(WORDS[:3])}<|im_end|>\n<|im_start|>assistant\n"
  assert ids("prompt ids: ") == tokenizer(rendered, add_special_tokens=False)["input_ids"]
  # The fine-tuned model continues the line and ends its turn.
  answer = tokenizer(f"{' '.join(WORDS[3:6])}<|im_end|>", add_special_tokens=False)["input_ids"]
  assert ids("generated ids: ")[:len(answer)] == answer, out


def truncated_line_6(path: Path) -> None:
  lines = path.read_text().splitlines()
  lines[5] = lines[5][:30]
  path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("extra, damage, message", [
    ([], truncated_line_6, "hf_data_files: {train} line 6: not valid JSON (Expecting property name enclosed in "
                           "double quotes at column 31); fix or remove that record"),
    (["max_target_length=8"], None, "every sft sample was dropped: none has a trained token within "
                                    "max_target_length + 1 = 9 tokens; max_target_length >= "),
], ids=["malformed-line", "all-dropped"])
def test_bad_data_stops_the_run_before_it_writes_anything(tmp_path, monkeypatch, extra, damage, message):
  """Found when the data opens or in the first batch, read before config.yml or any metric."""
  if damage is not None:
    def write_then_damage(path: Path, records: list[dict]) -> Path:
      path.write_text("".join(json.dumps(r) + "\n" for r in records))
      if path.name == "train.jsonl":
        damage(path)
      return path
    monkeypatch.setitem(globals(), "write_jsonl", write_then_damage)
  proc = train(tmp_path, "steps=2", *extra, records=conversations(16, 0))
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
  expected = "error: " + message.format(train=tmp_path / "train.jsonl")
  assert proc.returncode == 2 and len(errors) == 1 and errors[0].startswith(expected), proc.stderr[-2000:]
  assert not list((tmp_path / "sft").iterdir())  # no config.yml, config_history, metrics or lease
