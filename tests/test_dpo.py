"""DPO: the loss and its metrics against TRL's DPOTrainer on the same log-probabilities, preference
records → paired rows, the step against its frozen reference, bad input, and (slow) train.py with
configs/dpo.yml from a params-only checkpoint: accuracy rises, the reference stays bitwise, resume."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import random
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import models
from MaxText.training.objectives import dpo
from MaxText.training import params_io, run_start
from MaxText.platform import accelerators
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError, UserError
from MaxText.input_pipeline import chat, preference
from MaxText.input_pipeline.batch_spec import DPO_FIELDS
from MaxText.input_pipeline.packing import DocumentCursor
from MaxText.training.run_assembly import build_run
from MaxText.training.train_state import reference_of
from tests.conftest import REPO_ROOT
from tests.compile_settings import cpu_xla_flags, jax_cache_env

sys.path.insert(0, str(Path(__file__).parent / "input_pipeline"))
from sft_fixtures import CHATML, WORDS, write_tokenizer, without_markers  # noqa: E402

pytest.importorskip("transformers", reason="needs transformers (EXTRAS=test bash setup.sh)")


# ---- the loss and metrics against TRL -------------------------------------------------------------

def _trl_loss_and_metrics(logps: dict[str, np.ndarray], beta: float, label_smoothing: float,
                          loss_type: str) -> tuple[float, dict[str, float]]:
  """DPOTrainer._compute_loss on given summed log-probs: the model stands in with one completion
  token per sequence whose log-prob is the whole sum, the reference's come precomputed."""
  torch = pytest.importorskip("torch", reason="the TRL comparison needs torch (requirements-hf.txt)")
  trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer", reason="needs trl (requirements-test.txt)")
  num_pairs = len(logps["chosen"])
  sequence_logps = torch.tensor(np.concatenate([logps["chosen"], logps["rejected"]])[:, None])  # [chosen, rejected]
  outputs = types.SimpleNamespace(log_probs=sequence_logps, entropy=torch.zeros_like(sequence_logps),
                                  mean_logits=torch.zeros_like(sequence_logps),
                                  is_top1=torch.zeros_like(sequence_logps, dtype=torch.bool))
  model = types.SimpleNamespace(training=True)
  model_call = lambda **kwargs: outputs  # noqa: E731
  trainer = types.SimpleNamespace(
      model=model, accelerator=types.SimpleNamespace(device="cpu", gather=lambda x: x, gather_for_metrics=lambda x: x),
      aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
      loss_types=[loss_type], loss_weights=[1.0], beta=beta, label_smoothing=label_smoothing, use_weighting=False,
      _metrics={"train": collections.defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
  inputs = {"input_ids": torch.zeros((2 * num_pairs, 2), dtype=torch.long),
            "attention_mask": torch.ones((2 * num_pairs, 2), dtype=torch.long),
            "completion_mask": torch.tensor([[0, 1]] * (2 * num_pairs)),
            "ref_chosen_logps": torch.tensor(logps["ref_chosen"]),
            "ref_rejected_logps": torch.tensor(logps["ref_rejected"])}
  loss = trl_dpo.DPOTrainer._compute_loss(trainer, model_call, inputs, return_outputs=False)
  return float(loss), {name: values[-1] for name, values in trainer._metrics["train"].items()}


def _ours(logps: dict[str, np.ndarray], beta: float, label_smoothing: float) -> dict[str, float]:
  tokens = jnp.ones(len(logps["chosen"]))
  sums = dpo.pair_sums(*(jnp.asarray(logps[k]) for k in ("chosen", "rejected", "ref_chosen", "ref_rejected")),
                       tokens, tokens, beta, label_smoothing)
  return {name: float(value) for name, value in dpo.dpo_metrics(sums).items()}


def _random_logps(num_pairs: int, seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {name: rng.uniform(-60.0, -5.0, num_pairs) for name in ("chosen", "rejected", "ref_chosen", "ref_rejected")}


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_loss_and_metrics_match_trl_sigmoid_dpo(beta):
  logps = _random_logps(16, 0)
  logps["chosen"][:2] = logps["ref_chosen"][:2] + logps["rejected"][:2] - logps["ref_rejected"][:2]  # ties count 0
  trl_loss, trl_metrics = _trl_loss_and_metrics(logps, beta, 0.0, "sigmoid")
  ours = _ours(logps, beta, 0.0)
  np.testing.assert_allclose(ours["loss"], trl_loss, rtol=1e-5)
  for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
               "logps/rejected"):
    np.testing.assert_allclose(ours[name], trl_metrics[name], rtol=1e-5, atol=1e-6, err_msg=name)
  assert 0.0 < ours["rewards/accuracies"] < 1.0


def test_label_smoothing_is_conservative_dpo_as_trl_computes_it():
  """TRL 1.16's `sigmoid` loss ignores label_smoothing; its cDPO formula -(1-ε) logσ(βΔ) - ε logσ(-βΔ)
  lives in the `aot` loss, which for a single pair (sorting a batch of one changes nothing) is
  exactly that formula. Ours is compared pair by pair."""
  beta, epsilon = 0.2, 0.1
  logps = _random_logps(6, 1)
  ours = [_ours({k: v[i:i + 1] for k, v in logps.items()}, beta, epsilon)["loss"] for i in range(6)]
  theirs = [_trl_loss_and_metrics({k: v[i:i + 1] for k, v in logps.items()}, beta, epsilon, "aot")[0]
            for i in range(6)]
  np.testing.assert_allclose(ours, theirs, rtol=1e-5)
  plain = [_ours({k: v[i:i + 1] for k, v in logps.items()}, beta, 0.0)["loss"] for i in range(6)]
  assert not np.allclose(ours, plain)
  # What `sigmoid` does with the same ε in TRL 1.16 (so dpo_label_smoothing=0 is the setting to compare with it).
  ignored, _ = _trl_loss_and_metrics(logps, beta, epsilon, "sigmoid")
  np.testing.assert_allclose(ignored, np.mean(plain), rtol=1e-5)


def test_rows_without_completion_tokens_are_not_pairs():
  logps = {k: jnp.asarray(v) for k, v in _random_logps(4, 2).items()}
  tokens = jnp.asarray([3.0, 0.0, 5.0, 2.0])  # row 1: eval padding
  sums = dpo.pair_sums(logps["chosen"], logps["rejected"], logps["ref_chosen"], logps["ref_rejected"], tokens,
                       jnp.asarray([4.0, 0.0, 1.0, 0.0]), 0.1, 0.0)
  assert float(sums["pair_count"]) == 2.0
  kept = _ours({k: np.asarray(v)[[0, 2]] for k, v in logps.items()}, 0.1, 0.0)
  np.testing.assert_allclose(float(dpo.dpo_metrics(sums)["loss"]), kept["loss"], rtol=1e-6)


# ---- records → paired rows ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
  return write_tokenizer(tmp_path_factory.mktemp("tok") / "chatml", without_markers(CHATML))


def _encoder(directory: Path, max_target_length: int = 128, require_template: bool = False):
  tokenizer = chat.load_chat_tokenizer(str(directory), require_template=require_template)
  return preference.PreferenceEncoder(tokenizer, str(directory), max_target_length, add_bos=True, add_eos=True)


def _batch(encoder, records: list, rows: int, length: int = 128) -> tuple[dict[str, np.ndarray], int]:
  documents = [encoder(r) for r in records]
  cursor = DocumentCursor(lambda index: iter(documents[index:]), max_empty_run=4)
  return preference.pack_preference_batch(cursor, rows, length)


def _completion_text(encoder, batch: dict[str, np.ndarray], prefix: str, row: int) -> str:
  targets, weights = batch[prefix + "targets"][row], batch[prefix + "targets_segmentation"][row]
  return encoder.sequences.tokenizer.decode(targets[weights != 0].tolist())


def test_conversational_pairs_share_the_prompt_and_weigh_only_their_completions(tokenizer_dir):
  encoder = _encoder(tokenizer_dir)
  record = {"prompt": [{"role": "user", "content": "continue this line: the quick brown"}],
            "chosen": [{"role": "assistant", "content": "fox jumps over"}],
            "rejected": [{"role": "assistant", "content": "over fox jumps"}]}
  batch, num_real = _batch(encoder, [record], rows=2)
  assert num_real == 1 and set(batch) == set(DPO_FIELDS)
  assert _completion_text(encoder, batch, "", 0) == "fox jumps over<|im_end|>"
  assert _completion_text(encoder, batch, "rejected_", 0) == "over fox jumps<|im_end|>"
  prompt = encoder.sequences.tokenizer(
      "<|im_start|>user\ncontinue this line: the quick brown<|im_end|>\n<|im_start|>assistant\n",
      add_special_tokens=False)["input_ids"]
  for prefix in ("", "rejected_"):
    assert batch[prefix + "inputs"][0, :len(prompt)].tolist() == prompt
    real = batch[prefix + "inputs_segmentation"][0] != 0
    assert batch[prefix + "inputs_position"][0, real].tolist() == list(range(int(real.sum())))
  assert not batch["targets_segmentation"][1].any() and not batch["rejected_inputs_segmentation"][1].any()


def test_plain_string_pairs_need_no_chat_template(tmp_path):
  encoder = _encoder(write_tokenizer(tmp_path / "plain", None))
  batch, num_real = _batch(encoder, [{"prompt": "to be or", "chosen": " not to be", "rejected": " be to not"}], rows=1)
  tokenizer = encoder.sequences.tokenizer
  assert num_real == 1
  assert _completion_text(encoder, batch, "", 0) == " not to be</s>"  # the completion learns to stop
  assert _completion_text(encoder, batch, "rejected_", 0) == " be to not</s>"
  assert batch["inputs"][0, 0] == tokenizer.bos_token_id


def test_a_pair_truncated_to_no_completion_is_dropped_and_counted(tokenizer_dir, capsys):
  encoder = _encoder(tokenizer_dir, max_target_length=40)
  long_prompt = [{"role": "user", "content": " ".join(WORDS)}]
  short = {"prompt": [{"role": "user", "content": "to be"}], "chosen": [{"role": "assistant", "content": "or not"}],
           "rejected": [{"role": "assistant", "content": "not or"}]}
  batch, num_real = _batch(encoder, [{**short, "prompt": long_prompt}, short], rows=1, length=40)
  assert num_real == 1 and _completion_text(encoder, batch, "", 0) == "or not<|im_end|>"
  assert "warning: dpo: dropped a sample (no completion token within max_target_length + 1 = 41 tokens); " \
         "1 dropped so far" in capsys.readouterr().out


def test_a_pair_whose_sides_are_the_same_tokens_is_dropped_and_counted(tokenizer_dir, capsys):
  """Such a pair has a log 2 loss and a zero gradient at every step; it was trained on, silently, only shrinking
  the other pairs' share of the mean. Two completions that differ only past max_target_length are such a pair."""
  encoder = _encoder(tokenizer_dir, max_target_length=40)
  prompt = [{"role": "user", "content": "to be"}]
  same = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "or not"}],
          "rejected": [{"role": "assistant", "content": "or not"}]}
  cut = {"prompt": prompt, "chosen": [{"role": "assistant", "content": " ".join(WORDS) + " yes"}],
         "rejected": [{"role": "assistant", "content": " ".join(WORDS) + " no"}]}
  real = {**same, "rejected": [{"role": "assistant", "content": "not or"}]}
  batch, num_real = _batch(encoder, [same, cut, real], rows=1, length=40)
  assert num_real == 1 and _completion_text(encoder, batch, "rejected_", 0) == "not or<|im_end|>"
  out = capsys.readouterr().out
  assert "warning: dpo: dropped a sample (chosen and rejected are the same tokens within max_target_length + 1 = " \
         "41 tokens: the pair prefers nothing); 2 dropped so far" in out


