"""A LoRA run's adapters in PEFT's format: `adapter_config.json` + `adapter_model.safetensors`,
which `peft.PeftModel.from_pretrained(hf_model, DIR)` loads onto the HF base model.

Each adapted projection's HF weight comes from our kernel through the family's tensor table
(families/tensor_maps.py). For the projections LoRA targets, that conversion only moves entries
(transposes, head reshapes, RoPE permutations), so it is found by converting two probe kernels
whose entries are their own input (or output) index, and the same moves are applied to A's input
side and B's output side: lora_A.weight [r, in] = A's rows in HF's input order, lora_B.weight
[out, r] = B's columns in HF's output order. A conversion that computes (e.g. fuses tensors) is
refused in one line.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable, Iterator

import numpy as np

from MaxText import families
from MaxText.training import lora
from MaxText.paths import storage
from MaxText.convert import engine
from MaxText.errors import UserError
from MaxText.configuration.model_config import ModelConfig

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_DEFAULT_ALPHA = 8  # peft.LoraConfig's lora_alpha when a config has none
PICKLED_FILE = "adapter_model.bin"  # PEFT's save_pretrained(safe_serialization=False)
# LoraConfig keys that, set, make PEFT build another model than base + scale · B·A on the projections the tensors
# name: served as plain LoRA, such an adapter would silently answer as a model nobody trained.
NOT_PLAIN = {
    "layer_replication": "PEFT rebuilds the base model's layer stack from copies of its layers",
    "alora_invocation_tokens": "activated LoRA applies the adapter only after its invocation tokens",
    "arrow_config": "Arrow routes each token among several adapters",
    "kasa_config": "KaSA truncates the base weights and scales the adapter by learned singular values",
    "use_bdlora": "block-diagonal LoRA factors",
    "trainable_token_indices": "trained embedding rows beside the adapter",
    "target_parameters": "adapters on raw parameters such as MoE experts' weights, which adapter tables do not hold",
}
# init_lora_weights values whose start is subtracted from the base weights (PEFT redoes that when loading).
BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")


def _index_order(to_hf: Callable[[tuple[np.ndarray, ...], ModelConfig], np.ndarray], cfg: ModelConfig, kernel_shape: tuple[int, ...], num_in: int, side: str) -> np.ndarray:
  """For HF's [out, in] weight: which of our flattened input (side "in") or output ("out")
  indices each HF column (or row) holds; raises when the conversion is not a pure move."""
  in_size = int(np.prod(kernel_shape[:num_in]))
  out_size = int(np.prod(kernel_shape[num_in:]))
  if side == "in":
    probe = np.broadcast_to(np.arange(in_size, dtype=np.float64).reshape(in_size, 1), (in_size, out_size))
  else:
    probe = np.broadcast_to(np.arange(out_size, dtype=np.float64).reshape(1, out_size), (in_size, out_size))
  weight = np.asarray(to_hf((probe.reshape(kernel_shape),), cfg), np.float64)
  if weight.shape != (out_size, in_size):
    raise ValueError(f"HF weight {weight.shape} is not [{out_size}, {in_size}]")
  order = weight[0] if side == "in" else weight[:, 0]
  if not np.array_equal(weight, np.broadcast_to(order[None] if side == "in" else order[:, None], weight.shape)):
    raise ValueError("the conversion mixes entries")
  return order.astype(np.int64)


def _hf_layers(cfg: ModelConfig, maps: list[Any]) -> int:
  """The HF model's layers an adapter can name: the decoder's, plus the MTP modules where the family's
  checkpoint layout stores them after those (elsewhere a model's MTP modules have no HF name)."""
  has_mtp_layout = any(m.stack == "mtp" for m in maps)
  return cfg.num_decoder_layers + (cfg.mtp.mtp_num_layers if has_mtp_layout else 0)


def adapter_tensors(params: dict[str, Any], cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
  """(PEFT tensor name, array) for every adapter in `params` (scanned or unrolled; the adapter
  leaves are enough: lora.split(params)[0])."""
  family = families.family_for_decoder_block(cfg.decoder_block)
  maps = family.tensors(cfg)
  num_layers = _hf_layers(cfg, maps)
  for m in maps:
    if len(m.ours) != 1 or not m.ours[0].endswith("/kernel") or m.per_expert:
      continue
    for layer in (range(num_layers) if m.per_layer else [None]):
      if not engine._applies(cfg, m, layer):
        continue
      path, index = engine._leaf_path(cfg, m, m.ours[0], layer)
      dense = _subtree(params, path[:-1])
      if dense is None or "lora_a" not in dense:
        continue
      a, b = (np.asarray(dense[k][index] if index else dense[k]) for k in ("lora_a", "lora_b"))
      rank, num_in = a.shape[-1], a.ndim - 1
      kernel_shape = a.shape[:-1] + b.shape[1:]
      name = m.hf.format(i=layer).removesuffix(".weight")
      try:
        in_order = _index_order(m.to_hf, cfg, kernel_shape, num_in, "in")
        out_order = _index_order(m.to_hf, cfg, kernel_shape, num_in, "out")
      except ValueError as e:
        raise UserError(f"cannot export the LoRA adapter of {name} in PEFT's format: the {family.name} converter's "
                        f"{m.hf} is not a plain re-layout of our kernel ({e})") from None
      yield f"base_model.model.{name}.lora_A.weight", np.ascontiguousarray(a.reshape(-1, rank)[in_order].T)
      yield f"base_model.model.{name}.lora_B.weight", np.ascontiguousarray(b.reshape(rank, -1)[:, out_order].T)


def _subtree(params: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any] | None:
  node: Any = params
  for key in path:
    if not isinstance(node, dict) or key not in node:
      return None
    node = node[key]
  return node if isinstance(node, dict) else None


def save(output_path: str, params: dict[str, Any], cfg: ModelConfig) -> list[str]:
  """Writes the adapters of `params` to `output_path` (a new directory); returns the target names."""
  from safetensors.numpy import save as safetensors_bytes

  if not lora.has_adapters(params):
    raise UserError("the checkpoint holds no LoRA adapters to export (lora_rank=0 or no lora_target_modules)")
  tensors = dict(adapter_tensors(params, cfg))
  targets = sorted({name.split(".")[-3] for name in tensors})
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora.lora_rank, "lora_alpha": cfg.lora.lora_alpha,
            "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "init_lora_weights": True, "base_model_name_or_path": None}
  if storage.exists(output_path):
    raise UserError(f"{output_path} already exists; choose a new lora_peft_export_path or remove it first")
  storage.makedirs(output_path)
  storage.write_bytes(storage.join(output_path, WEIGHTS_FILE),
                      safetensors_bytes({k: v.astype(np.float32) for k, v in tensors.items()}))
  storage.write_text(storage.join(output_path, CONFIG_FILE), json.dumps(config, indent=2) + "\n")
  return targets


@dataclasses.dataclass(frozen=True)
class PeftAdapter:
  """An adapter read from PEFT's format, in our layout: for each adapted kernel (its tree path and,
  in a scanned stack, its layer index), lora_a [in dims..., r] and lora_b [r, out dims...]."""

  rank: int
  alpha: float
  targets: tuple[str, ...]
  leaves: dict[tuple[tuple[str, ...], tuple[int, ...]], tuple[np.ndarray, np.ndarray]]
  use_rslora: bool = False
  # Each leaf's scale where rank_pattern / alpha_pattern give its module another rank or alpha than r, lora_alpha.
  leaf_scales: dict[tuple[tuple[str, ...], tuple[int, ...]], float] = dataclasses.field(default_factory=dict)

  @property
  def scale(self) -> float:
    """What PEFT multiplies B·A by: lora_alpha / r, or lora_alpha / sqrt(r) for rank-stabilised LoRA."""
    return _scale(self.alpha, self.rank, self.use_rslora)

  def scale_of(self, leaf: tuple[tuple[str, ...], tuple[int, ...]]) -> float:
    return self.leaf_scales.get(leaf, self.scale)


def _scale(alpha: float, rank: int, use_rslora: bool) -> float:
  return alpha / (rank ** 0.5 if use_rslora else rank)


def _pattern_value(pattern: dict[str, Any], module: str, default: Any) -> Any:
  """PEFT's rank_pattern / alpha_pattern lookup: the value of the first key that matches the end of `module`'s
  dotted name (a regex), else `default`."""
  for key, value in pattern.items():
    if re.match(rf"(.*\.)?({key})$", module):
      return value
  return default


def _selects(config: dict[str, Any], module: str) -> bool:
  """Whether PEFT puts a LoRA layer on `module` (a dotted name such as model.layers.0.self_attn.q_proj) for this
  config: exclude_modules, then target_modules ("all-linear"; one regex matching the whole name; or names matching
  it or its end), then layers_to_transform (the first numbered part of the name, or the one after layers_pattern).
  A config without target_modules is taken as selecting what its tensors adapt."""
  excluded = config.get("exclude_modules")
  if isinstance(excluded, str) and excluded and re.fullmatch(excluded, module):
    return False
  if isinstance(excluded, list) and any(module == e or module.endswith("." + e) for e in excluded):
    return False
  targets = config.get("target_modules")
  if not targets or targets == "all-linear":
    return not (targets and module == "lm_head")
  if isinstance(targets, str):
    return re.fullmatch(targets, module) is not None
  if module in targets:
    return True
  if not any(module.endswith("." + t) for t in targets):
    return False
  layers = config.get("layers_to_transform")
  if layers is None or layers == []:
    return True
  patterns = config.get("layers_pattern") or []
  patterns = [patterns] if isinstance(patterns, str) else patterns
  found = (re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module) if not patterns else
           next((m for p in patterns if (m := re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", module))), None))
  if found is None:
    return False
  index = int(found.group("idx"))
  return index == layers if isinstance(layers, int) else index in layers


def _check_selection_keys(path: str, config: dict[str, Any]) -> None:
  """target_modules' companions that _selects reads, of the types PEFT takes."""
  def names(v: Any) -> bool:
    return v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))
  layers = config.get("layers_to_transform")
  if not (names(config.get("exclude_modules")) and names(config.get("layers_pattern"))) or not (
      layers is None or (isinstance(layers, int) and not isinstance(layers, bool))
      or (isinstance(layers, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in layers))):
    given = {k: config.get(k) for k in ("exclude_modules", "layers_pattern", "layers_to_transform")}
    raise UserError(f"{path}/{CONFIG_FILE}: exclude_modules and layers_pattern must be names, layers_to_transform "
                    f"layer numbers; got {str(given)[:120]}")
  for key in ("exclude_modules", "target_modules"):
    if isinstance(config.get(key), str) and config[key] != "all-linear":
      try:
        re.compile(config[key])
      except re.error as e:
        raise UserError(f"{path}/{CONFIG_FILE}: {key}={config[key][:80]!r} is not a regular expression ({e})") from None


def _module_of(tensor_name: str) -> str:
  """The base model's module name a PEFT tensor adapts (what rank_pattern keys are matched against)."""
  return tensor_name.removeprefix("base_model.model.").removesuffix(".lora_A.weight").removesuffix(".lora_B.weight")


def load(path: str, cfg: ModelConfig, abstract_params: dict[str, Any]) -> PeftAdapter:
  """The adapter in `path` (adapter_config.json + adapter_model.safetensors) placed onto the kernels of
  a model whose parameters are shaped like `abstract_params` (each adapted kernel's lora_a there gives
  its input dims); raises UserError naming what does not fit."""
  _, _, alpha = read_config(path)
  config = _read_json(path)
  use_rslora, base_rank = bool(config.get("use_rslora")), config["r"]
  rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
  leaf_scales: dict[tuple[tuple[str, ...], tuple[int, ...]], float] = {}
  tensors = _read_tensors(path)
  unused = set(tensors)
  family = families.family_for_decoder_block(cfg.decoder_block)
  maps = family.tensors(cfg)
  leaves: dict[tuple[tuple[str, ...], tuple[int, ...]], tuple[np.ndarray, np.ndarray]] = {}
  example = ""  # a name this model's adapters have: the naming scheme for the refusal of others
  for m in maps:
    if len(m.ours) != 1 or not m.ours[0].endswith("/kernel") or m.per_expert:
      continue
    for layer in (range(_hf_layers(cfg, maps)) if m.per_layer else [None]):
      if not engine._applies(cfg, m, layer):
        continue
      name = m.hf.format(i=layer).removesuffix(".weight")
      a_name, b_name = (f"base_model.model.{name}.lora_{side}.weight" for side in "AB")
      path_, index = engine._leaf_path(cfg, m, m.ours[0], layer)
      dense = _subtree(abstract_params, path_[:-1])
      if not example and dense is not None and "lora_a" in dense:
        example = a_name
      if a_name not in tensors:
        continue
      unused -= {a_name, b_name}
      if dense is None or "lora_a" not in dense or b_name not in tensors:
        raise UserError(f"{path}: the adapter of {name} has no place in this model (its projection takes no "
                        "adapter here); serve it with a base model whose adapter targets include it")
      rank = _pattern_value(rank_pattern, name, base_rank)
      module_alpha = float(_pattern_value(alpha_pattern, name, alpha))
      kernel_shape = tuple(dense["kernel"].shape[len(index):])
      num_in = len(dense["lora_a"].shape) - len(index) - 1
      a_hf, b_hf = np.asarray(tensors[a_name], np.float32), np.asarray(tensors[b_name], np.float32)
      in_size, out_size = int(np.prod(kernel_shape[:num_in])), int(np.prod(kernel_shape[num_in:]))
      if a_hf.shape != (rank, in_size) or b_hf.shape != (out_size, rank):
        if a_hf.ndim == b_hf.ndim == 2 and (a_hf.shape[1], b_hf.shape[0]) == (in_size, out_size) \
            and a_hf.shape[0] == b_hf.shape[1]:
          raise UserError(f"{path}: {name}'s adapter has rank {a_hf.shape[0]} (lora_A {list(a_hf.shape)}, lora_B "
                          f"{list(b_hf.shape)}) where {CONFIG_FILE} says r={rank} for it (r or rank_pattern); fix the "
                          "config or the tensors")
        raise UserError(f"{path}: {name}'s adapter is lora_A {list(a_hf.shape)}, lora_B {list(b_hf.shape)}; this "
                        f"model needs [{rank}, {in_size}] and [{out_size}, {rank}] (an adapter of another base model?)")
      try:
        in_order = _index_order(m.to_hf, cfg, kernel_shape, num_in, "in")
        out_order = _index_order(m.to_hf, cfg, kernel_shape, num_in, "out")
      except ValueError as e:
        raise UserError(f"{path}: cannot place the adapter of {name}: the {family.name} converter's {m.hf} is not a "
                        f"plain re-layout of our kernel ({e})") from None
      a, b = np.zeros((in_size, rank), np.float32), np.zeros((rank, out_size), np.float32)
      a[in_order], b[:, out_order] = a_hf.T, b_hf.T
      leaves[(path_[:-1], index)] = (a.reshape(kernel_shape[:num_in] + (rank,)),
                                     b.reshape((rank,) + kernel_shape[num_in:]))
      leaf_scales[(path_[:-1], index)] = _scale(module_alpha, rank, use_rslora)
  if unused:
    named = f", where this model's are named like {example}" if example else ""
    raise UserError(f"{path}: {len(unused)} tensors name no projection of this model, e.g. {sorted(unused)[0]}{named} "
                    "(an adapter of another model family or depth, or saved from another model class?)")
  _refuse_unfilled(path, config, cfg, set(tensors))
  if not leaves:
    raise UserError(f"{path} holds no LoRA tensors")
  targets = tuple(sorted({name.split(".")[-3] for name in tensors}))
  rank = max(a.shape[-1] for a, _ in leaves.values())  # the tables' rank it needs: its largest module's
  return PeftAdapter(rank, alpha, targets, leaves, use_rslora, leaf_scales)


def _refuse_unfilled(path: str, config: dict[str, Any], cfg: ModelConfig, stored: set[str]) -> None:
  """UserError when target_modules names (a list: a regex or "all-linear" reaches modules nobody meant) a module
  of this model that the stored tensors leave out: PEFT would start it from its initialisation (a random one with
  init_lora_weights=false)."""
  if not isinstance(config.get("target_modules"), list):
    return
  maps = families.family_for_decoder_block(cfg.decoder_block).tensors(cfg)
  unfilled = []
  for m in maps:
    if len(m.ours) != 1 or not m.ours[0].endswith("/kernel") or m.per_expert:
      continue
    for layer in (range(_hf_layers(cfg, maps)) if m.per_layer else [None]):
      name = m.hf.format(i=layer).removesuffix(".weight")
      if engine._applies(cfg, m, layer) and f"base_model.model.{name}.lora_A.weight" not in stored \
          and (layer is None or layer < cfg.num_decoder_layers) and _selects(config, name):
        unfilled.append(name)
  if unfilled:
    listed = str(config.get("target_modules"))[:80]
    raise UserError(f"{path}: {CONFIG_FILE} selects {unfilled[0]} (target_modules={listed}) but {WEIGHTS_FILE} "
                    f"holds no adapter for it ({len(unfilled)} such module(s)): an incomplete {WEIGHTS_FILE}? save "
                    "the adapter again, or take the module out of target_modules")


def check_targets(path: str, cfg: ModelConfig) -> None:
  """The target_modules check of `load` from the adapter's files and the model keys alone: a server runs it before
  the base model's weights load."""
  _refuse_unfilled(path, _read_json(path), cfg, set(_stored_shapes(path)))


def _read_tensors(path: str) -> dict[str, np.ndarray]:
  """The tensors of `path`'s WEIGHTS_FILE in float32 (stored as float32, float16 or bfloat16); UserError for a
  file safetensors cannot read, a tensor of another dtype or one holding NaN or infinity."""
  import ml_dtypes  # noqa: F401  (registers numpy's "bfloat16", which safetensors reads bf16 tensors as)
  from safetensors import SafetensorError, safe_open

  file = storage.join(path, WEIGHTS_FILE)
  try:
    with storage.local_copy(file) as local, safe_open(local, framework="numpy") as f:
      stored = {}
      for name in f.keys():
        try:
          stored[name] = f.get_tensor(name)
        except (AttributeError, KeyError):  # a dtype numpy has no type for (F8_E4M3: no numpy.float8_e4m3fn)
          raise UserError(f"{file}: {name} has dtype {f.get_slice(name).get_dtype()}; LoRA weights are float32, "
                          "float16 or bfloat16") from None
  except (SafetensorError, OSError, TypeError, ValueError) as e:
    raise UserError(f"{file} is not a readable safetensors file ({type(e).__name__}: {str(e)[:200]})") from None
  tensors = {}
  for name, array in stored.items():
    if array.dtype not in (np.float32, np.float16, ml_dtypes.bfloat16, np.float64):
      raise UserError(f"{file}: {name} has dtype {array.dtype}; LoRA weights are float32, float16 or bfloat16")
    tensors[name] = np.asarray(array, np.float32)
    if not np.isfinite(tensors[name]).all():
      raise UserError(f"{file}: {name} holds NaN or infinite values")
  return tensors


def _stored_shapes(path: str) -> dict[str, list[int]]:
  """Each tensor's shape in `path`'s WEIGHTS_FILE, read from its header alone; UserError for a file safetensors
  cannot read."""
  from safetensors import SafetensorError, safe_open

  file = storage.join(path, WEIGHTS_FILE)
  try:
    with storage.local_copy(file) as local, safe_open(local, framework="numpy") as f:
      return {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
  except (SafetensorError, OSError, TypeError, ValueError) as e:
    raise UserError(f"{file} is not a readable safetensors file ({type(e).__name__}: {str(e)[:200]})") from None


def stored_rank(path: str) -> int:
  """The rank the lora_A tensors of `path`'s adapter have (their largest first dim), so that a server sizes its
  adapter tables by what an adapter holds rather than by what its config claims."""
  shapes = [shape for name, shape in _stored_shapes(path).items() if name.endswith(".lora_A.weight")]
  return max((int(shape[0]) for shape in shapes if shape), default=0)


def _read_json(path: str) -> Any:
  """`path`'s CONFIG_FILE parsed; UserError when it cannot be read or is not JSON."""
  try:
    return json.loads(storage.read_text(storage.join(path, CONFIG_FILE)))
  except (ValueError, RecursionError) as e:
    raise UserError(f"{path}/{CONFIG_FILE} is not valid JSON: {str(e)[:200]}") from None
  except OSError as e:
    raise UserError(f"cannot read {path}/{CONFIG_FILE}: {e.strerror or e}") from None


def read_config(path: str) -> tuple[int, tuple[str, ...], float]:
  """(rank, the modules its tensors adapt, lora_alpha) of the PEFT LoRA adapter in `path`; UserError for anything
  else."""
  if not storage.exists(storage.join(path, CONFIG_FILE)) or not storage.exists(storage.join(path, WEIGHTS_FILE)):
    pickled = not storage.exists(storage.join(path, WEIGHTS_FILE)) and storage.exists(storage.join(path, PICKLED_FILE))
    hint = (f" (it holds {PICKLED_FILE}, a PyTorch pickle, which is not read: loading one can run code; save the "
            "adapter again with PEFT's save_pretrained(..., safe_serialization=True))") if pickled else ""
    last = path.rstrip("/").rsplit("/", 1)[-1]
    if last in (CONFIG_FILE, WEIGHTS_FILE, PICKLED_FILE):
      hint = f" (give the directory that holds them, not {last})"
    raise UserError(f"{path} is not a PEFT LoRA adapter: it needs {CONFIG_FILE} and {WEIGHTS_FILE}{hint}")
  config = _read_json(path)
  rank = config.get("r") if isinstance(config, dict) else None
  if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA" or not isinstance(rank, int) \
      or isinstance(rank, bool):
    raise UserError(f"{path}/{CONFIG_FILE} does not describe a LoRA adapter (peft_type LORA with an integer r)")
  if rank < 1:
    raise UserError(f"{path}/{CONFIG_FILE}: r={rank}; a LoRA adapter's rank is >= 1")
  alpha = config.get("lora_alpha")
  alpha = PEFT_DEFAULT_ALPHA if alpha is None else alpha  # as peft.LoraConfig reads a config without one
  if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not abs(alpha) < 1e30:
    raise UserError(f"{path}/{CONFIG_FILE}: lora_alpha={str(alpha)[:40]} is not a finite number")
  targets = config.get("target_modules") or []
  if not isinstance(targets, (str, list)) or not all(isinstance(t, str) for t in targets):
    raise UserError(f"{path}/{CONFIG_FILE}: target_modules must be a module name or a list of them, got "
                    f"{str(targets)[:80]}")
  if config.get("use_rslora") not in (None, False, True):
    raise UserError(f"{path}/{CONFIG_FILE}: use_rslora={str(config['use_rslora'])[:40]} is not true or false")
  for name in ("use_dora", "fan_in_fan_out"):
    if config.get(name):  # null reads as false, as PEFT reads it
      raise UserError(f"{path}: {name}={config[name]} is not supported; plain LoRA adapters only")
  for name, what in NOT_PLAIN.items():
    if config.get(name):
      raise UserError(f"{path}: {name}={str(config[name])[:60]} is not supported ({what}); plain LoRA adapters only")
  init = config.get("init_lora_weights")
  if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
    raise UserError(f"{path}: init_lora_weights={init!r} trains the adapter against changed base weights, which PEFT "
                    "recreates when it loads the adapter; convert it to a plain LoRA adapter first (PEFT's "
                    "save_pretrained(..., path_initial_model_for_weight_conversion=...))")
  for key, is_value in (("rank_pattern", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1),
                        ("alpha_pattern", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                         and abs(v) < 1e30)):
    pattern = config.get(key) or {}
    if not isinstance(pattern, dict) or not all(is_value(v) for v in pattern.values()):
      wanted = "ranks >= 1" if key == "rank_pattern" else "finite numbers"
      raise UserError(f"{path}/{CONFIG_FILE}: {key} must map module names to {wanted}, got {str(pattern)[:80]}")
    for k in pattern:
      try:
        re.compile(k)
      except re.error as e:
        raise UserError(f"{path}/{CONFIG_FILE}: {key} key {k[:80]!r} is not a regular expression ({e})") from None
  if config.get("modules_to_save"):
    raise UserError(f"{path}: modules_to_save={str(config['modules_to_save'])[:80]} (whole modules trained beside the "
                    "adapter) is not supported; plain LoRA adapters only")
  shapes = _stored_shapes(path)
  biases = sorted(name for name in shapes if name.endswith(".bias"))
  if biases and config.get("lora_bias"):  # PEFT's lora_bias: a trained bias on each lora_B
    raise UserError(f"{path}: lora_bias={config['lora_bias']} (a trained bias on lora_B, e.g. {biases[0]}) is not "
                    "supported; plain LoRA adapters only")
  if biases:  # PEFT's bias="all" / "lora_only": trained biases of the base model's projections
    raise UserError(f"{path}: holds {len(biases)} trained bias tensors (bias={config.get('bias')!r}), e.g. "
                    f"{biases[0]}; plain LoRA adapters only (bias=\"none\")")
  # Every adapted module needs both halves. Checked here, before the rank checks: a missing lora_A read as rank 0
  # blamed the config's r ("fix adapter_config.json"), a missing lora_B as a projection this model lacks.
  pairs = sorted(name for name in shapes if name.endswith((".lora_A.weight", ".lora_B.weight")))
  if not pairs:
    found = f"; it holds e.g. {sorted(shapes)[0][:120]}" if shapes else "; it holds no tensors"
    raise UserError(f"{path}/{WEIGHTS_FILE} holds no LoRA tensors (PEFT names them base_model.model.<module>.lora_A"
                    f".weight and .lora_B.weight){found}")
  for name in pairs:
    half = name[-len("A.weight")]  # "A" or "B"
    other = name[:-len("A.weight")] + ("B" if half == "A" else "A") + ".weight"
    if other not in shapes:
      raise UserError(f"{path}: {name} has no lora_{'B' if half == 'A' else 'A'}.weight beside it; each adapted "
                      f"module needs both lora_A and lora_B (an incomplete {WEIGHTS_FILE}?)")
  # PEFT loads a tensor only onto a module its config selects, silently dropping the rest.
  _check_selection_keys(path, config)
  unselected = sorted({module for module in map(_module_of, pairs) if not _selects(config, module)})
  if unselected:
    raise UserError(f"{path}: {WEIGHTS_FILE} holds the adapter of {unselected[0]}, which {CONFIG_FILE} does not select "
                    f"(target_modules={str(config.get('target_modules'))[:80]}, exclude_modules, layers_to_transform), "
                    "so PEFT would load it nowhere; add it to target_modules or remove its tensors")
  # The modules its tensors adapt: target_modules may also be a regex or PEFT's "all-linear", which name none.
  stored = {name.split(".")[-3] for name in pairs}
  # The largest rank the config gives a module its tensors adapt: what those tensors must hold (check_stored_rank).
  rank_pattern = config.get("rank_pattern") or {}
  if rank_pattern:
    rank = max(_pattern_value(rank_pattern, _module_of(name), rank) for name in pairs)
  return rank, tuple(sorted(stored)), float(alpha)
