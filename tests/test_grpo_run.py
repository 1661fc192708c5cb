"""GRPO through train.py: bad input stops in one line before anything is written; a run raises its
reward, and a killed run resumes bitwise (also with an environment's multi-turn episodes); two
processes train exactly like one."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "input_pipeline"))
from sft_fixtures import CHATML, WORDS, without_markers, write_tokenizer  # noqa: E402

from MaxText.configuration.config import Config  # noqa: E402
from MaxText import models  # noqa: E402
from MaxText.training import params_io  # noqa: E402
from tests.compile_settings import cpu_xla_flags, jax_cache_env  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL = dict(base_emb_dim=64, base_num_decoder_layers=2, base_mlp_dim=128, head_dim=16, vocab_size=320,
             max_target_length=72)
# A verifiable reward on token ids: the share of a completion's tokens below 160. A random policy
# scores about one half; GRPO should move it up quickly.
REWARDS = "def low_ids(completion_ids, **_):\n  return [sum(t < 160 for t in c) / max(len(c), 1) for c in completion_ids]\n"

# Multi-turn: a tool message after the first turn, whose text depends on the turn; done after the second.
# Each step sleeps at random (unseeded): which episode answers first must change nothing.
TWO_TURNS = """
import random, time

class TwoTurns:
  def __init__(self, prompt, answer, **columns):
    self.prompt, self.answer = prompt, answer
  def start(self):
    return [{"role": "user", "content": self.answer}]  # short: two turns fit max_prefill_predict_length
  def step(self, turn):
    time.sleep(random.random() * 0.02)
    if turn.turn == 1:
      return ([{"role": "tool", "content": str(len(turn.text) % 7)}], 0.25 * (len(turn.text) % 2), False)
    return ([], 0.0, True)
