"""Applies a family's tensor table in either direction, and matches HF configs to ours.

HF → ours streams: each HF tensor is transformed and written straight into a disk-backed
(memory-mapped) array of our parameter tree, then dropped, so host memory holds about one
tensor (plus the transposed copy) at a time. The staged tree is then written to Orbax one
parameter at a time (`streaming.save_params_one_by_one`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping

import jax
import numpy as np
import yaml

from MaxText import families
from MaxText.paths import storage
from MaxText.configuration.config import MODEL_CONFIG_FILE
from MaxText.configuration.model_config import ARCHITECTURE_KEYS, ModelConfig
from MaxText.configuration.vision_config import VisionConfig
from MaxText.families.tensor_maps import TensorMap
from MaxText.layers import mtp
from MaxText.errors import ConfigError, UserError


def _layer_key(cfg: ModelConfig, layer: int | None, stack: str | None = None
               ) -> tuple[tuple[str, ...], tuple[int, ...]]:
  """Where layer `layer`'s parameters live: ('layers',) with a leading index when scanned; the
  dense ones (first_dense_layers, moe_layer_interval) in the `dense_layers` stack; layers past the decoder are the
  multi-token-prediction modules (their decoder layer under `layer`, their own tensors, the
  entries of the "mtp" stack, beside it)."""
  if layer is None:
    return (), ()
  if layer >= cfg.num_decoder_layers:
    module = mtp.module_name(layer - cfg.num_decoder_layers)
    return ((module,) if stack == "mtp" else (module, "layer")), ()
  stack_name, index = cfg.stack_position(layer)
  return ((stack_name,), (index,)) if cfg.scan_layers else ((f"{stack_name}_{index}",), ())


def _applies(cfg: ModelConfig, m: TensorMap, layer: int | None) -> bool:
  """Whether a table entry applies to layer `layer` (entries limited to one stack: TensorMap.stack)."""
  if layer is not None and layer >= cfg.num_decoder_layers:  # an MTP module: a layer like the main stack's
    return m.stack != "dense_layers"
  if m.stack is None or layer is None:
    return True
  return m.stack != "mtp" and m.stack == cfg.stack_position(layer)[0]


def _num_hf_layers(cfg: ModelConfig, maps: list[TensorMap], family_name: str) -> int:
  """Decoder layers plus the MTP modules, which the checkpoint stores as the layers after them."""
  if cfg.mtp.mtp_num_layers and not any(m.stack == "mtp" for m in maps):
    raise ConfigError(f"the {family_name} converter has no multi-token-prediction layout; convert with "
                      "mtp_num_layers=0 (the MTP modules of a converted model start from their initialisation)")
  return cfg.num_decoder_layers + cfg.mtp.mtp_num_layers


def flat_abstract(abstract_params: dict[str, Any]) -> dict[tuple[str, ...], jax.ShapeDtypeStruct]:
  flat = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
  return {tuple(str(k.key) for k in path): leaf for path, leaf in flat}


class ShapeMismatch(ConfigError):
  """An HF tensor whose converted shape is not its parameter's."""


