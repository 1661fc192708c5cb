"""What a run directory records about its configuration, and what reading it back decides.

    <run_dir>/config.yml                      the configuration of the latest start
    <run_dir>/config_history/<UTC time>.yml   the configuration of every start, never overwritten

A resume compares the keys that fix what the saved state *is* (its shapes, its layout, what
its numbers mean, where its data position points) with the run's saved configuration; a
difference is the user's mistake, reported before anything is read or written. Everything
else (steps, schedules, periods, mesh degrees, hardware, ...) may change between starts.

Tools that read a run or a checkpoint take the model keys from the configuration saved with
it (`saved_model_keys`), so nobody has to retype them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Mapping

import yaml

from MaxText.paths import storage
from MaxText.configuration import config_fields, config_groups, spellings
from MaxText.configuration.model_config import LORA_KEYS, MODEL_KEYS
from MaxText.errors import ConfigError, UserError

if TYPE_CHECKING:
  from MaxText.configuration.config import Config

CONFIG_FILE = "config.yml"
HISTORY_DIR = "config_history"
MODEL_CONFIG_FILE = "model_config.yml"  # beside a parameters-only checkpoint

# The keys a resume must not change, by what they decide (field metadata in the config groups).
FIXED_ON_RESUME: dict[str, tuple[str, ...]] = {
    kind: config_fields.keys_where(config_groups.GROUPS, config_fields.FIXED, kind) for kind in config_fields.FIXED_KINDS}


def flat_values(config: Config) -> dict[str, Any]:
  """The values a start records (config.yml's flat keys plus the derived ones it compares)."""
  return {**dict(config.values), "global_batch_size": config.data.global_batch_size}


def _remedy(path: str, run_dir: str) -> str:
  # A config_history entry is itself the copy config.yml would be restored from.
  if storage.name(storage.parent(path)) == HISTORY_DIR:
    return "move it away (out of config_history/)"
  return f"restore it from {storage.join(run_dir, HISTORY_DIR)}, or move it away"


def _read_record(path: str, run_dir: str) -> dict[str, Any]:
  """The flat values of a saved configuration (config.yml or a config_history entry)."""
  try:
    data = yaml.safe_load(storage.read_text(path)) or {}
  except (yaml.YAMLError, UnicodeDecodeError) as e:  # not even text: damaged on disk or by a copy
    why = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else str(e).splitlines()[0]
    raise UserError(f"{path} is not readable YAML ({why}); {_remedy(path, run_dir)}: the resume is then checked "
                    "against the run's other records (config_history/, the checkpoint's saved keys)") from None
  if not isinstance(data, dict):
    raise UserError(f"{path} does not hold a configuration (a YAML mapping); {_remedy(path, run_dir)}")
  derived = data.pop("derived", None) or {}
  if "global_batch_size" in derived:
    data["global_batch_size"] = derived["global_batch_size"]
  return spellings.upgrade(data)  # a record written before a key was renamed


def read_saved(run_dir: str) -> dict[str, Any] | None:
  """The flat values of the run's latest start (config.yml), or None when it has none."""
  path = storage.join(run_dir, CONFIG_FILE)
  return _read_record(path, run_dir) if storage.is_file(path) else None


def newest_history(run_dir: str) -> tuple[dict[str, Any], str] | None:
  """(values, path) of the newest config_history entry, or None when there is none."""
  directory = storage.join(run_dir, HISTORY_DIR)
  if not storage.is_dir(directory):
    return None
  # Entries are named by their UTC start time (a second start in one second adds -2, -3, ...).
  def order(name: str) -> tuple[str, int]:
    stamp, _, n = name[:-len(".yml")].partition("-")
    return stamp, int(n) if n.isdigit() else 1

  names = sorted((n for n in storage.listdir(directory) if n.endswith(".yml")), key=order)
  if not names:
    return None
  path = storage.join(directory, names[-1])
  return _read_record(path, run_dir), path


def resume_keys(config: Config) -> dict[str, Any]:
  """The values of the keys a resume must keep, as a checkpoint records them (JSON: lists)."""
  values = flat_values(config)
  return {key: list(values[key]) if isinstance(values[key], tuple) else values[key]
          for keys in FIXED_ON_RESUME.values() for key in keys if key in values}


def _same(a: object, b: object) -> bool:
  if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
  if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
      and not isinstance(b, bool):
    return float(a) == float(b)
  return a == b


def _shapes_nothing(key: str, a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
  """Whether `key` fixes nothing in this model: max_position_embeddings is a learned position table's rows, but
  for RoPE only the length an exported config.json declares."""
  tables = (a.get("position_embedding"), b.get("position_embedding"))
  return key == "max_position_embeddings" and "learned" not in tables


# Keys naming one file or folder: the same one spelled another way (./tok.model, an absolute path, a link) is no
# change, where its text alone refused the resume.
_ONE_PATH_KEYS = ("tokenizer_path", "dataset_path")


def same_path(key: str, a: object, b: object) -> bool:
  """Whether two values of a path key (tokenizer_path, dataset_path) name one file, through links and relative
  spellings; False for any other key."""
  if key not in _ONE_PATH_KEYS or not isinstance(a, str) or not isinstance(b, str) or not a or not b:
    return False
  try:
    return storage.same_file(a, b)
  except UserError:  # a malformed path: compared as text
    return False


def resume_differences(current: Mapping[str, Any], saved: Mapping[str, Any],
                       kinds: tuple[str, ...] = config_fields.FIXED_KINDS) -> list[str]:
  """`key: saved -> now` for each fixed key (of `kinds`) whose value changed (keys a saved config lacks,
  written before the key existed, are not compared)."""
  found = []
  for kind in kinds:
    for key in FIXED_ON_RESUME[kind]:
      if key in saved and key in current and not _same(saved[key], current[key]) \
          and not _shapes_nothing(key, current, saved) and not same_path(key, saved[key], current[key]):
        found.append(f"{key}: {saved[key]!r} -> {current[key]!r}")
  return found


def check_resume(config: Config, run_dir: str, what: str,
                 checkpoint_keys: tuple[Mapping[str, Any], str] | None = None) -> list[str]:
  """Raises ConfigError (exit 2) when this start would resume `what` (e.g. "checkpoint step 6")
  with a fixed key changed; nothing has been read or written yet. Compares with every record the
  run has: config.yml (else the newest config_history entry: config.yml may be lost to a partial
  copy) and `checkpoint_keys` (the keys saved with that checkpoint, and where they come from).
  Returns the records it used, for the log."""
  records: list[tuple[Mapping[str, Any], str]] = []
  saved = read_saved(run_dir)
  if saved is not None:
    records.append((saved, storage.join(run_dir, CONFIG_FILE)))
  else:
    history = newest_history(run_dir)
    if history is not None:
      records.append((history[0], f"{history[1]} ({CONFIG_FILE} is missing)"))
  if checkpoint_keys is not None:
    values, source = checkpoint_keys
    records.append((spellings.upgrade(values), source if records else f"{source} ({CONFIG_FILE} and {HISTORY_DIR}/ are missing)"))
  current = flat_values(config)
  differences: list[str] = []
  sources = []
  for values, source in records:
    found = resume_differences(current, values)
    if found:
      sources.append(source)
      differences += [d for d in found if d not in differences]
  if differences:
    note = "; global_batch_size is per_device_batch_size x the number of devices" \
        if any(d.startswith("global_batch_size:") for d in differences) else ""
    # A LoRA run's checkpoints are refused as parameters (params_io.load_params): point at the export instead.
    start = ("export these weights with their adapters merged (MaxText.generate_param_only_checkpoint "
             "param_only_checkpoint_path=DIR) and start a new run from them with load_parameters_path=DIR"
             if any(_trained_adapters(values) for values, _ in records) else
             f"start a new run from these weights with load_parameters_path={storage.join(run_dir, 'checkpoints')}")
    raise ConfigError(
        f"cannot resume {what} of {run_dir}: the saved state was made with other values of key(s) that fix "
        f"its shape or meaning ({'; '.join(differences)}, saved -> now{note}; recorded in {' and '.join(sources)}). "
        f"Rerun with the saved values, choose a new run_name, or {start}")
  return [source for _, source in records]


def check_full_state(config: Config, path: str) -> None:
  """load_full_state_path: the state another run saved must have this run's shape and meaning, as a resume's
  must, but for its data position (a new run may read other data). AdamW's and adam_pax's states have one
  layout, so another opt_type loaded silently, its moments read as the other optimizer's."""
  run_dir = run_dir_of(path)
  if run_dir is None:
    return
  saved = read_saved(run_dir)
  if saved is None:
    return
  kinds = tuple(kind for kind in config_fields.FIXED_KINDS if kind != config_fields.DATA_POSITION)
  differences = resume_differences(flat_values(config), saved, kinds)
  if differences:
    raise ConfigError(
        f"load_full_state_path={path}: its run ({storage.join(run_dir, CONFIG_FILE)}) saved the state with other "
        f"values of key(s) that fix its shape or meaning ({'; '.join(differences)}, saved -> now). Set them as "
        f"saved, or start from its weights alone with load_parameters_path={path} (a fresh optimizer state)")


def record_start(config: Config, run_dir: str) -> str:
  """Writes config.yml (this start) and a new config_history entry; returns the entry's path."""
  text = config.to_yaml()
  storage.makedirs(storage.join(run_dir, HISTORY_DIR))
  stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
  entry, n = storage.join(run_dir, HISTORY_DIR, f"{stamp}.yml"), 1
  while storage.exists(entry):  # two starts in one second (the lease makes them sequential)
    n += 1
    entry = storage.join(run_dir, HISTORY_DIR, f"{stamp}-{n}.yml")
  storage.write_text(entry, text)
  storage.write_text(storage.join(run_dir, CONFIG_FILE), text)
  return entry


# ---------------------------------------------------------------- tools reading a run

def run_dir_of(checkpoint_path: str) -> str | None:
  """The run directory holding `checkpoint_path` (the run directory itself, its checkpoints
  directory, or one step of it), when it has a saved config.yml."""
  path = storage.resolve(checkpoint_path)
  candidates = [path]
  if storage.name(path) == "checkpoints":
    candidates.append(storage.parent(path))
  elif storage.name(path).isdigit() and storage.name(storage.parent(path)) == "checkpoints":
    candidates.append(storage.parent(storage.parent(path)))
  for candidate in reversed(candidates):
    if storage.is_file(storage.join(candidate, CONFIG_FILE)):
      return candidate
  return None


def saved_model_keys(checkpoint_path: str) -> tuple[dict[str, Any], str] | None:
  """(model keys, the file they come from) saved with a checkpoint: a parameters-only
  checkpoint's model_config.yml, or the config.yml of the run the checkpoint belongs to (with
  its LoRA keys: that run's checkpoints hold its adapters)."""
  beside = storage.join(checkpoint_path, MODEL_CONFIG_FILE)
  if storage.is_file(beside):
    try:
      values = yaml.safe_load(storage.read_text(beside)) or {}
      why = "" if isinstance(values, dict) else f"it holds a {type(values).__name__}, not key: value lines"
    except (yaml.YAMLError, UnicodeDecodeError) as e:
      why = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else f"not readable YAML: {str(e).splitlines()[0]}"
    if why:
      raise UserError(f"{beside} does not hold the checkpoint's model keys ({why}); restore it from where the "
                      "checkpoint came from, or delete it and give the model keys (model_name=...) yourself")
    return spellings.upgrade(values), beside
  run_dir = run_dir_of(checkpoint_path)
  if run_dir is None:
    return None
  saved = read_saved(run_dir) or {}
  return {k: saved[k] for k in (*MODEL_KEYS, *LORA_KEYS) if k in saved}, storage.join(run_dir, CONFIG_FILE)


def contradictions(given: Mapping[str, Any], saved: Mapping[str, Any]) -> list[str]:
  """`key=given (saved: value)` for each given model key that differs from the saved one, the LoRA keys
  included where the saved run trained adapters (another alpha or fewer targets exported or decoded a
  model nobody trained), and lora_rank always (a plain run's checkpoints have no adapters to read)."""
  lora_keys = LORA_KEYS if _trained_adapters(saved) else ("lora_rank",)
  return [f"{key}={given[key]!r} (saved: {saved[key]!r})" for key in (*MODEL_KEYS, *lora_keys)
          if key in given and key in saved and not _same(given[key], saved[key])
          and not _shapes_nothing(key, given, saved)]


def _trained_adapters(saved: Mapping[str, Any]) -> bool:
  rank = saved.get("lora_rank", 0)
  return isinstance(rank, int) and rank > 0