@pytest.mark.parametrize("record, error, message", [
    ({"prompt": "to be", "chosen": " or not"}, UserError,
     "a dpo record needs 'prompt', 'chosen' and 'rejected' fields; it lacks 'rejected' (it has prompt, chosen)"),
    ({"prompt": "to be", "chosen": None, "rejected": " not or"}, UserError,  # as datasets fills a missing field
     "a dpo record needs 'prompt', 'chosen' and 'rejected' fields; it lacks 'chosen' (it has prompt, rejected)"),
    ({"prompt": [{"role": "user", "content": "to be"}], "chosen": [{"role": "user", "content": "or not"}],
      "rejected": [{"role": "assistant", "content": "not or"}]}, UserError,
     "a dpo record's 'chosen' must be a list of messages with an assistant turn"),
    ({"prompt": "to be", "chosen": [{"role": "assistant", "content": "or not"}], "rejected": "not or"}, UserError,
     "must all be strings or all be lists of messages; got str, list, str"),
    # Named as the record names them (were: "sft field 'prompt' ...", "sft field 'completion' ...").
    ({"prompt": 3, "chosen": [{"role": "assistant", "content": "or not"}], "rejected": "not or"}, UserError,
     "a dpo record's 'prompt' must be a string or a list of {'role': ..., 'content': ...} messages, got int '3'"),
    ({"prompt": [{"role": "user", "content": "to be"}], "chosen": [{"role": "assistant", "content": "or not"}, "and"],
      "rejected": [{"role": "assistant", "content": "not or"}]}, UserError,
     "dpo field 'chosen' must be a list of {'role': ..., 'content': ...} messages, got"),
    # Were the chat template's own error ("TypeError: unsupported operand type(s) for +: 'int' and 'str'").
    ({"prompt": [{"role": "user", "content": "to be"}], "chosen": [{"role": "assistant", "content": 5}],
      "rejected": [{"role": "assistant", "content": "not or"}]}, UserError,
     "dpo field 'chosen': message 0 (role 'assistant'): its content is 5, a number; give it a string, or a list of "
     "content parts"),
])
def test_bad_records_are_named(tokenizer_dir, record, error, message):
  with pytest.raises(error, match=None) as raised:
    _encoder(tokenizer_dir)(record)
  assert message in str(raised.value)


