"""Score a model's greedy completions of prompt records with reward functions:

    python3 -m MaxText.rl.evaluate configs/grpo.yml load_parameters_path=CKPT tokenizer_path=TOK \\
        hf_data_files=heldout.jsonl reward_functions=exact_match [max_completion_length=...]

num_generations completions per prompt, sampled as a GRPO rollout samples them
(rl_sampling_temperature, rl_sampling_top_p, rl_sampling_top_k) by the same engine, seeded from
decode_sampling_seed (the same checkpoint gives the same score), scored by the same reward
functions: the mean is the policy's expected reward, which a greedy completion would not show. Prints the mean reward (and per function) and the first
four prompts with a completion each: a before/after check of an RL run on prompts it never saw.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # `python3 MaxText/rl/evaluate.py`: import the package, not sibling files.
  sys.path[0] = str(Path(__file__).resolve().parent.parent.parent)

from typing import Any

import numpy as np

from MaxText import startup
from MaxText.configuration import config as config_lib
from MaxText.errors import ConfigError, run_cli
from MaxText.inference.engine import load_engine
from MaxText.inference.sampling import RowParams
from MaxText.input_pipeline import chat
from MaxText.input_pipeline.tokenizer import load_tokenizer
from MaxText.platform.distributed import log
from MaxText.rl import episodes as episodes_lib
from MaxText.rl import interleaved_episodes
from MaxText.rl import prompts as prompts_lib
from MaxText.rl import rewards as rewards_lib
from MaxText.rl.rollouts import generate, padded_generate

MAX_SLOTS = 64  # prompts decoded together


def evaluate(config: config_lib.Config, show: int = 4) -> dict[str, float]:
  """The mean reward of sampled completions over every prompt record (and per reward function)."""
  if config.data.objective != "grpo":
    raise ConfigError("MaxText.rl.evaluate reads the GRPO keys (prompt records, reward functions): start from "
                      "configs/grpo.yml or set objective=grpo")
  tokenizer = chat.load_chat_tokenizer(config.data.tokenizer_path, require_template=False)
  # As decode and serve check: ids past the embedding would be scored as some other token's, silently.
  vocab = load_tokenizer(config.data.tokenizer_type, config.data.tokenizer_path).vocab_size
  if vocab > config.model.vocab_size:
    raise ConfigError(f"the tokenizer {config.data.tokenizer_path} has {vocab} tokens but the model's vocab_size is "
                      f"{config.model.vocab_size}: this tokenizer does not belong to this checkpoint")
  eos_id = tokenizer.eos_token_id
  reward_set = rewards_lib.RewardSet(config.rl, eos_id)
  prompt_set = prompts_lib.PromptSet(config, tokenizer)
  group = config.rl.num_generations
  prompts = [p for p in prompt_set.prompts for _ in range(group)]  # each prompt num_generations times
  slots = min(MAX_SLOTS, len(prompts))
  engine, params = load_engine(config, slots, "evaluate: no load_parameters_path given; scoring a random model")
  rl = config.rl
  seeds = np.random.SeedSequence([config.decode.decode_sampling_seed, 1 << 20]).generate_state(len(prompts))
  completions: list[list[int]] = []
  environment = episodes_lib.environment_for(rl) if rl.rl_environment else None
  if environment is not None:  # multi-turn episodes: scored by the environment (and the reward functions)
    return _evaluate_episodes(config, environment, tokenizer, engine, params, prompts, seeds, slots, reward_set,
                              show)
  for start in range(0, len(prompts), slots):
    chunk = prompts[start:start + slots]
    rows = [p.ids for p in chunk] + [chunk[-1].ids] * (slots - len(chunk))  # one shape: one compilation
    row_params = [RowParams(rl.rl_sampling_temperature, rl.rl_sampling_top_p, rl.rl_sampling_top_k, int(seed))
                  for seed in seeds[start:start + slots]]
    row_params += [row_params[-1]] * (slots - len(row_params))
    out = generate(engine, params, rows, row_params, rl.max_completion_length, eos_id)
    completions += out[:len(chunk)]
  texts = [tokenizer.decode(c[:-1] if c and c[-1] == eos_id else c, skip_special_tokens=True) for c in completions]
  scores = reward_set.score([p.prompt for p in prompts], texts, completions, prompts_lib.columns_of(prompts, 1),
                            [p.index for p in prompts])
  means = {name.rsplit(":", 1)[-1]: float(values.mean()) for name, values in scores.per_function.items()}
  log(f"evaluate: {len(prompt_set.prompts)} prompts of {prompt_set.describe}, {group} completions each "
      f"(temperature {rl.rl_sampling_temperature:g}), at most {rl.max_completion_length} new tokens")
  log(f"reward {float(scores.total.mean()):.4f} ({', '.join(f'{k} {v:.4f}' for k, v in means.items())})")
  for i in range(0, min(show, len(prompt_set.prompts)) * group, group):
    log(f"  {prompts[i].prompt!r} -> {texts[i]!r} (reward {float(scores.total[i]):g})")
  return {"reward": float(np.mean(scores.total)), **means}


def _evaluate_episodes(config: config_lib.Config, environment: Any, tokenizer: chat.ChatTokenizer, engine: Any,
                       params: Any, prompts: list[prompts_lib.Prompt], seeds: np.ndarray, slots: int,
                       reward_set: rewards_lib.RewardSet, show: int) -> dict[str, float]:
  """`evaluate` with rl_environment: each prompt's episodes, as a GRPO rollout runs them (rl/episodes.py;
  interleaved in the engine with rl_interleave_episodes, rl/interleaved_episodes.py)."""
  rl, eos_id = config.rl, tokenizer.eos_token_id
  limits = episodes_lib.Limits.of(rl, config.decode.max_prefill_predict_length, config.data.max_target_length)
  episodes: list[episodes_lib.Episode] = []
  for start in range(0, len(prompts), slots):
    chunk = prompts[start:start + slots]

    def row_params(turn: int, start: int = start, count: int = len(chunk)) -> list[RowParams]:
      turn_seeds = seeds if not turn else np.random.SeedSequence(
          [config.decode.decode_sampling_seed, 1 << 20, turn]).generate_state(len(prompts))
      return [RowParams(rl.rl_sampling_temperature, rl.rl_sampling_top_p, rl.rl_sampling_top_k, int(seed))
              for seed in turn_seeds[start:start + count]]
    records = [(p.index, p.prompt, p.columns) for p in chunk]
    if rl.rl_interleave_episodes:
      episodes += interleaved_episodes.run(environment, tokenizer, eos_id, records, engine, params, row_params, limits)
    else:
      episodes += episodes_lib.run(environment, tokenizer, eos_id, records, padded_generate(engine, params, eos_id),
                                   row_params, limits)
  total = np.asarray([e.reward for e in episodes], np.float64)
  means = {"environment": float(total.mean())}
  if reward_set.names:
    scores = reward_set.score([p.prompt for p in prompts], [e.last_text for e in episodes],
                              [e.last_ids for e in episodes], prompts_lib.columns_of(prompts, 1),
                              [p.index for p in prompts])
    total = total + scores.total
    means.update({name.rsplit(":", 1)[-1]: float(values.mean()) for name, values in scores.per_function.items()})
  shares = episodes_lib.metrics(episodes, episodes_lib.Timing())
  log(f"evaluate: {len(prompts) // rl.num_generations} prompts, {rl.num_generations} episodes each with "
      f"rl_environment={rl.rl_environment} (temperature {rl.rl_sampling_temperature:g}), at most {rl.rl_max_turns} "
      f"turns of {rl.max_completion_length} tokens; {shares['episodes/mean_turns']:.2f} turns per episode")
  log(f"reward {float(total.mean()):.4f} ({', '.join(f'{k} {v:.4f}' for k, v in means.items())})")
  for i in range(0, min(show * rl.num_generations, len(episodes)), rl.num_generations):
    shown = tokenizer.decode(episodes[i].tokens, skip_special_tokens=False)
    log(f"  {prompts[i].prompt!r} -> {shown!r} (reward {float(total[i]):g})")
  return {"reward": float(total.mean()), **means}


TOOL = startup.Tool("evaluate", reads_run=True, joins_job=True)

main = startup.config_main(TOOL, evaluate)


if __name__ == "__main__":
  run_cli(main)
