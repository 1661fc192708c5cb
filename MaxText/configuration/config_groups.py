"""Typed, frozen groups of the configuration, each validated next to its own fields.

`build_groups(flat_values, target)` turns the flat key=value dict into ModelConfig /
MeshConfig / OptimConfig / DataConfig (data_config.py) / RunConfig / CheckpointConfig /
DecodeConfig / StartupConfig. A field is named after the base.yml key it holds (config_fields.key) or is
derived from keys (config_fields.derived: scaled sizes, the global batch, paths). Building
a group does no I/O: files, tokenizers and the clock are read where they are used.
Layers receive a ModelConfig (or one of its records: rope, attn, moe, ...) only.
"""

from __future__ import annotations

import dataclasses
import fractions
import math
import threading
from typing import Any, Mapping

from MaxText.paths import storage
from MaxText.platform.accelerators import DeviceTarget
from MaxText.configuration.config_fields import OPTIMIZER, derived, key, read_keys
from MaxText.configuration.config_fields import require as _require
from MaxText.errors import ConfigError
from MaxText.platform.mesh_axes import HYBRID_RING_SLICE, HYBRID_RINGS, MESH_AXES, Group, MeshAxis
from MaxText.configuration.data_config import DataConfig
from MaxText.configuration.decode_config import DecodeConfig
from MaxText.configuration.distill_config import DistillConfig
from MaxText.configuration import batch_split, config_yaml, elastic_config
from MaxText.configuration.model_config import ModelConfig
from MaxText.configuration import rl_config
from MaxText.configuration.rl_config import RLConfig
from MaxText.configuration.task_eval_config import TaskEvalConfig
from MaxText.configuration.model_checks import FLOAT32_MAX, one_of as _one_of, positive as _positive

METRIC_TRACKERS = ("wandb", "vertex_tensorboard")  # training/trackers.py: one class per name
WANDB_MODES = ("", "online", "offline", "disabled")
# Orbax's checkpoint events with enable_checkpoint_cloud_logger (upstream: Google Cloud Logging), in the run folder.
EVENTS_FILE = "checkpoint_events.jsonl"