def test_a_completion_with_no_token_to_train_on_is_refused(tokenizer_dir):
  """An empty completion without add_eos: the pair was dropped as if truncated ("no completion token within
  max_target_length + 1 = 129 tokens"), and a file of them ended "raise max_target_length or shorten the prompts"."""
  encoder = preference.PreferenceEncoder(chat.load_chat_tokenizer(str(tokenizer_dir)), str(tokenizer_dir), 128,
                                         add_bos=True, add_eos=False)
  with pytest.raises(UserError) as raised:
    encoder({"prompt": "to be", "chosen": " or not", "rejected": ""})
  assert str(raised.value) == ("a dpo record's 'rejected' has no token to train on: it is empty (and add_eos=False adds "
                               "no end-of-sequence token after a plain-text one); give it a completion or remove the "
                               "record"), str(raised.value)
  assert encoder({"prompt": "to be", "chosen": " or not", "rejected": " not or"}).shape[1] > 0


def test_message_lists_need_a_chat_template(tmp_path):
  encoder = _encoder(write_tokenizer(tmp_path / "plain", None))
  record = {"prompt": [{"role": "user", "content": "to be"}], "chosen": [{"role": "assistant", "content": "or not"}],
            "rejected": [{"role": "assistant", "content": "not or"}]}
  with pytest.raises(ConfigError, match="dpo records with message lists are rendered with the chat template, and the "
                                        "tokenizer in .* has none"):
    encoder(record)