class StagedParams:
  """Our parameter tree as memory-mapped files under `directory` (local: a temporary staging
  directory of the converter), filled one slice at a time."""

  def __init__(self, abstract_params: dict[str, Any], directory: str, weight_dtype: np.dtype | str):
    self.directory = directory
    self.leaves = flat_abstract(abstract_params)
    self.dtype = np.dtype(weight_dtype)
    self._written: dict[tuple[str, ...], set[tuple[int, ...]]] = {}
    self._depth: dict[tuple[str, ...], int] = {}

  def _file(self, path: tuple[str, ...]) -> str:
    return storage.join(self.directory, "__".join(path) + ".bin")

  def put(self, path: tuple[str, ...], index: tuple[int, ...], value: np.ndarray, source: str) -> None:
    if path not in self.leaves:
      raise ConfigError(f"HF tensor {source} maps to {'/'.join(path)}, which this model config does not have; "
                        "check the model keys (e.g. decoder_block, logits_via_embedding)")
    leaf = self.leaves[path]
    if any(i >= n for i, n in zip(index, leaf.shape)):
      raise ConfigError(f"HF tensor {source} is for index {list(index)} of {'/'.join(path)}, whose stacked shape is "
                        f"{tuple(leaf.shape[:len(index)])}; the model config does not match the checkpoint")
    expected = tuple(leaf.shape[len(index):])
    if tuple(value.shape) != expected:
      raise ShapeMismatch(f"HF tensor {source} becomes shape {tuple(value.shape)} but {'/'.join(path)} expects "
                        f"{expected}; the model config does not match the checkpoint")
    written = self._written.setdefault(path, set())
    if index in written:
      raise UserError(f"HF tensor {source} sets {'/'.join(path)}{list(index) or ''} a second time")
    mode: Literal["r+", "w+"] = "r+" if storage.exists(self._file(path)) else "w+"
    staged = np.memmap(self._file(path), dtype=self.dtype, mode=mode, shape=tuple(leaf.shape))
    staged[index] = value  # numpy casts while copying: no converted temporary
    staged.flush()
    del staged  # unmap: the written pages belong to the page cache, not to this process
    written.add(index)
    self._depth[path] = len(index)

  def missing(self) -> list[str]:
    out = []
    for path, leaf in self.leaves.items():
      depth = self._depth.get(path, 0)
      if len(self._written.get(path, ())) < math.prod(leaf.shape[:depth]):
        out.append("/".join(path))
    return out

  def tree(self) -> dict[str, Any]:
    """The nested dict of read-only memory maps (what gets saved)."""
    out: dict[str, Any] = {}
    for path, leaf in self.leaves.items():
      node = out
      for key in path[:-1]:
        node = node.setdefault(key, {})
      node[path[-1]] = np.memmap(self._file(path), dtype=self.dtype, mode="r", shape=tuple(leaf.shape))
    return out


def _match(maps: list[TensorMap], name: str) -> tuple[TensorMap, int | None, int | None] | None:
  for m in maps:
    found = m.pattern().match(name)
    if found:
      groups = found.groupdict()
      return m, int(groups["i"]) if "i" in groups else None, int(groups["e"]) if "e" in groups else None
  return None


