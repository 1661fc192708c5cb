"""Parameters-only checkpoint I/O: one Orbax PyTree directory holding {"params": params}
(written by the converters and `generate_param_only_checkpoint`), read from any of our
checkpoint kinds, in either layer layout (scanned `layers` or unrolled `layers_0..N`).

Reads are sharded: arrays go straight into the shardings of the current mesh.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from MaxText import models
from MaxText.training import lora
from MaxText.paths import storage
from MaxText.run_dir.checkpointing import STATE, first_line, is_step_dir, log, not_a_checkpoint, quiet_absl, \
    shapes_by_path
from MaxText.errors import UserError
from MaxText.platform.sharding import with_shardings

PARAMS = "params"


def save_params(path: str, params: models.Params) -> None:
  """Writes a parameters-only checkpoint (synchronously) to a new directory `path`."""
  if storage.exists(path):
    raise UserError(f"{path} already exists; choose a new output path or remove it first")
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(storage.as_path(path), {PARAMS: params})
  checkpointer.wait_until_finished()
  checkpointer.close()


def params_directory(path: str) -> tuple[str, str]:
  """(Orbax PyTree directory holding the params, what kind of checkpoint `path` is)."""
  root = storage.resolve(path)
  if not storage.exists(root):
    raise UserError(f"checkpoint {path} does not exist")
  if is_step_dir(root):
    return storage.join(root, STATE), "full-state step"
  if (why := not_a_checkpoint(path, root)) is not None:
    raise UserError(why)
  steps = sorted((int(n) for n in storage.listdir(root) if n.isdigit() and is_step_dir(storage.join(root, n))),
                 reverse=True)
  if steps:
    return storage.join(root, str(steps[0]), STATE), f"latest step ({steps[0]}) of a checkpoints directory"
  if storage.exists(storage.join(root, "_METADATA")) or storage.exists(storage.join(root, "_CHECKPOINT_METADATA")):
    return root, "parameters-only"
  raise UserError(f"{path} is not a checkpoint: expected a parameters-only checkpoint, a step directory "
                  f"containing '{STATE}/', or a checkpoints directory with numbered steps")


def is_read_error(error: BaseException) -> bool:
  """Whether Orbax or TensorStore raised `error` for files that do not hold the expected parameters (cut short,
  zeroed, missing, or another model's; TypeError: a subtree where an array is due). Reading into jax arrays,
  Orbax raises TensorStore's error as the cause of a bare Exception."""
  return isinstance(error, (ValueError, KeyError, FileNotFoundError, TypeError)) or (
      error.__cause__ is not None and str(error).startswith("Encountered error while reading"))


def remedy(error: BaseException, kind: str) -> str:
  """What to do after a failed read: a model that differs from the writer's, or files that are damaged."""
  # TensorStore's read errors (a file cut short, missing or overwritten) start "Error reading" after their
  # status code; a differing model is a shape, dtype or tree mismatch, which Orbax words otherwise.
  if "Error reading" not in first_line(error):
    return "check that the model config matches the one that wrote it"
  other = " or load an earlier step (its step directory)" if kind.startswith("latest step") else ""
  return f"its files are damaged or incomplete: copy the checkpoint again{other}"


def load_params(path: str, abstract_params: models.Params, shardings: models.Params) -> models.Params:
  """Reads only the parameters from any of our checkpoint kinds, into `shardings`.

  A checkpoint written with the other layer layout (scanned `layers` vs `layers_0..N`) is
  read in its own layout and converted, so scan_layers may differ between writer and reader.
  """
  directory, kind = params_directory(path)
  stored = _stored_params(directory)
  stored_rank = _stored_adapter_rank(stored)
  if stored_rank and not lora.has_adapters(abstract_params):
    # A LoRA run reads only the base weights here: it starts fresh adapters, and its objectives take the
    # adapters-off model as the starting one, which must then be the checkpoint's whole function.
    raise UserError(f"{path} ({kind} checkpoint) holds LoRA adapters, and this run reads base weights only (a LoRA "
                    "run starts fresh adapters on them); merge them in with MaxText.generate_param_only_checkpoint "
                    "and load that, or, to go on training these adapters, resume their run (its run_name, or "
                    "load_full_state_path)")
  wanted_rank = _adapter_rank(abstract_params)
  if stored_rank and wanted_rank and stored_rank != wanted_rank:  # Orbax's own line suggests padding them
    raise UserError(f"{path} ({kind} checkpoint) holds LoRA adapters of rank {stored_rank}, this model's places are of "
                    f"rank {wanted_rank}: set lora_rank={stored_rank}")
  converted = _stored_8bit_kernel(stored)
  if converted:
    raise UserError(f"{path} ({kind} checkpoint) holds 8-bit kernels (values and scales, as quantize_weights stores "
                    f"them in memory) at {converted}; load the float checkpoint they were converted from "
                    "(quantize_weights=int8 or fp8 converts it at load)")
  stored_scanned = None if stored is None else "layers" in stored
  wanted_scanned = "layers" in abstract_params
  convert = stored_scanned is not None and stored_scanned != wanted_scanned
  read_abstract, read_shardings = (_other_layout(abstract_params, shardings) if convert
                                   else (abstract_params, shardings))
  if stored is not None and (differences := _shape_differences(stored, read_abstract)):
    raise UserError(f"cannot load parameters from {path} ({kind} checkpoint): it was written by another model "
                    f"config: {differences}; give the model keys that wrote it (its config.yml or model_config.yml)")
  target = {PARAMS: with_shardings(read_abstract, read_shardings)}
  try:
    restored = ocp.PyTreeCheckpointer().restore(
        storage.as_path(directory), args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True))
  except Exception as e:  # noqa: BLE001 - Orbax wraps a sharded array's read error in a bare Exception
    if not is_read_error(e):
      raise
    raise UserError(f"cannot load parameters from {path} ({kind} checkpoint): {first_line(e)}; "
                    f"{remedy(e, kind)}") from None
  params = restored[PARAMS]
  if convert:
    num_layers = _num_layers(abstract_params)
    relayout = models.unstack_layers if stored_scanned else models.stack_layers
    params = jax.jit(lambda p: relayout(p, num_layers), out_shardings=shardings)(params)
  if bad := nonfinite_arrays(params):
    raise UserError(f"cannot load parameters from {path} ({kind} checkpoint): {describe_nonfinite(bad)}")
  layout = "" if not convert else f", {'scanned' if stored_scanned else 'unrolled'} layers converted"
  log(f"checkpoint: loaded parameters from {path} ({kind} checkpoint{layout})")
  return params