# ---- configuration --------------------------------------------------------------------------------

DPO_DATA = dict(objective="dpo", dataset_type="hf", hf_data_files="train.jsonl", tokenizer_type="huggingface",
                tokenizer_path="tokenizer")


@pytest.mark.parametrize("overrides, message", [
    (dict(dataset_type="synthetic"), "objective=dpo reads preference records with dataset_type=hf"),
    (dict(use_sft=True), "'use_sft' (deprecated) says use_sft=True but Config.for_testing also gives objective='dpo'"),
    (dict(tokenizer_type="sentencepiece"), "set tokenizer_type=huggingface"),
    (dict(load_full_state_path="/somewhere"), "objective=dpo starts from load_parameters_path"),
    (dict(dpo_label_smoothing=0.5), "dpo_label_smoothing (the probability a preference label is flipped) must be"),
    (dict(dpo_beta=0.0), "dpo_beta must be a finite float32 number > 0, got 0.0"),
    (dict(dpo_beta=math.inf), "dpo_beta must be a finite float32 number > 0, got inf"),  # NaN: inf * 0 at step 1
    (dict(dpo_beta=1e39), "dpo_beta must be a finite float32 number > 0, got 1e+39"),  # inf on the device
])
def test_configuration_errors(tiny_overrides, overrides, message):
  with pytest.raises(ConfigError, match=None) as raised:
    Config.for_testing(**{**tiny_overrides, **DPO_DATA, **overrides})
  assert message in str(raised.value)


