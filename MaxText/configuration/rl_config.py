"""The reinforcement-learning group (objective=grpo): rollouts, rewards and the GRPO loss.

Every field holds the base.yml key of its name; MaxText/rl/ and objectives/grpo.py read them.
Checked here without I/O; reward paths are imported when the run opens its data (rl/rewards.py).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any, Mapping

from MaxText.configuration.config_fields import DATA_POSITION, key, read_keys
from MaxText.configuration.config_fields import require as _require

GRPO_LOSS_TYPES = ("grpo", "dapo", "dr_grpo")  # objectives/grpo_loss.py
REWARD_SCALINGS = ("group", "batch", "none")
# objectives/rollout_correction.py's MODES (the names of TRL's vllm_importance_sampling_mode)
IMPORTANCE_SAMPLING_MODES = ("off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
OLD_LOGPS_SOURCES = ("auto", "trainer", "sampler")  # grpo_old_logps: where the ratio's π_old comes from


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLConfig:
  num_generations: int = key(fixed_on_resume=DATA_POSITION)  # completions per prompt: a group
  max_completion_length: int = key()
  rl_sampling_temperature: float = key()
  rl_sampling_top_p: float = key()
  rl_sampling_top_k: int = key()
  reward_functions: tuple[str, ...] = key()  # built-in names or package.module:function
  reward_weights: tuple[float, ...] = key()  # () = every function weighs 1
  rl_prompt_column: str = key(fixed_on_resume=DATA_POSITION)
  rl_answer_column: str = key()  # exact_match compares the completion's answer with this column
  rl_format_regex: str = key()  # format: 1 when the completion matches
  rl_length_penalty_window: int = key()  # length_penalty: tokens before max_completion_length where it ramps
  grpo_beta: float = key()  # KL weight to the frozen reference (0 = no reference)
  grpo_epsilon_low: float = key()
  grpo_epsilon_high: float = key()
  grpo_num_iterations: int = key()  # optimizer updates per rollout batch (μ)
  grpo_loss_type: str = key()
  grpo_scale_rewards: str = key()
  grpo_old_logps: str = key()  # an OLD_LOGPS_SOURCES entry (old_logps_from_sampler)
  rl_importance_sampling: str = key()  # off or a rollout_correction.MODES entry
  rl_importance_sampling_cap: float = key()  # C_max: the weight's ceiling (truncate) or rejection bound (mask)
  rl_importance_sampling_floor: float = key()  # C_min: the same below (0 = none)
  rl_rollout_devices: int = key()  # 0 = the rollouts run on the training mesh (rl/rollout_mesh.py)
  rl_rollout_ici_tensor_parallelism: int = key()
  rl_weight_sync_interval: int = key()
  rl_max_staleness: int = key()  # 0 = synchronous; bounds rl_weight_sync_interval - 1
  rl_environment: str = key()  # "" = single-turn; calculator or package.module:Name (rl/environments.py)
  rl_environment_timeout_seconds: float = key()  # the most one call of the environment may take
  rl_max_turns: int = key()  # model turns per episode
  rl_max_episode_tokens: int = key()  # prompt + every turn; 0 = max_target_length + 1
  rl_interleave_episodes: bool = key()  # episodes keep their slots while their environment runs (rl/interleaved_episodes.py)
  rl_teacher_kl_weight: float = key()  # λ: on-policy distillation from the distill_teacher_* teacher (0 = none)
  rl_reward_advantage_weight: float = key()  # w_r: the reward's advantage in each token's (0 = the teacher's alone)

  @classmethod
  def from_values(cls, v: Mapping[str, Any]) -> "RLConfig":
    rl = cls(**read_keys(cls, v))
    if v["objective"] != "grpo":
      return rl
    _require(rl.num_generations >= 2, f"num_generations={rl.num_generations}: GRPO compares the completions of one "
             "prompt with each other, so a group of 1 has zero advantage and trains nothing; use num_generations >= 2")
    _require(rl.max_completion_length >= 1, f"max_completion_length must be >= 1, got {rl.max_completion_length}")
    prefill, length = v["max_prefill_predict_length"], v["max_target_length"]
    _require(prefill + rl.max_completion_length <= length + 1,
             f"max_prefill_predict_length ({prefill}) + max_completion_length ({rl.max_completion_length}) must be "
             f"<= max_target_length + 1 ({length + 1}): a prompt and its completion are one training sequence")
    _require(rl.rl_sampling_temperature > 0, f"rl_sampling_temperature must be > 0, got {rl.rl_sampling_temperature}")
    _require(0 < rl.rl_sampling_top_p <= 1, f"rl_sampling_top_p must be in (0, 1], got {rl.rl_sampling_top_p}")
    _require(0 <= rl.rl_sampling_top_k <= v["vocab_size"],
             f"rl_sampling_top_k must be in [0, vocab_size] (0 = off), got {rl.rl_sampling_top_k}")
    _require(bool(rl.reward_functions) or bool(rl.rl_environment), "objective=grpo needs reward_functions: built-in "
             "names (exact_match, format, length_penalty) or package.module:function paths (or an rl_environment, "
             "whose episodes give rewards)")
    _require(not rl.reward_weights or len(rl.reward_weights) == len(rl.reward_functions),
             f"reward_weights has {len(rl.reward_weights)} values for {len(rl.reward_functions)} reward_functions; "
             "give one weight per function or none (all 1)")
    twice = sorted({name for name in rl.reward_functions if rl.reward_functions.count(name) > 1})
    _require(not twice, f"reward_functions lists {', '.join(twice)} twice; list each function once and give it the "
             "sum of the weights in reward_weights")
    weights = tuple(_number(w) for w in rl.reward_weights)  # a command line's `1,0.5` arrives as text
    _require(all(math.isfinite(w) for w in weights), "reward_weights must be finite numbers (the reward is their "
             f"weighted sum), got {', '.join(map(str, rl.reward_weights))}")
    rl = dataclasses.replace(rl, reward_weights=weights)
    # inf was accepted: inf x the KL's exact 0 at the first step made every loss NaN
    _require(math.isfinite(rl.grpo_beta) and rl.grpo_beta >= 0, f"grpo_beta must be a finite number >= 0 (0 = no "
             f"KL term), got {rl.grpo_beta}")
    _require(0 <= rl.grpo_epsilon_low < 1 and rl.grpo_epsilon_high >= 0,
             f"grpo_epsilon_low must be in [0, 1) and grpo_epsilon_high >= 0; got {rl.grpo_epsilon_low}, "
             f"{rl.grpo_epsilon_high}")
    _require(rl.grpo_num_iterations >= 1, f"grpo_num_iterations must be >= 1, got {rl.grpo_num_iterations}")
    _require(rl.grpo_loss_type in GRPO_LOSS_TYPES,
             f"grpo_loss_type must be one of {', '.join(GRPO_LOSS_TYPES)}; got {rl.grpo_loss_type!r}")
    _require(rl.grpo_scale_rewards in REWARD_SCALINGS,
             f"grpo_scale_rewards must be one of {', '.join(REWARD_SCALINGS)}; got {rl.grpo_scale_rewards!r}")
    _require(rl.rl_length_penalty_window >= 0, "rl_length_penalty_window must be >= 0")
    _check_importance_sampling(rl)
    _check_teacher(v, rl)
    _check_old_logps(rl)
    _require(rl.rl_weight_sync_interval >= 1, f"rl_weight_sync_interval must be >= 1 (copy the weights to the rollout "
             f"mesh every this many updates), got {rl.rl_weight_sync_interval}")
    _check_staleness(rl)
    _check_environment(rl, length)
    _check_grpo_run(v, rl)
    return rl


def _number(value: object) -> float:
  try:
    return float(value) if isinstance(value, (int, float, str)) else math.nan
  except ValueError:
    return math.nan


def _check_importance_sampling(rl: RLConfig) -> None:
  mode = rl.rl_importance_sampling
  _require(mode in IMPORTANCE_SAMPLING_MODES, f"rl_importance_sampling must be one of "
           f"{', '.join(IMPORTANCE_SAMPLING_MODES)}; got {mode!r}")
  if mode == "off":
    return
  cap, floor = rl.rl_importance_sampling_cap, rl.rl_importance_sampling_floor
  _require(math.isfinite(cap) and cap >= 1, f"rl_importance_sampling_cap must be a finite number >= 1 (a token the "
           f"engine and the trainer score alike has weight 1 and must keep it), got {cap}")
  _require(0 <= floor <= 1, f"rl_importance_sampling_floor must be in [0, 1] (0 = no lower bound), got {floor}")
  sampled = (rl.rl_sampling_temperature, rl.rl_sampling_top_p, rl.rl_sampling_top_k)
  _require(sampled == (1.0, 1.0, 0), f"rl_importance_sampling={mode} weighs tokens by the trainer's over the engine's "
           "log-probability, both of the model's own distribution (temperature 1, every token allowed), but the "
           f"rollouts sample with rl_sampling_temperature={sampled[0]}, rl_sampling_top_p={sampled[1]}, "
           f"rl_sampling_top_k={sampled[2]}; set them to 1, 1, 0 or rl_importance_sampling=off")


def old_logps_from_sampler(rl: RLConfig) -> bool:
  """Whether the ratio's π_old is the engine's log-prob of each sampled token (the policy that sampled
  the batch, which a batch made ahead lags by up to rl_max_staleness updates) instead of the trainer's
  at the step. auto: the engine's when batches may be stale and no importance weights correct them."""
  if rl.grpo_old_logps == "auto":
    return rl.rl_max_staleness > 0 and rl.rl_importance_sampling == "off"
  return rl.grpo_old_logps == "sampler"


