"""The data group: where training batches come from and how they are shaped, validated next to its
fields (no I/O: files and tokenizers are checked when the data is opened, input_pipeline.check_sources).

The objective lives here because it chooses the batch's fields and the records a run reads.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Mapping

from MaxText.paths import storage
from MaxText.configuration import batch_split
from MaxText.configuration.config_fields import DATA_POSITION, derived, key, read_keys, warn_once
from MaxText.configuration.config_fields import require as _require
from MaxText.configuration.data_mixture import MixtureSource, MixtureStage, parse_schedule, parse_sources
from MaxText.configuration.model_checks import one_of as _one_of, positive as _positive
from MaxText.configuration.objective_registry import CHAT_OBJECTIVES, OBJECTIVES
from MaxText.errors import ConfigError


def _warn_unused_mixture(sources: "tuple[MixtureSource, ...]", schedule: "tuple[MixtureStage, ...]", steps: int) -> None:
  """A schedule stage at or past `steps` (the batch of step N+1 is the first its weights draw), or a source whose
  weight is 0 in every stage that applies, changes nothing in this run: said, since it reads as if it did (a
  stage for a longer run that a later resume reaches may be meant, so no error)."""
  late = [stage.step for stage in schedule if stage.step >= steps]
  if late:
    warn_once(f"warning: data_mixture_schedule's stage(s) at step {', '.join(map(str, late))} begin at or after "
              f"steps={steps}: they change no weight in this run")
  first = [] if schedule and schedule[0].step == 0 else [tuple(s.weight for s in sources)]  # replaced at once
  applied = first + [stage.weights for stage in schedule if stage.step < steps]
  unread = [s.name for i, s in enumerate(sources) if all(weights[i] == 0 for weights in applied)]
  if unread:
    warn_once(f"warning: data_mixture source(s) {', '.join(map(repr, unread))} have weight 0 throughout this run's "
              f"{steps} steps: they are opened and checked but never read")

if TYPE_CHECKING:
  from MaxText.configuration.config_groups import MeshConfig
  from MaxText.platform.accelerators import DeviceTarget  # JAX: not at import (the server's HTTP processes read TOKENIZER_TYPES)

DATASET_TYPES = ("synthetic", "tfds", "hf", "grain", "stream")
TOKENIZER_TYPES = ("sentencepiece", "tiktoken", "huggingface")  # input_pipeline/tokenizer.py reads each


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
  dataset_type: str = key(fixed_on_resume=DATA_POSITION)
  per_device_batch_size: float = key()
  max_target_length: int = key(fixed_on_resume=DATA_POSITION)
  vocab_size: int = key()
  data_shuffle_seed: int = key(fixed_on_resume=DATA_POSITION)
  synthetic_max_stride: int = key()
  eval_interval: int = key()
  eval_steps: int = key()
  # Real data (dataset_type tfds | hf | grain); see input_pipeline/.
  dataset_path: str = key(fixed_on_resume=DATA_POSITION)
  dataset_name: str = key(fixed_on_resume=DATA_POSITION)
  train_split: str = key(fixed_on_resume=DATA_POSITION)
  eval_split: str = key()
  hf_path: str = key(fixed_on_resume=DATA_POSITION)
  hf_data_files: str = key(fixed_on_resume=DATA_POSITION)
  hf_eval_files: str = key()
  grain_train_files: str = key(fixed_on_resume=DATA_POSITION)
  grain_eval_files: str = key()
  grain_worker_count: int = key()
  # Shard files streamed one at a time (input_pipeline/streaming.py).
  stream_train_files: str = key(fixed_on_resume=DATA_POSITION)
  stream_eval_files: str = key()
  # Several weighted sources instead of one (configuration/data_mixture.py, input_pipeline/mixture.py).
  data_mixture: tuple[MixtureSource, ...] = key(fixed_on_resume=DATA_POSITION)
  data_mixture_schedule: tuple[MixtureStage, ...] = key()
  train_data_columns: tuple[str, ...] = key(fixed_on_resume=DATA_POSITION)
  tokenizer_type: str = key(fixed_on_resume=DATA_POSITION)
  tokenizer_path: str = key(fixed_on_resume=DATA_POSITION)
  add_bos: bool = key(fixed_on_resume=DATA_POSITION)
  add_eos: bool = key(fixed_on_resume=DATA_POSITION)
  packing: bool = key(fixed_on_resume=DATA_POSITION)
  enable_data_shuffling: bool = key(fixed_on_resume=DATA_POSITION)
  data_prefetch_batches: int = key()
  reuse_example_batch: bool = key()  # every step trains on the first batch read (train.py's ReusedBatch)
  # Supervised fine-tuning on conversations / prompt-completion pairs (input_pipeline/chat.py).
  # What the run trains: a name in objective_registry.OBJECTIVES (lm, sft, dpo, grpo); the old
  # use_sft/use_dpo/use_grpo flags are aliases (spellings.VALUE_ALIASES).
  objective: str = key(fixed_on_resume=DATA_POSITION)
  sft_train_on_completion_only: bool = key(fixed_on_resume=DATA_POSITION)
  # Multimodal SFT: image slots per batch row (input_pipeline/image_sft.py); 0 = no pixel_values field.
  max_images_per_row: int = key(fixed_on_resume=DATA_POSITION)
  # A new mesh may change per_device_batch_size or the device count, not their product.
  global_batch_size: int = derived(fixed_on_resume=DATA_POSITION)
  # The data_sharding axes the batch's rows are split over (MeshConfig.batch_axes); on the others
  # every device holds the same rows.
  batch_axes: tuple[str, ...] = derived()
  image_size: int = derived(0)  # pixel_values' side (the vision tower's) when max_images_per_row > 0

  @property
  def text_column(self) -> str:
    return self.train_data_columns[0]

  @property
  def has_eval_source(self) -> bool:
    """Real data that is evaluated (eval_interval > 0)."""
    return self.dataset_type != "synthetic" and self.eval_interval > 0

  @classmethod
  def from_values(cls, v: Mapping[str, Any], target: DeviceTarget, mesh: MeshConfig,
                  reads_data: bool = True) -> "DataConfig":
    """`reads_data`: False for a tool that reads no training data; where data would come from is
    then not checked (a fine-tuning config names files a server never opens)."""
    _one_of(v, "dataset_type", DATASET_TYPES)
    _one_of(v, "objective", tuple(OBJECTIVES))
    _positive(v, "per_device_batch_size", "synthetic_max_stride", "eval_steps")
    if v["objective"] in CHAT_OBJECTIVES and reads_data:
      objective = v["objective"]
      _require(v["dataset_type"] in ("hf", "grain"), f"objective={objective} reads conversation records with "
               "dataset_type=hf (JSON/JSONL/Parquet files) or grain (JSON records); got "
               f"dataset_type={v['dataset_type']}")
      _require(v["tokenizer_type"] == "huggingface", f"objective={objective} renders the model's chat template, which "
               f"lives in its Hugging Face tokenizer files: set tokenizer_type=huggingface (got {v['tokenizer_type']})")
    _check_images(v)
    if v["objective"] == "dpo" and reads_data:
      _check_dpo(v, pipelined=dict(mesh.shape)["stage"] > 1)
    _require(not (v["reuse_example_batch"] and v["objective"] == "grpo"), "reuse_example_batch repeats the first "
             "batch read, but objective=grpo samples each step's batch from the state being trained; drop reuse_example_batch")
    mixture = parse_sources(v["data_mixture"], v)
    schedule = parse_schedule(v["data_mixture_schedule"], mixture)
    if mixture and reads_data:
      _check_mixture(v, mixture)
      _warn_unused_mixture(mixture, schedule, int(v["steps"]))
    if v["dataset_type"] != "synthetic" and reads_data:
      _check_real_data(v, mixed=bool(mixture))
    global_batch = v["per_device_batch_size"] * target.num_devices
    _require(float(global_batch).is_integer(), f"per_device_batch_size {v['per_device_batch_size']} x "
             f"{target.num_devices} devices = {global_batch} is not a whole number of sequences")
    global_batch = int(global_batch)
    # Far above any real step (millions of tokens): a mistyped batch is this line, not a failure in the step's data.
    tokens = global_batch * v["max_target_length"]
    _require(tokens < 2**31, f"per_device_batch_size {v['per_device_batch_size']:g} x {target.num_devices} devices x "
             f"max_target_length {v['max_target_length']} = {tokens:.3g} tokens per step, over the 2**31 this project "
             "accepts: lower per_device_batch_size")
    # Checked here as well as in OptimConfig: the batch split below divides by it (0 was a ZeroDivisionError).
    _positive(v, "gradient_accumulation_steps")
    accum = v["gradient_accumulation_steps"]
    shape = dict(mesh.shape)
    pipeline_micro = batch_split.pipeline_microbatches(shape, v["num_pipeline_microbatches"])
    batch_axes = mesh.batch_axes(global_batch, accum, pipeline_micro)
    _check_batch_split(v["per_device_batch_size"], target.num_devices, global_batch, accum, mesh, batch_axes,
                       pipeline_micro)
    return cls(**read_keys(cls, v, data_mixture=mixture, data_mixture_schedule=schedule), global_batch_size=global_batch,
               batch_axes=batch_axes, image_size=v["vision_image_size"] if v["max_images_per_row"] else 0)


def _check_batch_split(per_device: float, devices: int, global_batch: int, accum: int, mesh: "MeshConfig",
                       batch_axes: tuple[str, ...], pipeline_micro: int = 1) -> None:
  """Each micro-batch splits into whole rows over the devices of `batch_axes` (the pipeline's
  microbatches are checked by model_checks.check_pipeline, with the keys they come from; the batch
  this message advises splits into them too, so that following it does not meet that check)."""
  shape = dict(mesh.shape)
  if batch_split.splits(shape, batch_axes, global_batch, accum):
    return
  shards = batch_split.row_devices(shape, batch_axes)
  unstaged = batch_split.row_devices(shape, [a for a in batch_axes if a != "stage"])
  rows = math.lcm(shards * accum, unstaged * accum * pipeline_micro)
  raise ConfigError(f"global batch {global_batch} (per_device_batch_size {per_device:g} x {devices} devices) must "
                    f"split evenly into gradient_accumulation_steps={accum} micro-batches over "
                    f"{batch_split.over(shape, mesh.data_sharding, batch_axes)}; set "
                    f"per_device_batch_size to a multiple of {rows / devices:g}, or move parallelism from "
                    "those axes to tensor or sequence")


def _check_images(v: Mapping[str, Any]) -> None:
  count = v["max_images_per_row"]
  _require(isinstance(count, int) and count >= 0, f"max_images_per_row must be a whole number >= 0, got {count!r}")
  if not count:
    return
  _require(v["objective"] == "sft" and bool(v["use_multimodal"]), f"max_images_per_row={count} gives batches images, "
           "which only objective=sft reads, for a use_multimodal=True model; set max_images_per_row=0 otherwise")
  # An image's placeholder run is never split across rows, so one must fit in a row.
  run = v["mm_tokens_per_image"] + 2
  _require(v["max_target_length"] > run, f"max_target_length ({v['max_target_length']}) must exceed an image's "
           f"{run} tokens (mm_tokens_per_image + begin/end markers) to hold any image")


def _check_dpo(v: Mapping[str, Any], pipelined: bool) -> None:
  _require(v["dataset_type"] in ("hf", "grain"), "objective=dpo reads preference records with dataset_type=hf "
           f"(JSON/JSONL/Parquet files) or grain (JSON records); got dataset_type={v['dataset_type']}")
  _require(v["tokenizer_type"] == "huggingface", "objective=dpo tokenizes with the model's Hugging Face tokenizer "
           f"(and its chat template for conversations): set tokenizer_type=huggingface (got {v['tokenizer_type']})")
  _require(not v["load_full_state_path"], "objective=dpo starts from load_parameters_path (the policy's first "
           "weights and the frozen reference), not load_full_state_path; to continue a DPO run, rerun it")
  _require(not (pipelined and v["pipeline_schedule"] == "1f1b"),
           "objective=dpo runs the plain forward pass; set pipeline_schedule=gpipe or num_pipeline_stages=1")


def _check_mixture(v: Mapping[str, Any], sources: tuple[MixtureSource, ...]) -> None:
  _require(v["dataset_type"] != "synthetic", "data_mixture needs dataset_type set to a real type (tfds, hf, grain "
           "or stream): it is every source's default and the eval data's type")
  _require(v["objective"] != "grpo", "data_mixture mixes training documents; objective=grpo reads prompts (rl_config), "
           "not a mixture: leave data_mixture empty")
  for source in sources:
    _check_train_source(source.values(v), f"data_mixture source {source.name!r}: ")


def _check_train_source(v: Mapping[str, Any], who: str = "") -> None:
  """The keys a training source of v["dataset_type"] needs."""
  kind = v["dataset_type"]
  _require(kind in DATASET_TYPES[1:], f"{who}dataset_type must be one of {', '.join(DATASET_TYPES[1:])}; got {kind!r}")
  if kind == "tfds":
    _require(bool(v["dataset_name"]), f"{who}dataset_type=tfds needs dataset_name (and dataset_path, its data_dir)")
    _require(not storage.is_remote(v["dataset_path"]),
             f"{who}dataset_path={v['dataset_path']}: TFDS data is read through ArrayRecord, which cannot open gs:// "
             "paths; copy the prepared dataset to local disk (gcloud storage cp -r) or mount the bucket with gcsfuse")
  elif kind == "hf":
    _require(bool(v["hf_path"] or v["hf_data_files"]), f"{who}dataset_type=hf needs hf_path or hf_data_files")
  elif kind == "grain":
    _require(bool(v["grain_train_files"]), f"{who}dataset_type=grain needs grain_train_files")
  else:
    _require(bool(v["stream_train_files"]), f"{who}dataset_type=stream needs stream_train_files (parquet, JSONL "
             "or ArrayRecord shards, local or gs://)")
  _require(len(v["train_data_columns"]) == 1,
           f"{who}train_data_columns must name exactly one text column, got {list(v['train_data_columns'])}")


def _check_real_data(v: Mapping[str, Any], mixed: bool = False) -> None:
  """The keys each dataset_type needs (with a mixture, its sources replace the train keys). Files
  and the tokenizer are checked when the data is opened (input_pipeline.check_sources)."""
  kind, evaluates = v["dataset_type"], v["eval_interval"] > 0
  if not mixed:
    _check_train_source(v)
  _require(len(v["train_data_columns"]) == 1,
           f"train_data_columns must name exactly one text column, got {list(v['train_data_columns'])}")
  _require(v["grain_worker_count"] >= 0 and v["data_prefetch_batches"] >= 0,
           "grain_worker_count and data_prefetch_batches must be >= 0")
  _require(v["max_target_length"] >= 2, f"max_target_length must be >= 2 for real data, got {v['max_target_length']}")
  _one_of(v, "tokenizer_type", TOKENIZER_TYPES)
  _require(bool(v["tokenizer_path"]), f"tokenizer_path is empty: dataset_type={kind} needs a tokenizer "
           "(tokenizer_type and tokenizer_path)")
  if kind == "hf":
    _require(not evaluates or bool(v["hf_eval_files"] or (v["hf_path"] and not v["hf_data_files"])),
             "eval_interval > 0 with hf_data_files needs hf_eval_files (the eval split's files)")
  elif kind == "grain":
    _require(not evaluates or bool(v["grain_eval_files"]), "eval_interval > 0 with dataset_type=grain "
             "needs grain_eval_files")
  elif kind == "stream":
    _require(not evaluates or bool(v["stream_eval_files"]), "eval_interval > 0 with dataset_type=stream "
             "needs stream_eval_files")
