"""The tools around training with their paths on gs:// (a real GCS JSON API on 127.0.0.1): the
checkpoint converters and the logit checker, tokenizers, the hf data reader, saved compiled steps,
decode from a bucket, and one-line errors for files missing from a bucket."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import hf_families as H
from MaxText import decode, generate_param_only_checkpoint, logit_checker, startup, train
from MaxText.training import compiled_step
from MaxText.platform import sharding
from MaxText.paths import storage
from MaxText import train_compile, train_tokenizer
from MaxText.configuration.config import BASE_CONFIG_PATH, Config
from MaxText.convert import hf_to_maxtext, maxtext_to_hf
from MaxText.errors import ConfigError, UserError
from MaxText.input_pipeline import create_data_iterator
from MaxText.input_pipeline.files import expand_files
from MaxText.input_pipeline.tokenizer import load_tokenizer
from tests.conftest import REPO_ROOT, SHAKESPEARE
from tests.input_pipeline.data_fixtures import numbered_documents
from tests.compile_settings import cpu_xla_flags, jax_cache_env

BASE = str(BASE_CONFIG_PATH)
TEXT = "doc 3 alpha bravo charlie"


def cli_env(gcs) -> dict:
  """What a user's shell gives a CLI: the emulator address only (the tools configure the rest)."""
  return {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(1),
          "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(Path.home()), "PYTHONPATH": str(REPO_ROOT),
          **gcs.env(), **jax_cache_env()}


def run_cli(gcs, module: str, *args: str, expect: int = 0) -> subprocess.CompletedProcess:
  proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT, env=cli_env(gcs), capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == expect, proc.stdout[-2000:] + proc.stderr[-3000:]
  return proc


def one_error_line(proc: subprocess.CompletedProcess) -> str:
  lines = [line for line in proc.stderr.splitlines() if line.startswith("error")]
  assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  return lines[0]


@pytest.fixture(scope="module")
def bucket(gcs) -> str:
  """One bucket for the module's shared files (tests write under their own prefixes)."""
  return f"gs://{gcs.create_bucket()}"


@pytest.fixture(scope="module")
def hf_local(tmp_path_factory) -> Path:
  """A tiny random Llama 3.1 in a local HF directory."""
  directory = tmp_path_factory.mktemp("hf") / "llama"
  H.build_hf_model("llama3.1").save_pretrained(str(directory))
  return directory


@pytest.fixture(scope="module")
def hf_remote(bucket, hf_local) -> str:
  path = f"{bucket}/hf/llama"
  storage.copy_tree(str(hf_local), path)
  return path


@pytest.fixture(scope="module")
def ckpt_remote(gcs, bucket, hf_local) -> str:
  """hf_to_maxtext's CLI writing a params-only checkpoint into the bucket from a local HF dir."""
  path = f"{bucket}/ckpt/llama"
  proc = run_cli(gcs, "MaxText.convert.hf_to_maxtext", f"hf_model_path={hf_local}", f"output_path={path}")
  assert f"hf_to_maxtext: wrote {path}" in proc.stdout
  return path


@pytest.fixture(scope="module")
def small_spm(tmp_path_factory, bucket) -> tuple[str, str]:
  """(local, gs://) copies of a 100-token SentencePiece model (fits the tiny models' vocab of 128)."""
  directory = tmp_path_factory.mktemp("spm")
  corpus = directory / "corpus.txt"
  corpus.write_text("\n".join(numbered_documents() * 3) + "\n")
  remote = f"{bucket}/tokenizers/small.model"
  train_tokenizer.train([str(corpus)], 100, remote)  # the trainer's output goes straight to the bucket
  local = directory / "small.model"
  local.write_bytes(storage.read_bytes(remote))
  return str(local), remote


# ---------------------------------------------------------------- checkpoint conversion