def _fill_auto_axis(degrees: dict[MeshAxis, int], total: int, group: Group) -> dict[MeshAxis, int]:
  """Replaces at most one -1 degree so the group's product equals `total`."""
  def name_of(axis: MeshAxis) -> str:
    return axis.key(group)

  unit = "devices per slice" if group == "ici" else "slices"
  auto = [axis for axis, d in degrees.items() if d == -1]
  # base.yml's own -1 (FSDP within a slice, data across): a user who sets another axis to -1 never wrote it.
  default = "ici_fsdp_parallelism" if group == "ici" else "dcn_data_parallelism"
  hint = (f" ({default} is -1 in base.yml: set it to a degree, e.g. {default}=1, for another to take the rest)"
          if default in map(name_of, auto) else "")
  _require(len(auto) <= 1, f"at most one {group}_*_parallelism may be -1, got {', '.join(map(name_of, auto))}{hint}")
  for axis, d in degrees.items():
    _require(d == -1 or d >= 1, f"{name_of(axis)} must be >= 1 or -1, got {d}")
  fixed = {a: d for a, d in degrees.items() if d != -1}
  product = math.prod(fixed.values())
  named = " * ".join(name_of(a) for a, d in fixed.items() if d != 1) or f"the {group}_* degrees"
  if total % product:
    raise ConfigError(f"{named} = {product} does not divide {total} {unit}")
  if auto:
    return {**degrees, auto[0]: total // product}
  _require(product == total, f"{named} = {product} uses only {product} of {total} {unit}; "
           f"set one {group}_*_parallelism to -1 to fill the rest")
  return degrees


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
  ici_data_parallelism: int = key()
  ici_pipeline_parallelism: int = key()
  ici_fsdp_parallelism: int = key()
  ici_fsdp_transpose_parallelism: int = key()
  ici_sequence_parallelism: int = key()
  ici_tensor_parallelism: int = key()
  ici_expert_parallelism: int = key()
  ici_autoregressive_parallelism: int = key()
  dcn_data_parallelism: int = key()
  dcn_pipeline_parallelism: int = key()
  dcn_fsdp_parallelism: int = key()
  dcn_fsdp_transpose_parallelism: int = key()
  dcn_sequence_parallelism: int = key()
  dcn_tensor_parallelism: int = key()
  dcn_expert_parallelism: int = key()
  dcn_autoregressive_parallelism: int = key()
  num_slices: int = key()  # -1 resolved from the devices
  allow_split_physical_axes: bool = key()  # a mesh axis may take part of a physical torus axis
  custom_mesh: str = key()  # "" (jax's device order) or a mesh_axes.HYBRID_RINGS name
  elastic_min_slices: int = key()  # 0 = not elastic; configuration/elastic_config.py
  logical_axis_rules: tuple[tuple[str, tuple[str, ...]], ...] = key()
  data_sharding: tuple[str, ...] = key()
  sharding_tolerance: float = key()

  def degrees(self, group: Group) -> tuple[tuple[str, int], ...]:
    """(mesh axis, degree) of the `ici` or `dcn` keys, in MESH_AXES order (-1 values resolved)."""
    return tuple((axis.value, getattr(self, axis.key(group))) for axis in MeshAxis)

  @property
  def ici(self) -> tuple[tuple[str, int], ...]:
    return self.degrees("ici")

  @property
  def dcn(self) -> tuple[tuple[str, int], ...]:
    return self.degrees("dcn")

  @property
  def shape(self) -> tuple[tuple[str, int], ...]:
    """Total degree per mesh axis (ici × dcn), in MESH_AXES order."""
    dcn = dict(self.dcn)
    return tuple((axis, degree * dcn[axis]) for axis, degree in self.ici)

  @property
  def num_devices(self) -> int:
    """The training mesh's devices: the target's, less a rollout mesh's (rl_rollout_devices), which
    Config.target still counts. The step's FLOPs and tokens are per device of this mesh."""
    return math.prod(degree for _, degree in self.shape)

  def batch_axes(self, rows: int, micro_batches: int = 1, pipeline_micro: int = 1) -> tuple[str, ...]:
    """The data_sharding axes a batch of `rows` rows, taken in `micro_batches` micro-batches of
    `pipeline_micro` pipeline microbatches each, is split over (batch_split.batch_axes): all of them
    when their devices divide it; else only those the model splits rows over, the others (by default
    sequence and tensor) holding the same rows, as upstream MaxText does for a per_device_batch_size
    under 1. The caller checks that the axes returned divide the rows (batch_split.splits)."""
    return batch_split.batch_axes(dict(self.shape), self.data_sharding, self.logical_axis_rules, rows, micro_batches,
                                  pipeline_micro)

  @classmethod
  def from_values(cls, v: Mapping[str, Any], target: DeviceTarget) -> "MeshConfig":
    num_slices = v["num_slices"] if v["num_slices"] != -1 else target.num_slices
    _require(num_slices >= 1 and target.num_devices % num_slices == 0,
             f"num_slices={num_slices} does not divide the {target.num_devices} devices")
    resolved: dict[str, Any] = {"num_slices": num_slices}
    group: Group
    for group, total in (("ici", target.num_devices // num_slices), ("dcn", num_slices)):
      degrees = _fill_auto_axis({a: v[a.key(group)] for a in MeshAxis}, total, group)
      resolved.update({a.key(group): d for a, d in degrees.items()})
    rules = []
    for rule in v["logical_axis_rules"]:
      _require(isinstance(rule, (list, tuple)) and len(rule) == 2 and isinstance(rule[0], str),
               f"each logical_axis_rules entry must be [logical_name, [mesh_axes...]], got {rule!r}")
      mesh_axes = (rule[1],) if isinstance(rule[1], str) else tuple(rule[1] or ())
      for axis in mesh_axes:
        _require(axis in MESH_AXES, f"logical_axis_rules maps {rule[0]!r} to unknown mesh axis "
                 f"{axis!r}; mesh axes are {', '.join(MESH_AXES)}")
      rules.append((rule[0], mesh_axes))
    for i, axis in enumerate(v["data_sharding"]):
      _require(axis in MESH_AXES, f"data_sharding names unknown mesh axis {axis!r}; mesh axes are {', '.join(MESH_AXES)}")
      _require(axis not in v["data_sharding"][:i], f"data_sharding names mesh axis {axis!r} twice; name each axis once")
    _require(0.0 <= v["sharding_tolerance"] <= 1.0,
             f"sharding_tolerance must be in [0, 1], got {v['sharding_tolerance']}")
    _check_custom_mesh(v, resolved, target.num_devices // num_slices)
    return cls(**read_keys(cls, v, logical_axis_rules=tuple(rules), **resolved))


def _check_custom_mesh(v: Mapping[str, Any], resolved: Mapping[str, Any], per_slice: int) -> None:
  name = v["custom_mesh"]
  if not name:
    return
  _require(name in HYBRID_RINGS, f"custom_mesh={name!r} is not a device order here; known: "
           f"{', '.join(HYBRID_RINGS)} ('' for jax's own)")
  rings, size = HYBRID_RINGS[name]
  chips = math.prod(HYBRID_RING_SLICE)
  _require(per_slice == chips, f"custom_mesh={name} lays out the {chips} chips of a v6e-256 slice; this target has "
           f"{per_slice} devices per slice; drop custom_mesh")
  split = {a.ici_key: resolved[a.ici_key] for a in MeshAxis if resolved[a.ici_key] > 1}
  _require(sorted(split.values()) == sorted((rings, size)), f"custom_mesh={name} needs two ici axes of degrees "
           f"{rings} and {size} (the rest 1), got {', '.join(f'{k}={d}' for k, d in split.items()) or 'none'}")
  _require(v["allow_split_physical_axes"] or resolved["num_slices"] > 1,
           f"custom_mesh={name} on one slice needs allow_split_physical_axes=True (upstream MaxText ignores it "
           "otherwise); set it, or drop custom_mesh")


OPT_TYPES = ("adamw", "muon", "sgd", "adam_pax")  # training/optimizers.create_optimizer
FLOAT32_TINY = 1.1754943508222875e-38  # float32's smallest normal number
FLOAT32_BELOW_ONE = 1.0 - 2.0**-24  # float32's largest number below 1; a decay above it is 1.0 on the device
# Each state dtype's largest number below 1: the moments are kept in weight_dtype, where a larger decay is 1.0.
BELOW_ONE = {"float32": FLOAT32_BELOW_ONE, "bfloat16": 1.0 - 2.0**-8, "float16": 1.0 - 2.0**-11}
# Each state dtype's smallest normal number: an epsilon below it is 0 (or flushed to 0) there. bfloat16 has
# float32's exponent range.
TINY = {"float32": FLOAT32_TINY, "bfloat16": FLOAT32_TINY, "float16": 2.0**-14}
MAX_MUON_NS_STEPS = 100


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
  opt_type: str = key(fixed_on_resume=OPTIMIZER)
  learning_rate: float = key()
  warmup_steps_fraction: float = key()
  learning_rate_schedule_steps: int = key()  # -1 resolved to the run's optimizer updates
  cosine_learning_rate_final_fraction: float = key()
  adam_b1: float = key()
  adam_b2: float = key()
  adam_eps: float = key()
  adam_eps_root: float = key()
  adam_weight_decay: float = key()
  # Muon (opt_type=muon; training/muon.py): momentum, Newton-Schulz iterations, and the update's RMS match to
  # AdamW's (0 = optax's width scaling); its state differs from AdamW's, so a resume must agree on opt_type.
  muon_beta: float = key()
  muon_ns_steps: int = key()
  muon_consistent_rms: float = key()
  gradient_clipping_threshold: float = key()
  gradient_accumulation_steps: int = key()
  z_loss_multiplier: float = key()
  # DPO's loss (objective=dpo; MaxText/training/objectives/dpo.py): the reward scale β and the conservative-DPO flip probability.
  dpo_beta: float = key()
  dpo_label_smoothing: float = key()
  optimizer_memory_host_offload: bool = key()  # optimizer state in pinned host memory
  warmup_steps: int = derived()

  @classmethod
  def from_values(cls, v: Mapping[str, Any]) -> "OptimConfig":
    _require(v["opt_type"] in OPT_TYPES, f"opt_type must be one of {', '.join(OPT_TYPES)}, got {v['opt_type']!r}")
    _require(0.0 < v["muon_beta"] <= FLOAT32_BELOW_ONE and v["muon_ns_steps"] >= 1
             and 0.0 <= v["muon_consistent_rms"] <= FLOAT32_MAX,
             f"Muon needs 0 < muon_beta < 1 (in float32), muon_ns_steps >= 1 and muon_consistent_rms a finite float32 "
             f"number >= 0; got {v['muon_beta']}, {v['muon_ns_steps']}, {v['muon_consistent_rms']}")
    # Below float32's smallest normal it is 0 on the device (0 itself picks optax's width scaling): every
    # matrix update would be 0.
    rms = v["muon_consistent_rms"]
    _require(v["opt_type"] != "muon" or rms == 0 or rms >= FLOAT32_TINY, f"muon_consistent_rms={rms} is 0 in float32 "
             f"(below {FLOAT32_TINY:.3g}) and would zero every matrix update; set 0 (optax's width scaling) or 0.2")
    # Optax unrolls the iterations into the compiled step, whose compile time grows with their number.
    _require(v["muon_ns_steps"] <= MAX_MUON_NS_STEPS, f"muon_ns_steps must be at most {MAX_MUON_NS_STEPS} (each "
             f"iteration is unrolled into the compiled step; 5 is the published setting), got {v['muon_ns_steps']}")
    _positive(v, "learning_rate", "gradient_accumulation_steps")
    # An infinite learning rate (or one past float32's range, inf on the device) passes `> 0` and trains on NaN.
    _require(v["learning_rate"] <= FLOAT32_MAX, f"learning_rate must be a finite float32 number > 0, got "
             f"{v['learning_rate']}")
    # Below float32's smallest normal it is 0 (or flushed to 0) on the device: every update would be 0.
    _require(v["learning_rate"] >= FLOAT32_TINY, f"learning_rate={v['learning_rate']} is 0 in float32 (below "
             f"{FLOAT32_TINY:.3g}): the run would train nothing; set a learning rate such as 3e-4")
    for name in ("adam_eps", "adam_eps_root", "adam_weight_decay", "z_loss_multiplier"):
      # A negative value flips what the term does (a weight growth, a reward for large logits, a
      # denominator through zero), a silently different optimizer.
      _require(0 <= v[name] <= FLOAT32_MAX, f"{name} must be a finite float32 number >= 0, got {v[name]}")
    # Adam divides by sqrt(v + eps_root) + eps: a parameter whose gradient is 0 (an embedding row no batch
    # uses, a LoRA adapter at its start) is 0/0 = NaN on the first update. Below float32's smallest normal
    # an epsilon may be flushed to 0.
    _require(v["opt_type"] == "sgd" or max(v["adam_eps"], v["adam_eps_root"]) >= FLOAT32_TINY,
             f"adam_eps={v['adam_eps']} and adam_eps_root={v['adam_eps_root']}: Adam's update m / (sqrt(v + "
             "adam_eps_root) + adam_eps) is 0/0 = NaN for a parameter whose gradients are 0 (an unused embedding row, "
             f"a LoRA adapter at its start); set adam_eps > 0 (at least {FLOAT32_TINY:.3g}; 1e-8 is usual)")
    # The update is computed in the moments' dtype (weight_dtype): in float16 1e-8 is 0, and so is the square
    # of a gradient below about 2e-4, so the update was 0/0 = NaN or m/0 = inf.
    state_tiny = TINY.get(v["weight_dtype"], FLOAT32_TINY)
    _require(v["opt_type"] == "sgd" or max(v["adam_eps"], v["adam_eps_root"]) >= state_tiny,
             f"adam_eps={v['adam_eps']} and adam_eps_root={v['adam_eps_root']} are 0 in {v['weight_dtype']}, the "
             f"dtype the optimizer keeps its moments in (weight_dtype={v['weight_dtype']}): a small or zero gradient's "
             f"update would be NaN or inf; set adam_eps >= {state_tiny:.3g} or weight_dtype=float32")
    final = v["cosine_learning_rate_final_fraction"]
    _require(0.0 <= final <= 1.0, "cosine_learning_rate_final_fraction (the schedule's last learning rate over its "
             f"peak) must be in [0, 1], got {final}")
    _require(0.0 <= v["warmup_steps_fraction"] <= 1.0,
             f"warmup_steps_fraction must be in [0, 1], got {v['warmup_steps_fraction']}")
    schedule_steps = v["learning_rate_schedule_steps"]
    # The schedule counts optimizer updates: a GRPO step makes grpo_num_iterations of them.
    updates_per_step = v["grpo_num_iterations"] if v["objective"] == "grpo" else 1
    schedule_steps = v["steps"] * updates_per_step if schedule_steps == -1 else schedule_steps
    _require(schedule_steps > 0, f"learning_rate_schedule_steps must be > 0 or -1, got {schedule_steps}")
    # The step counter and the schedule's step are int32 on the device.
    named = (f"learning_rate_schedule_steps={schedule_steps}" if v["learning_rate_schedule_steps"] != -1 else
             f"steps={v['steps']}" + (f" x grpo_num_iterations={updates_per_step}" if updates_per_step > 1 else ""))
    _require(schedule_steps < 2**31, f"{named} is {schedule_steps} optimizer updates, more than the 2**31 - 1 the "
             "device's int32 step counter holds; lower it")
    for name in ("adam_b1", "adam_b2"):
      # Above FLOAT32_BELOW_ONE a decay is 1.0 on the device: the bias correction 1 - b^t is 0 (b1: inf updates).
      _require(0.0 <= v[name] <= FLOAT32_BELOW_ONE, f"{name} must be in [0, 1) and below 1 in float32 (at most "
               f"{FLOAT32_BELOW_ONE:.8f}), got {v[name]}")
    # Optax keeps the moments (Muon its momentum) in the parameters' dtype and decays them there: with
    # bfloat16 weights a b2 of 0.999 is 1.0, and the second moment only ever grew.
    state_dtype = v["weight_dtype"]
    below = BELOW_ONE.get(state_dtype, FLOAT32_BELOW_ONE)
    decays = {"sgd": (), "muon": ("adam_b1", "adam_b2", "muon_beta")}.get(v["opt_type"], ("adam_b1", "adam_b2"))
    for name in decays:
      _require(v[name] <= below, f"{name}={v[name]} is 1.0 in {state_dtype}, the dtype the optimizer keeps its moments "
               f"in (weight_dtype={state_dtype}): they would never decay; set {name} <= {below:.8g} or "
               "weight_dtype=float32")
    # The decoupled decay multiplies each weight by 1 - learning_rate x adam_weight_decay per update: at 1 or more
    # every weight is zeroed or flipped in sign, growing each update past 2, and the loss ran off to inf.
    decay = v["learning_rate"] * v["adam_weight_decay"]
    _require(v["opt_type"] == "sgd" or decay < 1, f"learning_rate={v['learning_rate']} x adam_weight_decay="
             f"{v['adam_weight_decay']} = {decay:g}: the decoupled weight decay multiplies every weight by 1 - {decay:g} "
             f"each update, which zeroes it or flips its sign; set adam_weight_decay below 1 / learning_rate "
             f"({1 / v['learning_rate']:g}; 0.1 is usual)")
    # A threshold below float32's smallest normal is 0 on the device, and clipping to it zeroes every gradient.
    clip = v["gradient_clipping_threshold"]
    _require(clip == 0 or clip >= FLOAT32_TINY, f"gradient_clipping_threshold must be 0 (off) or a float32 number "
             f">= {FLOAT32_TINY:.3g} (a smaller one is 0 on the device and clips every gradient to 0), got {clip}")
    # inf (or past float32's range, inf on the device) clipped nothing, as 0 does, while the stop at a non-finite
    # step said clipping was on and offered no remedy.
    _require(clip <= FLOAT32_MAX, f"gradient_clipping_threshold={clip} is not a finite float32 number and would "
             "clip nothing; set 0 to turn clipping off, or a finite threshold such as 1.0")
    # inf passed `> 0`: the first step's log-ratio difference is 0 (the policy starts as the reference), inf * 0 = NaN.
    _require(0 < v["dpo_beta"] <= FLOAT32_MAX, f"dpo_beta must be a finite float32 number > 0, got {v['dpo_beta']}")
    _require(0.0 <= v["dpo_label_smoothing"] < 0.5, f"dpo_label_smoothing (the probability a preference label is "
             f"flipped) must be in [0, 0.5), got {v['dpo_label_smoothing']}")
    # The fraction as written (0.29, not the binary float 0.28999...): 0.29 of 100 updates is 29 of them, where
    # int(0.29 * 100) is 28.
    warmup_steps = int(fractions.Fraction(repr(v["warmup_steps_fraction"])) * schedule_steps)
    # The warmup starts at 0: a run of one update, all of it warmup, trained nothing (an explicit longer
    # learning_rate_schedule_steps is a run continued later, whose first update may well be 0).
    _require(not (v["learning_rate_schedule_steps"] == -1 and schedule_steps == 1 and warmup_steps == 1),
             f"warmup_steps_fraction={v['warmup_steps_fraction']} of {named} (1 optimizer update) warms up over that "
             "update, whose learning rate is then 0 (the warmup starts at 0): the run would train nothing; set "
             "warmup_steps_fraction < 1 or raise steps")
    return cls(**read_keys(cls, v, learning_rate_schedule_steps=schedule_steps), warmup_steps=warmup_steps)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
  run_name: str = key()  # filled in from the clock by config.load_config when empty
  base_output_directory: str = key()
  steps: int = key()
  log_period: int = key()
  router_collapse_fraction: float = key()
  router_collapse_logs: int = key()
  skip_nonfinite_steps: bool = key()
  max_consecutive_skipped_steps: int = key()
  loss_spike_threshold: float = key()
  loss_spike_window: int = key()
  straggler_report_period: int = key()
  straggler_threshold: float = key()
  step_timeout_seconds: float = key()
  eval_interval: int = key()
  init_weights_seed: int = key()
  enable_tensorboard: bool = key()
  enable_jsonl_metrics: bool = key()
  metric_trackers: tuple[str, ...] = key()  # beside JSONL/TensorBoard (training/trackers.py)
  wandb_project: str = key()
  wandb_entity: str = key()  # "" = the account's default entity
  wandb_mode: str = key()  # "" = wandb's own choice (WANDB_MODE, else online)
  vertex_tensorboard_dir: str = key()  # "" = $AIP_TENSORBOARD_LOG_DIR, else <run_dir>/vertex_tensorboard
  print_config: bool = key()
  cpu_peak_tflops: float = key()
  profiler: str = key()  # "" (off) or "xplane"
  profile_start_step: int = key()
  profile_steps: int = key()
  profile_cleanly: bool = key()  # the loop waits for the step at both ends of the trace
  profile_all_processes: bool = key()
  collect_stack_trace: bool = key()
  stack_trace_to_cloud: bool = key()
  stack_trace_interval_seconds: int = key()
  storage_timeout_seconds: int = key()
  storage_retry_seconds: float = key()
  run_lease_timeout_seconds: float = key()
  run_dir: str = derived()  # base_output_directory/run_name

  @classmethod
  def from_values(cls, v: Mapping[str, Any]) -> "RunConfig":
    _positive(v, "steps", "log_period", "profile_steps", "stack_trace_interval_seconds", "storage_timeout_seconds",
              "storage_retry_seconds", "run_lease_timeout_seconds")
    _positive(v, "router_collapse_logs", "max_consecutive_skipped_steps")
    _require(v["straggler_report_period"] >= 0 and v["straggler_threshold"] > 0,
             "straggler_report_period must be >= 0 (0 = off) and straggler_threshold > 0")
    # inf: a window of equal losses (std 0) gave the limit inf * 0 = NaN, and every step read as a spike
    _require(0 <= v["loss_spike_threshold"] < math.inf and v["loss_spike_window"] >= 2,
             f"loss_spike_threshold must be a finite number >= 0 (0 = off) and loss_spike_window >= 2, got "
             f"{v['loss_spike_threshold']} and {v['loss_spike_window']}")
    # inf or past threading.TIMEOUT_MAX: the watchdog thread's first wait raised OverflowError and the run went unwatched
    _require(0 <= v["step_timeout_seconds"] <= threading.TIMEOUT_MAX, f"step_timeout_seconds must be >= 0 (0 = off) "
             f"and at most {threading.TIMEOUT_MAX:.0f}, got {v['step_timeout_seconds']}")
    # A thread waits each of these (or a part of it); past threading.TIMEOUT_MAX (10**13 for "never") its
    # wait raised OverflowError: the lease refresh and the stack-trace thread died, storage calls failed.
    for name in ("run_lease_timeout_seconds", "stack_trace_interval_seconds", "storage_timeout_seconds",
                 "storage_retry_seconds"):
      _require(v[name] <= threading.TIMEOUT_MAX, f"{name} must be at most {threading.TIMEOUT_MAX:.0f} (the longest a "
               f"thread can wait), got {v[name]}")
    _require(0 < v["router_collapse_fraction"] <= 1,
             f"router_collapse_fraction must be in (0, 1], got {v['router_collapse_fraction']}")
    _require(v["eval_interval"] == -1 or v["eval_interval"] > 0, "eval_interval must be > 0 or -1 (never)")
    run_name = v["run_name"]
    _require(bool(run_name), "run_name is empty; set run_name=NAME")
    _require("/" not in run_name, f"run_name must not contain '/', got {run_name!r}")
    # "." or ".." made base_output_directory itself, or its parent, the run directory (another run's, maybe).
    _require(run_name not in (".", "..") and run_name.isprintable(),
             f"run_name must be a directory name of its own (not '.' or '..', no control characters), got {run_name!r}")
    _require(v["profiler"] in ("", "xplane"), f"profiler must be '' (off) or 'xplane', got {v['profiler']!r}")
    _require(v["profile_start_step"] >= 0, f"profile_start_step must be >= 0, got {v['profile_start_step']}")
    values = read_keys(cls, v, metric_trackers=_metric_trackers(v))
    _one_of(v, "wandb_mode", WANDB_MODES, empty="wandb's own choice")
    _require("wandb" not in values["metric_trackers"] or bool(v["wandb_project"]),
             "metric_trackers names wandb but wandb_project is empty; set wandb_project=<your W&B project>")
    return cls(**values, run_dir=storage.join(v["base_output_directory"], run_name))


def _metric_trackers(v: Mapping[str, Any]) -> tuple[str, ...]:
  names = v["metric_trackers"]
  if isinstance(names, str):  # metric_trackers=wandb,vertex_tensorboard on the command line
    names = config_yaml.split_items("metric_trackers", names)
  _require(isinstance(names, (list, tuple)) and all(n in METRIC_TRACKERS for n in names),
           f"metric_trackers must be a list of {', '.join(METRIC_TRACKERS)}; got {names!r}")
  _require(len(set(names)) == len(names), f"metric_trackers names a tracker twice: {list(names)}")
  return tuple(names)


def _nested(a: str, b: str) -> bool:
  """Whether two output directories are the same or one holds the other ("" is none)."""
  if not a or not b:
    return False
  a, b = a.rstrip("/") + "/", b.rstrip("/") + "/"
  return a.startswith(b) or b.startswith(a)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
  enable_checkpointing: bool = key()
  async_checkpointing: bool = key()
  checkpoint_period: int = key()
  max_num_checkpoints_to_keep: int = key()  # -1 = keep all
  load_parameters_path: str = key()
  load_full_state_path: str = key()
  resume_from_step: int = key()  # -1 = the newest checkpoint
  param_only_checkpoint_path: str = key()
  force_unroll: bool = key()
  lora_peft_export_path: str = key()  # generate_param_only_checkpoint: also the adapters in PEFT's format
  # The fast per-host tier of multi-tier checkpointing.
  enable_emergency_checkpoint: bool = key()
  local_checkpoint_directory: str = key()
  local_checkpoint_period: int = key()
  local_checkpoint_max_to_keep: int = key()
  enable_checkpoint_cloud_logger: bool = key()  # Orbax's checkpoint events to events_path
  directory: str = derived()  # run_dir/checkpoints
  events_path: str = derived()  # run_dir/checkpoint_events.jsonl with enable_checkpoint_cloud_logger, else ""
  local_directory: str = derived()  # local_checkpoint_directory/run_name, absolute ("" = no local tier)

  @property
  def max_to_keep(self) -> int | None:
    """Orbax's max_to_keep (None = keep all)."""
    return None if self.max_num_checkpoints_to_keep == -1 else self.max_num_checkpoints_to_keep

  @classmethod
  def from_values(cls, v: Mapping[str, Any], run: RunConfig) -> "CheckpointConfig":
    _require(v["checkpoint_period"] > 0, f"checkpoint_period must be > 0, got {v['checkpoint_period']} "
             "(to turn checkpoints off set enable_checkpointing=False)")
    keep = v["max_num_checkpoints_to_keep"]
    _require(keep == -1 or keep >= 1, f"max_num_checkpoints_to_keep must be >= 1 or -1 (keep all), got {keep}")
    _require(not v["lora_peft_export_path"] or v["lora_rank"] > 0,
             "lora_peft_export_path exports LoRA adapters; the model has none (lora_rank=0)")
    _require(not _nested(v["lora_peft_export_path"], v["param_only_checkpoint_path"]),
             f"lora_peft_export_path={v['lora_peft_export_path']} and param_only_checkpoint_path="
             f"{v['param_only_checkpoint_path']} overlap; each export needs a directory of its own")
    _require(not (v["load_parameters_path"] and v["load_full_state_path"]),
             "set at most one of load_parameters_path (weights only, fresh optimizer) and "
             "load_full_state_path (weights, optimizer state and step)")
    _require(v["resume_from_step"] >= -1, f"resume_from_step must be a saved step, 0 (from the beginning) or -1 "
             f"(the newest checkpoint), got {v['resume_from_step']}")
    _require(v["resume_from_step"] == -1 or v["enable_checkpointing"],
             "resume_from_step chooses among the run's checkpoints: it needs enable_checkpointing=True")
    local = v["enable_emergency_checkpoint"]
    _require(not local or (v["local_checkpoint_directory"] and v["local_checkpoint_period"] > 0),
             "enable_emergency_checkpoint=True needs local_checkpoint_directory=<a directory on each host's disk> "
             "and local_checkpoint_period > 0")
    _require(not local or not storage.is_remote(v["local_checkpoint_directory"]),
             f"local_checkpoint_directory must be on the host's own disk, got {v['local_checkpoint_directory']}; "
             "the persistent tier (base_output_directory) is the one for gs://")
    _require(not local or v["enable_checkpointing"], "enable_emergency_checkpoint=True needs enable_checkpointing=True "
             "(the persistent tier)")
    _require(v["local_checkpoint_max_to_keep"] >= 1, "local_checkpoint_max_to_keep must be >= 1")
    local_directory = storage.join(storage.resolve(v["local_checkpoint_directory"]), run.run_name) if local else ""
    events_path = storage.join(run.run_dir, EVENTS_FILE) if v["enable_checkpoint_cloud_logger"] else ""
    return cls(**read_keys(cls, v), directory=storage.join(run.run_dir, "checkpoints"),
               local_directory=local_directory, events_path=events_path)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StartupConfig:
  """Keys read before the Config exists (platform, flags, distributed start, model file,
  AOT target); checked where start-up reads them, kept here for the record."""
  hardware: str = key()
  cpu_defaults: bool = key()
  model_name: str = key()
  libtpu_init_args: str = key()
  xla_flags: str = key()
  distributed_init_timeout_seconds: int = key()
  distributed_heartbeat_timeout_seconds: int = key()
  compile_topology: str = key()
  compile_topology_num_slices: int = key()
  compiled_trainstep_file: str = key()

  @classmethod
  def from_values(cls, v: Mapping[str, Any]) -> "StartupConfig":
    return cls(**read_keys(cls, v))


GROUPS = (ModelConfig, MeshConfig, OptimConfig, DataConfig, RunConfig, CheckpointConfig,
          DecodeConfig, StartupConfig, RLConfig, TaskEvalConfig, DistillConfig)


@dataclasses.dataclass(frozen=True)
class Groups:
  model: ModelConfig
  mesh: MeshConfig
  optim: OptimConfig
  data: DataConfig
  run: RunConfig
  checkpoint: CheckpointConfig
  decode: DecodeConfig
  startup: StartupConfig
  rl: RLConfig
  tasks: TaskEvalConfig
  distill: DistillConfig


def build_groups(values: Mapping[str, Any], target: DeviceTarget, reads_data: bool = True) -> Groups:
  """`reads_data`: False for a tool that reads no training data (startup.Tool): neither the data
  sources nor GRPO's prompts, rewards and groups are checked."""
  all_devices = target.num_devices
  if reads_data:  # a rollout mesh of its own (rl_rollout_devices) leaves the rest to train
    target = dataclasses.replace(target, num_devices=rl_config.training_devices(values, target.num_devices,
                                                                                target.num_processes))
  try:
    mesh = MeshConfig.from_values(values, target)
  except ConfigError as e:  # the degrees were likely written for every device
    if target.num_devices == all_devices:
      raise
    raise ConfigError(f"{e} (the training mesh has {target.num_devices} of the {all_devices} devices: "
                      f"rl_rollout_devices={all_devices - target.num_devices} roll out)") from None
  run = RunConfig.from_values(values)
  num_experts, expert_degree = values["num_experts"], dict(mesh.shape)["expert"]
  # Experts are split evenly over the expert axis; a dense model may use that axis as extra FSDP.
  _require(num_experts == 1 or num_experts % expert_degree == 0,
           f"num_experts ({num_experts}) must be a multiple of the expert parallelism "
           f"(ici_expert_parallelism * dcn_expert_parallelism = {expert_degree})")
  data = DataConfig.from_values(values, target, mesh, reads_data)
  elastic_config.check(values, mesh, target.num_devices, data.global_batch_size, data.batch_axes)
  rl = RLConfig.from_values(values if reads_data else {**values, "objective": "lm"})
  # With a rollout mesh the batch counts the training devices alone, fewer than the user may have counted.
  split = "" if target.num_devices == all_devices else \
      f" (the training mesh has {target.num_devices} of the {all_devices} devices: rl_rollout_devices=" \
      f"{all_devices - target.num_devices} roll out)"
  _require(not (data.objective == "grpo" and reads_data) or data.global_batch_size % rl.num_generations == 0,
           f"the global batch of {data.global_batch_size} completions (per_device_batch_size x devices) does not "
           f"divide into groups of num_generations={rl.num_generations}; make it a multiple{split}")
  model = ModelConfig.from_values(values, mesh, data.global_batch_size)
  rl_config.check_rollout_heads(rl, model.num_query_heads, data.objective if reads_data else "lm")
  return Groups(model=model, mesh=mesh,
                optim=OptimConfig.from_values(values), data=data, run=run,
                checkpoint=CheckpointConfig.from_values(values, run), decode=DecodeConfig.from_values(values),
                startup=StartupConfig.from_values(values), rl=rl, tasks=TaskEvalConfig.from_values(values),
                distill=DistillConfig.from_values(values, reads_data))