def _stored_params(directory: str) -> Any | None:
  """The stored parameters' metadata tree (shapes and dtypes, no values); None when it is unreadable,
  which the restore then reports."""
  try:
    with quiet_absl():
      return ocp.PyTreeCheckpointer().metadata(storage.as_path(directory)).item_metadata[PARAMS]
  except Exception:  # noqa: BLE001 - unreadable metadata: let the restore report the problem
    return None


def _shape_differences(stored: Any, abstract_params: models.Params) -> str:
  """The parameters this model builds that the checkpoint stores with another shape, or not at all,
  and the unrolled layers it stores beyond this model's ("" when none). Orbax names no parameter (its
  advice is to pad them), leaves a parameter it does not find unread, and reads an extra layer never."""
  have, want = shapes_by_path(stored), shapes_by_path(abstract_params)
  differ = [f"{PARAMS}/{p} {have[p]} (this config: {want[p]})" for p in sorted(want) if p in have and have[p] != want[p]]
  differ += [f"{PARAMS}/{p} is not stored" for p in sorted(set(want) - set(have))]
  extra_layers = [k for k in stored if models.stacked_layer_key(str(k)) is not None and k not in abstract_params]
  differ += [f"{PARAMS}/{k} is stored but this config builds fewer layers" for k in sorted(extra_layers)]
  return "; ".join(differ[:3]) + (f"; and {len(differ) - 3} more" if len(differ) > 3 else "")