def stage_hf_tensors(tensors: Iterable[tuple[str, np.ndarray]], family: families.Family, cfg: ModelConfig,
                     staged: StagedParams, shape_note: str = "") -> int:
  """Streams HF tensors into `staged`; returns the largest HF tensor's size in bytes. `shape_note` ends a
  shape refusal (config.json fields read by a default, which the weights may contradict)."""
  maps = family.tensors(cfg)
  num_layers = _num_hf_layers(cfg, maps, family.name)
  largest, unknown = 0, []
  tied: dict[str, bytes] = {}  # a tied model's embedding and the lm_head copy the checkpoint may hold
  for name, array in tensors:
    largest = max(largest, array.nbytes)
    found = _match(maps, name)
    if found is None:
      unknown.append(name)
      continue
    tensor_map, layer, expert = found
    if cfg.logits_via_embedding and (tensor_map.ours == ("token_embedder/embedding",)
                                     or (not tensor_map.ours and name.endswith("lm_head.weight"))):
      tied[name] = _values_digest(array)
    if layer is not None and layer >= num_layers:
      raise ConfigError(f"HF tensor {name} is for layer {layer}, but the model has {cfg.num_decoder_layers} layers"
                        + (f" and {cfg.mtp.mtp_num_layers} MTP module(s)" if cfg.mtp.mtp_num_layers else ""))
    if not _applies(cfg, tensor_map, layer):
      raise ConfigError(f"HF tensor {name} belongs to the {tensor_map.stack} stack, but layer {layer} is not in it "
                        f"(first_dense_layers={cfg.moe.first_dense_layers})")
    if tensor_map.ours and array.dtype.kind in "biu":  # (ml_dtypes' bfloat16 is kind "V")
      raise ConfigError(f"HF tensor {name} has dtype {array.dtype}, not floating point: the checkpoint is quantised "
                        "(or damaged); dequantise it to bfloat16 or float32 first")
    if tensor_map.ours and array.dtype.kind == "c":  # numpy's cast would drop the imaginary part
      raise ConfigError(f"HF tensor {name} has dtype {array.dtype}, not real floating point: the checkpoint is damaged "
                        "or not a model's weights")
    if tensor_map.ours and not _all_finite(array):  # converted, every tool that loads it refuses it as diverged
      raise ConfigError(f"HF tensor {name} holds NaN or infinite values: the checkpoint was saved from a diverged run "
                        "or is damaged; use a checkpoint whose weights are finite")
    prefix, index = _layer_key(cfg, layer, tensor_map.stack)
    index = index + ((expert,) if expert is not None else ())
    try:
      values = tensor_map.to_ours(array, cfg)
    except ValueError as e:  # a reshape or split the tensor's shape does not allow
      raise ConfigError(f"HF tensor {name} has shape {tuple(array.shape)}, which does not fit the model config "
                        f"({' '.join(str(e).split())[:150]}); does config.json belong to these weights?"
                        f"{shape_note}") from None
    for path, value in zip(tensor_map.ours, values):
      try:
        staged.put(prefix + tuple(path.split("/")), index, value, name)
      except ShapeMismatch as e:
        raise ConfigError(f"{e}{shape_note}") from None
  if len(tied) == 2 and len(set(tied.values())) == 2:
    embedding, head = sorted(tied, key=lambda n: n.endswith("lm_head.weight"))
    raise ConfigError(f"config.json ties the output layer to the embedding (tie_word_embeddings), but the checkpoint's "
                      f"{head} differs from its {embedding}, so transformers leaves them untied; set "
                      "\"tie_word_embeddings\": false in config.json (or drop the stale lm_head.weight)")
  if unknown:
    raise ConfigError(f"{len(unknown)} HF tensor(s) have no mapping in the {family.name} converter, e.g. "
                      f"{', '.join(unknown[:3])}; is this the right model family?")
  missing = staged.missing()
  if missing:
    raise ConfigError(f"the HF checkpoint does not fill {len(missing)} of our parameters, e.g. "
                      f"{', '.join(missing[:3])}; some shards may be missing")
  return largest


def _all_finite(array: np.ndarray) -> bool:
  """Whether every value is finite, a block at a time (a whole-tensor mask would add to the peak memory)."""
  flat = array.reshape(-1)
  return all(bool(np.isfinite(flat[start:start + _FINITE_BLOCK]).all()) for start in range(0, flat.size, _FINITE_BLOCK))


_FINITE_BLOCK = 2**24


def _values_digest(array: np.ndarray) -> bytes:
  """A digest of `array`'s shape and float32 values, taken a block of rows at a time (an embedding is large)."""
  digest = hashlib.sha256(repr(tuple(array.shape)).encode())
  rows = array.reshape(array.shape[0], -1) if array.ndim else array.reshape(1, 1)
  for start in range(0, rows.shape[0], 4096):
    digest.update(np.ascontiguousarray(rows[start:start + 4096], np.float32).tobytes())
  return digest.digest()


def _leaf_path(cfg: ModelConfig, m: TensorMap, path: str, layer: int | None
               ) -> tuple[tuple[str, ...], tuple[int, ...]]:
  prefix, index = _layer_key(cfg, layer, m.stack)
  return prefix + tuple(path.split("/")), index