# ---- the step: policy against its frozen reference ------------------------------------------------

def _pair_batch(rows: int, length: int, vocab: int, seed: int) -> dict[str, jax.Array]:
  """Chosen = a fixed continuation of the prompt, rejected = the same tokens reversed."""
  rng = np.random.default_rng(seed)
  batch = {name: np.zeros((rows, length), np.int32) for name in DPO_FIELDS}
  for row in range(rows):
    prompt = rng.integers(1, vocab, 6)
    continuation = (prompt[-1] + np.arange(1, 7)) % (vocab - 1) + 1
    for prefix, completion in (("", continuation), ("rejected_", continuation[::-1])):
      tokens = np.concatenate([prompt, completion])
      n = len(tokens) - 1
      batch[prefix + "inputs"][row, :n], batch[prefix + "targets"][row, :n] = tokens[:-1], tokens[1:]
      batch[prefix + "inputs_position"][row, :n] = np.arange(n)
      batch[prefix + "inputs_segmentation"][row, :n] = 1
      batch[prefix + "targets_segmentation"][row, len(prompt) - 1:n] = 1
  return {k: jnp.asarray(v) for k, v in batch.items()}


def test_the_step_trains_the_policy_and_leaves_the_reference_alone(tiny_overrides, tmp_path):
  overrides = {**tiny_overrides, **DPO_DATA, "per_device_batch_size": 4, "learning_rate": 3e-3,
               "gradient_accumulation_steps": 2, "dpo_beta": 0.5}
  one_device = dataclasses.replace(accelerators.local_target(), num_devices=1)
  config = Config.for_testing(one_device, **overrides)
  run = build_run(config, devices=jax.devices()[:1])
  assert reference_of(run.setup.abstract_state) is not None
  with pytest.raises(UserError, match="objective=dpo needs a reference model: set load_parameters_path"):
    run_start.initial_state(config, run.setup, None, lambda: pytest.fail("must not initialise"))
  spec = models.build_model_spec(config.model)
  params_io.save_params(str(tmp_path / "start"), jax.jit(spec.init_params)(jax.random.key(1)))
  config = Config.for_testing(one_device, **overrides, load_parameters_path=str(tmp_path / "start"))
  state = run_start.initial_state(config, run.setup, None, lambda: pytest.fail("must not initialise")).state
  reference = jax.tree.map(np.asarray, state.reference)
  assert all(np.array_equal(a, np.asarray(b))
             for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(state.params)))
  assert jax.tree.leaves(state.opt_state)  # the optimizer holds the policy's moments only
  assert len(jax.tree.leaves(state.opt_state[1][0].mu)) == len(jax.tree.leaves(state.params))

  state, history = _train_on_one_batch(run, state, tiny_overrides)
  # Policy = reference at the start: every reward 0, the loss log 2, no pair counted as won.
  assert history[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and history[0]["rewards/accuracies"] == 0.0
  assert history[-1]["loss"] < 0.5 * math.log(2) and history[-1]["rewards/accuracies"] == 1.0
  assert history[-1]["rewards/margins"] > 0
  assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(reference),
                                                               jax.tree.leaves(state.reference)))
  batch = _pair_batch(4, tiny_overrides["max_target_length"], tiny_overrides["vocab_size"], 0)
  sums = jax.device_get(run.eval_step(state, batch))
  assert float(sums["pair_count"]) == 4 and float(sums["accuracy_sum"]) == 4


# ---- train.py end to end ---------------------------------------------------------------------------

MODEL = ["base_emb_dim=64", "base_num_decoder_layers=2", "base_mlp_dim=128", "head_dim=16", "vocab_size=320",
         "max_target_length=96"]