def _check_old_logps(rl: RLConfig) -> None:
  source = rl.grpo_old_logps
  _require(source in OLD_LOGPS_SOURCES, f"grpo_old_logps must be one of {', '.join(OLD_LOGPS_SOURCES)}; got {source!r}")
  _require(source != "sampler" or rl.rl_importance_sampling == "off", "grpo_old_logps=sampler makes the engine's "
           f"log-probs the ratio's old policy, which rl_importance_sampling={rl.rl_importance_sampling} would weigh by "
           "the trainer's once more; set grpo_old_logps=trainer (importance weights) or rl_importance_sampling=off")


def _check_teacher(v: Mapping[str, Any], rl: RLConfig) -> None:
  """On-policy distillation (objectives/teacher_advantage.py): a teacher exactly when λ > 0."""
  weight, reward_weight = rl.rl_teacher_kl_weight, rl.rl_reward_advantage_weight
  _require(math.isfinite(weight) and weight >= 0, f"rl_teacher_kl_weight must be a finite number >= 0 (0 = no "
           f"teacher), got {weight}")
  _require(math.isfinite(reward_weight) and reward_weight >= 0, "rl_reward_advantage_weight must be a finite number "
           f">= 0 (0 = the teacher's advantage alone), got {reward_weight}")
  teacher = v["distill_teacher_path"]
  _require(weight == 0 or bool(teacher), f"rl_teacher_kl_weight={weight} distils from a teacher on the rollouts: set "
           "distill_teacher_path to its checkpoint (and distill_teacher_model_name if no model keys are saved with it)")
  _require(weight > 0 or not teacher, f"objective=grpo with distill_teacher_path={teacher} but rl_teacher_kl_weight=0:"
           " the teacher would be loaded and never used; set rl_teacher_kl_weight > 0 (e.g. 1) or drop the teacher")
  _require(weight > 0 or reward_weight > 0, "rl_reward_advantage_weight=0 and rl_teacher_kl_weight=0 leave every "
           "advantage 0 and train nothing; set one of them > 0")


