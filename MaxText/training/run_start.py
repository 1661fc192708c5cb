"""Where a run starts: this run's latest checkpoint, else another run's full state
(`load_full_state_path`), else parameters only (`load_parameters_path`), else a fresh init."""

from __future__ import annotations

import dataclasses
import shlex
from typing import Any, Callable

import jax

from MaxText.paths import storage
from MaxText.run_dir.checkpointing import Restored, RunCheckpoints, first_line, is_step_dir, log, not_a_checkpoint
from MaxText.configuration.config import Config
from MaxText.configuration.config_groups import CheckpointConfig
from MaxText.errors import UserError
from MaxText.training.optimizers import Params
from MaxText.training.params_io import describe_nonfinite, nonfinite_arrays
from MaxText.training.train_state import StateSetup, TrainState, state_from_params


@dataclasses.dataclass
class Start:
  state: TrainState
  data_state: dict[str, Any] | None
  rng_key_data: list[int] | None
  description: str


def _state_from_params(setup: StateSetup, params: Params) -> TrainState:
  """Step 0 and a fresh optimizer around loaded parameters (fine-tuning), with the objective's
  extra state (DPO's reference: a copy of them)."""
  create = lambda p: state_from_params(p, setup.optimizer, setup.layout)
  return setup.layout.load_extra_state(jax.jit(create, out_shardings=setup.state_shardings, donate_argnums=(0,))(params))


def _load_params(config: Config, setup: StateSetup, path: str) -> Params:
  """The parameters of `path`; when the optimizer trains only part of them (LoRA), the frozen
  part from `path` and the trained part freshly initialised (LoRA's lora_b zero: the loaded
  model's function). A checkpoint holding adapters is refused there (params_io.load_params)."""
  shardings = setup.state_shardings.params
  partition = setup.updater.partition
  if not partition.frozen_gives_base_model:  # every parameter is in the checkpoint
    return setup.on_mesh.read(path)
  base = setup.on_mesh.read(path, lambda tree: partition.split(tree)[1])
  init_trained = jax.jit(lambda rng: partition.split(setup.on_mesh.spec.init_params(rng))[0],
                         out_shardings=partition.split(shardings)[0])
  return partition.combine(init_trained(jax.random.key(config.run.init_weights_seed)), base)


def initial_state(config: Config, setup: StateSetup, checkpoints: RunCheckpoints | None,
                  init_fn: Callable[[], TrainState]) -> Start:
  """Resume this run's latest checkpoint, else load_full_state_path, else load_parameters_path,
  else `init_fn()` — the order MaxText users rely on when they rerun the same command."""
  cfg: CheckpointConfig = config.checkpoint
  abstract, shardings = setup.abstract_state, setup.state_shardings
  if checkpoints is not None and cfg.resume_from_step >= 0:
    rewind(checkpoints, cfg.resume_from_step)
  if checkpoints is not None:
    restored = checkpoints.restore_latest(abstract, shardings)
    if restored is not None:
      return Start(restored.state, restored.data_state, restored.meta.get("rng_key_data"),
                   f"resumed from step {restored.step} of {restored.source}")
  if cfg.load_full_state_path:
    restored = restore_full_state(cfg.load_full_state_path, abstract, shardings)
    return Start(restored.state, restored.data_state, restored.meta.get("rng_key_data"),
                 f"loaded the full state of step {restored.step} from {cfg.load_full_state_path}")
  if setup.layout.needs_loaded_params and not cfg.load_parameters_path:
    raise UserError(setup.layout.needs_loaded_params)
  if cfg.load_parameters_path:
    params = _load_params(config, setup, cfg.load_parameters_path)
    return Start(_state_from_params(setup, params), None, None,
                 f"loaded parameters from {cfg.load_parameters_path}; fresh optimizer state, step 0")
  return Start(init_fn(), None, None, f"initialised from seed {config.run.init_weights_seed}")


def rewind(checkpoints: RunCheckpoints, step: int) -> None:
  """resume_from_step: the checkpoints after `step` go aside (renamed, never deleted) unless they
  were saved since this rewind was made (a rerun of the same command continues from them)."""
  plan = checkpoints.rewind_plan(step)
  moved = checkpoints.rewind(step, plan)
  start = f"step {step}" if step > 0 else "the beginning (step 0)"
  if moved:
    log(f"resume_from_step={step}: moved checkpoint step(s) {', '.join(map(str, plan))} aside ("
        f"{', '.join(storage.name(m) for m in moved)} in {checkpoints.directory}); resuming from {start}")
  elif checkpoints.all_steps() and checkpoints.all_steps()[-1] > step:
    log(f"resume_from_step={step} was applied by an earlier start: the newer checkpoints were saved since, so the "
        "run continues from the newest")