def _train_on_one_batch(run, state, tiny_overrides, steps: int = 12):
  """`steps` train steps on one batch of 4 pairs: (final state, each step's metrics)."""
  batch = _pair_batch(4, tiny_overrides["max_target_length"], tiny_overrides["vocab_size"], 0)
  history = []
  for _ in range(steps):
    state, metrics = run.train_step(state, batch, jax.random.key(0))
    history.append({k: float(v) for k, v in metrics.items()})
  return state, history

def preference_records(count: int, seed: int) -> list[dict]:
  """"continue this line" prompts; chosen = the next four words of a fixed cycle, rejected = the
  same words shuffled."""
  rng = random.Random(seed)
  records = []
  for _ in range(count):
    start = rng.randrange(len(WORDS))
    line = [WORDS[(start + i) % len(WORDS)] for i in range(7)]
    shuffled = line[3:]
    while shuffled == line[3:]:
      shuffled = rng.sample(line[3:], 4)
    records.append({"prompt": [{"role": "user", "content": "continue this line: " + " ".join(line[:3])}],
                    "chosen": [{"role": "assistant", "content": " ".join(line[3:])}],
                    "rejected": [{"role": "assistant", "content": " ".join(shuffled)}]})
  return records


def _train(tmp_path: Path, *extra: str, records: list[dict] | None = None) -> subprocess.CompletedProcess:
  files = []
  train_records = preference_records(256, 0) if records is None else records
  for name, records in (("train", train_records), ("eval", preference_records(16, 1))):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    files.append(f"hf_{'data' if name == 'train' else 'eval'}_files={path}")
  tokenizer = tmp_path / "tokenizer"
  if not tokenizer.exists():
    write_tokenizer(tokenizer, without_markers(CHATML))
  command = [sys.executable, "-m", "MaxText.train", "configs/dpo.yml", "run_name=dpo",
             f"base_output_directory={tmp_path}", f"tokenizer_path={tokenizer}", *files, *MODEL,
             "per_device_batch_size=8", "learning_rate=3e-3", "eval_steps=2", "data_prefetch_batches=0",
             "print_config=False", "cpu_peak_tflops=0.1", "log_period=1", "async_checkpointing=False", *extra]
  env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(1), "PATH": "/usr/bin:/bin",
         "HOME": str(Path.home()), "PYTHONPATH": str(REPO_ROOT), **jax_cache_env()}
  return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_dpo_without_a_reference_stops_in_one_line(tmp_path):
  proc = _train(tmp_path, "steps=2")
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
  assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
  assert "objective=dpo needs a reference model: set load_parameters_path" in errors[0]
  assert not (tmp_path / "dpo" / "checkpoints").exists() or not any((tmp_path / "dpo" / "checkpoints").iterdir())


@pytest.mark.slow  # two training processes
def test_dpo_from_params_only_raises_preference_accuracy_keeps_the_reference_and_resumes(tmp_path, tiny_overrides):
  config = Config.for_testing(**dict(arg.split("=") for arg in MODEL))
  start = tmp_path / "start"
  params_io.save_params(str(start), jax.jit(models.build_model_spec(config.model).init_params)(jax.random.key(0)))
  first = _train(tmp_path, f"load_parameters_path={start}", "steps=40", "eval_interval=20", "checkpoint_period=20")
  assert first.returncode == 0, first.stderr[-3000:]
  resumed = _train(tmp_path, f"load_parameters_path={start}", "steps=60", "eval_interval=20", "checkpoint_period=20")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "state: resumed from step 40" in resumed.stdout, resumed.stdout[-2000:]

  records = [json.loads(line) for line in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
  accuracy = [r["rewards/accuracies"] for r in records if "rewards/accuracies" in r]
  assert len(accuracy) == 60 and accuracy[0] == 0.0  # policy = reference at step 1: no pair won yet
  assert np.mean(accuracy[-20:]) >= 0.75 and np.mean(accuracy[-20:]) > np.mean(accuracy[:10]) + 0.25, accuracy
  evals = [r for r in records if "eval_rewards/accuracies" in r]
  # Held out: 16 pairs; a policy that had learnt nothing would win none (ties) or about half.
  assert [r["step"] for r in evals] == [20, 40, 60] and evals[-1]["eval_rewards/accuracies"] >= 0.75
  assert evals[-1]["eval_rewards/margins"] > evals[0]["eval_rewards/margins"] > 0

  import orbax.checkpoint as ocp

  starting = jax.tree.leaves(ocp.PyTreeCheckpointer().restore(str(start))["params"])
  saved = ocp.PyTreeCheckpointer().restore(str(tmp_path / "dpo" / "checkpoints" / "60" / "state"))
  assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
             zip(starting, jax.tree.leaves(saved["reference"])))
  assert not all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                 zip(starting, jax.tree.leaves(saved["params"])))