def hf_tensors_from_params(read_leaf: Callable[[tuple[str, ...]], np.ndarray], family: families.Family,
                           cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, array) for every tensor the family writes, reading our (scanned or unrolled)
  parameters through `read_leaf(path)` when first needed and dropping each after its last use,
  so at most the leaves of one HF tensor (a whole layer stack when scanned) are held."""
  maps = family.tensors(cfg)
  num_layers = _num_hf_layers(cfg, maps, family.name)
  steps = [(m, layer) for m in maps if m.write
           for layer in (range(num_layers) if m.per_layer else [None]) if _applies(cfg, m, layer)]
  last_use = {_leaf_path(cfg, m, p, layer)[0]: i for i, (m, layer) in enumerate(steps) for p in m.ours}
  cache: dict[tuple[str, ...], np.ndarray] = {}
  for i, (m, layer) in enumerate(steps):
    for expert in (range(m.count(cfg) if m.count else cfg.moe.num_experts) if m.per_expert else [None]):
      leaves = []
      for p in m.ours:
        path, index = _leaf_path(cfg, m, p, layer)
        if path not in cache:
          cache[path] = read_leaf(path)
        index = index + ((expert,) if expert is not None else ())
        leaves.append(np.asarray(cache[path][index] if index else cache[path]))
      tensor = m.to_hf(tuple(leaves), cfg)
      del leaves  # views keep a whole stored parameter alive
      yield m.hf.format(i=layer, e=expert), tensor
      del tensor
    for path in [path for path in cache if last_use[path] == i]:
      del cache[path]


# ---- model keys: HF config.json ↔ our base.yml keys

# The vision record's architecture keys: meaningless without use_multimodal.
VISION_KEYS = tuple(f.name for f in dataclasses.fields(VisionConfig)
                    if f.name in ARCHITECTURE_KEYS and f.name != "use_multimodal")


def canonical(keys: Mapping[str, Any]) -> dict[str, Any]:
  """Architecture keys with settings that have no effect blanked, so equal models compare equal."""
  out = {k: keys[k] for k in ARCHITECTURE_KEYS if k in keys}
  out["mlp_activations"] = list(out.get("mlp_activations", []))
  out["attention_layer_pattern"] = list(out.get("attention_layer_pattern", []))
  if not out.get("query_pre_attn_scalar"):
    out["query_pre_attn_scalar"] = float(out.get("head_dim", 0))
  if "local" not in out["attention_layer_pattern"]:
    out["sliding_window_size"] = None
  if "chunked" not in out["attention_layer_pattern"]:
    out["attention_chunk_size"] = None
  out["rope_layer_pattern"] = list(out.get("rope_layer_pattern", []))
  if not out.get("attn_temperature_floor_scale"):
    out["attn_temperature_scale"] = None
  if out.get("rope_type") != "llama3":
    for key in ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_position"):
      out[key] = None
  if out.get("position_embedding") != "learned":
    out["max_position_embeddings"] = None
  if out.get("position_embedding") != "rope":
    for key in ("rope_min_timescale", "rope_max_timescale", "rope_interleaved", "rope_type"):
      out[key] = None
  if not out.get("use_multimodal"):
    for key in VISION_KEYS:
      out[key] = None
  for key, value in out.items():  # 1 and 1.0 are the same setting
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      out[key] = float(value)
  return out


def differences(ours: Mapping[str, Any], theirs: Mapping[str, Any], ignore: tuple[str, ...] = ()) -> list[str]:
  a, b = canonical(ours), canonical(theirs)
  return [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in ARCHITECTURE_KEYS if a.get(k) != b.get(k) and k not in ignore]


# Architecture keys config.json cannot settle: DeepSeek-V3's num_nextn_predict_layers says the original
# model had an MTP module, not that this checkpoint holds it (transformers neither loads nor saves it),
# so converting it is the user's choice (mtp_num_layers=1).
NOT_IN_HF_CONFIG = ("mtp_num_layers",)


def hf_model_keys(family: families.Family, hf_config: Mapping[str, Any]) -> dict[str, Any]:
  """The family's model keys of config.json, with its max_position_embeddings (a multimodal config's
  text_config's): the longest sequence the model is meant for, which a RoPE model's export writes back. A
  family with a learned position table sets it itself (its rows)."""
  text = hf_config.get("text_config")
  decoder = text if isinstance(text, Mapping) else hf_config
  _check_kv_heads_value(decoder, "text_config." if decoder is text else "")
  keys = family.model_keys(hf_config)
  _check_default_kv_heads(decoder, keys, hf_config.get("model_type"))
  fields = text if isinstance(text, Mapping) and text.get("max_position_embeddings") is not None else hf_config
  value = fields.get("max_position_embeddings")
  if "max_position_embeddings" not in keys and value is not None:
    if isinstance(value, bool) or not float(value).is_integer() or value < 1:
      raise ValueError(f"max_position_embeddings must be a positive whole number, got {value!r}")
    keys["max_position_embeddings"] = int(value)
  return keys


def _check_kv_heads_value(fields: Mapping[str, Any], where: str) -> None:
  """num_key_value_heads is null (as many as the query heads) or a positive count: 0 read as "unset" would
  convert a model whose attention divides by it in transformers."""
  value = fields.get("num_key_value_heads")
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer() or value < 1:
    raise ConfigError(f"HF config.json {where}num_key_value_heads={value!r} is not a positive whole number; write the "
                      "checkpoint's key/value head count (its k_proj rows / head_dim), or null for as many as "
                      "num_attention_heads")


def null_fields_note(hf_config: Mapping[str, Any]) -> str:
  """The end of a tensor-shape refusal when config.json left num_key_value_heads null: read as the query heads
  (as transformers' Llama reads it), which a grouped-query checkpoint's weights contradict."""
  text = hf_config.get("text_config")
  fields = text if isinstance(text, Mapping) else hf_config
  if "num_key_value_heads" not in fields or fields["num_key_value_heads"] is not None:
    return ""
  return (f" (config.json's num_key_value_heads is null, read as num_attention_heads="
          f"{fields.get('num_attention_heads')}: set it to the checkpoint's count, k_proj rows / head_dim)")


def _check_default_kv_heads(fields: Mapping[str, Any], keys: Mapping[str, Any], model_type: str | None) -> None:
  """A config.json without num_key_value_heads gets its transformers class's default (a fixed count in several
  families), which may not divide the query heads: no model transformers can run, refused naming the field."""
  heads, kv = keys.get("base_num_query_heads"), keys.get("base_num_kv_heads")
  if "num_key_value_heads" in fields or not heads or not kv or heads % kv == 0:
    return
  raise ConfigError(f"HF {model_type} config.json leaves out num_key_value_heads, which transformers then takes "
                    f"as {kv}, not a divisor of num_attention_heads={heads}; add the checkpoint's "
                    "\"num_key_value_heads\" (its k_proj rows / head_dim) to config.json")


def full_model_keys(schema: Mapping[str, Any], inferred: Mapping[str, Any]) -> dict[str, Any]:
  """Every architecture key: the inferred ones over base.yml's defaults."""
  return {k: inferred.get(k, schema[k]) for k in ARCHITECTURE_KEYS if k in schema}


def describe_keys(keys: Mapping[str, Any]) -> str:
  """`keys` as the key=value arguments a user would type (lists in YAML flow style)."""
  def text(value: object) -> str:
    return "[" + ",".join(map(str, value)) + "]" if isinstance(value, (list, tuple)) else str(value)
  return " ".join(f"{k}={text(v)}" for k, v in keys.items())


def write_model_config(output_path: str, keys: Mapping[str, Any], source: str) -> str:
  """Writes model_config.yml into the checkpoint directory `output_path` (local or gs://); returns its path."""
  path = storage.join(output_path, MODEL_CONFIG_FILE)
  header = (f"# Model keys of this checkpoint (converted from {source}); train.py, the logit checker and\n"
            "# maxtext_to_hf read them when load_parameters_path points here and no model_name is given.\n")
  storage.write_text(path, header + yaml.safe_dump(dict(keys), sort_keys=False, default_flow_style=None))
  return path
