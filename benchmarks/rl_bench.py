"""How a GRPO step splits between rollout (sampling + rewards) and update, for a small model, and
what a rollout mesh of its own and asynchronous rollouts change.

    python3 benchmarks/rl_bench.py [steps=12] [devices=4] [max_completion_length=32] [num_generations=8]
        [rows=32] [base_emb_dim=256] [base_num_decoder_layers=4] [platform=cpu|gpu]
        [modes=same] [rl_rollout_devices=2] [tool_latency_s=0]

Runs `python3 -m MaxText.train configs/grpo.yml` on a generated prompt set (a byte-level BPE
tokenizer, random starting weights, a reward on token ids, so completions run to
max_completion_length) and reads its metrics.jsonl. The first two steps (compilation) are left out;
the rest give medians of: rollout seconds (prefill + one decode step per token, host loop included),
update seconds (`update_s`, the rest of the step's wall time: old/reference log-probs, forward and
backward, optimizer), rollout
tokens/s (completion tokens sampled per second) and update tokens/s (every row's tokens, prompt and
padding included, per second of update). On GPU (platform=gpu) the same run uses one device.

`modes` (comma-separated) picks the layouts, each one run: same (rollouts on the training mesh),
split (the last rl_rollout_devices devices roll out, weights copied every update), async1 and
async2 (split, rl_max_staleness 1 and 2 with a weight copy every 2 and 3 updates: the batches
up to the next copy are generated while the training runs), lora and lora_split (same and split with
LoRA adapters of rank 8 on the attention projections: after a process's first copy only the adapters
move), and tools (the same mesh, multi-turn
episodes: an environment answers each of 3 model turns with a tool message of about 16 tokens,
after sleeping 0 to tool_latency_s seconds; episodes interleaved in the engine,
rl/interleaved_episodes.py), tools_by_turn (the same in batch by turn, rl/episodes.py) and
tools_paged (interleaved on the paged cache: each turn prefills only the appended tokens). Each prints steps/s (timed steps over their wall time) and the weight copies'
median seconds and bytes; tools also episodes/s (episodes over rollout seconds), turns per episode
and the model's share of the episodes' tokens after the prompt (the rest is tool output, in the
context but not trained on). The global batch is `rows` in every mode. The last line of each mode
is machine-readable: `RESULT rl ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from MaxText.configuration import tool_args  # noqa: E402  (key=value arguments, the old --flags kept)
from benchmarks import bench_args  # noqa: E402

REWARD = "def low_ids(completion_ids, **_):\n  return [sum(t < 200 for t in c) / max(len(c), 1) for c in completion_ids]\n"
# The tools modes' environment: a tool message after each model turn, the episode ends after the third.
# Each call first sleeps LATENCY x (prompt length mod 4) / 3 seconds: tools that answer at different speeds.
ENVIRONMENT = """
import time
LATENCY = {latency!r}

class ThreeTurns:
  def __init__(self, prompt, **columns):
    self.prompt = prompt
  def start(self):
    return [{{"role": "user", "content": self.prompt}}]
  def step(self, turn):
    time.sleep(LATENCY * (len(self.prompt) % 4) / 3)
    return ([{{"role": "tool", "content": "alpha beta gamma delta epsilon zeta"}}], 0.0, turn.turn >= 3)
"""
TOOL_TURNS = 3


# The old names of options named after the config keys they set (the old --flags work with a warning).
RENAMED = {"completion": "max_completion_length", "generations": "num_generations", "emb": "base_emb_dim",
           "layers": "base_num_decoder_layers"}


def _prepare(directory: Path, model: dict[str, int], tool_latency_s: float = 0.0) -> None:
  """A tokenizer with a ChatML template, 512 prompts, random starting weights, the reward module."""
  script = f"""