"""


def prepare(directory: Path) -> None:
  """The tokenizer, prompts and starting parameters these runs train from (the GRPO fault campaign's too)."""
  write_tokenizer(directory / "tokenizer", without_markers(CHATML))
  rng = random.Random(0)
  with open(directory / "prompts.jsonl", "w") as f:
    for _ in range(64):
      start = rng.randrange(len(WORDS))
      f.write(json.dumps({"prompt": "continue this line: " + " ".join(WORDS[(start + k) % len(WORDS)] for k in range(3)),
                          "answer": WORDS[(start + 3) % len(WORDS)]}) + "\n")
  config = Config.for_testing(**MODEL)
  params_io.save_params(str(directory / "start"),
                        jax.jit(models.build_model_spec(config.model).init_params)(jax.random.key(0)))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
  directory = tmp_path_factory.mktemp("grpo")
  prepare(directory)
  (directory / "task_rewards.py").write_text(REWARDS)
  (directory / "task_envs.py").write_text(TWO_TURNS)
  return directory


def _command(workdir: Path, out: Path, *extra: str) -> list[str]:
  return [sys.executable, "-m", "MaxText.train", "configs/grpo.yml", "run_name=grpo", f"base_output_directory={out}",
          f"tokenizer_path={workdir / 'tokenizer'}", f"hf_data_files={workdir / 'prompts.jsonl'}",
          f"load_parameters_path={workdir / 'start'}", *(f"{k}={v}" for k, v in MODEL.items()),
          "max_prefill_predict_length=64", "max_completion_length=8", "num_generations=4", "per_device_batch_size=8",
          "reward_functions=task_rewards:low_ids", "learning_rate=1e-2", "print_config=False", "cpu_peak_tflops=0.1",
          "log_period=1", "async_checkpointing=False", "learning_rate_schedule_steps=24", *extra]


def _env(workdir: Path, devices: int) -> dict[str, str]:
  return {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(devices),
          "PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "PYTHONPATH": f"{workdir}:{REPO_ROOT}", **jax_cache_env()}


def _train(workdir: Path, out: Path, *extra: str, devices: int = 2) -> subprocess.CompletedProcess:
  return subprocess.run(_command(workdir, out, *extra), cwd=REPO_ROOT, env=_env(workdir, devices), capture_output=True,
                        text=True, timeout=600)


def _metrics(out: Path) -> list[dict]:
  return [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("extra, message", [
    (["reward_functions=task_rewards_missing:low_ids"], "reward function task_rewards_missing:low_ids: cannot import"),
    pytest.param(["reward_functions=task_rewards:low_ids,exact_match", "rl_answer_column=solution"],
                 "reward exact_match reads the column rl_answer_column='solution', which the prompt records do not have",
                 marks=pytest.mark.slow),
    (["max_prefill_predict_length=16", "max_target_length=24"], "prompt record 0 of hf json files"),
])
def test_bad_input_stops_in_one_line_before_anything_is_written(workdir, tmp_path, extra, message):
  proc = _train(workdir, tmp_path, "steps=2", *extra)
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
  assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
  checkpoints = tmp_path / "grpo" / "checkpoints"
  assert not (tmp_path / "grpo" / "config.yml").exists()
  assert not checkpoints.exists() or not any(checkpoints.iterdir())


@pytest.mark.slow  # three training processes
def test_the_reward_rises_and_a_killed_run_resumes_bitwise(workdir, tmp_path):
  whole = _train(workdir, tmp_path / "whole", "steps=24", "checkpoint_period=12")
  assert whole.returncode == 0, whole.stderr[-3000:]
  first = _train(workdir, tmp_path / "halves", "steps=12", "checkpoint_period=12")
  second = _train(workdir, tmp_path / "halves", "steps=24", "checkpoint_period=12")
  assert first.returncode == 0 and second.returncode == 0, (first.stderr + second.stderr)[-3000:]
  assert "state: resumed from step 12" in second.stdout

  records = _metrics(tmp_path / "whole")
  reward = [r["reward"] for r in records]
  assert len(reward) == 24 and np.mean(reward[-6:]) > np.mean(reward[:6]) + 0.25, reward
  assert "| reward " in whole.stdout
  for name in ("reward_std", "rewards/low_ids/mean", "kl", "entropy", "clip_ratio/region_mean", "advantage_std",
               "completions/mean_length", "completions/clipped_ratio", "rollout_s", "rollout_tokens_per_s"):
    assert name in records[-1], name
  resumed = _metrics(tmp_path / "halves")
  keys = ("reward", "loss", "grad_norm", "entropy", "completions/mean_length")
  assert [[r[k] for k in keys] for r in resumed if r["step"] > 12] == [[r[k] for k in keys] for r in records[12:]]


@pytest.mark.slow  # three training processes per environment
@pytest.mark.parametrize("environment", ["calculator", "task_envs:TwoTurns"])
def test_a_killed_run_with_an_environment_resumes_bitwise(workdir, tmp_path, environment):
  """Episodes hold nothing across steps and every turn's seeds come from the step, the row and the
  turn: a run stopped at its checkpoint and rerun trains exactly like the uninterrupted one."""
  extra = (f"rl_environment={environment}", "rl_max_turns=2", "checkpoint_period=3")
  whole = _train(workdir, tmp_path / "whole", "steps=6", *extra)
  assert whole.returncode == 0, whole.stderr[-3000:]
  first = _train(workdir, tmp_path / "halves", "steps=3", *extra)
  second = _train(workdir, tmp_path / "halves", "steps=6", *extra)
  assert first.returncode == 0 and second.returncode == 0, (first.stderr + second.stderr)[-3000:]
  assert "state: resumed from step 3" in second.stdout
  keys = ("reward", "rewards/environment/mean", "rewards/low_ids/mean", "loss", "grad_norm", "entropy",
          "completions/mean_length", "episodes/mean_turns", "episodes/model_token_share")
  records, resumed = _metrics(tmp_path / "whole"), _metrics(tmp_path / "halves")
  assert len(records) == 6 and records[0]["episodes/mean_turns"] == (1.0 if environment == "calculator" else 2.0), records[0]
  assert [[r[k] for k in keys] for r in resumed if r["step"] > 3] == [[r[k] for k in keys] for r in records[3:]]


@pytest.mark.slow  # two jax.distributed processes and a one-process reference
@pytest.mark.parametrize("extra", [(), ("rl_environment=task_envs:TwoTurns", "rl_max_turns=2")],
                         ids=["single_turn", "interleaved_episodes"])
def test_two_processes_sample_and_train_like_one(workdir, tmp_path, extra):
  one = _train(workdir, tmp_path / "one", "steps=3", "checkpoint_period=3", *extra, devices=4)
  assert one.returncode == 0, one.stderr[-3000:]
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{s.getsockname()[1]}"
  procs = []
  for index in range(2):
    env = {**_env(workdir, 2), "JAX_COORDINATOR_ADDRESS": address, "JAX_PROCESS_COUNT": "2",
           "JAX_PROCESS_ID": str(index)}
    procs.append(subprocess.Popen(_command(workdir, tmp_path / "two", "steps=3", "checkpoint_period=3",
                                           "dcn_data_parallelism=2", "distributed_init_timeout_seconds=120", *extra),
                                  cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  outs = [p.communicate(timeout=600) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
  keys = ("reward", "loss", "grad_norm", "completions/mean_length")
  ours, theirs = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
  np.testing.assert_allclose([[r[k] for k in keys] for r in theirs], [[r[k] for k in keys] for r in ours], rtol=1e-5)
