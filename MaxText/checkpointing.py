"""Orbax checkpoints: save the full train state every `checkpoint_period` steps, resume after a
kill, start from someone else's weights, and never lose a checkpoint that was once complete.

Layout of a run (`base_output_directory/run_name/checkpoints`):
    <step>/state   TrainState {step, params, opt_state} (Orbax PyTree, sharded arrays)
    <step>/data    the data iterator's state (JSON)
    <step>/meta    the train RNG key and what wrote the checkpoint (JSON)
A parameters-only checkpoint (converters, `generate_param_only_checkpoint`) is one Orbax
PyTree directory holding {"params": params}.

Restores are sharded: arrays are read straight into the shardings of the current mesh,
which may differ from the mesh that saved them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import time
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from MaxText import models, storage
from MaxText.config_groups import CheckpointConfig
from MaxText.errors import TrainingError, UserError
from MaxText.local_checkpoints import LocalTier
from MaxText.train_state import TrainState

STATE, DATA, META = "state", "data", "meta"
PARAMS = "params"


def _log(message: str) -> None:
  if jax.process_index() == 0:
    print(message, flush=True)


def with_shardings(abstract: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs that carry the target shardings (what Orbax restores into)."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


# ---------------------------------------------------------------- parameters only

def save_params(path: str, params: Any) -> None:
  """Writes a parameters-only checkpoint (synchronously) to a new directory `path`."""
  if storage.exists(path):
    raise UserError(f"{path} already exists; choose a new output path or remove it first")
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(storage.as_path(path), {PARAMS: params})
  checkpointer.wait_until_finished()
  checkpointer.close()


def _is_step_dir(path: str) -> bool:
  return storage.is_dir(storage.join(path, STATE))


def _pytree_dir(path: str) -> tuple[str, str]:
  """(Orbax PyTree directory holding the params, what kind of checkpoint `path` is)."""
  root = storage.resolve(path)
  if not storage.exists(root):
    raise UserError(f"checkpoint {path} does not exist")
  if _is_step_dir(root):
    return storage.join(root, STATE), "full-state step"
  steps = sorted((int(n) for n in storage.listdir(root) if n.isdigit() and _is_step_dir(storage.join(root, n))),
                 reverse=True)
  if steps:
    return storage.join(root, str(steps[0]), STATE), f"latest step ({steps[0]}) of a checkpoints directory"
  if storage.exists(storage.join(root, "_METADATA")) or storage.exists(storage.join(root, "_CHECKPOINT_METADATA")):
    return root, "parameters-only"
  raise UserError(f"{path} is not a checkpoint: expected a parameters-only checkpoint, a step directory "
                  f"containing '{STATE}/', or a checkpoints directory with numbered steps")


def load_params(path: str, abstract_params: Any, shardings: Any) -> Any:
  """Reads only the parameters from any of our checkpoint kinds, into `shardings`.

  A checkpoint written with the other layer layout (scanned `layers` vs `layers_0..N`) is
  read in its own layout and converted, so scan_layers may differ between writer and reader.
  """
  directory, kind = _pytree_dir(path)
  stored_scanned = _stored_layout_is_scanned(directory)
  wanted_scanned = "layers" in abstract_params
  convert = stored_scanned is not None and stored_scanned != wanted_scanned
  read_abstract, read_shardings = (_other_layout(abstract_params, shardings) if convert
                                   else (abstract_params, shardings))
  target = {PARAMS: with_shardings(read_abstract, read_shardings)}
  try:
    restored = ocp.PyTreeCheckpointer().restore(
        storage.as_path(directory), args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True))
  except (ValueError, KeyError, FileNotFoundError) as e:
    raise UserError(f"cannot load parameters from {path} ({kind} checkpoint): {_first_line(e)}; "
                    "check that the model config matches the one that wrote it") from None
  params = restored[PARAMS]
  if convert:
    num_layers = _num_layers(abstract_params)
    relayout = models.unstack_layers if stored_scanned else models.stack_layers
    params = jax.jit(lambda p: relayout(p, num_layers), out_shardings=shardings)(params)
  layout = "" if not convert else f", {'scanned' if stored_scanned else 'unrolled'} layers converted"
  _log(f"checkpoint: loaded parameters from {path} ({kind} checkpoint{layout})")
  return params


@contextlib.contextmanager
def _quiet_absl() -> Iterator[None]:
  """Orbax warns that a step's state has no _CHECKPOINT_METADATA of its own (the step has it);
  reading metadata only, that is noise."""
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


def _stored_layout_is_scanned(directory: str) -> bool | None:
  try:
    with _quiet_absl():
      keys = ocp.PyTreeCheckpointer().metadata(storage.as_path(directory)).item_metadata[PARAMS].keys()
  except Exception:  # noqa: BLE001 - unreadable metadata: let the restore report the problem
    return None
  return "layers" in keys


def _num_layers(params: Any) -> int:
  if "layers" in params:
    return jax.tree.leaves(params["layers"])[0].shape[0]
  return sum(1 for k in params if k.startswith("layers_"))


def _other_layout(abstract_params: Any, shardings: Any) -> tuple[Any, Any]:
  """Abstract params and shardings in the opposite layer layout (the stacked dim unsharded)."""
  # Only named shardings carry a per-dimension spec; any other sharding fits either shape.
  def unstack(a: jax.ShapeDtypeStruct, s: Any) -> tuple[Any, Any]:
    if isinstance(s, NamedSharding):
      s = NamedSharding(s.mesh, PartitionSpec(*s.spec[1:]))
    return jax.ShapeDtypeStruct(a.shape[1:], a.dtype), s

  def stack(a: jax.ShapeDtypeStruct, s: Any, n: int) -> tuple[Any, Any]:
    if isinstance(s, NamedSharding):
      s = NamedSharding(s.mesh, PartitionSpec(None, *s.spec))
    return jax.ShapeDtypeStruct((n, *a.shape), a.dtype), s

  rest = [k for k in abstract_params if k != "layers" and not k.startswith("layers_")]
  out_a, out_s = {k: abstract_params[k] for k in rest}, {k: shardings[k] for k in rest}
  num_layers = _num_layers(abstract_params)
  is_leaf = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
  if "layers" in abstract_params:
    pairs = jax.tree.map(unstack, abstract_params["layers"], shardings["layers"], is_leaf=is_leaf)
    for i in range(num_layers):
      out_a[f"layers_{i}"] = jax.tree.map(lambda pair: pair[0], pairs, is_leaf=lambda x: isinstance(x, tuple))
      out_s[f"layers_{i}"] = jax.tree.map(lambda pair: pair[1], pairs, is_leaf=lambda x: isinstance(x, tuple))
  else:
    pairs = jax.tree.map(lambda a, s: stack(a, s, num_layers), abstract_params["layers_0"], shardings["layers_0"],
                         is_leaf=is_leaf)
    out_a["layers"] = jax.tree.map(lambda pair: pair[0], pairs, is_leaf=lambda x: isinstance(x, tuple))
    out_s["layers"] = jax.tree.map(lambda pair: pair[1], pairs, is_leaf=lambda x: isinstance(x, tuple))
  return out_a, out_s


def _shapes_by_path(tree: Any) -> dict[str, tuple[int, ...]]:
  """{'params/layers/mlp/...': shape} for the arrays of a state tree or of Orbax's metadata of
  one (whose nodes are plain dicts and lists, not the state's dataclasses and tuples)."""
  def key_name(entry: Any) -> str:
    for attribute in ("name", "key", "idx"):
      if hasattr(entry, attribute):
        return str(getattr(entry, attribute))
    return str(entry)

  leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
  return {"/".join(key_name(k) for k in path): tuple(leaf.shape) for path, leaf in leaves if hasattr(leaf, "shape")}


def _first_line(error: BaseException) -> str:
  text = str(error).strip().splitlines()
  return f"{type(error).__name__}: {text[0] if text else ''}"[:400]


# ---------------------------------------------------------------- full train state

@dataclasses.dataclass
class Restored:
  state: Any
  data_state: dict[str, Any] | None
  meta: dict[str, Any]
  step: int
  source: str = ""  # where it came from, for the log


class RunCheckpoints:
  """The run's CheckpointManager: periodic (async) saves, resume with fallback, clear failures."""

  def __init__(self, cfg: CheckpointConfig, directory: str | None = None):
    self.cfg = cfg
    self.directory = storage.resolve(directory or cfg.directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.max_to_keep, enable_async_checkpointing=cfg.async_checkpointing, create=True)
    try:
      self._manager = ocp.CheckpointManager(storage.as_path(self.directory), item_names=(STATE, DATA, META), options=options)
    except OSError as e:
      raise UserError(f"cannot use checkpoint directory {self.directory}: {_first_line(e)}") from None
    self.last_saved_step: int | None = self._manager.latest_step()
    # Multi-tier: the fast per-host tier beside this (persistent) one.
    self.local = LocalTier(cfg.local_directory, cfg.local_checkpoint_period, cfg.local_checkpoint_max_to_keep) if cfg.local_directory \
        else None

  def local_due(self, step: int) -> bool:
    return self.local is not None and step % self.local.period == 0

  def save_local(self, step: int, state: Any, data_state: dict[str, Any], meta: dict[str, Any]) -> None:
    assert self.local is not None
    self.local.save(step, state, data_state, meta)

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def newest_step(self) -> int | None:
    """The newest step either tier holds (this host's view of the local tier), before any read."""
    steps = self.all_steps() + (self.local.steps() if self.local is not None else [])
    return max(steps) if steps else None

  def save(self, step: int, state: Any, data_state: dict[str, Any], meta: dict[str, Any]) -> None:
    """Starts (async) or completes (sync) a save of `step`; raises TrainingError if any save failed."""
    self._raise_if_failed(step)
    args = ocp.args.Composite(**{STATE: ocp.args.StandardSave(state), DATA: ocp.args.JsonSave(data_state),
                                 META: ocp.args.JsonSave(meta)})
    try:
      self._manager.save(step, args=args, force=True)
    except Exception as e:  # noqa: BLE001 - any storage failure must stop the run with a clear message
      raise self._save_error(step, e) from None
    self.last_saved_step = step
    if not self.cfg.async_checkpointing:
      self.wait(step)

  def _save_error(self, step: int, error: BaseException) -> TrainingError:
    older = [s for s in self.all_steps() if s != step]
    kept = f"older checkpoints are untouched ({', '.join(map(str, older[-3:]))})" if older else "no older checkpoint"
    return TrainingError(f"saving checkpoint of step {step} to {self.directory} failed: {_first_line(error)}; "
                         f"{kept}; free space or fix permissions, then rerun the same command to resume")

  def _raise_if_failed(self, step: int) -> None:
    try:
      self._manager.check_for_errors()
    except Exception as e:  # noqa: BLE001
      raise self._save_error(self.last_saved_step if self.last_saved_step is not None else step, e) from None

  def wait(self, step: int | None = None) -> None:
    """Blocks until the pending save is on disk; raises TrainingError if it failed."""
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001
      raise self._save_error(step if step is not None else self.last_saved_step or 0, e) from None

  def close(self) -> None:
    try:
      self.wait()
      if self.local is not None:
        self.local.close()
    finally:
      self._manager.close()

  def restore_latest(self, abstract_state: Any, shardings: Any) -> Restored | None:
    """Newest step that restores cleanly, from whichever tier holds the newer one; a damaged
    persistent step is set aside (renamed, never deleted)."""
    persistent = self.all_steps()
    if self.local is not None:
      restored = self._restore_local(abstract_state, shardings, persistent[-1] if persistent else None)
      if restored is not None:
        return restored
    for step in reversed(persistent):
      self._check_stored_shapes(step, abstract_state)
      try:
        return self._restore_step(step, abstract_state, shardings)
      except Exception as e:  # noqa: BLE001 - any damage means: fall back to the previous step
        moved = self._set_aside(step)
        _log(f"warning: checkpoint step {step} in {self.directory} is incomplete or corrupt "
             f"({_first_line(e)}); moved it to {moved} and falling back to the previous one")
    return None

  def _check_stored_shapes(self, step: int, abstract_state: Any) -> None:
    """A step whose arrays have other shapes than this config builds was written by another
    model config: a UserError naming them, not damage (the step stays where it is). Unreadable
    metadata is left for the restore to report as damage."""
    try:
      with _quiet_absl():
        stored = ocp.PyTreeCheckpointer().metadata(storage.as_path(storage.join(self.directory, str(step), STATE)))
      stored_shapes = _shapes_by_path(stored.item_metadata.tree if hasattr(stored.item_metadata, "tree")
                                      else stored.item_metadata)
    except Exception:  # noqa: BLE001
      return
    wanted = _shapes_by_path(abstract_state)
    differences = [f"{p} {stored_shapes[p]} (this config: {wanted[p]})" for p in sorted(wanted)
                   if p in stored_shapes and stored_shapes[p] != wanted[p]]
    missing = sorted(set(wanted) - set(stored_shapes))
    extra = sorted(set(stored_shapes) - set(wanted))
    # Damage loses arrays; another config has arrays of other shapes or names (missing AND extra).
    if not differences and not (missing and extra):
      return
    differences.sort(key=lambda text: not text.startswith("params/"))  # the model's own arrays first
    parts = differences[:3] + [f"{p} is not stored" for p in missing[:2]] + [f"{p} is stored but not built"
                                                                              for p in extra[:2]]
    raise UserError(f"checkpoint step {step} in {self.directory} was written by another model config: "
                    f"{'; '.join(parts)}. Rerun with the model keys that wrote it, choose a new run_name, or start "
                    f"a new run from its weights with load_parameters_path={self.directory}")

  def _restore_local(self, abstract_state: Any, shardings: Any, persistent_step: int | None) -> Restored | None:
    """The local tier's newest step if every process holds it and it is newer than the
    persistent tier's (all processes decide together)."""
    assert self.local is not None
    step = self.local.agreed_step(shardings, abstract_state)
    if step is None or (persistent_step is not None and step <= persistent_step):
      return None
    try:
      state, data_state, meta = self.local.restore(step, abstract_state, shardings)
      ok = True
    except Exception as e:  # noqa: BLE001 - a damaged local copy: the persistent tier is the fallback
      _log(f"warning: local checkpoint step {step} in {self.local.root} is unreadable ({_first_line(e)}); "
           "using the persistent tier")
      ok = False
    everyone_ok = bool(multihost_utils.process_allgather(jnp.asarray(ok, jnp.int32)).min())
    if not everyone_ok:
      return None
    return Restored(state, data_state, meta, step, f"the local tier ({self.local.root})")

  def _restore_step(self, step: int, abstract_state: Any, shardings: Any) -> Restored:
    args = ocp.args.Composite(**{STATE: ocp.args.StandardRestore(with_shardings(abstract_state, shardings)),
                                 DATA: ocp.args.JsonRestore(), META: ocp.args.JsonRestore()})
    restored = self._manager.restore(step, args=args)
    return Restored(restored[STATE], restored[DATA], restored[META] or {}, step, self.directory)

  def _set_aside(self, step: int) -> str:
    source = storage.join(self.directory, str(step))
    target_name = f"{step}.corrupt-{int(time.time())}"
    if jax.process_index() == 0 and storage.exists(source):
      storage.set_aside(source, target_name)
    multihost_utils.sync_global_devices(f"checkpoint_set_aside_{step}")
    self._manager.reload()
    return storage.join(self.directory, target_name)


def restore_full_state(path: str, abstract_state: Any, shardings: Any) -> Restored:
  """Full state from a step directory or a checkpoints root (its latest good step)."""
  root = storage.resolve(path)
  if not storage.exists(root):
    raise UserError(f"load_full_state_path {path} does not exist")
  if _is_step_dir(root):
    step_name = storage.name(root)
    directory, steps = storage.parent(root), [int(step_name)] if step_name.isdigit() else []
    if not steps:
      raise UserError(f"load_full_state_path {path}: a step directory must be named by its step number")
  else:
    directory, steps = root, None
  cfg = CheckpointConfig(enable_checkpointing=True, async_checkpointing=False, checkpoint_period=1,
                         max_num_checkpoints_to_keep=-1, load_parameters_path="", load_full_state_path="",
                         param_only_checkpoint_path="", force_unroll=False, enable_emergency_checkpoint=False,
                         local_checkpoint_directory="", local_checkpoint_period=0, local_checkpoint_max_to_keep=1,
                         directory=directory, local_directory="")
  checkpoints = RunCheckpoints(cfg)
  try:
    if steps is not None:
      return checkpoints._restore_step(steps[0], abstract_state, shardings)
    restored = checkpoints.restore_latest(abstract_state, shardings)
  except UserError:
    raise
  except Exception as e:  # noqa: BLE001
    raise UserError(f"cannot restore the full state from {path}: {_first_line(e)}") from None
  finally:
    checkpoints._manager.close()
  if restored is None:
    raise UserError(f"load_full_state_path {path} holds no complete checkpoint")
  return restored


# ---------------------------------------------------------------- preemption

class PreemptionWatcher:
  """Turns SIGTERM (what TPU/GKE preemption sends) into "checkpoint at the next step boundary".

  With several processes JAX's own preemption sync point makes every process pick the same
  step; a single process installs a SIGTERM handler that sets a flag.
  """

  def __init__(self) -> None:
    self._flag = False
    self._multi = jax.process_count() > 1
    self._previous = None
    if not self._multi:
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

  def _on_sigterm(self, signum: int, frame: Any) -> None:
    self._flag = True

  def reached(self, step: int) -> bool:
    if self._multi:
      return multihost_utils.reached_preemption_sync_point(step)
    return self._flag

  def close(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None


# ---------------------------------------------------------------- where a run starts

@dataclasses.dataclass
class Start:
  state: Any
  data_state: dict[str, Any] | None
  rng_key_data: list[int] | None
  description: str


def _state_from_params(setup: Any, params: Any) -> Any:
  """Step 0 and a fresh optimizer around loaded parameters (fine-tuning)."""
  def create(p: Any) -> Any:
    return TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=setup.optimizer.init(p))

  return jax.jit(create, out_shardings=setup.state_shardings, donate_argnums=(0,))(params)


def initial_state(config: Any, setup: Any, checkpoints: RunCheckpoints | None, init_fn: Any) -> Start:
  """Resume this run's latest checkpoint, else load_full_state_path, else load_parameters_path,
  else `init_fn()` — the order MaxText users rely on when they rerun the same command."""
  cfg: CheckpointConfig = config.checkpoint
  abstract, shardings = setup.abstract_state, setup.state_shardings
  if checkpoints is not None:
    restored = checkpoints.restore_latest(abstract, shardings)
    if restored is not None:
      return Start(restored.state, restored.data_state, restored.meta.get("rng_key_data"),
                   f"resumed from step {restored.step} of {restored.source}")
  if cfg.load_full_state_path:
    restored = restore_full_state(cfg.load_full_state_path, abstract, shardings)
    return Start(restored.state, restored.data_state, restored.meta.get("rng_key_data"),
                 f"loaded the full state of step {restored.step} from {cfg.load_full_state_path}")
  if cfg.load_parameters_path:
    params = load_params(cfg.load_parameters_path, abstract.params, shardings.params)
    return Start(_state_from_params(setup, params), None, None,
                 f"loaded parameters from {cfg.load_parameters_path}; fresh optimizer state, step 0")
  return Start(init_fn(), None, None, f"initialised from seed {config.run.init_weights_seed}")