def _check_logits(capsys, ckpt: str, hf_path: str) -> str:
  code = logit_checker.main(["logit_checker", BASE, f"load_parameters_path={ckpt}", f"hf_model_path={hf_path}",
                             "dtype=float32", "atol=2e-5", "max_kl=1e-9"])
  out = capsys.readouterr().out
  assert code == 0, out[-2000:]
  assert "logit_checker: PASS" in out
  return out


def test_hf_to_maxtext_writes_a_gs_checkpoint_that_passes_the_logit_checker(gcs, bucket, ckpt_remote, hf_local,
                                                                             capsys):
  objects = gcs.objects(storage.bucket_of(ckpt_remote).removeprefix("gs://"), "ckpt/llama/")
  assert "ckpt/llama/model_config.yml" in objects and "ckpt/llama/_CHECKPOINT_METADATA" in objects
  out = _check_logits(capsys, ckpt_remote, str(hf_local))
  assert f"using the model keys saved with the checkpoint in {ckpt_remote}/model_config.yml" in out
  with pytest.raises(UserError, match=f"{ckpt_remote} already exists"):
    hf_to_maxtext.convert(str(hf_local), ckpt_remote, [])


def test_hf_to_maxtext_reads_a_gs_hf_directory(bucket, hf_remote, capsys):
  ckpt = f"{bucket}/ckpt/from-gs-hf"
  hf_to_maxtext.convert(hf_remote, ckpt, [])
  assert f"inferred from {hf_remote}/config.json" in capsys.readouterr().out
  _check_logits(capsys, ckpt, hf_remote)  # both sides read from the bucket