def nonfinite_arrays(params: Any) -> list[str]:
  """The paths (params/...) of the floating-point arrays of `params` that hold a NaN or an infinity."""
  leaves = [(f"{PARAMS}/{jax.tree_util.keystr(path, simple=True, separator='/')}", leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(params)
            if jnp.issubdtype(leaf.dtype, jnp.floating)]
  finite = jax.device_get(jax.jit(lambda xs: [jnp.all(jnp.isfinite(x)) for x in xs])([x for _, x in leaves]))
  return [name for (name, _), ok in zip(leaves, finite) if not ok]


def describe_nonfinite(names: list[str]) -> str:
  more = f" and {len(names) - 3} more array(s)" if len(names) > 3 else ""
  return (f"NaN or infinite values in {', '.join(names[:3])}{more}; they were saved from a diverged run or were "
          "damaged: load an earlier checkpoint (a full-state step saved before the run diverged)")


def _stored_adapter_rank(stored: Any | None) -> int:
  """The rank of the stored LoRA adapters (0: none, or unreadable metadata: the restore reports that)."""
  return _adapter_rank(stored) if stored is not None and lora.has_adapters(stored) else 0


def _adapter_rank(params: Any) -> int:
  """The last dim of the first lora_a leaf (arrays, abstract arrays or checkpoint metadata; 0: none or no shape)."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    if str(getattr(path[-1], "key", "")) == "lora_a":
      shape = getattr(leaf, "shape", None)
      return int(shape[-1]) if shape else 0
  return 0


def _stored_8bit_kernel(stored: Any | None) -> str:
  """The path of a stored kernel that is a converted QuantizedWeight ({values, scale}), "" when none."""
  for path, _ in jax.tree_util.tree_flatten_with_path(stored)[0] if stored is not None else []:
    keys = [str(getattr(k, "key", k)) for k in path]
    if keys[-1:] == ["scale"] and keys[-2:-1] == ["kernel"]:
      return "/".join(keys[:-1])
  return ""


def _num_layers(params: models.Params, stack: str = "layers") -> int:
  if stack in params:
    return jax.tree.leaves(params[stack])[0].shape[0]
  return sum(1 for k in params if models.stacked_layer_key(k) == stack)


def _other_layout(abstract_params: models.Params, shardings: models.Params) -> tuple[models.Params, models.Params]:
  """Abstract params and shardings in the opposite layer layout (the stacked dim unsharded)."""
  # Only named shardings carry a per-dimension spec; any other sharding fits either shape.
  def unstack(a: jax.ShapeDtypeStruct, s: Sharding) -> tuple[jax.ShapeDtypeStruct, Sharding]:
    if isinstance(s, NamedSharding):
      s = NamedSharding(s.mesh, PartitionSpec(*s.spec[1:]))
    return jax.ShapeDtypeStruct(a.shape[1:], a.dtype), s

  def stack(a: jax.ShapeDtypeStruct, s: Sharding, n: int) -> tuple[jax.ShapeDtypeStruct, Sharding]:
    if isinstance(s, NamedSharding):
      s = NamedSharding(s.mesh, PartitionSpec(None, *s.spec))
    return jax.ShapeDtypeStruct((n, *a.shape), a.dtype), s

  rest = [k for k in abstract_params if k not in models.LAYER_STACKS and models.stacked_layer_key(k) is None]
  out_a, out_s = {k: abstract_params[k] for k in rest}, {k: shardings[k] for k in rest}
  is_leaf = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
  first = lambda pairs, n: jax.tree.map(lambda pair: pair[n], pairs, is_leaf=lambda x: isinstance(x, tuple))  # noqa: E731
  for name in models.LAYER_STACKS:  # `layers`, and `dense_layers` when the model has a dense prefix
    num_layers = _num_layers(abstract_params, name)
    if name in abstract_params:
      pairs = jax.tree.map(unstack, abstract_params[name], shardings[name], is_leaf=is_leaf)
      for i in range(num_layers):
        out_a[f"{name}_{i}"], out_s[f"{name}_{i}"] = first(pairs, 0), first(pairs, 1)
    elif num_layers:
      pairs = jax.tree.map(lambda a, s: stack(a, s, num_layers), abstract_params[f"{name}_0"],
                           shardings[f"{name}_0"], is_leaf=is_leaf)
      out_a[name], out_s[name] = first(pairs, 0), first(pairs, 1)
  return out_a, out_s
