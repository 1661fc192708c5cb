"""MXFP4-quantised Hugging Face checkpoints (GPT-OSS's published experts), dequantised while they stream.

The OCP microscaling format as those checkpoints store it: a weight W [..., R, C] is kept as
`<name>_blocks` [..., R, C/32, 16] uint8 (two FP4 E2M1 codes per byte, the low nibble first) and
`<name>_scales` [..., R, C/32] uint8 (one shared power of two per 32 values, biased by 127), and
the checkpoint's tensor is W transposed in its last two axes ([E, D, 2F] for gate_up_proj). The
codes' values are exact in bfloat16, and so are their products with a power of two in its range,
so the dequantised tensor is the bfloat16 tensor the quantiser saw, rounded only by the format.

Blocks and scales of one tensor are separate safetensors entries (in name order, with e.g. the
bias between them); the reader keeps the first of a pair until the second arrives, then yields
the dequantised tensor under the name without the suffix, which the family's tensor table then
maps like a bfloat16 checkpoint's.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping

import ml_dtypes
import numpy as np

from MaxText.errors import UserError

BLOCK = 32  # values sharing one scale
_BLOCKS, _SCALES = "_blocks", "_scales"
# FP4 E2M1: sign bit, 2 exponent bits, 1 mantissa bit.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


def quant_method(hf_config: Mapping[str, Any]) -> str | None:
  """The checkpoint's `quantization_config.quant_method`, or None for an unquantised one."""
  quantization = hf_config.get("quantization_config")
  if not quantization:
    return None
  return str(dict(quantization).get("quant_method", "?"))


def dequantize(blocks: np.ndarray, scales: np.ndarray, name: str = "") -> np.ndarray:
  """[..., R, G, 16] codes and [..., R, G] scales -> the bfloat16 tensor [..., G*32, R]."""
  if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape \
      or blocks.shape[-1] != BLOCK // 2:
    raise UserError(f"{name}: MXFP4 blocks {blocks.shape} {blocks.dtype} and scales {scales.shape} {scales.dtype} "
                    f"do not match the format (uint8 [..., G, {BLOCK // 2}] and uint8 [..., G])")
  values = np.empty(blocks.shape[:-1] + (BLOCK,), np.float32)
  values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
  values[..., 1::2] = FP4_VALUES[blocks >> 4]
  values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
  rows = values.reshape(blocks.shape[:-2] + (-1,))  # [..., R, C]
  return np.ascontiguousarray(np.swapaxes(rows, -1, -2)).astype(ml_dtypes.bfloat16)


def dequantized_tensors(tensors: Iterable[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
  """`tensors` with each `<name>_blocks` / `<name>_scales` pair replaced by `<name>` dequantised."""
  waiting: dict[str, tuple[str, np.ndarray]] = {}  # name -> (the suffix seen, its array)
  for name, array in tensors:
    suffix = next((s for s in (_BLOCKS, _SCALES) if name.endswith(s)), None)
    if suffix is None:
      yield name, array
      continue
    base = name[:-len(suffix)]
    if base not in waiting:
      waiting[base] = (suffix, array)
      continue
    first_suffix, first = waiting.pop(base)
    if first_suffix == suffix:
      raise UserError(f"{name} appears twice in the checkpoint")
    blocks, scales = (first, array) if first_suffix == _BLOCKS else (array, first)
    yield base, dequantize(blocks, scales, base)
  if waiting:
    unpaired = ", ".join(base + suffix for base, (suffix, _) in sorted(waiting.items()))
    raise UserError(f"MXFP4 tensors without their other half (blocks or scales): {unpaired}")
