"""`python3 -m MaxText.decode` on a tiny params-only checkpoint: prints ids that equal the engine's
greedy tokens, reads the model keys saved beside the checkpoint, and fails with one clear line."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from MaxText import models
from MaxText.training import params_io
from MaxText.configuration.config import Config
from MaxText.convert import engine as convert_engine
from decode_test_utils import one_device_mesh, uncached_greedy
from tests.compile_settings import cpu_xla_flags

REPO = Path(__file__).resolve().parents[2]
MODEL = dict(base_emb_dim=32, base_num_query_heads=4, base_num_kv_heads=2, head_dim=8, base_mlp_dim=64,
             base_num_decoder_layers=2, vocab_size=64)
RUN = dict(max_target_length=16, max_prefill_predict_length=8, dtype="float32", print_config=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
  """A params-only checkpoint of random weights with its model_config.yml, as converters write."""
  path = tmp_path_factory.mktemp("ckpt") / "params"
  config = Config.for_testing(**MODEL, **RUN)
  spec = models.build_model_spec(config.model)
  params_io.save_params(str(path), jax.jit(spec.init_params)(jax.random.key(3)))
  convert_engine.write_model_config(str(path), MODEL, "a test")
  return path


def run_decode(*args: str) -> subprocess.CompletedProcess:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(1)}
  return subprocess.run([sys.executable, "-m", "MaxText.decode", "configs/base.yml", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)


def printed_ids(stdout: str) -> list[int]:
  line = next(l for l in stdout.splitlines() if l.startswith("generated ids: "))
  return ast.literal_eval(line.removeprefix("generated ids: "))


# 5: the cache's end falls inside the last call (1, the plain loop, is decoded by the other tests here)
@pytest.mark.parametrize("steps_per_call", [pytest.param(1, marks=pytest.mark.slow), 5])
def test_cli_prints_ids_equal_to_in_process_greedy(checkpoint, steps_per_call):
  result = run_decode(f"load_parameters_path={checkpoint}", "prompt_token_ids=5,17,42",
                      *(f"{k}={v}" for k, v in RUN.items()), f"decode_steps_per_call={steps_per_call}")
  assert result.returncode == 0, result.stderr[-2000:]
  ids = printed_ids(result.stdout)
  assert len(ids) == RUN["max_target_length"] - 3 + 1 and all(0 <= t < MODEL["vocab_size"] for t in ids)
  assert "prefill:" in result.stdout and "tokens/s" in result.stdout.split("generate:")[1]
  # The defaults scan the layers, which XLA's CPU backend decodes slowly: one note says so.
  assert sum("note: on CPU, scanned layers (scan_layers=True) decode several times slower" in line
             for line in result.stdout.splitlines()) == 1, result.stdout
  # The same tokens as greedy decoding without a cache, on the checkpoint read back in process.
  config = Config.for_testing(**MODEL, **RUN)
  spec = models.build_model_spec(config.model)
  params = params_io.load_params(str(checkpoint), spec.abstract_params,
                                     models.shard_params_like(spec, one_device_mesh(), config.mesh.logical_axis_rules))
  assert uncached_greedy(spec, params, [5, 17, 42], len(ids), RUN["max_target_length"]) == ids


@pytest.mark.slow  # two subprocess starts' worth of compiling
def test_cli_speculative_decoding_prints_the_same_ids_and_the_acceptance_rate(checkpoint, tmp_path):
  """A smaller draft checkpoint with its own model_config.yml (read as the target's is)."""
  draft_model = dict(MODEL, base_emb_dim=16, base_num_query_heads=2, base_num_kv_heads=1, base_num_decoder_layers=1)
  spec = models.build_model_spec(Config.for_testing(**draft_model, **RUN).model)
  params_io.save_params(str(tmp_path / "draft"), jax.jit(spec.init_params)(jax.random.key(4)))
  convert_engine.write_model_config(str(tmp_path / "draft"), draft_model, "a test")
  common = (f"load_parameters_path={checkpoint}", "prompt_token_ids=5,17,42", *(f"{k}={v}" for k, v in RUN.items()))
  plain = run_decode(*common)
  result = run_decode(*common, "speculative_tokens=3", f"draft_load_parameters_path={tmp_path / 'draft'}")
  assert plain.returncode == 0 and result.returncode == 0, result.stderr[-2000:]
  assert printed_ids(result.stdout) == printed_ids(plain.stdout)
  assert "acceptance rate" in result.stdout and "speculative: k=3" in result.stdout


@pytest.mark.parametrize("args,message", [
    (("load_parameters_path=/nonexistent/ckpt", "prompt_token_ids=1,2"), "checkpoint /nonexistent/ckpt does not exist"),
    (("prompt_token_ids=1,2,3,4,5,6,7,8,9",), "more than max_prefill_predict_length=8"),
    (("prompt=hello",), "set tokenizer_path"),
    (("prompt_token_ids=1,2", "speculative_tokens=2"), "speculative_tokens=2 needs a draft model"),
    (("prompt_token_ids=1,2", "speculative_tokens=2", "draft_load_parameters_path=/nonexistent/draft"),
     "draft checkpoint /nonexistent/draft does not exist"),
])
def test_cli_errors_are_one_line(args, message):
  result = run_decode(*(f"{k}={v}" for k, v in {**MODEL, **RUN}.items()), *args)
  assert result.returncode == 2, result.stderr[-2000:]
  lines = [l for l in result.stderr.splitlines() if l.startswith("error")]
  assert len(lines) == 1 and message in lines[0], result.stderr[-2000:]


def test_tokenizer_larger_than_vocab_is_an_error(tmp_path):
  spm = pytest.importorskip("sentencepiece")
  corpus = tmp_path / "corpus.txt"
  words = [f"word{i}" for i in range(300)]
  corpus.write_text("\n".join(" ".join(np.random.default_rng(i).choice(words, 12)) for i in range(300)))
  spm.SentencePieceTrainer.Train(input=str(corpus), model_prefix=str(tmp_path / "tok"), vocab_size=200,
                                 model_type="bpe", minloglevel=2)
  result = run_decode(*(f"{k}={v}" for k, v in {**MODEL, **RUN}.items()), f"tokenizer_path={tmp_path / 'tok.model'}",
                      "prompt=word1 word2")
  assert result.returncode == 2
  assert "has 200 tokens but the model's vocab_size is 64" in result.stderr


@pytest.mark.parametrize("overrides,message", [
    (dict(decode_sampling_strategy="beam"), "decode_sampling_strategy must be one of greedy, weighted, nucleus, topk"),
    # Was "decode_sampling_temperature must be > 0 ..., got 0.0": nothing said what 0 asks for, nor how to get it.
    (dict(decode_sampling_temperature=0.0, decode_sampling_strategy="weighted"),
     "decode_sampling_temperature=0 does not combine with decode_sampling_strategy=weighted (sampling divides the logits "
     "by the temperature); for greedy decoding set decode_sampling_strategy=greedy, else give a temperature > 0"),
    (dict(decode_sampling_temperature=-1.0), "decode_sampling_temperature must be > 0"),
    (dict(decode_sampling_top_p=1.5), "decode_sampling_top_p must be in (0, 1]"),
    # Was "... between 1 and vocab_size, got 1000": the bound, the checkpoint's, was not named.
    (dict(decode_sampling_top_k=1000, decode_sampling_strategy="topk"),
     "decode_sampling_top_k must be between 1 and vocab_size=64, got 1000"),
    (dict(prompt_token_ids="5,x"), "prompt_token_ids must be comma-separated integers"),
    (dict(prompt_token_ids="5,64"), "prompt_token_ids must lie in [0, vocab_size=64)"),
    (dict(max_prefill_predict_length=0), "max_prefill_predict_length must be > 0"),
    # Were accepted: inf (and 1e39, inf in float32) sampled every token alike; a seed outside uint32 stopped
    # decode with an OverflowError traceback after the prefill.
    (dict(decode_sampling_temperature=float("inf")), "decode_sampling_temperature must be > 0 and a finite float32"),
    (dict(decode_sampling_temperature=1e39), "decode_sampling_temperature must be > 0 and a finite float32"),
    (dict(decode_sampling_seed=-1), "decode_sampling_seed must be in [0, 2**32) (an unsigned 32-bit seed), got -1"),
    (dict(decode_sampling_seed=2**32), "decode_sampling_seed must be in [0, 2**32)"),
])
def test_decode_keys_are_validated(overrides, message):
  from MaxText.errors import ConfigError
  with pytest.raises(ConfigError, match=None) as error:
    Config.for_testing(**MODEL, **{**RUN, **overrides})
  assert message in str(error.value)


def test_temperature_0_is_greedy_decodings_own_setting():
  """Greedy reads no temperature: 0, the serving API's word for greedy, was refused with decode_sampling_strategy=greedy."""
  from MaxText.inference.sampling import RowParams, SamplingParams

  decode_cfg = Config.for_testing(**MODEL, **RUN, decode_sampling_temperature=0).decode
  assert (decode_cfg.decode_sampling_strategy, decode_cfg.decode_sampling_temperature) == ("greedy", 0.0)
  params = SamplingParams(decode_cfg.decode_sampling_strategy, decode_cfg.decode_sampling_temperature)
  assert RowParams.from_strategy(params, 0) == RowParams.from_strategy(SamplingParams("greedy"), 0)


def test_lora_adapters_are_refused_rather_than_decoded_without(tmp_path):
  """serve_lora_adapters given to decode.py: one line, where it decoded the base model as if not asked."""
  from MaxText import decode
  from MaxText.errors import UserError

  config = Config.for_testing(**MODEL, **RUN, prompt_token_ids="1,2", serve_lora_adapters=f"a={tmp_path}")
  with pytest.raises(UserError, match="decode.py reads no LoRA adapters"):
    decode.decode(config)


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory) -> Path:
  """A Hugging Face tokenizer of about 260 tokens (more than MODEL's vocab_size) without a chat template."""
  from tests.input_pipeline.sft_fixtures import write_tokenizer

  return write_tokenizer(tmp_path_factory.mktemp("tok") / "plain", None)