def _check_grpo_run(v: Mapping[str, Any], rl: RLConfig) -> None:
  _require(v["dataset_type"] in ("hf", "grain"), "objective=grpo reads prompt records with dataset_type=hf "
           f"(JSON/JSONL/Parquet files) or grain (JSON records); got dataset_type={v['dataset_type']}")
  _require(v["tokenizer_type"] == "huggingface", "objective=grpo renders prompts with the model's chat template and "
           f"decodes completions with its Hugging Face tokenizer: set tokenizer_type=huggingface (got "
           f"{v['tokenizer_type']})")
  _require(not v["load_full_state_path"], "objective=grpo starts from load_parameters_path (the policy's first "
           "weights and the frozen reference), not load_full_state_path; to continue a GRPO run, rerun it")
  _require(v["eval_interval"] < 0, "objective=grpo has no eval batches (its progress is the reward of each rollout "
           "batch, in the step metrics); set eval_interval=-1")
  _require(v["ici_pipeline_parallelism"] == 1 and v["dcn_pipeline_parallelism"] == 1,
           "objective=grpo generates with the KV-cache engine, which has no pipeline stages; set "
           "ici_pipeline_parallelism=1 and dcn_pipeline_parallelism=1")
  _require(not (v["optimizer_memory_host_offload"] and rl.grpo_num_iterations > 1),
           "grpo_num_iterations > 1 keeps the optimizer state on the device across its updates; set "
           "optimizer_memory_host_offload=False or grpo_num_iterations=1")


def own_rollout_devices(objective: str, rl: RLConfig) -> int:
  """The devices rolling out on a mesh of their own: rl_rollout_devices with objective=grpo, else none."""
  return rl.rl_rollout_devices if objective == "grpo" else 0


