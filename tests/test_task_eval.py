"""Downstream tasks inside training (training/task_eval.py): lm-eval runs its own tasks against the
parameters being trained; its log-likelihoods, accuracies and greedy generations equal what the
model's logits give directly; train.py logs them; and the exported checkpoint served by
MaxText.serve scores the same under lm-eval's `local-completions`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from MaxText.input_pipeline.tokenizer import load_tokenizer
from MaxText.platform import sharding
from MaxText.training import run_assembly, task_eval
from tests.lm_eval_tasks import choice_task

lm_eval = pytest.importorskip("lm_eval", reason="needs lm-eval (EXTRAS=test bash setup.sh)")
sys.path.insert(0, str(Path(__file__).parent / "input_pipeline"))
from sft_fixtures import CHATML, WORDS, write_tokenizer, without_markers  # noqa: E402

MODEL = dict(base_emb_dim=32, base_num_query_heads=4, base_num_kv_heads=2, head_dim=8, base_mlp_dim=64,
             base_num_decoder_layers=2, vocab_size=272, max_target_length=64, dtype="float32", print_config=False,
             tokenizer_type="huggingface", add_bos=False, per_device_batch_size=1)
GENERATION_TASK = """task: tiny_continue
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
metric_list:
  - metric: exact_match
"""


def line_docs(count: int = 6) -> list[dict]:
  """'continue this line' items over the fixture's fixed cycle of words: the next words are the answer."""
  docs = []
  for i in range(count):
    start = (5 * i) % len(WORDS)
    words = [WORDS[(start + k) % len(WORDS)] for k in range(6)]
    wrong = [WORDS[(start + 7 + k) % len(WORDS)] for k in range(3)]
    docs.append({"context": "continue this line: " + " ".join(words[:3]),
                 "choices": [" " + " ".join(words[3:]), " " + " ".join(wrong)][::(1 if i % 2 else -1)],
                 "label": 0 if i % 2 else 1, "answer": " " + " ".join(words[3:])})
  return docs


def write_tasks(directory: Path, docs: list[dict]) -> Path:
  directory.mkdir(parents=True, exist_ok=True)
  data = directory / "docs.jsonl"
  data.write_text("".join(json.dumps(d) + "\n" for d in docs))
  (directory / "choice.yaml").write_text(choice_task("tiny_choice", data))
  (directory / "continue.yaml").write_text(GENERATION_TASK.format(data=data))
  return directory


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("tasks")
  tokenizer_dir = write_tokenizer(tmp / "tok", without_markers(CHATML))
  tasks = write_tasks(tmp / "tasks", line_docs())
  config = Config.for_testing(**MODEL, tokenizer_path=str(tokenizer_dir), eval_tasks="tiny_choice,tiny_continue",
                              eval_tasks_path=str(tasks), eval_tasks_interval=1)
  run = run_assembly.build_run(config)
  tokenizer = load_tokenizer("huggingface", str(tokenizer_dir))
  hook = task_eval.TaskEvalHook(run, tokenizer, None, True)
  return run, tokenizer, hook, jax.device_get(run.init_state().params)


def _padded_logits(run, params, ids: list[int]) -> np.ndarray:
  """One unsharded forward pass outside the scorer: [len(ids), V] logits (padded to one shape so
  the reference compiles once)."""
  length = MODEL["max_target_length"]
  tokens, segments = np.zeros((1, length), np.int32), np.zeros((1, length), np.int32)
  tokens[0, :len(ids)], segments[0, :len(ids)] = ids, 1
  apply = _reference_apply(run)
  return np.asarray(apply(params, jnp.asarray(tokens), jnp.arange(length)[None], jnp.asarray(segments)))[0, :len(ids)]


_APPLY = {}


def _reference_apply(run):
  if id(run) not in _APPLY:
    _APPLY[id(run)] = jax.jit(sharding.unsharded()(run.setup.on_mesh.spec.apply))
  return _APPLY[id(run)]


def _direct_logprobs(run, params, ids: list[int]) -> np.ndarray:
  logp = jax.nn.log_softmax(jnp.asarray(_padded_logits(run, params, ids)[:-1], jnp.float32), axis=-1)
  return np.asarray(jnp.take_along_axis(logp, jnp.asarray(ids[1:])[:, None], axis=-1)[:, 0])


def _direct_greedy(run, params, ids: list[int], steps: int) -> list[int]:
  out: list[int] = []
  for _ in range(steps):
    out.append(int(np.argmax(_padded_logits(run, params, ids + out)[-1])))
  return out


