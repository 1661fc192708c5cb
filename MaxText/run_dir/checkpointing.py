"""The run's Orbax checkpoints: save the full train state every `checkpoint_period` steps,
resume after a kill, and never lose a checkpoint that was once complete (a damaged step is set
aside, not deleted; a step written by another model config is refused by name).

Layout of a run (`base_output_directory/run_name/checkpoints`):
    <step>/state   TrainState {step, params, opt_state} (Orbax PyTree, sharded arrays)
    <step>/data    the data iterator's state (JSON)
    <step>/meta    the train RNG key and what wrote the checkpoint (JSON)

Restores are sharded: arrays are read straight into the shardings of the current mesh,
which may differ from the mesh that saved them. Parameters-only checkpoints are
`params_io.py`'s; where a run starts (resume, load, init) is `run_start.py`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from typing import Any, Generic, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from MaxText.paths import storage, storage_retry
from MaxText.configuration.config_groups import CheckpointConfig
from MaxText.errors import TrainingError, UserError, quiet_logger
from MaxText.run_dir import peer_handover
from MaxText.run_dir.local_checkpoints import LocalTier
from MaxText.platform.sharding import with_shardings

# The run's state (a tree of arrays); its abstract twin and its shardings are trees of the same type.
State = TypeVar("State")

STATE, DATA, META = "state", "data", "meta"
META_FILE = "metadata"  # the file Orbax's JsonSave writes in an item's directory
REWIND_KEY = "resume_from_step"  # in a checkpoint's meta: the resume_from_step of the start that saved it
RESUME_KEYS = "resume_keys"  # in a checkpoint's meta: the values of the keys a resume must keep


def log(message: str) -> None:
  if jax.process_index() == 0:
    print(message, flush=True)


def is_step_dir(path: str) -> bool:
  return storage.is_dir(storage.join(path, STATE))


def not_a_checkpoint(path: str, root: str) -> str | None:
  """Why `path` (resolved: `root`) holds no checkpoint when it is a file or a run directory (one
  holding checkpoints/, not a checkpoint itself); None for anything else."""
  if not storage.is_dir(root):
    return f"{path} is a file, not a checkpoint directory"
  inner = storage.join(root, "checkpoints")
  if storage.is_dir(inner):
    # Naming an empty checkpoints directory would only send the user to its own refusal.
    if not any(name.isdigit() and is_step_dir(storage.join(inner, name)) for name in storage.listdir(inner)):
      return (f"{path} is a run directory whose checkpoints directory {inner} holds no finished step yet: load "
              "another checkpoint, or wait for this run's first save")
    return f"{path} is a run directory, not a checkpoint: give its checkpoints directory {inner} (its newest step)"
  return None


def _check_writable(directory: str) -> None:
  """A run's own local checkpoint directory must take saves: otherwise the first save, after
  checkpoint_period steps of training, would be the first to find out."""
  path = storage.resolve(directory)
  if storage.is_remote(path) or jax.process_index() != 0:
    return  # a bucket's writes are checked by its own start-up probe; one process speaks for the run
  if storage.exists(path) and not storage.is_dir(path):
    raise UserError(f"checkpoint directory {path} is a file, not a folder: move it away or choose another "
                    "run_name or base_output_directory")
  if storage.is_dir(path) and not os.access(path, os.W_OK | os.X_OK):
    raise UserError(f"checkpoint directory {path} is not writable by this user: fix its permissions or choose "
                    "another run_name or base_output_directory")


def _not_damage(error: BaseException) -> bool:
  """A restore that failed for want of memory or permission: the step itself may well be whole."""
  text = str(error)
  return isinstance(error, (MemoryError, PermissionError)) or "RESOURCE_EXHAUSTED" in text \
      or "PERMISSION_DENIED" in text


FIRST_LINE_CHARS = 400


def first_line(error: BaseException) -> str:
  # Orbax wraps TensorStore's read error (which names the array and the file) in a line that names
  # neither and ends in a repr of the whole TensorStore spec.
  if error.__cause__ is not None and str(error).startswith("Encountered error while reading"):
    error = error.__cause__
  text = str(error).strip().splitlines()
  line = text[0].split(" [tensorstore_spec", 1)[0] if text else ""  # TensorStore's JSON spec follows
  line = f"{type(error).__name__}: {line}"
  if len(line) <= FIRST_LINE_CHARS:
    return line
  # TensorStore nests its causes ("Error writing ...: Failed writing ...: ... file 18: No space left on
  # device [os_error_code='28']"): the innermost, the one that says what to fix, comes last.
  reason = line.rsplit(": ", 1)[-1]
  if len(reason) > FIRST_LINE_CHARS // 2:
    return line[:FIRST_LINE_CHARS]
  return f"{line[:FIRST_LINE_CHARS - len(reason) - 7]} ... : {reason}"


def quiet_absl() -> contextlib.AbstractContextManager[None]:
  """Orbax warns that a step's state has no _CHECKPOINT_METADATA of its own (the step has it);
  reading metadata only, that is noise."""
  return quiet_logger("absl")


def shapes_by_path(tree: object) -> dict[str, tuple[int, ...]]:
  """{'params/layers/mlp/...': shape} for the arrays of a state tree or of Orbax's metadata of
  one (whose nodes are plain dicts and lists, not the state's dataclasses and tuples)."""
  def key_name(entry: object) -> str:
    for attribute in ("name", "key", "idx"):
      if hasattr(entry, attribute):
        return str(getattr(entry, attribute))
    return str(entry)

  leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
  return {"/".join(key_name(k) for k in path): tuple(leaf.shape) for path, leaf in leaves if hasattr(leaf, "shape")}


class SaveFailed(TrainingError):
  """A checkpoint save that failed. Orbax's save threads may still wait for signals the failed save
  will never send, and they are not daemons: a normal exit would wait for them for ever."""

  exit_at_once = True


@dataclasses.dataclass
class Restored(Generic[State]):
  state: State
  data_state: dict[str, Any] | None
  meta: dict[str, Any]
  step: int
  source: str = ""  # where it came from, for the log


class EventLog(ocp.logging.AbstractLogger):  # type: ignore[misc]
  """Orbax's checkpoint events (each save's and restore's statistics) as JSON lines in `path`, written
  by process 0: where upstream's enable_checkpoint_cloud_logger sends them to Google Cloud Logging."""

  def __init__(self, path: str):
    self._log: storage.LineLog | None = None
    if jax.process_index() == 0:  # a resumed run's file keeps its earlier events
      earlier = storage.read_text(path).splitlines(keepends=True) if storage.exists(path) else []
      # Each event written out at once: a gs:// object is rewritten whole, and saves are few.
      self._log = storage.LineLog(path, earlier, upload_interval_seconds=0.0)

  def log_entry(self, entry: Any, *args: Any, **kwargs: Any) -> None:
    if self._log is not None:
      self._log.write_line(json.dumps(entry, default=str, sort_keys=True))


class _HeldSaveErrors(logging.Filter):
  """Orbax logs a failed save's causes as ERROR lines from its threads, then raises the same failure, which the run
  reports as its one `error:` line: its ERROR records wait here until the save's outcome is known, dropped when it
  failed, logged when it did not. Only while a save is under way (`hold`): Orbax's other ERROR lines go out."""

  def __init__(self) -> None:
    super().__init__()
    self._lock = threading.Lock()
    self._held: list[logging.LogRecord] = []
    self._holding = False

  def filter(self, record: logging.LogRecord) -> bool:
    if not self._holding or record.levelno < logging.ERROR or "orbax" not in record.pathname:
      return True
    with self._lock:
      self._held.append(record)
    return False

  def hold(self) -> None:
    self._holding = True

  def drop(self) -> None:
    with self._lock:
      self._held.clear()
      self._holding = False

  def release(self) -> None:
    with self._lock:
      held, self._held = self._held, []
      self._holding = False
    for record in held:
      logging.getLogger(record.name).handle(record)


_SAVE_ERRORS = _HeldSaveErrors()
logging.getLogger("absl").addFilter(_SAVE_ERRORS)


class RunCheckpoints:
  """The run's CheckpointManager: periodic (async) saves, resume with fallback, clear failures."""

  def __init__(self, directory: str, *, max_to_keep: int | None = None, async_save: bool = False,
               local: LocalTier | None = None, events_path: str = ""):
    """The checkpoints under `directory`; with the defaults (synchronous, every step kept, no
    local tier) this is how another run's checkpoints are opened for reading."""
    self.directory = storage.resolve(directory)
    self._async_save = async_save
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True)

    def open_manager() -> ocp.CheckpointManager:
      return ocp.CheckpointManager(storage.as_path(self.directory), item_names=(STATE, DATA, META), options=options,
                                   logger=EventLog(events_path) if events_path else None)

    try:
      self._manager = storage_retry.call("listing checkpoints", self.directory, open_manager)
    except OSError as e:
      raise UserError(f"cannot use checkpoint directory {self.directory}: {first_line(e)}") from None
    self.last_saved_step: int | None = self._manager.latest_step()
    self._durable_step = self.last_saved_step  # the newest step known complete (for storage_retry's message)
    self._saved_here = False  # this process saved (the run's own checkpoints, not another run's being read)
    self._own = False  # this run's own checkpoints (for_run): a damaged step may be set aside; another run's stay
    # Multi-tier: the fast per-host tier beside this (persistent) one.
    self.local = local

  @classmethod
  def for_run(cls, cfg: CheckpointConfig) -> "RunCheckpoints":
    """This run's checkpoints as `cfg` configures them (both tiers)."""
    local = LocalTier(cfg.local_directory, cfg.local_checkpoint_period, cfg.local_checkpoint_max_to_keep) if cfg.local_directory else None
    if cfg.events_path:
      log(f"checkpoint: enable_checkpoint_cloud_logger: each save's and restore's events go to {cfg.events_path} "
          "(JSON lines; this project does not use Google Cloud Logging)")
    _check_writable(cfg.directory)
    checkpoints = cls(cfg.directory, max_to_keep=cfg.max_to_keep, async_save=cfg.async_checkpointing, local=local,
                      events_path=cfg.events_path)
    storage_retry.note_saved(checkpoints.directory, checkpoints.last_saved_step)
    checkpoints._own = True
    return checkpoints

  @property
  def unfinished_step(self) -> int | None:
    """The step of a save this process started that is not known to be on disk yet (an async save
    in flight, which `wait` and `close` wait for), else None."""
    return self.last_saved_step if self._saved_here and self.last_saved_step != self._durable_step else None

  def local_due(self, step: int) -> bool:
    return self.local is not None and step % self.local.period == 0

  def save_local(self, step: int, state: object, data_state: dict[str, Any], meta: dict[str, Any]) -> None:
    assert self.local is not None
    self.local.save(step, state, data_state, meta)

  def wait_local(self) -> None:
    """Blocks until the pending local-tier save is on disk; raises TrainingError if it failed."""
    if self.local is not None:
      self.local.wait()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def newest_step(self) -> int | None:
    """The newest step either tier holds (this host's view of the local tier), before any read."""
    steps = self.all_steps() + (self.local.steps() if self.local is not None else [])
    return max(steps) if steps else None

  def save(self, step: int, state: object, data_state: dict[str, Any], meta: dict[str, Any]) -> None:
    """Starts (async) or completes (sync) a save of `step`; raises TrainingError if any save failed."""
    self._raise_if_failed(step)
    self.wait()  # the previous async save, which Orbax's save would wait for first (unbounded)
    args = ocp.args.Composite(**{STATE: ocp.args.StandardSave(state), DATA: ocp.args.JsonSave(data_state),
                                 META: ocp.args.JsonSave(meta)})
    storage_retry.note_saved(self.directory, self._durable_step, pending=step)
    _SAVE_ERRORS.hold()
    try:
      storage_retry.call(f"saving checkpoint step {step}", self.directory,
                         lambda: self._manager.save(step, args=args, force=True), retry=False)
    except storage_retry.StorageUnavailable:
      raise
    except Exception as e:  # noqa: BLE001 - any storage failure must stop the run with a clear message
      raise self._save_error(step, e) from None
    self.last_saved_step, self._saved_here = step, True
    if not self._async_save:
      self.wait(step)

  def _save_error(self, step: int, error: BaseException) -> TrainingError:
    _SAVE_ERRORS.drop()  # Orbax's lines about this failure: the error says it
    older = [s for s in self._steps_on_storage() if s != step]
    kept = f"older checkpoints are untouched ({', '.join(map(str, older[-3:]))})" if older else "no older checkpoint"
    return SaveFailed(f"saving checkpoint of step {step} to {self.directory} failed: {first_line(error)}; "
                         f"{kept}; free space or fix permissions, then rerun the same command to resume")

  def _steps_on_storage(self) -> list[int]:
    """The complete steps the directory holds now. Orbax's own list drops the steps that max_to_keep
    prunes when a save starts, though it deletes them only once that save is complete."""
    try:
      self._manager.reload()
    except Exception:  # noqa: BLE001 - the listing is for the message only; the failure is what to report
      pass
    return self.all_steps()

  def _raise_if_failed(self, step: int) -> None:
    try:
      self._manager.check_for_errors()
    except Exception as e:  # noqa: BLE001
      raise self._save_error(self.last_saved_step if self.last_saved_step is not None else step, e) from None

  def wait(self, step: int | None = None) -> None:
    """Blocks until the pending save is on disk; raises TrainingError if it failed."""
    pending = step if step is not None else self.last_saved_step or 0
    try:
      storage_retry.call(f"saving checkpoint step {pending}", self.directory, self._manager.wait_until_finished,
                         retry=False)
    except storage_retry.StorageUnavailable:
      raise
    except Exception as e:  # noqa: BLE001
      raise self._save_error(pending, e) from None
    _SAVE_ERRORS.release()  # nothing failed: whatever Orbax logged is shown as it was
    if self._saved_here:
      self._durable_step = self.last_saved_step
      storage_retry.note_saved(self.directory, self._durable_step)

  def close(self) -> None:
    try:
      self.wait()
      if self.local is not None:
        self.local.close()
    finally:
      if not storage_retry.is_down():
        self._manager.close()
      elif self.local is not None:  # Orbax's threads may hang on the unreachable storage: left to the exit
        self.local.close()  # this host's own disk still works: its newest save stays usable

  def restore_latest(self, abstract_state: State, shardings: State) -> Restored[State] | None:
    """Newest step that restores cleanly, from whichever tier holds the newer one; a damaged
    persistent step is set aside (renamed, never deleted)."""
    self._set_aside_step_files()
    persistent = self.all_steps()
    if self.local is not None:
      restored = self._restore_local(abstract_state, shardings, persistent[-1] if persistent else None)
      if restored is not None:
        return restored
    # A step that fails is set aside only once an older one restores: when none does, the cause is
    # common to all of them (memory, permissions, the environment), and renaming every step would
    # have started the run over from step 0.
    failed: list[tuple[int, str]] = []
    for step in reversed(persistent):
      self._check_stored_shapes(step, abstract_state)
      try:
        restored = self.restore_step(step, abstract_state, shardings)
      except storage_retry.StorageUnavailable:
        raise  # unreachable is not damaged: the step stays where it is
      except Exception as e:  # noqa: BLE001 - any damage means: fall back to the previous step
        if _not_damage(e):
          raise TrainingError(f"cannot restore checkpoint step {step} of {self.directory}: {first_line(e)}; that "
                              "is not damage to the step, so nothing was moved aside: fix it and rerun") from None
        failed.append((step, first_line(e)))
        continue
      for bad, why in failed:
        if not self._own:  # another run's directory (load_full_state_path): read, never rearranged
          log(f"warning: checkpoint step {bad} in {self.directory} is incomplete or corrupt ({why}); left in place "
              "(another run's) and falling back to the previous one")
          continue
        moved = self._set_aside(bad)
        log(f"warning: checkpoint step {bad} in {self.directory} is incomplete or corrupt ({why}); moved it to "
            f"{moved} and falling back to the previous one")
      return restored
    if failed:
      raise TrainingError(
          f"no checkpoint in {self.directory} restores (step {failed[0][0]}: {failed[0][1]}"
          f"{f'; and {len(failed) - 1} older step(s)' if len(failed) > 1 else ''}); nothing was moved aside. If the "
          "steps are damaged, move them aside (a run's own: rerun with resume_from_step=0, which sets them aside and "
          "starts from the beginning)")
    return None

  def _set_aside_step_files(self) -> None:
    """A file under a step's name is no checkpoint, and Orbax would delete it to save that step again:
    it is set aside with a warning, like a damaged step."""
    # Process 0 alone: Orbax lists no file as a step, so the other processes have nothing to sync on.
    if not self._own or jax.process_index() != 0 or storage.is_remote(self.directory) \
        or not storage.is_dir(self.directory):
      return
    for name in storage.listdir(self.directory):
      path = storage.join(self.directory, name)
      if name.isdigit() and not storage.is_dir(path):
        moved = storage.set_aside(path, f"{name}.corrupt-{int(time.time())}")
        log(f"warning: {path} is a file, not a checkpoint step; moved it to {moved} and resuming from the newest "
            "step that restores")

  def _check_stored_shapes(self, step: int, abstract_state: object) -> None:
    """A step whose arrays have other shapes than this config builds was written by another
    model config: a UserError naming them, not damage (the step stays where it is). Unreadable
    metadata is left for the restore to report as damage."""
    try:
      with quiet_absl():
        stored = ocp.PyTreeCheckpointer().metadata(storage.as_path(storage.join(self.directory, str(step), STATE)))
      stored_shapes = shapes_by_path(stored.item_metadata.tree if hasattr(stored.item_metadata, "tree")
                                      else stored.item_metadata)
    except Exception:  # noqa: BLE001
      return
    wanted = shapes_by_path(abstract_state)
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
    # Only the optimizer's state differs: an optimizer key the resume check does not compare changed
    # its layout (gradient_clipping_threshold from > 0 to 0 drops the clipping's place in it).
    optimizer_only = all(p.startswith("opt_state/") for p in (*differences, *missing, *extra))
    what, keys = (("another optimizer configuration", "the optimizer keys that wrote it (gradient_clipping_threshold "
                   "0 and > 0 keep differently laid-out states; the run's config.yml has the saved values)")
                  if optimizer_only else ("another model config", "the model keys that wrote it"))
    raise UserError(f"checkpoint step {step} in {self.directory} was written by {what}: "
                    f"{'; '.join(parts)}. Rerun with {keys}, choose a new run_name, or start "
                    f"a new run from its weights with load_parameters_path={self.directory}")

  def _restore_local(self, abstract_state: State, shardings: State, persistent_step: int | None
                     ) -> Restored[State] | None:
    """The local tier's newest step that every process can restore, if newer than the persistent
    tier's: from its own disk, or handed over by the processes that hold it (all decide together)."""
    assert self.local is not None
    plan, passed_over = peer_handover.plan(self.local, abstract_state, shardings, persistent_step)
    if passed_over:
      log(f"{passed_over}; using {f'local step {plan.step}' if plan else 'the persistent tier'}")
    if plan is None:
      return None
    source = f"the local tier ({self.local.directory})"
    if plan.lackers:
      try:
        state, data_state, meta = peer_handover.restore(self.local, plan, abstract_state, shardings)
      except peer_handover.HandoverFailed as e:
        if not e.said_here:  # a process that could not read its copy has said why in its own line
          log(f"warning: {e}; using the persistent tier")
        return None
      if jax.process_index() in plan.lackers:  # kept on this host too: a next loss may leave it the only holder
        self.local.save(plan.step, state, data_state, meta)
      return Restored(state, data_state, meta, plan.step, f"{source[:-1]}; {plan.describe()})")
    try:
      state, data_state, meta = self.local.restore(plan.step, abstract_state, shardings)
      ok = True
    except Exception as e:  # noqa: BLE001 - a damaged local copy: the persistent tier is the fallback
      print(f"warning: local checkpoint step {plan.step} in {self.local.directory} is unreadable on process "
            f"{jax.process_index()} ({first_line(e)}); using the persistent tier", flush=True)
      ok = False
    failed = np.flatnonzero(np.asarray(multihost_utils.process_allgather(np.int32(not ok))).reshape(-1))
    if len(failed):
      if ok:  # a process that could not read its copy has said why in its own line
        log(f"warning: local checkpoint step {plan.step} is unreadable on process(es) "
            f"{', '.join(map(str, failed.tolist()))}; using the persistent tier")
      return None
    return Restored(state, data_state, meta, plan.step, source)

  def restore_step(self, step: int, abstract_state: State, shardings: State) -> Restored[State]:
    args = ocp.args.Composite(**{STATE: ocp.args.StandardRestore(with_shardings(abstract_state, shardings)),
                                 DATA: ocp.args.JsonRestore(), META: ocp.args.JsonRestore()})
    restored = storage_retry.call(f"restoring checkpoint step {step}", self.directory,
                                  lambda: self._manager.restore(step, args=args), retry=False)
    return Restored(restored[STATE], restored[DATA], restored[META] or {}, step, self.directory)

  def _set_aside(self, step: int, target_name: str = "") -> str:
    source = storage.join(self.directory, str(step))
    target_name = target_name or f"{step}.corrupt-{int(time.time())}"
    if jax.process_index() == 0 and storage.exists(source):
      storage.set_aside(source, target_name)
    multihost_utils.sync_global_devices(f"checkpoint_set_aside_{step}")
    self._manager.reload()
    return storage.join(self.directory, target_name)

  # ------------------------------------------------------------------ resume_from_step

  def saved_meta(self, step: int) -> dict[str, Any] | None:
    """The meta saved with `step` (the persistent tier's, else this host's local copy), read
    without restoring anything; None when it is unreadable."""
    path = storage.join(self.directory, str(step), META, META_FILE)
    try:
      meta = json.loads(storage.read_text(path))
      return meta if isinstance(meta, dict) else None
    except Exception:  # noqa: BLE001 - absent or damaged: the restore reports damage
      pass
    return self.local.meta(step) if self.local is not None and step in self.local.steps() else None

  def rewind_plan(self, step: int) -> list[int]:
    """The persistent steps that resume_from_step=`step` sets aside, newest first: those after
    it that were not saved by a start with that same resume_from_step (rerunning the same
    command after a kill continues, it does not go back again). UserError when there are some
    but `step` (> 0) is not a saved step."""
    steps = self.all_steps()
    later = [s for s in reversed(steps) if s > step and (self.saved_meta(s) or {}).get(REWIND_KEY) != step]
    if later and step > 0 and step not in steps:
      raise UserError(f"resume_from_step={step}: {self.directory} holds no checkpoint of step {step} (saved "
                      f"steps: {', '.join(map(str, steps)) or 'none'}); choose one of those, or 0 to start over")
    return later

  def rewind(self, step: int, plan: list[int]) -> list[str]:
    """Sets aside (renames, never deletes) the persistent steps of `plan` and this host's local
    steps after `step` not saved under the same rewind; every process calls it. Returns the new
    names of the persistent steps."""
    multihost_utils.sync_global_devices("resume_from_step_planned")  # every process planned before any move
    stamp = int(time.time() * 1000)  # milliseconds: two rewinds to one step get distinct names
    moved = [self._set_aside(s, f"{s}.before-resume_from_step_{step}-{stamp}") for s in plan]
    if self.local is not None:
      for s in self.local.steps():
        if s > step and (self.local.meta(s) or {}).get(REWIND_KEY) != step:
          self.local.set_aside(s, f"{s}.before-resume_from_step_{step}-{stamp}")
    if plan:
      self.last_saved_step = self._manager.latest_step()
    return moved
