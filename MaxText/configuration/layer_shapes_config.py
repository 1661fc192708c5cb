"""The model's per-layer-shape record: layers of one stack that differ in head shape, in where their
keys and values come from, or in an input of their own (Gemma 4). Every field holds the base.yml key
of its name; ModelConfig nests it as `layer_shapes` (a family's layer with `per_layer_shapes` reads it,
families/gemma4_layers.py). Checked without I/O.

Such a stack is not one homogeneous layer, so it runs unrolled whatever scan_layers says (ModelConfig reads
scan_layers as False then) and unpipelined.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from MaxText.configuration import model_checks
from MaxText.configuration.config_fields import key, read_keys
from MaxText.configuration.config_fields import require as _require
from MaxText.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerShapesConfig:
  """Global layers' own head shape, keys shared across layers, per-layer input embeddings."""
  global_head_dim: int = key(architecture=True)  # 0 = head_dim
  global_num_kv_heads: int = key(architecture=True)  # 0 = num_kv_heads
  attention_k_eq_v: bool = key(architecture=True)  # global layers' values are their keys (no value projection)
  use_v_norm: bool = key(architecture=True)  # scale-free RMSNorm over each value head
  num_kv_shared_layers: int = key(architecture=True)  # the last this many layers reuse earlier layers' keys and values
  kv_shared_double_mlp: bool = key(architecture=True)  # those layers' MLPs are twice mlp_dim wide
  per_layer_input_dim: int = key(architecture=True)  # 0 = off; width of each layer's own token embedding
  per_layer_input_vocab_size: int = key(architecture=True)  # 0 = vocab_size; rows of the per-layer embedding
  moe_beside_mlp: bool = key(architecture=True)  # routed experts (mlp_dim wide) beside a dense MLP of dense_mlp_dim

  @property
  def active(self) -> bool:
    """Whether any layer differs from the stack's common shape."""
    return bool(self.set_keys)

  @property
  def set_keys(self) -> list[str]:
    """The keys set away from the stack's common shape."""
    return [field.name for field in dataclasses.fields(self) if getattr(self, field.name) and field.name not in (
        "per_layer_input_vocab_size",)]

  @classmethod
  def from_values(cls, v: Mapping[str, Any], *, num_layers: int, pipelined: bool) -> "LayerShapesConfig":
    values = read_keys(cls, v)
    for name in ("attention_k_eq_v", "use_v_norm", "kv_shared_double_mlp", "moe_beside_mlp"):
      _require(isinstance(values[name], bool), f"{name} must be True or False, got {values[name]!r}")
    for name in ("global_head_dim", "global_num_kv_heads", "per_layer_input_dim", "per_layer_input_vocab_size"):
      _require(values[name] >= 0, f"{name} must be >= 0 (0 = off or the common value), got {values[name]}")
    _require(0 <= values["num_kv_shared_layers"] < num_layers,
             f"num_kv_shared_layers must be in [0, num_decoder_layers ({num_layers})), got {values['num_kv_shared_layers']}")
    _require(values["global_head_dim"] % 2 == 0, f"global_head_dim must be even, got {values['global_head_dim']}")
    # Every token id looks up a row: an id past the table read garbage (NaN losses from the first step).
    rows = values["per_layer_input_vocab_size"]
    _require(not values["per_layer_input_dim"] or rows == 0 or rows >= v["vocab_size"],
             f"per_layer_input_vocab_size ({rows}) must be 0 or at least vocab_size ({v['vocab_size']}): every token "
             "id looks up a row of the per-layer embedding table")
    record = cls(**values)
    if not record.active:
      return record
    # Only a family whose layer reads these keys (Family.per_layer_shapes) may set them.
    family = model_checks.family_of(v["decoder_block"])
    if not (family and family.per_layer_shapes):
      blocks = sorted(b for f in model_checks.families().values() if f.per_layer_shapes for b in f.decoder_blocks)
      raise ConfigError(f"global_head_dim, global_num_kv_heads, attention_k_eq_v, use_v_norm, num_kv_shared_layers, "
                        f"kv_shared_double_mlp, per_layer_input_dim and moe_beside_mlp need decoder_block "
                        f"{', '.join(blocks)}; got {v['decoder_block']!r}: set them to 0 / False")
    _require(not pipelined, f"per-layer shapes ({', '.join(record.set_keys)}) do not support pipeline parallelism (the "
             "stack's layers differ); set ici_pipeline_parallelism=1 and dcn_pipeline_parallelism=1")
    kinds = [v["attention_layer_pattern"][i % len(v["attention_layer_pattern"])] for i in range(num_layers)]
    shared = values["num_kv_shared_layers"]
    _require(set(kinds[num_layers - shared:]) <= set(kinds[:num_layers - shared]),
             f"num_kv_shared_layers={shared} leaves a kind of attention layer with no unshared layer to share keys and "
             "values from; lower num_kv_shared_layers")
    _require(not values["moe_beside_mlp"] or v["num_experts"] > 1,
             f"moe_beside_mlp=True needs num_experts > 1, got {v['num_experts']}")
    _require(values["moe_beside_mlp"] or v["num_experts"] == 1,
             f"num_experts={v['num_experts']} with per-layer shapes ({', '.join(record.set_keys)}) runs experts only "
             "beside a dense MLP: set moe_beside_mlp=True or num_experts=1")
    num_kv = v["base_num_kv_heads"]
    global_kv = values["global_num_kv_heads"] or num_kv
    _require(v["base_num_query_heads"] % global_kv == 0,
             f"num_query_heads ({v['base_num_query_heads']}) must be a multiple of global_num_kv_heads ({global_kv})")
    return record