def test_lm_eval_scores_equal_the_model_logits(setup):
  run, tokenizer, hook, params = setup
  hook.scorer.params = params
  results = lm_eval.simple_evaluate(model=hook.lm, tasks=["tiny_choice", "tiny_continue"], task_manager=hook.manager,
                                    log_samples=True, bootstrap_iters=0, verbosity="ERROR")
  correct = []
  for sample in results["samples"]["tiny_choice"]:
    sums = []
    for (context, continuation), ((loglikelihood, _),) in zip(sample["arguments"], sample["resps"]):
      whole, context_ids = tokenizer.encode(context + continuation), tokenizer.encode(context)
      sums.append(float(_direct_logprobs(run, params, whole)[len(context_ids) - 1:].sum()))
      assert loglikelihood == pytest.approx(sums[-1], abs=1e-4), (context, continuation)
    correct.append(int(np.argmax(sums)) == sample["doc"]["label"])
  for sample in results["samples"]["tiny_continue"]:
    context = sample["arguments"][0][0]
    ids = _direct_greedy(run, params, tokenizer.encode(context), 12)
    greedy = tokenizer.decode(ids[:ids.index(tokenizer.eos_id)] if tokenizer.eos_id in ids else ids)
    expected = greedy[:greedy.index("\n")] if "\n" in greedy else greedy
    assert sample["resps"][0][0] == expected, (context, greedy)
  scalars = task_eval.task_scalars(results)
  assert scalars["tasks/tiny_choice/acc"] == pytest.approx(np.mean(correct))
  assert "tasks/tiny_continue/exact_match" in scalars and not any("stderr" in k for k in scalars)
  assert hook.evaluate(params) == scalars  # the hook's own call: the same numbers without the samples


@pytest.mark.slow
def test_unknown_tasks_and_a_missing_cadence_are_one_line_errors(setup, tmp_path):
  run, tokenizer, _, _ = setup
  config = Config.for_testing(**MODEL, eval_tasks="no_such_task", eval_tasks_path=str(tmp_path),
                              eval_tasks_interval=5)
  bad = run_assembly.Run(config, run.mesh, run.setup, run.objective, run.batch_sharding, run.train_step, run.eval_step)
  with pytest.raises(ConfigError, match="no_such_task is not an lm-eval task"):
    task_eval.TaskEvalHook(bad, tokenizer, None, True)
  with pytest.raises(ConfigError, match="never runs: set eval_tasks_interval"):
    Config.for_testing(**MODEL, eval_tasks="tiny_choice")


def _pairs(count: int, seed: int) -> list[dict]:
  import random

  rng = random.Random(seed)
  out = []
  for _ in range(count):
    start = rng.randrange(len(WORDS))
    words = [WORDS[(start + k) % len(WORDS)] for k in range(6)]
    out.append({"prompt": "continue this line: " + " ".join(words[:3]), "completion": " " + " ".join(words[3:])})
  return out


