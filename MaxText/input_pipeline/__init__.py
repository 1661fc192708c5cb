"""Input pipelines: `create_data_iterator(config, mesh)` and `create_eval_iterator(config, mesh)` are
the front doors; `dataset_type` picks synthetic (generated on device) or a real dataset (tfds, hf,
grain, stream) tokenised, packed and sharded by `pipeline.py`; `data_mixture` draws the train
rows from several such sources (`mixture.py`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, Sequence

from MaxText.configuration import objective_registry
from MaxText.configuration.data_mixture import MixtureSource

if TYPE_CHECKING:
  from jax.sharding import Mesh, NamedSharding

  from MaxText.input_pipeline.synthetic import Batch
  from MaxText.input_pipeline import mixture, pipeline
  from MaxText.configuration.config import Config
  from MaxText.configuration.data_config import DataConfig

# Eval batches come from a disjoint part of the synthetic stream.
_EVAL_SEED_OFFSET = 1 << 30


class BatchIterator(Protocol):
  """What the front doors return: SyntheticIterator or pipeline.PackedBatchIterator (global batches,
  a checkpointable position, and `reset()` back to the start for eval)."""

  def __iter__(self) -> Iterator[Batch]: ...

  def __next__(self) -> Batch: ...

  def reset(self) -> BatchIterator: ...

  def get_state(self) -> dict[str, Any]: ...

  def set_state(self, state: dict[str, Any]) -> None: ...


_FILE_KEYS = {"hf": ("hf_data_files", "hf_eval_files"), "grain": ("grain_train_files", "grain_eval_files"),
              "stream": ("stream_train_files", "stream_eval_files")}


def source_config(cfg: DataConfig, source: MixtureSource) -> DataConfig:
  """The data keys as one source of the mixture sees them (its own keys in place, no eval split)."""
  return dataclasses.replace(cfg, **dict(source.keys), data_mixture=(), hf_eval_files="", grain_eval_files="",
                             stream_eval_files="")


def check_sources(cfg: DataConfig) -> None:
  """Opens what a real dataset_type names before any state is built, so a missing file, a bad
  glob or a tokenizer larger than vocab_size stops the run at once (config validation does no I/O)."""
  if cfg.dataset_type == "synthetic":
    return
  from MaxText.paths import storage
  from MaxText.errors import ConfigError
  from MaxText.input_pipeline import files, tokenizer

  for source_cfg, who in [(cfg, "")] + [(source_config(cfg, s), f"data_mixture source {s.name!r}: ")
                                        for s in cfg.data_mixture]:
    if source_cfg.dataset_type == "tfds" and source_cfg.dataset_path and not storage.is_dir(source_cfg.dataset_path):
      raise ConfigError(f"{who}dataset_path {source_cfg.dataset_path} is not a directory")
    for key in _FILE_KEYS.get(source_cfg.dataset_type, ()):
      if getattr(source_cfg, key):
        try:
          files.expand_files(key, getattr(source_cfg, key))
        except ConfigError as e:
          raise ConfigError(f"{who}{e}") from None
  template = objective_registry.record(cfg.objective).chat_template
  if template is not None:
    from MaxText.input_pipeline import chat

    # A required template must exist before anything starts; others are needed only for message lists.
    chat.load_chat_tokenizer(cfg.tokenizer_path, require_template=template)
  loaded = tokenizer.load_tokenizer(cfg.tokenizer_type, cfg.tokenizer_path)
  if template is None:  # plain documents: add_bos/add_eos with no such token was refused only once the state was built
    tokenizer.DocumentEncoder(loaded, cfg.add_bos, cfg.add_eos)
  vocab = loaded.vocab_size
  if vocab > cfg.vocab_size:
    raise ConfigError(f"the tokenizer {cfg.tokenizer_path} has {vocab} tokens, more than vocab_size="
                      f"{cfg.vocab_size}; set vocab_size >= {vocab}")


def open_records(cfg: DataConfig, train: bool, text_column: str | None = None) -> tuple[Sequence[Any], str]:
  """The random-access records of the train or eval split and a description of them; `text_column`: the column
  read as text (None: records are read whole)."""
  split = cfg.train_split if train else cfg.eval_split
  if cfg.dataset_type == "tfds":
    from MaxText.input_pipeline import tfds

    return tfds.open_split(cfg.dataset_name, cfg.dataset_path, split)
  if cfg.dataset_type == "hf":
    from MaxText.input_pipeline import hf

    files, key = (cfg.hf_data_files, "hf_data_files") if train else (cfg.hf_eval_files, "hf_eval_files")
    return hf.open_split(cfg.hf_path, files, split, key, text_column)
  from MaxText.input_pipeline import grain

  return grain.open_files(*(("grain_train_files", cfg.grain_train_files) if train
                            else ("grain_eval_files", cfg.grain_eval_files)))


Encoded = tuple[Callable[[Any], Any], dict[str, Any]]  # a record encoder and the packer's arguments it needs


# The encoders objectives name in their records (training/objectives/, base.ObjectiveRecord.encoder).


def document_encoder(config: Config) -> Encoded:
  """Plain documents: the text column tokenized, bos/eos added."""
  from MaxText.input_pipeline.tokenizer import DocumentEncoder, load_tokenizer

  cfg = config.data
  return DocumentEncoder(load_tokenizer(cfg.tokenizer_type, cfg.tokenizer_path), cfg.add_bos, cfg.add_eos), {}


def conversation_encoder(config: Config) -> Encoded:
  """SFT's conversations or prompt/completion pairs, rendered with the chat template."""
  from MaxText.input_pipeline import chat, image_sft

  cfg = config.data
  # Every conversation goes through the image encoder: a text-only model then refuses images.
  encoder = image_sft.ImageSftEncoder(chat.load_chat_tokenizer(cfg.tokenizer_path), cfg.max_target_length,
                                      cfg.sft_train_on_completion_only, cfg.add_bos, cfg.add_eos,
                                      config.model.vision, config.model.decoder_block, cfg.max_images_per_row,
                                      config.startup.model_name or "the model")
  if not cfg.max_images_per_row:
    return encoder, {}
  from MaxText.input_pipeline import packing

  return encoder, {"pack": functools.partial(packing.pack_batch,
                                             images=packing.ImageSlots(cfg.max_images_per_row, cfg.image_size))}


