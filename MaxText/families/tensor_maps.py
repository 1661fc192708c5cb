"""The tensor tables a model family's converter is written in (see MaxText/families/).

A `TensorMap` pairs ONE HF tensor with one or more of ours (a fused HF tensor such as
GPT-2's c_attn feeds three of our kernels). Names may hold "{i}" (layer index) and "{e}"
(expert index, or another stacked index with its `count`, e.g. a vision encoder layer): our paths
are then relative to one layer (and, with "{e}", index the leading dimension of our tensor), so the same table serves scanned and unrolled
stacks. Converting HF → ours streams tensor by tensor through the table; ours → HF walks
the table. `write=False` marks an alternative HF form that is read but never written; `stack`
limits an entry to the dense prefix, the layers after it (first_dense_layers), or the
multi-token-prediction modules.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from MaxText.configuration.model_config import ModelConfig
from MaxText.errors import ConfigError


Array = np.ndarray
# One HF tensor to ours, or back.
ConvertOne = Callable[[Array, ModelConfig], Array]


@dataclasses.dataclass(frozen=True)
class TensorMap:
  """One HF tensor ↔ our tensor(s) at `ours` ('/'-separated paths)."""

  hf: str
  ours: tuple[str, ...]
  to_ours: Callable[[Array, ModelConfig], tuple[Array, ...]]
  to_hf: Callable[[tuple[Array, ...], ModelConfig], Array]
  write: bool = True
  # A per-layer entry for one layer stack only ("dense_layers": the first_dense_layers prefix,
  # "layers": the layers after it and the MTP modules' layers, "mtp": the MTP modules' own tensors,
  # stored as layers past the decoder's); None: every layer.
  stack: str | None = None
  # How many values "{e}" takes when writing: None = the experts (num_experts); a stacked index of
  # another kind (the vision encoder's layers) says its own count.
  count: Callable[[ModelConfig], int] | None = None

  @property
  def per_layer(self) -> bool:
    return "{i}" in self.hf

  @property
  def per_expert(self) -> bool:
    return "{e}" in self.hf

  def pattern(self) -> re.Pattern[str]:
    escaped = re.escape(self.hf).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)")
    return re.compile(escaped + "$")


def _same(x: Array, cfg: ModelConfig) -> Array:
  del cfg
  return x


def one(hf: str, ours: str, to_ours: Callable[[Array, ModelConfig], Array] = _same,
        to_hf: Callable[[Array, ModelConfig], Array] = _same, write: bool = True) -> TensorMap:
  """The common 1:1 case: `to_ours`/`to_hf` take and return single arrays."""
  return TensorMap(hf, (ours,), lambda x, cfg: (to_ours(x, cfg),), lambda xs, cfg: to_hf(xs[0], cfg), write)


def ignored(hf: str) -> TensorMap:
  """An HF tensor to skip (non-persistent buffers, a tied lm_head copy)."""
  return TensorMap(hf, (), lambda x, cfg: (), lambda xs, cfg: np.zeros(()), write=False)


@dataclasses.dataclass(frozen=True)
class _IgnoredPrefix(TensorMap):
  def pattern(self) -> re.Pattern[str]:
    return re.compile(re.escape(self.hf) + ".*$")


def ignored_prefix(prefix: str) -> TensorMap:
  """Every HF tensor whose name starts with `prefix`, skipped (a multimodal checkpoint's vision tower)."""
  return _IgnoredPrefix(prefix, (), lambda x, cfg: (), lambda xs, cfg: np.zeros(()), write=False)


# Where an image-text checkpoint keeps its text decoder's `model.` tensors.
TEXT_DECODER_PREFIX = "model.language_model."


def also_read_as_text_decoder(text: list[TensorMap], left_out: Sequence[str]) -> list[TensorMap]:
  """A text checkpoint's table (written back) plus, read only, the same tensors as an image-text
  checkpoint names them (`model.language_model.` in place of `model.`), with everything under the
  `left_out` prefixes (its towers) skipped: such a checkpoint converts as its text decoder."""
  multimodal = [dataclasses.replace(m, hf=TEXT_DECODER_PREFIX + m.hf[len("model."):], write=False)
                for m in text if m.hf.startswith("model.")]
  return text + multimodal + [ignored_prefix(prefix) for prefix in left_out]


# ---- transforms shared by the families: torch Linear weights are [out, in], our kernels [in, out...].

def transpose(x: Array, cfg: ModelConfig) -> Array:
  del cfg
  return x.T


def rope_permutation(head_dim: int) -> np.ndarray:
  """Feature order taking HF's halves RoPE layout to the interleaved one: pair i is
  (i, i + H/2) in HF and (2i, 2i + 1) interleaved."""
  half = head_dim // 2
  return np.stack([np.arange(half), np.arange(half) + half], axis=-1).reshape(-1)


def heads_in(num_heads: Callable[[ModelConfig], int], rope: bool = False) -> tuple[ConvertOne, ConvertOne]:
  """HF [heads*H, D] projection ↔ our [D, heads, H] kernel (q/k permuted when `rope` and
  the model uses interleaved RoPE; v never is)."""
  def to_ours(w: Array, cfg: ModelConfig) -> Array:
    kernel = w.T.reshape(cfg.emb_dim, num_heads(cfg), cfg.head_dim)
    return kernel[..., rope_permutation(cfg.head_dim)] if rope and cfg.rope.rope_interleaved else kernel

  def to_hf(kernel: Array, cfg: ModelConfig) -> Array:
    if rope and cfg.rope.rope_interleaved:
      kernel = kernel[..., np.argsort(rope_permutation(cfg.head_dim))]
    return kernel.reshape(cfg.emb_dim, -1).T
  return to_ours, to_hf


def heads_out(w: Array, cfg: ModelConfig) -> Array:
  """HF o_proj [D, N*H] → our out kernel [N, H, D]."""
  return w.T.reshape(cfg.num_query_heads, cfg.head_dim, cfg.emb_dim)


def heads_out_to_hf(kernel: Array, cfg: ModelConfig) -> Array:
  return kernel.reshape(-1, cfg.emb_dim).T


def query_heads(cfg: ModelConfig) -> int:
  return cfg.num_query_heads


def kv_heads(cfg: ModelConfig) -> int:
  return cfg.num_kv_heads


def require_hf(hf_config: Mapping[str, Any], key: str, allowed: Sequence[Any], default: Any = None) -> Any:
  """Reads an HF config field that must take one of `allowed` values for us to reproduce it."""
  value = hf_config.get(key, default)
  if value not in allowed:
    raise ConfigError(f"HF config {key}={value!r} is not supported by the "
                      f"{hf_config.get('model_type')} converter (supported: {', '.join(map(repr, allowed))})")
  return value


def hf_field(hf_config: Mapping[str, Any], key: str, *aliases: str) -> Any:
  """An HF config field that some configs spell as one of `aliases`; missing under every name, the KeyError
  names `key`, the family's own spelling (the converter's error line quotes it)."""
  for name in (key, *aliases):
    if hf_config.get(name):
      return hf_config[name]
  raise KeyError(key)


def routed_experts(hf_config: Mapping[str, Any], key: str, *aliases: str) -> int:
  """An MoE config's routed-expert count. One expert is refused: our num_experts=1 is a dense MLP, which has
  no place for the checkpoint's router (its tensors would fail to stage, naming the wrong keys)."""
  count = int(hf_field(hf_config, key, *aliases)) if aliases else int(hf_config[key])
  if count < 1:
    raise ConfigError(f"HF config {key}={count} is not an expert count (a positive whole number); use the "
                      "checkpoint's own config.json")
  if count < 2:
    raise ConfigError(f"HF config {key}={count} (a mixture of one expert) is not supported by the "
                      f"{hf_config.get('model_type')} converter: num_experts=1 is a dense MLP here, without the "
                      "checkpoint's router; convert a model with at least 2 experts")
  return count


def count_hf(hf_config: Mapping[str, Any], key: str, what: str, default: Any = None, minimum: int = 1) -> int:
  """A whole-number config field of at least `minimum` where it is read (a window, a rank, a width, a period):
  transformers computes with a smaller one as given (a zero-width layer, every key masked, a division by zero),
  and with null fails, so neither is read as "unset". Absent with no default: KeyError (the converter's line)."""
  if key not in hf_config and default is None:
    raise KeyError(key)
  value = hf_config.get(key, default)
  if (isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer()
      or value < minimum):
    raise ConfigError(f"HF config {key}={value!r} is not {what} (a whole number of at least {minimum}); use the "
                      "checkpoint's own config.json")
  return int(value)


def experts_per_token(hf_config: Mapping[str, Any], num_experts: int, key: str = "num_experts_per_tok") -> int:
  """The routed experts each token takes: 1 .. num_experts (transformers' top-k of 0 drops every expert, of more
  than there are fails)."""
  top_k = count_hf(hf_config, key, "an expert count per token")
  if top_k > num_experts:
    raise ConfigError(f"HF config {key}={top_k} is more than the {num_experts} routed experts; use the checkpoint's "
                      "own config.json")
  return top_k


def sliding_window(hf_config: Mapping[str, Any], layer_is_local: Sequence[bool], key: str = "sliding_window"
                   ) -> int | None:
  """The window of a config whose `layer_is_local` layers slide: a positive length where any does (transformers
  masks every key under 0 or below and fails on null), unread (None) where none does."""
  if not any(layer_is_local):
    return None
  return count_hf(hf_config, key, "a window for its sliding_attention layers")


def given_layer_types(hf_config: Mapping[str, Any], kinds: Sequence[str], default: Callable[[], list[str]]
                      ) -> list[str]:
  """config.json's `layer_types`, one of `kinds` per layer; `default()` only where it is absent or null (transformers
  keeps an empty or short list as given and refuses it, while the pattern read from it would repeat its layers)."""
  given = hf_config.get("layer_types")
  if given is None:
    return default()
  num_layers = hf_config["num_hidden_layers"]
  if not isinstance(given, list) or len(given) != num_layers or not all(kind in kinds for kind in given):
    raise ConfigError(f"HF config layer_types={str(given)[:80]} is not a list of num_hidden_layers={num_layers} "
                      f"entries, each one of {', '.join(kinds)}; use the checkpoint's own config.json")
  return list(given)


def hf_layer_types(pattern: Sequence[str], num_layers: int) -> list[str]:
  """HF's per-layer `layer_types` for a local/global attention_layer_pattern (its inverse: below)."""
  return ["sliding_attention" if pattern[i % len(pattern)] == "local" else "full_attention" for i in range(num_layers)]


def attention_pattern(layer_is_local: Sequence[bool]) -> list[str]:
  """The shortest repeating [local/global...] list that reproduces a per-layer pattern."""
  kinds = ["local" if local else "global" for local in layer_is_local]
  for period in range(1, len(kinds) + 1):
    if all(kinds[i] == kinds[i % period] for i in range(len(kinds))):
      return kinds[:period]
  return kinds


# ---- a vision tower's encoder layers (SigLIP's, Llama 4's): two LayerNorms, biased attention
# projections split into heads, a biased two-layer MLP; stacked over vision_num_layers.

def same(x: Array, cfg: ModelConfig) -> Array:
  del cfg
  return x


def _vision_heads(cfg: ModelConfig) -> tuple[int, int, int]:
  return cfg.vision.vision_emb_dim, cfg.vision.vision_num_heads, cfg.vision.vision_head_dim


def _vision_heads_in(w: Array, cfg: ModelConfig) -> Array:
  return w.T.reshape(_vision_heads(cfg))


def _vision_heads_in_bias(b: Array, cfg: ModelConfig) -> Array:
  return b.reshape(_vision_heads(cfg)[1:])


def _vision_heads_out(w: Array, cfg: ModelConfig) -> Array:
  e, a, y = _vision_heads(cfg)
  return w.T.reshape(a, y, e)


def vision_flat_in(kernel: Array, cfg: ModelConfig) -> Array:
  """Our [E, ...] kernel -> torch's [..., E] Linear weight (the inverse of transposing and reshaping it)."""
  return kernel.reshape(cfg.vision.vision_emb_dim, -1).T


def vision_flat_out(kernel: Array, cfg: ModelConfig) -> Array:
  """Our [..., E] kernel -> torch's [E, ...] Linear weight."""
  return kernel.reshape(-1, cfg.vision.vision_emb_dim).T


def _flat(b: Array, cfg: ModelConfig) -> Array:
  del cfg
  return b.reshape(-1)


def vision_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  """The vision_config fields every vision tower's HF config spells alike (its shape)."""
  vision = cfg.vision
  return {"hidden_size": vision.vision_emb_dim, "intermediate_size": vision.vision_mlp_dim,
          "num_hidden_layers": vision.vision_num_layers, "num_attention_heads": vision.vision_num_heads,
          "num_channels": 3, "image_size": vision.vision_image_size, "patch_size": vision.vision_patch_size}


def vision_layer_tensors(hf_layer: str, norms: tuple[str, str] = ("layer_norm1", "layer_norm2"),
                         out: str = "out_proj") -> list[TensorMap]:
  """Each vision encoder layer's tensors: HF's under `hf_layer` (holding "{e}", the layer) ↔ ours
  under vision_encoder/layers/. `norms`: HF's names of the pre-attention and pre-MLP LayerNorms
  (ours: layer_norm1, layer_norm2); `out`: of the attention output projection."""
  def stacked(hf: str, ours: str, to_ours: ConvertOne = transpose, to_hf: ConvertOne = transpose) -> TensorMap:
    entry = one(hf_layer + hf, "vision_encoder/layers/" + ours, to_ours, to_hf)
    return dataclasses.replace(entry, count=lambda cfg: cfg.vision.vision_num_layers)

  maps = []
  for hf, ours in zip(norms, ("layer_norm1", "layer_norm2")):
    maps += [stacked(f"{hf}.weight", f"{ours}/scale", same, same), stacked(f"{hf}.bias", f"{ours}/bias", same, same)]
  for hf, ours in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
    maps += [stacked(f"self_attn.{hf}.weight", f"attention/{ours}/kernel", _vision_heads_in, vision_flat_in),
             stacked(f"self_attn.{hf}.bias", f"attention/{ours}/bias", _vision_heads_in_bias, _flat)]
  maps += [stacked(f"self_attn.{out}.weight", "attention/out/kernel", _vision_heads_out, vision_flat_out),
           stacked(f"self_attn.{out}.bias", "attention/out/bias", same, same)]
  for fc in ("fc1", "fc2"):
    maps += [stacked(f"mlp.{fc}.weight", f"{fc}/kernel"), stacked(f"mlp.{fc}.bias", f"{fc}/bias", same, same)]
  return maps