@pytest.mark.slow  # train.py, the parameter export, an in-process server and lm-eval's client
def test_train_logs_task_scores_that_the_served_export_reproduces(tmp_path, monkeypatch):
  import subprocess
  import threading
  import time

  import uvicorn

  from MaxText.serve import build_app, build_server
  from tests.conftest import REPO_ROOT
  from tests.compile_settings import cpu_xla_flags, jax_cache_env

  tokenizer_dir = write_tokenizer(tmp_path / "tok", without_markers(CHATML))
  tasks = write_tasks(tmp_path / "tasks", line_docs())
  data = tmp_path / "train.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in _pairs(512, 0)))
  model = ["base_emb_dim=64", "base_num_decoder_layers=2", "base_mlp_dim=128", "head_dim=16", "max_target_length=64",
           "vocab_size=320", "cpu_peak_tflops=0.1", "add_bos=False", "tokenizer_type=huggingface",
           f"tokenizer_path={tokenizer_dir}"]
  env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(1), "PATH": "/usr/bin:/bin",
         "HOME": str(Path.home()), "PYTHONPATH": str(REPO_ROOT), "HF_DATASETS_OFFLINE": "1", **jax_cache_env()}

  def run(module: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout

  out = run("MaxText.train", "configs/sft.yml", "run_name=tasks", f"base_output_directory={tmp_path}", *model,
            f"hf_data_files={data}", "per_device_batch_size=8", "learning_rate=3e-3", "steps=120",
            "eval_interval=-1", "eval_tasks=tiny_choice,tiny_continue", f"eval_tasks_path={tasks}",
            "eval_tasks_interval=60", "checkpoint_period=120", "async_checkpointing=False", "print_config=False",
            "data_prefetch_batches=0")
  assert [line.split()[1] for line in out.splitlines() if line.startswith("tasks ")] == ["60", "120"], out
  logged = [json.loads(line) for line in (tmp_path / "tasks" / "metrics.jsonl").read_text().splitlines()]
  final = {k: v for record in logged if record.get("step") == 120 for k, v in record.items() if k.startswith("tasks/")}
  assert final["tasks/tiny_choice/acc"] == 1.0, final  # it learned the line's continuation
  assert final["tasks/tiny_continue/exact_match"] > 0, final

  params = tmp_path / "params"
  run("MaxText.generate_param_only_checkpoint", "configs/base.yml", "run_name=tasks", f"base_output_directory={tmp_path}",
      *model, f"param_only_checkpoint_path={params}")
  # Room for the longest scored prompt (context and continuation, up to max_length 64 tokens).
  served_model = {**{k: v for k, v in (a.split("=", 1) for a in model)}, "max_target_length": "80"}
  config = Config.for_testing(**served_model, load_parameters_path=str(params), max_prefill_predict_length=64,
                              serve_max_tokens=16, serve_model_name="tiny", dtype="float32", print_config=False)
  server = build_server(config)
  uv = uvicorn.Server(uvicorn.Config(build_app(server, api_key="k", max_body_bytes=1 << 16), host="127.0.0.1", port=0,
                                     log_level="warning"))
  thread = threading.Thread(target=uv.run, daemon=True)
  thread.start()
  try:
    deadline = time.monotonic() + 60
    while not uv.started:
      assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
      time.sleep(0.05)
    url = f"http://127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}"
    monkeypatch.setenv("OPENAI_API_KEY", "k")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    served = lm_eval.simple_evaluate(
        model="local-completions", tasks=["tiny_choice", "tiny_continue"],
        task_manager=lm_eval.tasks.TaskManager(include_path=str(tasks), include_defaults=False),
        model_args=dict(base_url=f"{url}/v1/completions", model="tiny", tokenizer=str(tokenizer_dir),
                        tokenizer_backend="huggingface", max_length=64, num_concurrent=2, max_gen_toks=12),
        log_samples=False, bootstrap_iters=0)
  finally:
    uv.should_exit = True
    thread.join(30)
    server.scheduler.stop()
  assert task_eval.task_scalars(served) == pytest.approx(final)


def test_scorer_edge_requests(setup):
  """No requests; a context and continuation both empty (the row's padding was summed as its score); an
  empty continuation; a context past max_target_length (its last tokens kept); a generation from an empty
  context (conditioned on eot, as lm-eval's log-likelihoods are; it read a padding position)."""
  run, tokenizer, hook, params = setup
  hook.scorer.params = params
  length = MODEL["max_target_length"]
  assert hook.scorer.loglikelihoods([]) == [] and hook.lm.generate_until([]) == []
  ids = tokenizer.encode(" ".join(["to be or not"] * length))
  assert len(ids) > length + 4
  got = hook.scorer.loglikelihoods([([], []), (ids[:3], []), (ids[:-2], ids[-2:])])
  assert got[:2] == [(0.0, True), (0.0, True)]
  whole = ids[-(length + 1):]
  logp = jax.nn.log_softmax(jnp.asarray(_padded_logits(run, params, whole[:-1]), jnp.float32), axis=-1)
  assert got[2][0] == pytest.approx(float(logp[-2, whole[-2]] + logp[-1, whole[-1]]), abs=1e-4)
  from lm_eval.api.instance import Instance

  empty = hook.lm.generate_until([Instance("generate_until", {}, ("", {"until": ["zzz"], "max_gen_toks": 3}), 0)])
  eot = hook.lm.eot_token_id
  assert empty == hook.scorer.generate([([eot], ["zzz"], 3)], tokenizer.decode, tokenizer.eos_id)


def test_a_stop_string_spelled_as_a_special_token_ends_a_generation(setup):
  """until=["<|im_end|>"]: decode writes no special token, so generation ran on to its budget. Here the
  tokenizer's special_id names the third greedy token as one."""
  run, tokenizer, hook, params = setup
  hook.scorer.params = params
  context = tokenizer.encode("to be or not")
  greedy = _direct_greedy(run, params, context, 4)
  stop_token = {"STOP": greedy[2]}.get
  got = hook.scorer.generate([(context, ["STOP"], 4), (context, [], 4)], tokenizer.decode, None, stop_token)
  assert got == [tokenizer.decode(greedy[:2]), tokenizer.decode(greedy)]


def test_a_cadence_longer_than_the_run_warns(capsys):
  from MaxText import train
  train.warn_if_never_due({"eval_interval": 50, "eval_tasks_interval": -1}, 10)
  train.warn_if_never_due({"eval_interval": 10}, 10)
  assert capsys.readouterr().err.splitlines() == [
      "warning: eval_interval=50 is more than steps=10: this run never evaluates; set eval_interval to at most 10"]