def nonfinite_advice(config: Config, checkpoints: RunCheckpoints | None,
                     argv: list[str]) -> Callable[[int], str]:
  """What to do once non-finite steps stopped the run, given the first of them: go back to the
  newest checkpoint whose parameters gave a finite loss after it, with a lower learning rate."""
  lower = f"learning_rate={config.optim.learning_rate / 10:g}"
  # Clipping already on (base.yml's default) is no remedy to offer.
  rest = "check the data" if config.optim.gradient_clipping_threshold > 0 else \
      "enable gradient_clipping_threshold, or check the data"

  def advise(first_bad: int) -> str:
    if checkpoints is None:
      return f"lower learning_rate (e.g. {lower}), or {rest}"
    saved = set(checkpoints.all_steps())
    if checkpoints.last_saved_step is not None:  # a save still in flight counts: the stop waits for it
      saved.add(checkpoints.last_saved_step)
    # Step s's parameters are known good only if step s+1 was finite; a step saved later may hold bad ones.
    good = [s for s in saved if s <= first_bad - 2] + [0]
    current = config.checkpoint.resume_from_step
    if current >= 0 and any(s > current for s in saved):
      good = [s for s in good if s != current]  # the same value would continue from those later steps
    if not good:
      return (f"move the checkpoints of steps {', '.join(map(str, sorted(saved)))} in {checkpoints.directory} "
              f"aside, then rerun with a lower learning rate ({lower})")
    back = max(good)
    args = [a for a in argv[1:] if not a.startswith(("resume_from_step=", "learning_rate="))]
    command = shlex.join(["python3", "-m", "MaxText.train", *args, f"resume_from_step={back}", lower])
    start = f"from step {back}, the last one known good," if back else "from the beginning (no checkpoint is known good)"
    return (f"resume {start} with a lower learning rate (later checkpoints are moved aside, not deleted): {command} "
            f"(or {rest})")

  return advise


def restore_full_state(path: str, abstract_state: TrainState, shardings: TrainState) -> Restored[TrainState]:
  """Full state from a step directory or a checkpoints root (its latest good step)."""
  root = storage.resolve(path)
  if not storage.exists(root):
    raise UserError(f"load_full_state_path {path} does not exist")
  if is_step_dir(root):
    step_name = storage.name(root)
    directory, steps = storage.parent(root), [int(step_name)] if step_name.isdigit() else []
    if not steps:
      raise UserError(f"load_full_state_path {path}: a step directory must be named by its step number")
  elif (why := not_a_checkpoint(path, root)) is not None:
    raise UserError(f"load_full_state_path {why}")
  else:
    directory, steps = root, None
  checkpoints = RunCheckpoints(directory)
  restored: Restored[TrainState] | None
  try:
    if steps is not None:
      restored = checkpoints.restore_step(steps[0], abstract_state, shardings)
    else:
      restored = checkpoints.restore_latest(abstract_state, shardings)
  except UserError:
    raise
  except Exception as e:  # noqa: BLE001
    raise UserError(f"cannot restore the full state from {path}: {first_line(e)}") from None
  finally:
    checkpoints.close()
  if restored is None:
    raise UserError(f"load_full_state_path {path} holds no complete checkpoint{_what_it_holds(root)}")
  if bad := nonfinite_arrays(restored.state.params):
    raise UserError(f"load_full_state_path {path}: step {restored.step} holds {describe_nonfinite(bad)}")
  return restored


def _what_it_holds(root: str) -> str:
  """What a path that holds no full-state step is instead, and what to give: the step directory above
  an item (state/, data/, meta/), or load_parameters_path for a parameters-only checkpoint."""
  parent = storage.parent(root)
  if is_step_dir(parent):
    return f": it is the {storage.name(root)!r} item of a checkpoint step; give its step directory {parent}"
  if storage.exists(storage.join(root, "_CHECKPOINT_METADATA")) or storage.exists(storage.join(root, "_METADATA")):
    return (": it is a parameters-only checkpoint (no optimizer state or data position); load it with "
            "load_parameters_path instead")
  return ""