def test_maxtext_to_hf_from_gs_to_gs_loads_in_transformers(gcs, bucket, ckpt_remote, hf_local, tmp_path):
  from safetensors.numpy import load_file

  out = f"{bucket}/exported/llama"
  proc = run_cli(gcs, "MaxText.convert.maxtext_to_hf", f"load_parameters_path={ckpt_remote}", f"output_path={out}")
  assert f"maxtext_to_hf: wrote {out}" in proc.stdout
  assert storage.listdir(out) == ["config.json", "model.safetensors"]
  local = tmp_path / "exported"
  storage.copy_tree(out, str(local))
  original, exported = load_file(str(hf_local / "model.safetensors")), load_file(str(local / "model.safetensors"))
  assert sorted(exported) == sorted(original)
  for name, value in original.items():
    np.testing.assert_array_equal(exported[name], value, err_msg=name)
  model, info = H.transformers.AutoModelForCausalLM.from_pretrained(str(local), attn_implementation="eager",
                                                                    output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"]
  with pytest.raises(UserError, match="exists and is not empty"):
    maxtext_to_hf.export(ckpt_remote, out, [])


# ---------------------------------------------------------------- tokenizers


def test_train_tokenizer_reads_and_writes_gs_and_sentencepiece_loads_from_gs(gcs, bucket, tmp_path):
  if not SHAKESPEARE.is_file():
    pytest.skip(f"{SHAKESPEARE} is absent (the shared tinyshakespeare corpus the tokenizer is trained on)")
  storage.copy_tree(str(SHAKESPEARE), f"{bucket}/corpus/shakespeare.txt")
  output = f"{bucket}/tok/spm.model"
  proc = run_cli(gcs, "MaxText.train_tokenizer", f"data_files={bucket}/corpus/*.txt", "vocab_size=512",
                 f"output_path={output}")
  assert f"wrote {output}" in proc.stdout and "lines of 1 file(s)" in proc.stdout
  assert storage.listdir(f"{bucket}/tok") == ["spm.model"]  # no .vocab or partial files beside it
  remote = load_tokenizer("sentencepiece", output)
  local_copy = tmp_path / "spm.model"
  local_copy.write_bytes(storage.read_bytes(output))
  local = load_tokenizer("sentencepiece", str(local_copy))
  text = "To be, or not to be: that is the question."
  assert remote.vocab_size == 512 and (remote.bos_id, remote.eos_id) == (1, 2)
  assert remote.encode(text) == local.encode(text) and remote.decode(remote.encode(text)) == text


def test_huggingface_and_tiktoken_tokenizers_load_from_gs(bucket, tmp_path):
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  hf = Tokenizer(models.BPE(unk_token="<unk>"))
  hf.pre_tokenizer = pre_tokenizers.Whitespace()
  hf.train_from_iterator(numbered_documents(), trainers.BpeTrainer(vocab_size=120,
                                                                   special_tokens=["<unk>", "<s>", "</s>"]))
  local = tmp_path / "hf_tok"
  local.mkdir()
  hf.save(str(local / "tokenizer.json"))
  (local / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
  remote = f"{bucket}/tokenizers/hf"
  storage.copy_tree(str(local), remote)
  reference = load_tokenizer("huggingface", str(local))
  for path in (remote, f"{remote}/tokenizer.json"):  # the directory, or the file with its config beside it
    tokenizer = load_tokenizer("huggingface", path)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.vocab_size) == (1, 2, reference.vocab_size)
    assert tokenizer.encode(TEXT) == reference.encode(TEXT)

  ranks = "".join(f"{__import__('base64').b64encode(bytes([b])).decode()} {b}\n" for b in range(256))
  storage.write_text(f"{bucket}/tokenizers/bytes.tiktoken", ranks)
  tiktoken = load_tokenizer("tiktoken", f"{bucket}/tokenizers/bytes.tiktoken")
  assert tiktoken.vocab_size == 512 and tiktoken.decode(tiktoken.encode(TEXT)) == TEXT


# ---------------------------------------------------------------- hf data files


def _write_data(local: Path, remote: str) -> None:
  """The same documents as two jsonl and two parquet files, locally and in the bucket."""
  import datasets

  docs = numbered_documents()
  local.mkdir(parents=True, exist_ok=True)
  for i, part in enumerate((docs[:30], docs[30:])):
    (local / f"train-{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
    datasets.Dataset.from_dict({"text": part}).to_parquet(str(local / f"train-{i}.parquet"))
  storage.copy_tree(str(local), remote)


def _batches(spm: str, files: str, n: int = 4) -> list[dict[str, np.ndarray]]:
  config = Config.for_testing(dataset_type="hf", hf_data_files=files, tokenizer_path=spm, vocab_size=128,
                              max_target_length=16, per_device_batch_size=1, print_config=False)
  iterator = create_data_iterator(config, sharding.create_mesh(config.mesh))
  return [{k: np.asarray(jax.device_get(v)) for k, v in next(iterator).items()} for _ in range(n)]


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_hf_data_files_on_gs_give_the_same_batches_as_local_files(bucket, small_spm, tmp_path, suffix):
  local_spm, remote_spm = small_spm
  remote = f"{bucket}/data-{suffix}"
  _write_data(tmp_path / "data", remote)
  assert expand_files("hf_data_files", f"{remote}/train-*.{suffix}") == [
      f"{remote}/train-0.{suffix}", f"{remote}/train-1.{suffix}"]
  expected = _batches(local_spm, str(tmp_path / "data" / f"train-*.{suffix}"))
  for files in (f"{remote}/train-*.{suffix}", f"{remote}/train-0.{suffix},{remote}/train-1.{suffix}"):
    got = _batches(remote_spm, files)
    for i, (a, b) in enumerate(zip(expected, got)):
      for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=f"{files} batch {i} {name}")
  assert expected[0]["inputs_segmentation"].any()


def test_saved_dataset_on_gs_reads_like_the_local_one(bucket, tmp_path):
  import datasets

  from MaxText.input_pipeline import hf

  docs = numbered_documents()
  saved = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs[:40]}),
                                "validation": datasets.Dataset.from_dict({"text": docs[40:]})})
  saved.save_to_disk(str(tmp_path / "saved"))
  storage.copy_tree(str(tmp_path / "saved"), f"{bucket}/saved")
  remote, _ = hf.open_split(f"{bucket}/saved", "", "validation", "hf_data_files")
  local, _ = hf.open_split(str(tmp_path / "saved"), "", "validation", "hf_data_files")
  assert remote["text"] == local["text"] == docs[40:]
  with pytest.raises(ConfigError, match="split 'test' does not exist in gs://.*/saved; it has train, validation"):
    hf.open_split(f"{bucket}/saved", "", "test", "hf_data_files")


