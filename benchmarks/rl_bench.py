"""How a GRPO step splits between rollout (sampling + rewards) and update, for a small model.

    python3 benchmarks/rl_bench.py [steps=12] [devices=4] [max_completion_length=32] [num_generations=8]
        [rows=32] [base_emb_dim=256] [base_num_decoder_layers=4] [platform=cpu|gpu]

Runs `python3 -m MaxText.train configs/grpo.yml` on a generated prompt set (a byte-level BPE
tokenizer, random starting weights, a reward on token ids, so completions run to
max_completion_length) and reads its metrics.jsonl. The first two steps (compilation) are left out;
the rest give medians of: rollout seconds (prefill + one decode step per token, host loop included),
update seconds (`update_s`, the rest of the step's wall time: old/reference log-probs, forward and
backward, optimizer), rollout
tokens/s (completion tokens sampled per second) and update tokens/s (every row's tokens, prompt and
padding included, per second of update). On GPU (platform=gpu) the same run uses one device.
The last line is machine-readable: `RESULT rl ...`.
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from MaxText.configuration import tool_args  # noqa: E402  (key=value arguments, the old --flags kept)

REWARD = "def low_ids(completion_ids, **_):\n  return [sum(t < 200 for t in c) / max(len(c), 1) for c in completion_ids]\n"


# The old names of options named after the config keys they set (the old --flags work with a warning).
RENAMED = {"completion": "max_completion_length", "generations": "num_generations", "emb": "base_emb_dim",
           "layers": "base_num_decoder_layers"}


def _prepare(directory: Path, model: dict[str, int]) -> None:
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
  args = tool_args.parse_args(parser, None, renamed=RENAMED)
  devices = args.devices if args.platform == "cpu" else 1
  prefill = 64
  emb = args.base_emb_dim
  model = dict(base_emb_dim=emb, base_num_query_heads=4, base_num_kv_heads=4, head_dim=emb // 4, base_mlp_dim=4 * emb,
               base_num_decoder_layers=args.base_num_decoder_layers, vocab_size=512,
               max_target_length=prefill + args.max_completion_length)
  with tempfile.TemporaryDirectory(prefix="rl-bench-") as tmp:
    directory = Path(tmp)
    _prepare(directory, model)
    command = [sys.executable, "-m", "MaxText.train", "configs/grpo.yml", "run_name=bench",
               f"base_output_directory={directory / 'out'}", f"tokenizer_path={directory / 'tokenizer'}",
               f"hf_data_files={directory / 'prompts.jsonl'}", f"load_parameters_path={directory / 'start'}",
               *(f"{k}={v}" for k, v in model.items()), f"max_prefill_predict_length={prefill}",
               f"max_completion_length={args.max_completion_length}", f"num_generations={args.num_generations}",
               f"per_device_batch_size={args.rows / devices}", "reward_functions=bench_rewards:low_ids",
               f"steps={args.steps}", "log_period=1", "checkpoint_period=100000", "print_config=False",
               "enable_tensorboard=False", "learning_rate=1e-4", "rl_sampling_temperature=1.0"]
    env = {**os.environ, "PYTHONPATH": f"{directory}:{REPO}"}
    if args.platform == "cpu":
      env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
      print(proc.stderr[-3000:], file=sys.stderr)
      return proc.returncode
    records = [json.loads(line) for line in (directory / "out" / "bench" / "metrics.jsonl").read_text().splitlines()]
  timed = [r for r in records if r["step"] > 2]
  rollout = statistics.median(r["rollout_s"] for r in timed)
  update = statistics.median(r["update_s"] for r in timed)  # the step's time but its rollout and rewards
  sampled = statistics.median(r["rollout_tokens_per_s"] for r in timed)
  update_tps = args.rows * model["max_target_length"] / update
  share = rollout / (rollout + update)
  print(f"model: emb {args.base_emb_dim}, {args.base_num_decoder_layers} layers; {args.rows} completions x "
        f"<= {args.max_completion_length} tokens per step "
        f"({args.num_generations} per prompt), prompts of ~40 tokens, {devices} {args.platform} device(s)")
  print(f"{'rollout s':>10} {'update s':>10} {'rollout share':>14} {'rollout tok/s':>14} {'update tok/s':>13}")
  print(f"{rollout:10.3f} {update:10.3f} {share:13.0%} {sampled:14.1f} {update_tps:13.1f}")
  print(f"RESULT rl platform={args.platform} rollout_s={rollout:.4f} update_s={update:.4f} rollout_share={share:.3f} "
        f"rollout_tokens_per_s={sampled:.1f} update_tokens_per_s={update_tps:.1f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