def training_devices(v: Mapping[str, Any], num_devices: int, num_processes: int) -> int:
  """The devices the training mesh and the global batch count: all but the rollout mesh's."""
  rollout = v["rl_rollout_devices"] if v["objective"] == "grpo" else 0
  if rollout == 0:
    return num_devices
  _require(rollout > 0, f"rl_rollout_devices must be >= 0 (the last devices that roll out on a mesh of their own; 0 = "
           f"roll out on the training mesh), got {rollout}")
  _require(rollout < num_devices, f"rl_rollout_devices={rollout} leaves no device to train of the {num_devices} "
           f"devices; give the rollouts at most {num_devices - 1} (0 = roll out on the training mesh)")
  # Several processes: each gives its last rl_rollout_devices / processes devices to the rollouts
  # (rl/rollout_mesh.py), and the weight copy needs as many training devices per rollout device on each.
  _require(rollout % num_processes == 0, f"rl_rollout_devices={rollout}: each of the {num_processes} processes gives "
           f"the rollouts the same number of its devices; give a multiple of {num_processes}")
  local, local_rollout = num_devices // num_processes, rollout // num_processes
  _require(num_processes == 1 or (local - local_rollout) % local_rollout == 0,
           f"rl_rollout_devices={rollout}: each process would train on {local - local_rollout} and roll out on "
           f"{local_rollout} of its {local} devices; the weight copy across processes needs the training devices to "
           "be a multiple of the rollout devices on each (e.g. rl_rollout_devices="
           f"{num_processes * max(d for d in range(1, local) if local % d == 0 and d <= local // 2)})")
  tensor = v["rl_rollout_ici_tensor_parallelism"]
  _require(tensor >= 1 and rollout % tensor == 0, f"rl_rollout_ici_tensor_parallelism={tensor} does not divide the "
           f"rl_rollout_devices={rollout}; give a divisor of it (the rest of the rollout mesh is data)")
  return num_devices - rollout


def check_rollout_heads(rl: RLConfig, num_query_heads: int, objective: str) -> None:
  """The rollout mesh's tensor degree splits the attention heads: it must divide them."""
  tensor = rl.rl_rollout_ici_tensor_parallelism
  _require(objective != "grpo" or rl.rl_rollout_devices == 0 or num_query_heads % tensor == 0,
           f"rl_rollout_ici_tensor_parallelism={tensor} does not divide the model's {num_query_heads} query heads, so "
           "the rollout mesh cannot hold the model; give a divisor of them")


def _check_environment(rl: RLConfig, max_target_length: int) -> None:
  """Multi-turn episodes (rl/episodes.py): their limits, and what they do not combine with yet."""
  if not rl.rl_environment:
    return
  _require(rl.rl_max_turns >= 1, f"rl_max_turns must be >= 1 (model turns per episode), got {rl.rl_max_turns}")
  # inf or past threading.TIMEOUT_MAX: the guard's first wait raised OverflowError
  _require(0 < rl.rl_environment_timeout_seconds <= threading.TIMEOUT_MAX, "rl_environment_timeout_seconds must be "
           f"> 0 and at most {threading.TIMEOUT_MAX:.0f} (the most one call of the environment may take; a thread "
           f"waits no longer), got {rl.rl_environment_timeout_seconds}")
  _require(0 <= rl.rl_max_episode_tokens <= max_target_length + 1, f"rl_max_episode_tokens={rl.rl_max_episode_tokens}"
           f" must be in [0, max_target_length + 1 = {max_target_length + 1}] (an episode is one training sequence; "
           "0 = that bound)")


def _check_staleness(rl: RLConfig) -> None:
  """A batch samples from the last weight copy, up to rl_weight_sync_interval - 1 updates old."""
  stale = rl.rl_max_staleness
  _require(stale >= 0, f"rl_max_staleness must be >= 0 (0 = synchronous), got {stale}")
  _require(stale == 0 or rl.rl_rollout_devices > 0, f"rl_max_staleness={stale} generates batches while the training "
           "runs, which needs devices of its own for the rollouts: set rl_rollout_devices (or rl_max_staleness=0)")
  interval = rl.rl_weight_sync_interval
  # Without a rollout mesh there is no copy to space out: name the missing key here, rather than ask for a
  # staleness bound that the check above then refuses for the same reason.
  _require(interval == 1 or rl.rl_rollout_devices > 0, f"rl_weight_sync_interval={interval} spaces out the weight "
           "copies to a rollout mesh of its own, which needs devices: set rl_rollout_devices (and rl_max_staleness >= "
           f"{interval - 1}) or rl_weight_sync_interval=1")
  _require(interval - 1 <= stale, f"rl_weight_sync_interval={interval} trains on batches sampled up to {interval - 1} "
           f"steps before, beyond rl_max_staleness={stale}; raise rl_max_staleness to {interval - 1} or lower the "
           "interval")
  tensor = rl.rl_rollout_ici_tensor_parallelism
  # Was accepted and ignored: the same-mesh rollouts run in the training layout, whatever this degree says.
  _require(tensor == 1 or rl.rl_rollout_devices > 0, f"rl_rollout_ici_tensor_parallelism={tensor} lays out a rollout "
           "mesh of its own, which needs devices: set rl_rollout_devices (a multiple of it) or "
           "rl_rollout_ici_tensor_parallelism=1 (the rollouts then run on the training mesh, in its layout)")