def test_prepare_data_reads_and_writes_gs(bucket):
  from MaxText.input_pipeline import prepare_data

  storage.write_text(f"{bucket}/raw/corpus.txt", "\n\n".join(numbered_documents()) + "\n")
  out = f"{bucket}/prepared"
  assert prepare_data.main(["prepare_data", f"data_files={bucket}/raw/corpus.txt", f"output_path={out}",
                            "formats=jsonl,arrayrecord", "eval_fraction=0.25"]) == 0
  assert storage.listdir(out) == ["arrayrecord", "jsonl", "prepare_data.json"]
  assert storage.listdir(f"{out}/arrayrecord") == ["train.array_record", "validation.array_record"]
  train_docs = [json.loads(line)["text"] for line in storage.read_text(f"{out}/jsonl/train.jsonl").splitlines()]
  assert train_docs == numbered_documents()[:36]


def test_remote_file_lists_are_checked_and_arrayrecord_on_gs_is_refused(bucket):
  storage.write_text(f"{bucket}/lists/a.jsonl", "{}\n")
  with pytest.raises(ConfigError, match=r"hf_data_files: no file matches 'gs://.*/lists/missing\.jsonl'"):
    expand_files("hf_data_files", f"{bucket}/lists/a.jsonl,{bucket}/lists/missing.jsonl")
  with pytest.raises(ConfigError, match=r"hf_data_files: no file matches 'gs://.*/lists/b\*\.jsonl'"):
    expand_files("hf_data_files", f"{bucket}/lists/b*.jsonl")
  with pytest.raises(ConfigError, match="ArrayRecord files cannot be read from a bucket directly .*gcsfuse"):
    expand_files("grain_train_files", f"{bucket}/lists/*.array_record")


# ---------------------------------------------------------------- compiled train step


CPU_TINY = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=128,
                base_num_decoder_layers=2, vocab_size=128, max_target_length=32, per_device_batch_size=1,
                print_config=False, steps=3)


def _train_losses(out: Path, run_name: str, **extra) -> list[float]:
  args = {**CPU_TINY, "run_name": run_name, "base_output_directory": out, "enable_checkpointing": False,
          "enable_tensorboard": False, "cpu_peak_tflops": 1.0, **extra}
  assert train.main(["train", BASE] + [f"{k}={v}" for k, v in args.items()]) == 0
  records = map(json.loads, (out / run_name / "metrics.jsonl").read_text().splitlines())
  return [r["loss"] for r in records if "loss" in r]


def test_compiled_trainstep_file_on_gs(bucket, tmp_path, capsys):
  path = f"{bucket}/aot/step.aot"
  argv = ["train_compile", BASE, "compile_topology=local", f"compiled_trainstep_file={path}"]
  assert train_compile.main(argv + [f"{k}={v}" for k, v in CPU_TINY.items()]) == 0
  assert f"saved the compiled train step to {path}" in capsys.readouterr().out
  header, offset = compiled_step.read_header(path)
  assert header["topology"] == "local" and storage.size(path) > offset
  loaded = _train_losses(tmp_path, "loaded", compiled_trainstep_file=path)
  assert "loaded the compiled executable" in capsys.readouterr().out
  # That a loaded step trains bitwise like a jitted one is test_train_compile's; here: it loads from gs://.
  assert len(loaded) == 3 and all(np.isfinite(loaded))
  with pytest.raises(UserError, match="cannot read compiled_trainstep_file 'gs://.*missing.aot'"):
    compiled_step.read_header(f"{bucket}/aot/missing.aot")


# ---------------------------------------------------------------- decode


def _printed_ids(stdout: str) -> list[int]:
  line = next(line for line in stdout.splitlines() if line.startswith("generated ids: "))
  return ast.literal_eval(line.removeprefix("generated ids: "))