def test_the_declared_dpo_batch_lowers_sharded_over_two_devices(tiny_overrides):
  """AOT compiles from batch_spec: the paired fields, batch-sharded, and the reference in the state."""
  two_devices = dataclasses.replace(accelerators.local_target(), num_devices=2)
  config = Config.for_testing(two_devices, **{**tiny_overrides, **DPO_DATA, "per_device_batch_size": 2,
                                              "ici_fsdp_parallelism": 2})
  run = build_run(config, devices=jax.devices()[:2])
  inputs = run.abstract_inputs()
  assert set(inputs.batch) == set(DPO_FIELDS) and inputs.batch["rejected_inputs"].shape == (4, 32)
  assert inputs.batch["rejected_targets"].sharding == inputs.batch["targets"].sharding == run.batch_sharding
  reference = reference_of(inputs.state)
  assert jax.tree.map(lambda x: x.sharding, reference) == jax.tree.map(lambda x: x.sharding, inputs.state.params)
  assert run.train_step.lower(*inputs.as_args()).compile() is not None


def test_a_dpo_step_counts_two_trained_sequences_and_two_reference_passes_per_row(tiny_overrides):
  from MaxText.training import metrics
  from MaxText.training.objectives import Preference

  config = Config.for_testing(**tiny_overrides)
  plain = metrics.training_tflops_per_step(config.model, 8, 32)
  preference_step = metrics.training_tflops_per_step(config.model, 8, 32, passes=Preference.passes_per_row)
  assert preference_step.total_tflops == pytest.approx(plain.total_tflops * 8 / 3)


@pytest.mark.slow  # one process per record (the record-level errors are in the default run above)
@pytest.mark.parametrize("bad, message", [
    ({"prompt": "to be", "chosen": " or not"}, "a dpo record needs 'prompt', 'chosen' and 'rejected' fields"),
    ({"prompt": [{"role": "user", "content": "to be"}], "chosen": [{"role": "user", "content": "or not"}],
      "rejected": [{"role": "assistant", "content": "not or"}]}, "a dpo record's 'chosen' must be a list of messages "
                                                                 "with an assistant turn"),
    (None, "dpo records with message lists are rendered with the chat template, and the tokenizer in"),
])
def test_bad_records_stop_the_run_in_one_line_and_touch_no_checkpoint(tmp_path, bad, message):
  config = Config.for_testing(**dict(arg.split("=") for arg in MODEL))
  start = tmp_path / "start"
  params_io.save_params(str(start), jax.jit(models.build_model_spec(config.model).init_params)(jax.random.key(0)))
  if bad is None:
    write_tokenizer(tmp_path / "tokenizer", None)  # no chat template, and the records are message lists
  records = preference_records(8, 0) + ([bad] if bad is not None else [])
  proc = _train(tmp_path, f"load_parameters_path={start}", "steps=4", "eval_interval=-1", "checkpoint_period=1",
                "enable_data_shuffling=False", records=records)
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
  assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
  checkpoints = tmp_path / "dpo" / "checkpoints"
  saved = sorted(p.name for p in checkpoints.iterdir()) if checkpoints.exists() else []
  assert all(name.isdigit() for name in saved), saved  # nothing set aside as damaged