def preference_encoder(config: Config) -> Encoded:
  """DPO's {"prompt", "chosen", "rejected"} records, one pair per row."""
  from MaxText.input_pipeline import chat, preference

  cfg = config.data
  encoder = preference.PreferenceEncoder(chat.load_chat_tokenizer(cfg.tokenizer_path, require_template=False),
                                         cfg.tokenizer_path, cfg.max_target_length, cfg.add_bos, cfg.add_eos)
  return encoder, {"pack": preference.pack_preference_batch}


def _encoder(config: Config) -> Encoded:
  """The record encoder of the run's objective and the packer's arguments it needs."""
  return objective_registry.record(config.data.objective).encoder(config)


def _open_sources(cfg: DataConfig, shards: Sequence[pipeline.HostShard], encoder: Callable[[Any], Any], train: bool,
                  what: str, name: str = "") -> list[tuple[mixture.OpenedSource, Callable[[int], str] | None]]:
  """One source's documents for each of `shards` (the records opened once), and how to name a
  document index (streams)."""
  from MaxText.input_pipeline import mixture, pipeline, streaming

  seed = cfg.data_shuffle_seed if (train and cfg.enable_data_shuffling) else None
  column = None if objective_registry.record(cfg.objective).whole_records else cfg.text_column
  opened: list[tuple[mixture.OpenedSource, Callable[[int], str] | None]] = []
  if cfg.dataset_type == "stream":
    key, value = ("stream_train_files", cfg.stream_train_files) if train else \
        ("stream_eval_files", cfg.stream_eval_files)
    describe = f"stream {value}"
    for shard in shards:
      stream = streaming.ShardStream(key, value, shard, encoder, column, seed, repeat=train,
                                     what=what.format(describe=describe))
      # An endless run of unusable documents would hang the packer; with no length known up front,
      # a fixed count of them in a row is the error.
      size = f"{stream.num_files_total} file(s)"
      opened.append((mixture.OpenedSource(name, stream.read_from, 1 << 16, describe, size),
                     functools.partial(streaming.describe_position, stream=stream)))
    return opened
  source, describe = open_records(cfg, train, column)
  locate = _record_locator(cfg, train)
  for shard in shards:
    dataset = pipeline.document_dataset(source, shard, encoder, column, seed, repeat=train,
                                        what=what.format(describe=describe), locate=locate)
    # An endless run of unusable documents would hang the packer; one epoch of them is an error.
    max_empty_run = max(len(source) // shard.count, 1)
    opened.append((mixture.OpenedSource(name, pipeline.reader(dataset, cfg.grain_worker_count), max_empty_run,
                                        describe, f"{len(source)} record(s)"), None))
  return opened


def real_data_iterator(config: Config, mesh: Mesh, train: bool, shard: pipeline.HostShard | None = None
                       ) -> BatchIterator:
  """A real dataset's batches; `shard`: the rows of another process than this one (tests simulate
  several processes with it and read their rows with `next_host_rows`)."""
  from MaxText.input_pipeline import mixture, pipeline
  from MaxText.platform.sharding import batch_sharding

  cfg = config.data
  sharding = batch_sharding(mesh, config.data.batch_axes)
  shard = shard or pipeline.host_shard(sharding, cfg.global_batch_size, cfg.max_target_length)
  encoder, pack = _encoder(config)
  explain_empty = getattr(encoder, "explain_empty", None)
  # An elastic run reads virtual data shards whose count no resize changes (pipeline.data_shards).
  shards = pipeline.data_shards(shard, config.optim.gradient_accumulation_steps if config.mesh.elastic_min_slices
                                else 1)
  if train and cfg.data_mixture:
    by_source = [_open_sources(source_config(cfg, s), shards, encoder, True,
                               f"data_mixture source {s.name!r} ({{describe}})", s.name) for s in cfg.data_mixture]
    by_shard = [(data_shard, [opened[k][0] for opened in by_source]) for k, data_shard in enumerate(shards)]
    return mixture.MixtureBatchIterator(by_shard[0][1], [s.weight for s in cfg.data_mixture], cfg.data_mixture_schedule,
                                        cfg.data_shuffle_seed, shard, sharding, cfg.global_batch_size,
                                        cfg.max_target_length, cfg.packing, cfg.data_prefetch_batches,
                                        explain_empty=explain_empty, shard_sources=by_shard, **pack)
  opened = _open_sources(cfg, shards, encoder, train, f"the {'train' if train else 'eval'} data ({{describe}})")
  return pipeline.PackedBatchIterator([o.read_from for o, _ in opened], shard, sharding, cfg.global_batch_size,
                                      cfg.max_target_length, cfg.packing, cfg.data_prefetch_batches,
                                      max_empty_run=opened[0][0].max_empty_run, describe=opened[0][0].describe,
                                      source_size=opened[0][0].size,
                                      explain_empty=explain_empty, describe_index=[d for _, d in opened],
                                      data_shards=shards, **pack)


def _record_locator(cfg: DataConfig, train: bool) -> Callable[[int], str] | None:
  """index -> where that record is in the user's files (hf data files), for a refused record."""
  files, key = (cfg.hf_data_files, "hf_data_files") if train else (cfg.hf_eval_files, "hf_eval_files")
  if cfg.dataset_type != "hf" or not files:
    return None
  from MaxText.input_pipeline import hf

  return hf.record_locator(cfg.hf_path, key, files)


def create_data_iterator(config: Config, mesh: Mesh, start_step: int = 0) -> BatchIterator:
  """The training iterator for `config.data`, producing batches split over `config.data.batch_axes`."""
  from MaxText.input_pipeline.synthetic import SyntheticIterator
  from MaxText.platform.sharding import batch_sharding

  sharding = batch_sharding(mesh, config.data.batch_axes)
  if config.data.dataset_type != "synthetic":
    return _with_teacher_top_k(config, real_data_iterator(config, mesh, train=True), sharding, train=True)
  return _with_teacher_top_k(config, SyntheticIterator(config.data, sharding, start_step=start_step), sharding,
                             train=True)


def create_eval_iterator(config: Config, mesh: Mesh) -> BatchIterator | None:
  """Eval batches (with `reset()`); real data is read from the eval split in order, and once it
  runs out the remaining batches are padding, which adds nothing to the eval loss."""
  from MaxText.input_pipeline.synthetic import SyntheticIterator
  from MaxText.platform.sharding import batch_sharding

  sharding = batch_sharding(mesh, config.data.batch_axes)
  if config.data.dataset_type != "synthetic":
    if not config.data.has_eval_source:
      return None
    return _with_teacher_top_k(config, real_data_iterator(config, mesh, train=False), sharding, train=False)
  return _with_teacher_top_k(config, SyntheticIterator(config.data, sharding, seed_offset=_EVAL_SEED_OFFSET),
                             sharding, train=False)


def _with_teacher_top_k(config: Config, batches: BatchIterator, sharding: NamedSharding, train: bool) -> BatchIterator:
  """With distill_top_k_path, the batches carry the teacher's precomputed top k (teacher_top_k.py)."""
  if not config.distill.top_k_from_files:
    return batches
  from MaxText.input_pipeline import teacher_top_k

  return teacher_top_k.open_batches(config, batches, sharding, train)


__all__ = ["BatchIterator", "Encoded", "conversation_encoder", "create_data_iterator", "create_eval_iterator",
           "document_encoder", "open_records", "preference_encoder", "real_data_iterator"]