def test_decode_from_a_gs_checkpoint_with_a_gs_tokenizer(gcs, ckpt_remote, small_spm):
  _, remote_spm = small_spm
  args = [f"load_parameters_path={ckpt_remote}", f"tokenizer_path={remote_spm}", f"prompt={TEXT}",
          "max_prefill_predict_length=16", "max_target_length=24", "dtype=float32", "print_config=False"]
  proc = run_cli(gcs, "MaxText.decode", BASE, *args)
  assert f"using the model keys saved with the checkpoint in {ckpt_remote}/model_config.yml" in proc.stdout
  assert "completion: " in proc.stdout
  tokenizer = load_tokenizer("sentencepiece", remote_spm)
  prompt = [line for line in proc.stdout.splitlines() if line.startswith("prompt: ")]
  assert prompt == [f"prompt: {TEXT!r}"] and tokenizer.decode(tokenizer.encode(TEXT)) == TEXT
  assert all(0 <= t < 128 for t in _printed_ids(proc.stdout))


@pytest.mark.slow
def test_param_only_checkpoint_from_a_gs_run_to_gs_then_decode(bucket, capsys):
  run_args = [f"{k}={v}" for k, v in {**CPU_TINY, "steps": 2, "checkpoint_period": 2, "enable_tensorboard": False,
                                       "cpu_peak_tflops": 1.0, "base_output_directory": f"{bucket}/runs",
                                       "run_name": "p"}.items()]
  assert train.main(["train", BASE, *run_args]) == 0
  output = f"{bucket}/params/p"
  assert generate_param_only_checkpoint.main(["generate", BASE, *run_args, f"param_only_checkpoint_path={output}"]) == 0
  assert storage.is_file(f"{output}/model_config.yml")
  with pytest.raises(UserError, match=f"{output} already exists"):
    generate_param_only_checkpoint.main(["generate", BASE, *run_args, f"param_only_checkpoint_path={output}"])
  capsys.readouterr()
  # No model keys on the command line: they come from model_config.yml in the bucket.
  ids = decode.decode(startup.start(decode.TOOL, [
      "decode", BASE, f"load_parameters_path={output}", "prompt_token_ids=5,17,42", "max_prefill_predict_length=8",
      "max_target_length=16", "print_config=False"]).config)
  assert f"using the model keys saved with the checkpoint in {output}/model_config.yml" in capsys.readouterr().out
  assert len(ids) == 16 - 3 + 1 and all(0 <= t < CPU_TINY["vocab_size"] for t in ids)


# ---------------------------------------------------------------- missing files: one line, exit 2


def test_missing_gs_tokenizer_is_one_line_and_exit_2(gcs, bucket):
  missing = f"{bucket}/tokenizers/missing.model"
  proc = run_cli(gcs, "MaxText.decode", BASE, f"tokenizer_path={missing}", "prompt=hello", "print_config=False",
                 *(f"{k}={v}" for k, v in CPU_TINY.items() if k != "steps"), expect=2)
  assert one_error_line(proc) == f"error: tokenizer_path {missing} does not exist"


@pytest.mark.parametrize("key,suffix,message", [
    ("hf_data_files", "missing.jsonl", "hf_data_files: no file matches 'gs://"),
    ("grain_train_files", "train.array_record", "ArrayRecord files cannot be read from a bucket directly"),
])
def test_missing_or_unreadable_gs_data_files_are_one_line_and_exit_2(gcs, bucket, small_spm, tmp_path, key, suffix,
                                                                     message):
  local_spm, _ = small_spm
  kind = "hf" if key.startswith("hf") else "grain"
  proc = run_cli(gcs, "MaxText.train", BASE, f"dataset_type={kind}", f"{key}={bucket}/data/{suffix}",
                 f"tokenizer_path={local_spm}", f"base_output_directory={tmp_path}", "run_name=missing",
                 *(f"{k}={v}" for k, v in CPU_TINY.items()), expect=2)
  assert message in one_error_line(proc)
