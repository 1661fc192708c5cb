"""Pre-train or fine-tune a decoder: `python3 -m MaxText.train configs/base.yml run_name=NAME [key=value ...]`.

Reads like a table of contents: config → backend → mesh → sharded state → data → jitted step → loop.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any

PROCESS_STARTED = time.time()  # before the heavy imports: they are start-up time too (goodput)

if __package__ in (None, ""):  # `python3 MaxText/train.py`: import the package, not sibling files.
  sys.path[0] = str(Path(__file__).resolve().parent.parent)

import jax

from MaxText.training import metrics
from MaxText.aot import memory_report
from MaxText.run_dir import checkpointing
from MaxText.platform import accelerators
from MaxText.configuration import config as config_lib
from MaxText.configuration import distill_config
from MaxText import startup
from MaxText.training import health, run_assembly, run_start, task_eval, trackers
from MaxText.input_pipeline import BatchIterator
from MaxText.input_pipeline.tokenizer import load_tokenizer
from MaxText.run_dir import preemption, run_lease
from MaxText.configuration import run_record
from MaxText.platform import distributed
from MaxText.paths import storage
from MaxText.platform.distributed import log
from MaxText.errors import ConfigError, TrainingError, UserError, run_cli
from MaxText.input_pipeline import check_sources
from MaxText.rl import rollout_mesh
from MaxText.rl.rollouts import RolloutBatches
from MaxText.layers import pipeline
from MaxText.layers.attention import select_kernel
from MaxText.training.trainer import (TRAIN_STEP, CheckpointHook, EvalHook, LeaseHook, LoggingHook, OnPolicyBatches,
                                     RouterHealthHook, Trainer, profile_hook)


def warn_if_never_due(intervals: dict[str, int], steps: int) -> None:
  """A cadence longer than the run is never due: the run would end without the figure it was asked for."""
  for name, every in intervals.items():
    if every > steps:
      print(f"warning: {name}={every} is more than steps={steps}: this run never evaluates; "
            f"set {name} to at most {steps}", file=sys.stderr, flush=True)


def check_resume(config: config_lib.Config, checkpoints: checkpointing.RunCheckpoints | None) -> None:
  """A resume must keep the saved state's shape and meaning; checked before anything is read,
  against every record the run has (run_record.check_resume) and the keys saved with the step."""
  def check() -> None:
    if checkpoints is None:
      _refuse_to_start_over(config)
      _check_full_state(config)
      return
    rewind_to = config.checkpoint.resume_from_step
    if rewind_to >= 0 and checkpoints.rewind_plan(rewind_to):
      step: int | None = rewind_to or None
    else:
      step = checkpoints.newest_step()
    if step is None:
      _check_full_state(config)
      return
    saved_keys = (checkpoints.saved_meta(step) or {}).get(checkpointing.RESUME_KEYS)
    records = run_record.check_resume(
        config, config.run.run_dir, f"checkpoint step {step}",
        (saved_keys, f"the keys saved with checkpoint step {step}") if isinstance(saved_keys, dict) else None)
    if not records:
      log(f"warning: {config.run.run_dir} has no saved configuration ({run_record.CONFIG_FILE}, "
          f"{run_record.HISTORY_DIR}/) and checkpoint step {step} records no keys: only the stored array shapes "
          "are checked against this configuration")
    elif records[0] != storage.join(config.run.run_dir, run_record.CONFIG_FILE):  # config.yml is missing
      log(f"resume check of checkpoint step {step}: against {' and '.join(records)}")

  distributed.on_process_0("checking the saved configuration", check)


def _check_full_state(config: config_lib.Config) -> None:
  """A first start from another run's full state (load_full_state_path) keeps that state's meaning."""
  if config.checkpoint.load_full_state_path:
    run_record.check_full_state(config, config.checkpoint.load_full_state_path)


def _refuse_to_start_over(config: config_lib.Config) -> None:
  """enable_checkpointing=False in a run directory that holds a run's checkpoints started that run
  over from step 0, rewriting its metrics.jsonl and config.yml (the checkpoints stayed)."""
  directory = storage.join(config.run.run_dir, "checkpoints")
  if config.checkpoint.load_full_state_path or not storage.is_dir(directory):
    return
  steps = sorted(int(n) for n in storage.listdir(directory) if n.isdigit() and checkpointing.is_step_dir(
      storage.join(directory, n)))
  if steps:
    raise ConfigError(
        f"enable_checkpointing=False would start run {config.run.run_dir} over from step 0 and rewrite its "
        f"metrics.jsonl, but it holds checkpoints (newest step {steps[-1]}); drop enable_checkpointing=False to "
        "resume it, or choose a new run_name (load_full_state_path or load_parameters_path can start it from "
        f"{directory})")


def record_start(config: config_lib.Config) -> None:
  """config.yml and a config_history entry for this start, once its state is known to fit."""
  distributed.on_process_0("recording the configuration", lambda: run_record.record_start(config, config.run.run_dir))


TOOL = startup.Tool("train", joins_job=True, takes_lease=True, stack_traces=True)


def main(argv: list[str]) -> int:
  with startup.start(TOOL, argv) as started:
    return train(started.config, started.lease, argv)


def train(config: config_lib.Config, lease: run_lease.Lease | None = None, argv: list[str] | None = None) -> int:
  if config.run.print_config:
    log("config:\n" + config.describe())
  checkpoints = checkpointing.RunCheckpoints.for_run(config.checkpoint) if config.checkpoint.enable_checkpointing else None
  check_resume(config, checkpoints)
  check_sources(config.data)
  trackers.check_installed(config.run)
  run_dir = config.run.run_dir
  target = config.target
  log(f"devices: {target.num_devices} x {target.device_kind} ({target.platform}), "
      f"{target.num_processes} process(es), {config.mesh.num_slices} slice(s)")

  # the train step is jitted, or loaded from compiled_trainstep_file; a rollout mesh's devices are not the run's
  run = run_assembly.build_run(config, devices=rollout_mesh.training_devices(config))
  log(f"mesh: {run.mesh_description()}")
  if config.model.pipeline.num_pipeline_stages > 1:
    log(pipeline.describe(config.model.pipeline))
  setup = run.setup
  try:
    start = run_start.initial_state(config, setup, checkpoints, run.init_state)
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    raise _state_does_not_fit(run, e) from None
  log(f"state: {start.description}")
  watchdog = health.StepWatchdog(config.run.step_timeout_seconds) if config.run.step_timeout_seconds > 0 else None
  data = open_data(run, start, watchdog) if int(start.state.step) < config.run.steps else None
  record_start(config)
  log(f"model: {run.num_params / 1e6:.2f}M parameters, {config.model.num_decoder_layers} layers, "
      f"attention={select_kernel(config.model.attn.attention, target.platform, config.model)}, "
      f"{setup.param_unsharded_fraction:.2%} of parameter bytes not fully sharded")
  if run.lora_description():
    log(run.lora_description())

  flops = metrics.objective_tflops_per_step(config, run.objective)
  peak, peak_source = accelerators.peak_tflops_per_device(target, config.run.cpu_peak_tflops)
  batch = metrics.batch_words(config.data.global_batch_size, config.data.max_target_length,
                              config.data.max_images_per_row)
  peak_text = f"peak {peak:.3f} TFLOP/s/device ({peak_source})" if peak == peak else peak_source  # nan: unknown
  log(f"per step: {flops.total_tflops:.4f} model TFLOPs ({batch}); {peak_text}")
  log(f"outputs: {run_dir}")

  start_step = int(start.state.step)
  if start_step >= config.run.steps:
    log(f"done: the run is already at step {start_step} of steps={config.run.steps}; raise steps to train further")
    if checkpoints is not None:
      checkpoints.close()
    return 0
  assert data is not None  # opened above for a run with steps left
  rng = jax.random.key(config.run.init_weights_seed) if start.rng_key_data is None \
      else jax.random.wrap_key_data(jax.numpy.asarray(start.rng_key_data, jax.numpy.uint32))
  trainer = Trainer(config, run.train_step, data, rng, flops, peak)
  trainer.advise_nonfinite = run_start.nonfinite_advice(config, checkpoints, argv if argv is not None else sys.argv)
  add_hooks(trainer, run, checkpoints, rng, start_step, lease, watchdog)
  try:
    loop = trainer.run(start.state, start_step)
  except jax.errors.JaxRuntimeError as e:
    if not memory_report.is_xla_oom(str(e)):
      raise
    if not trainer.steps_finished:
      raise _step_does_not_fit(run, e, start_step + 1) from None
    raise _ran_out_later(run, e, trainer, start_step, checkpoints) from None
  if trainer.stop_reason is not None:  # on every process: each host's log says why it exited 143
    print(f"stopped: {trainer.stop_reason}; rerun the same command to resume", flush=True)
    return 128 + signal.SIGTERM
  if loop.first and loop.last:
    first, last = loop.first.scalars["loss"], loop.last.scalars["loss"]
    log(f"done: steps {start_step + 1}..{loop.last.step}, loss {first:.4f} -> {last:.4f}; "
        f"metrics in {run_dir}")
  return 0


def _state_does_not_fit(run: run_assembly.Run, error: jax.errors.JaxRuntimeError) -> UserError:
  """The devices' out-of-memory error while the state is made or read (parameters, optimizer state and
  what the objective holds beside them: a teacher, a reference) as one line naming those parts per
  chip, so a teacher far larger than its student reads as such (it was XLA's traceback)."""
  parts = memory_report.state_bytes_per_chip(run.abstract_inputs().state)
  advice = ("measure the step first with python3 -m MaxText.train_compile (or search settings with MaxText.plan); "
            "shard the state over more devices or offload the optimizer state (optimizer_memory_host_offload)")
  first_line = str(error).strip().splitlines()[0]
  return UserError(f"the train state does not fit in the devices' memory "
                   f"({memory_report.describe_state(parts, _device_unit(run.config))}; "
                   f"XLA: {first_line}): {advice}{_teacher_advice(run.config)}")


def _teacher_advice(config: config_lib.Config) -> str:
  """What to do about a teacher that sits beside the student on the training devices ("" without one)."""
  teacher = distill_config.live_teacher(config.data.objective, config.distill, config.rl.rl_teacher_kl_weight)
  if teacher == distill_config.TEACHER_PER_MICRO_BATCH:
    return ("; a teacher too large to sit beside the student: precompute its top k once (python3 -m "
            "MaxText.generate_teacher_top_k, then distill_top_k_path) or pick a smaller teacher")
  return "; the teacher sits beside the student on the training devices: pick a smaller teacher" if teacher else ""


def _step_does_not_fit(run: run_assembly.Run, error: jax.errors.JaxRuntimeError, step: int) -> UserError:
  """XLA's out-of-memory error while the train step compiled or ran its first `step` (it was XLA's
  traceback), as one line: how much against how much per device where XLA says, the state's parts,
  and what uses less. Nothing was saved since the run started: its checkpoints are as they were."""
  config, message = run.config, str(error)
  first_line = message.strip().splitlines()[0]
  oom = memory_report.parse_xla_oom(first_line)
  generation = accelerators.tpu_generation_of(config.target.device_kind)
  offload = memory_report.offload_of(config) if oom.space == "host" else None
  off_heap = memory_report.off_heap_message(message, oom, generation, offload)
  if off_heap:
    return UserError(off_heap)
  unit = _device_unit(config)
  sizes = memory_report.oom_sizes(oom, unit, _device_bytes())
  state = memory_report.describe_state(memory_report.state_bytes_per_chip(run.abstract_inputs().state), unit)
  return UserError(f"the train step does not fit in the devices' memory (compiling or running step {step}): {sizes} "
                   f"({'; '.join(filter(None, (state, f'XLA: {first_line}')))}); use less per {unit}: "
                   f"{', '.join(_ways_to_use_less(run))}{_teacher_advice(config)}; python3 -m MaxText.train_compile "
                   "with the same overrides and compile_topology=local (or the slice's, e.g. v5e-256) prints the step's "
                   "memory report")


def _device_unit(config: config_lib.Config) -> str:
  generation = accelerators.tpu_generation_of(config.target.device_kind)
  return generation.device_unit if generation is not None else "device"


def _ways_to_use_less(run: run_assembly.Run) -> list[str]:
  """The keys that make the train step use less memory per device, with their values now."""
  config = run.config
  ways = [f"a smaller per_device_batch_size (now {config.data.per_device_batch_size:g})"]
  if config.model.remat.name != "full":
    ways.append(f"a remat_policy that saves less (remat_policy=full; now {config.model.remat.name})")
  ways.append(f"more fsdp sharding (ici_fsdp_parallelism; now fsdp={run.mesh.shape.get('fsdp', 1)})")
  if not config.optim.optimizer_memory_host_offload:
    ways.append("the optimizer state in host memory (optimizer_memory_host_offload=true)")
  return ways


def _ran_out_later(run: run_assembly.Run, error: jax.errors.JaxRuntimeError, trainer: Trainer, start_step: int,
                   checkpoints: checkpointing.RunCheckpoints | None) -> TrainingError:
  """XLA's out-of-memory error after steps of this start ran (it was XLA's traceback), as one line: where
  (a hook such as the evaluation, or the steps), that one step alone fit, and the checkpoint a rerun resumes
  from. The trainer's hooks have ended, so a save in flight is complete or reported."""
  last = start_step + trainer.steps_finished
  if trainer.activity == TRAIN_STEP:
    where, why = f"the train step after step {last}", ("so one step alone fits: memory held beside the step grew, "
                                                       "or the device allocator fragmented")
  else:
    where, why = trainer.activity, "so the train step fits; this needs more beside the train state"
  first_line = str(error).strip().splitlines()[0]
  newest = checkpoints.newest_step() if checkpoints is not None else None
  resume = ("checkpointing is off, so a rerun starts over" if checkpoints is None else
            "no checkpoint is saved yet, so a rerun starts over" if newest is None else
            f"the newest checkpoint is step {newest}: rerun the same command to resume from it")
  unit = _device_unit(run.config)
  return TrainingError(
      f"the devices ran out of memory in {where} (steps {start_step + 1}..{last} of this start ran, {why}; "
      f"XLA: {first_line}); {resume}; "
      f"to leave more room per {unit}: {', '.join(_ways_to_use_less(run))}")


def _device_bytes() -> int:
  """What a device's allocator may use (TPU and GPU say; 0 where the backend does not)."""
  try:
    stats = jax.local_devices()[0].memory_stats()
  except RuntimeError:  # a backend without memory statistics (UNIMPLEMENTED)
    return 0
  return int(stats.get("bytes_limit", 0)) if stats else 0


def open_data(run: run_assembly.Run, start: run_start.Start, watchdog: health.StepWatchdog | None = None) -> Any:
  """The train batches from where the run starts, the first already read: bad data (a malformed
  file, a refused record, every sample dropped, a failing reward function) stops the run before it
  writes to its directory. An objective that trains on its own samples gets the rollouts
  (rl/rollouts.py), which the trainer hands each step's state. With a watchdog, reading the first
  batch (for rollouts: scoring it, the user's reward functions) must finish within its timeout."""
  data: RolloutBatches | BatchIterator = RolloutBatches(run.config, run.mesh, run.batch_sharding) \
      if run.objective.uses_rollouts else run.data_iterator()
  if start.data_state is not None:
    data.set_state(start.data_state)
  guard = watchdog.guard if watchdog is not None else health.unguarded
  if isinstance(data, OnPolicyBatches):
    data.prime(start.state, guard)  # the first rollout, rewards included
  elif hasattr(data, "peek"):
    with guard("reading the first batch"):
      data.peek()
  if not isinstance(data, RolloutBatches) and run.config.data.reuse_example_batch:  # refused with rollouts
    return ReusedBatch(data)
  return data


class ReusedBatch:
  """reuse_example_batch: the first batch, read once and handed to every step (a benchmark of the
  step without data loading). Its saved position is the one before that batch, so a resumed run
  trains on the same batch, and one resumed without the key reads on from it."""

  def __init__(self, data: BatchIterator):
    self._data, self._position = data, data.get_state()  # on every process at once: it may gather
    self._batch: Any = None

  def __iter__(self) -> "ReusedBatch":
    return self

  def __next__(self) -> Any:
    if self._batch is None:
      self._batch = next(self._data)
    return self._batch

  def get_state(self) -> dict[str, Any]:
    return self._position


def add_hooks(trainer: Trainer, run: run_assembly.Run, checkpoints: checkpointing.RunCheckpoints | None,
              rng: jax.Array, start_step: int, lease: run_lease.Lease | None = None,
              watchdog: health.StepWatchdog | None = None) -> None:
  """Logging and eval hooks, plus checkpointing when it is enabled. With a lease, every step
  first checks that no other run took the run directory over. The trainer owns each cadence."""
  config, settings = run.config, run.config.run
  is_primary = jax.process_index() == 0
  writer = metrics.MetricWriter(settings.run_dir, settings.enable_jsonl_metrics, settings.enable_tensorboard,
                                resume_step=start_step, sinks=[trackers.Trackers.open(config)]) if is_primary else None
  if lease is not None:
    trainer.add_hook(LeaseHook(lease), every=1)
  # Before the logging hook: its on_end closes the metric writer, which goodput's on_end still uses.
  health.add_health_hooks(trainer, settings, writer, is_primary, jax.process_count(), PROCESS_STARTED, start_step,
                          watchdog)
  trainer.add_hook(LoggingHook(writer, is_primary), every=settings.log_period)
  model = config.model
  if model.moe.num_experts > 1 and is_primary:
    trainer.add_hook(RouterHealthHook(settings.router_collapse_fraction, settings.router_collapse_logs,
                                      model.moe.num_experts_per_tok / model.moe.num_experts), every=settings.log_period)
  if is_primary:
    warn_if_never_due({"eval_interval": settings.eval_interval, "eval_tasks_interval":
                       config.tasks.eval_tasks_interval if config.tasks.eval_tasks else -1}, settings.steps)
  eval_data = run.eval_iterator() if settings.eval_interval > 0 else None
  if eval_data is not None:
    trainer.add_hook(EvalHook(run.eval_step, eval_data, config.data.eval_steps, writer, is_primary,
                              run.objective.eval_metrics),
                     every=settings.eval_interval, needs_state=True)
  if config.tasks.eval_tasks:
    tokenizer = load_tokenizer(config.data.tokenizer_type, config.data.tokenizer_path)
    trainer.add_hook(task_eval.TaskEvalHook(run, tokenizer, writer, is_primary),
                     every=config.tasks.eval_tasks_interval, needs_state=True)
  if checkpoints is not None:
    def before_save() -> None:
      if lease is not None:
        lease.check()
      if writer is not None:
        writer.sync()

    meta: dict[str, Any] = {checkpointing.RESUME_KEYS: run_record.resume_keys(config)}
    if config.checkpoint.resume_from_step >= 0:
      meta[checkpointing.REWIND_KEY] = config.checkpoint.resume_from_step
    # An elastic run's grow-back stop saves to the local tier only: its peers hand the step over.
    grow_back = ((lambda: preemption.is_grow_back(settings.run_dir))
                 if config.mesh.elastic_min_slices > 0 and checkpoints.local is not None else None)
    trainer.add_hook(CheckpointHook(checkpoints, config.checkpoint.checkpoint_period, settings.steps,
                                    preemption.PreemptionWatcher(), rng, before_save=before_save, meta=meta,
                                    grow_back=grow_back),
                     every=0, needs_state=True)
  profiler = profile_hook(storage.join(settings.run_dir, "profile"), settings.profile_start_step, settings.profile_steps,
                          settings.steps, active=is_primary or settings.profile_all_processes,
                          clean=settings.profile_cleanly) if settings.profiler else None
  if profiler is not None:
    trainer.add_hook(profiler, every=0, needs_state=settings.profile_cleanly)


if __name__ == "__main__":
  run_cli(main)