@pytest.mark.parametrize("overrides, message", [
    # Was: "the tokenizer ... has 264 tokens but the model's vocab_size is 256: this tokenizer does not belong to this
    # checkpoint" (no model_config.yml read from a path that is not there: the default model's vocabulary).
    (dict(load_parameters_path="/nonexistent/ckpt"), "checkpoint /nonexistent/ckpt does not exist"),
    # Was: "prompt 0 has 0 tokens; ... (raise max_prefill_predict_length or shorten the prompt)".
    (dict(prompt="", add_bos=False, vocab_size=512), "the prompt is empty (no tokens, and add_bos=False adds none)"),
    # Was: "... objective=sft with conversations needs the model's own template".
    (dict(prompt="hi", prompt_chat_template=True, vocab_size=512),
     "has no chat template (no chat_template in tokenizer_config.json and no chat_template.jinja); decode with "
     "prompt_chat_template=True needs the model's own template"),
])
def test_prompt_and_checkpoint_errors_name_their_culprit(hf_tokenizer, overrides, message):
  from MaxText import decode
  from MaxText.errors import UserError

  values = {**MODEL, **RUN, "tokenizer_type": "huggingface", "tokenizer_path": str(hf_tokenizer), "prompt": "hi",
            **overrides}
  if "load_parameters_path" in overrides:
    values.pop("vocab_size")  # as on the command line without model_name: the keys saved beside the checkpoint
  with pytest.raises(UserError) as raised:
    decode.decode(Config.for_testing(**values))
  assert message in str(raised.value) and "\n" not in str(raised.value), str(raised.value)


def test_a_run_directory_without_a_saved_step_is_named_as_such(tmp_path):
  """Was "is a run directory, not a checkpoint: give its checkpoints directory ...", which, given, was refused as
  "not a checkpoint"."""
  from MaxText import decode
  from MaxText.errors import UserError

  (tmp_path / "run" / "checkpoints" / "3.orbax-checkpoint-tmp-1").mkdir(parents=True)  # a save cut short
  with pytest.raises(UserError) as raised:
    decode.decode(Config.for_testing(**MODEL, **RUN, prompt_token_ids="1,2", load_parameters_path=str(tmp_path / "run")))
  assert str(raised.value) == (f"{tmp_path / 'run'} is a run directory whose checkpoints directory "
                               f"{tmp_path / 'run' / 'checkpoints'} holds no finished step yet: load another "
                               "checkpoint, or wait for this run's first save")


def test_the_scanned_layers_note_is_for_cpu_and_scanned_stacks_only():
  from MaxText.inference import engine

  assert engine.layer_layout_note(Config.for_testing(**MODEL, **RUN)).startswith("note: on CPU, scanned layers")
  assert engine.layer_layout_note(Config.for_testing(**MODEL, **RUN, scan_layers=False)) is None