def test_conversational_records_read_from_parquet_through_the_hf_reader(tokenizer_dir, tmp_path):
  pyarrow_parquet = pytest.importorskip("pyarrow.parquet")
  import pyarrow

  from MaxText.input_pipeline import hf

  records = preference_records(4, 3)
  pyarrow_parquet.write_table(pyarrow.Table.from_pylist(records), str(tmp_path / "prefs.parquet"))
  source, describe = hf.open_split("", str(tmp_path / "prefs.parquet"), "train", "hf_data_files")
  assert len(source) == 4 and "parquet" in describe
  encoder = _encoder(tokenizer_dir)
  batch, num_real = _batch(encoder, [source[i] for i in range(4)], rows=4)
  assert num_real == 4
  for row, record in enumerate(records):
    assert _completion_text(encoder, batch, "", row) == record["chosen"][0]["content"] + "<|im_end|>"
    assert _completion_text(encoder, batch, "rejected_", row) == record["rejected"][0]["content"] + "<|im_end|>"


def test_preference_parquet_files_whose_schemas_differ(tokenizer_dir, tmp_path):
  """A second file whose messages carry a `name` field (or a column the first lacks) failed datasets' cast to the
  first file's types ('Couldn't cast', no file named); it now reads, and a column that is messages in one file and
  strings in another is one line naming both."""
  pyarrow_parquet = pytest.importorskip("pyarrow.parquet")
  import pyarrow

  from MaxText.input_pipeline import hf

  records = preference_records(4, 3)
  pyarrow_parquet.write_table(pyarrow.Table.from_pylist(records[:2]), str(tmp_path / "a.parquet"))
  named = [{**r, "chosen": [{**m, "name": "bot"} for m in r["chosen"]], "id": i} for i, r in enumerate(records[2:])]
  pyarrow_parquet.write_table(pyarrow.Table.from_pylist(named), str(tmp_path / "b.parquet"))
  source, _ = hf.open_split("", str(tmp_path / "*.parquet"), "train", "hf_data_files")
  encoder = _encoder(tokenizer_dir)
  batch, num_real = _batch(encoder, [source[i] for i in range(4)], rows=4)
  assert num_real == 4
  for row, record in enumerate(records):
    assert _completion_text(encoder, batch, "", row) == record["chosen"][0]["content"] + "<|im_end|>"

  plain = [{"prompt": "to be", "chosen": " or not", "rejected": " not or"}]
  pyarrow_parquet.write_table(pyarrow.Table.from_pylist(plain), str(tmp_path / "b.parquet"))
  with pytest.raises(ConfigError) as raised:
    hf.open_split("", str(tmp_path / "*.parquet"), "train", "hf_data_files")
  assert str(raised.value).startswith("hf_data_files: column 'prompt' is list<element: struct<"), str(raised.value)
  assert str(raised.value).endswith(f"in {tmp_path / 'a.parquet'} but string in {tmp_path / 'b.parquet'}; give it "
                                    "one type in every file")


def test_with_lora_the_reference_is_the_base_with_adapters_off(tiny_overrides, tmp_path):
  """No copy of the weights: the frozen base (adapters off) is the starting model, and stays bitwise."""
  from MaxText.training import lora

  overrides = {**tiny_overrides, **DPO_DATA, "per_device_batch_size": 4, "learning_rate": 3e-2, "dpo_beta": 0.5,
               "lora_rank": 4, "lora_alpha": 8.0}
  one_device = dataclasses.replace(accelerators.local_target(), num_devices=1)
  plain = Config.for_testing(one_device, **{**overrides, "lora_rank": 0})
  params_io.save_params(str(tmp_path / "start"),
                        jax.jit(models.build_model_spec(plain.model).init_params)(jax.random.key(1)))
  config = Config.for_testing(one_device, **overrides, load_parameters_path=str(tmp_path / "start"))
  run = build_run(config, devices=jax.devices()[:1])
  assert reference_of(run.setup.abstract_state) is None
  state = run_start.initial_state(config, run.setup, None, lambda: pytest.fail("must not initialise")).state
  base = jax.tree.map(np.asarray, lora.split(state.params)[1])
  state, history = _train_on_one_batch(run, state, tiny_overrides)
  assert history[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and history[0]["rewards/accuracies"] == 0.0
  assert history[-1]["loss"] < history[0]["loss"] and history[-1]["rewards/margins"] > 0
  assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(base),
                                                               jax.tree.leaves(lora.split(state.params)[1])))