import json, random, sys
sys.path.insert(0, {str(REPO)!r})
from pathlib import Path
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
import jax
from MaxText.configuration.config import Config
from MaxText import models as maxtext_models
from MaxText.training import params_io
d = Path({str(directory)!r})
words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda sigma".split()
rng = random.Random(0)
prompts = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(512)]
tok = Tokenizer(models.BPE(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(prompts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "<|im_start|>",
    "<|im_end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
(d / "tokenizer").mkdir()
tok.save(str(d / "tokenizer" / "tokenizer.json"))
template = ("{{%- for m in messages %}}{{{{ '<|im_start|>' + m['role'] + '\\\\n' + m['content'] + '<|im_end|>\\\\n' }}}}"
            "{{%- endfor %}}{{%- if add_generation_prompt %}}{{{{ '<|im_start|>assistant\\\\n' }}}}{{%- endif %}}")
(d / "tokenizer" / "tokenizer_config.json").write_text(json.dumps({{"bos_token": "<s>", "eos_token": "<|im_end|>",
    "unk_token": "<unk>", "chat_template": template}}))
(d / "prompts.jsonl").write_text("".join(json.dumps({{"prompt": p}}) + "\\n" for p in prompts))
config = Config.for_testing(**{model!r})
params_io.save_params(str(d / "start"), jax.jit(maxtext_models.build_model_spec(config.model).init_params)(jax.random.key(0)))
"""
  subprocess.run([sys.executable, "-c", script], check=True, cwd=REPO, capture_output=True, text=True)
  (directory / "bench_rewards.py").write_text(REWARD)
  (directory / "bench_environment.py").write_text(ENVIRONMENT.format(latency=tool_latency_s))


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=12)
  parser.add_argument("--devices", type=int, default=4, help="simulated CPU devices (cpu only)")
  parser.add_argument("--max_completion_length", type=int, default=32, help="max_completion_length")
  parser.add_argument("--num_generations", type=int, default=8)
  parser.add_argument("--rows", type=int, default=32, help="completions per step (the global batch)")
  parser.add_argument("--base_emb_dim", type=int, default=256)
  parser.add_argument("--base_num_decoder_layers", type=int, default=4)
  parser.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
  parser.add_argument("--modes", default="same",
                      help="comma-separated: same, split, async1, async2, lora, lora_split, tools, tools_by_turn, "
                           "tools_paged")
  parser.add_argument("--tool_latency_s", type=float, default=0.0,
                      help="tools modes: each environment call sleeps 0 to this many seconds (by its prompt)")
  parser.add_argument("--rl_rollout_devices", type=int, default=2, help="devices of the rollout mesh (split, async*)")
  args = tool_args.parse_args(parser, None, renamed=RENAMED)
  devices = args.devices if args.platform == "cpu" else 1
  modes = bench_args.names("modes", args.modes, MODES)
  for key in ("steps", "devices", "max_completion_length", "num_generations", "rows", "base_emb_dim",
              "base_num_decoder_layers", "rl_rollout_devices"):
    bench_args.at_least(key, getattr(args, key), 1)
  bench_args.at_least("tool_latency_s", args.tool_latency_s, 0)
  prefill = 64
  emb = args.base_emb_dim
  model = dict(base_emb_dim=emb, base_num_query_heads=4, base_num_kv_heads=4, head_dim=emb // 4, base_mlp_dim=4 * emb,
               base_num_decoder_layers=args.base_num_decoder_layers, vocab_size=512,
               max_target_length=prefill + args.max_completion_length)
  print(f"model: emb {args.base_emb_dim}, {args.base_num_decoder_layers} layers; {args.rows} completions x "
        f"<= {args.max_completion_length} tokens per step "
        f"({args.num_generations} per prompt), prompts of ~40 tokens, {devices} {args.platform} device(s)")
  print(f"{'mode':>13} {'steps/s':>8} {'rollout s':>10} {'update s':>10} {'rollout share':>14} {'rollout tok/s':>14} "
        f"{'update tok/s':>13} {'sync s':>8} {'sync MB':>8} {'idle train':>10} {'idle roll':>9}")
  with tempfile.TemporaryDirectory(prefix="rl-bench-") as tmp:
    directory = Path(tmp)
    _prepare(directory, model, args.tool_latency_s)
    for mode in modes:
      tools = mode.startswith("tools")
      rollout_devices = 0 if mode in ("same", "lora") or tools else args.rl_rollout_devices
      # tools: every turn's context fits the prefill (the prompt, earlier turns and tool messages)
      mode_prefill = prefill + (TOOL_TURNS - 1) * (args.max_completion_length + 32) if tools else prefill
      keys = {**model, "max_target_length": mode_prefill + args.max_completion_length}
      command = [sys.executable, "-m", "MaxText.train", "configs/grpo.yml", f"run_name={mode}",
                 f"base_output_directory={directory / 'out'}", f"tokenizer_path={directory / 'tokenizer'}",
                 f"hf_data_files={directory / 'prompts.jsonl'}", f"load_parameters_path={directory / 'start'}",
                 *(f"{k}={v}" for k, v in keys.items()), f"max_prefill_predict_length={mode_prefill}",
                 f"max_completion_length={args.max_completion_length}", f"num_generations={args.num_generations}",
                 f"per_device_batch_size={args.rows / (devices - rollout_devices)}",
                 "reward_functions=bench_rewards:low_ids", f"steps={args.steps}", "log_period=1",
                 "checkpoint_period=100000", "print_config=False", "enable_tensorboard=False", "learning_rate=1e-4",
                 "rl_sampling_temperature=1.0", *MODES[mode](rollout_devices)]
      env = {**os.environ, "PYTHONPATH": f"{directory}:{REPO}"}
      if args.platform == "cpu":
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
      proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
      if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        return proc.returncode
      records = [json.loads(line) for line in (directory / "out" / mode / "metrics.jsonl").read_text().splitlines()]
      _report(mode, records, args, keys)
  return 0


LORA = ("lora_rank=8", "lora_alpha=16", "lora_target_modules=q_proj,k_proj,v_proj,o_proj")
# Each mode's extra keys, given the rollout mesh's devices.
MODES: dict[str, Callable[[int], list[str]]] = {
    "same": lambda r: [],
    "split": lambda r: [f"rl_rollout_devices={r}"],
    "async1": lambda r: [f"rl_rollout_devices={r}", "rl_max_staleness=1", "rl_weight_sync_interval=2"],
    "async2": lambda r: [f"rl_rollout_devices={r}", "rl_max_staleness=2", "rl_weight_sync_interval=3"],
    "tools": lambda r: ["rl_environment=bench_environment:ThreeTurns", f"rl_max_turns={TOOL_TURNS}"],
    "tools_by_turn": lambda r: ["rl_environment=bench_environment:ThreeTurns", f"rl_max_turns={TOOL_TURNS}",
                                "rl_interleave_episodes=false"],
    "tools_paged": lambda r: ["rl_environment=bench_environment:ThreeTurns", f"rl_max_turns={TOOL_TURNS}",
                              "kv_cache_layout=paged"],
    "lora": lambda r: list(LORA),
    "lora_split": lambda r: [f"rl_rollout_devices={r}", *LORA],
}


def _report(mode: str, records: list[dict[str, Any]], args: argparse.Namespace, model: dict[str, int]) -> None:
  timed = [r for r in records if r["step"] > 2]
  steps_per_s = len(timed) / sum(r["step_seconds"] for r in timed)
  rollout = statistics.median(r["rollout_s"] for r in timed)
  update = statistics.median(r["update_s"] for r in timed)  # the step's time but its wait for the batch
  sampled = statistics.median(r["rollout_tokens_per_s"] for r in timed)
  update_tps = args.rows * model["max_target_length"] / update
  share = rollout / (rollout + update)
  copies = [r for r in records if r.get("weight_sync_bytes", 0) > 0][1:] or \
      [r for r in records if r.get("weight_sync_bytes", 0) > 0]  # past the first copy where there are more
  sync_s = statistics.median(r["weight_sync_s"] for r in copies) if copies else 0.0
  sync_mb = copies[0]["weight_sync_bytes"] / 2**20 if copies else 0.0
  first = next((r["weight_sync_bytes"] for r in records if r.get("weight_sync_bytes", 0) > 0), 0.0)  # every weight
  # Each side's idle share of the timed wall time (rl/rollout_mesh.py's IdleClock, per step's cycle).
  wall = sum(r["step_seconds"] for r in timed)
  idle_train, idle_roll = (sum(r.get(key, 0.0) * r["step_seconds"] for r in timed) / wall
                           for key in ("trainer_idle_share", "rollout_idle_share"))
  print(f"{mode:>13} {steps_per_s:8.3f} {rollout:10.3f} {update:10.3f} {share:13.0%} {sampled:14.1f} {update_tps:13.1f} "
        f"{sync_s:8.4f} {sync_mb:8.2f} {idle_train:10.0%} {idle_roll:9.0%}")
  print(f"RESULT rl mode={mode} platform={args.platform} steps_per_s={steps_per_s:.4f} rollout_s={rollout:.4f} "
        f"update_s={update:.4f} rollout_share={share:.3f} rollout_tokens_per_s={sampled:.1f} "
        f"update_tokens_per_s={update_tps:.1f} weight_sync_s={sync_s:.5f} weight_sync_bytes={sync_mb * 2**20:.0f} "
        f"first_sync_bytes={first:.0f} "
        f"trainer_idle_share={idle_train:.3f} rollout_idle_share={idle_roll:.3f}"
        + _episodes(timed, args.rows))


def _episodes(timed: list[dict[str, Any]], rows: int) -> str:
  """The tools mode's figures (printed, and the RESULT line's tail); "" for single-turn modes."""
  if "episodes/mean_turns" not in timed[0]:
    return ""
  per_s = statistics.median(rows / r["rollout_s"] for r in timed)
  share = statistics.median(r["episodes/model_token_share"] for r in timed)
  turns = statistics.median(r["episodes/mean_turns"] for r in timed)
  overlap = statistics.median(r.get("episodes/overlapped_step_share", 0.0) for r in timed)
  print(f"  tools: {per_s:.2f} episodes/s, {turns:.2f} model turns per episode, model-token share {share:.1%}, "
        f"{overlap:.0%} of decode steps while an environment ran")
  return (f" episodes_per_s={per_s:.3f} mean_turns={turns:.2f} model_token_share={share:.4f} "
          f"overlapped_step_share={overlap:.3f}")

if __name__ == "__main__":
  bench_args.run(main)
