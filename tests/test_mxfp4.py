"""MXFP4 checkpoints (GPT-OSS as published): our streaming dequantiser against transformers' own,
and a quantised checkpoint converting to exactly the parameters of its bfloat16 twin."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import hf_families as H
from MaxText.convert import hf_to_maxtext
from MaxText.families import mxfp4
from MaxText.errors import UserError
from tests.test_convert import _load

torch = H.torch


def _quantise(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The checkpoint layout of weight `w` [..., C, R] (stored transposed: rows R, 32-value blocks
  along C): codes [..., R, C/32, 16] and scales [..., R, C/32], rounding to the nearest FP4 value
  under a block scale that fits the block's largest magnitude."""
  rows = np.swapaxes(w, -1, -2).astype(np.float32)
  blocks = rows.reshape(rows.shape[:-1] + (-1, mxfp4.BLOCK))
  exponent = np.ceil(np.log2(np.maximum(np.abs(blocks).max(-1), 1e-30) / 6.0)).astype(np.int32)
  scaled = blocks / np.ldexp(1.0, exponent)[..., None]
  codes = np.abs(scaled[..., None] - mxfp4.FP4_VALUES).argmin(-1).astype(np.uint8)
  packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
  # C order: safetensors.numpy writes an array's buffer as it lies in memory
  return np.ascontiguousarray(packed, np.uint8), np.ascontiguousarray(exponent + 127, np.uint8)


def test_dequantising_equals_transformers_own_dequantiser():
  from transformers.integrations.mxfp4 import convert_moe_packed_tensors

  rng = np.random.default_rng(0)
  blocks = rng.integers(0, 256, size=(3, 10, 4, 16), dtype=np.uint8)  # 3 experts, 10 rows, 128 columns
  scales = rng.integers(120, 134, size=(3, 10, 4), dtype=np.uint8)
  theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.bfloat16)
  ours = mxfp4.dequantize(blocks, scales)
  assert ours.shape == (3, 128, 10) and ours.dtype == ml_dtypes.bfloat16
  np.testing.assert_array_equal(ours.view(np.uint16), theirs.contiguous().view(torch.int16).numpy().view(np.uint16))
  # The test's quantiser writes that same layout: a representable tensor survives the round trip.
  w = ours.astype(np.float32)
  np.testing.assert_array_equal(mxfp4.dequantize(*_quantise(w)).astype(np.float32), w)


def test_unpaired_or_malformed_mxfp4_tensors_are_one_line_errors():
  blocks, scales = np.zeros((2, 1, 16), np.uint8), np.zeros((2, 1), np.uint8)
  with pytest.raises(UserError, match="without their other half.*x.down_proj_blocks"):
    list(mxfp4.dequantized_tensors([("x.down_proj_blocks", blocks), ("y", scales)]))
  with pytest.raises(UserError, match="do not match the format"):
    list(mxfp4.dequantized_tensors([("x_blocks", blocks), ("x_scales", np.zeros((2, 2), np.uint8))]))


def _representable_experts(model) -> None:
  """Rounds the experts' weights to MXFP4 values, as a published checkpoint's bf16 twin holds."""
  with torch.no_grad():
    for name, param in model.named_parameters():
      if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        exact = mxfp4.dequantize(*_quantise(param.numpy())).astype(np.float32)
        param.copy_(torch.from_numpy(exact))


def _as_published(bf16_dir: Path, out: Path) -> Path:
  """`bf16_dir` with the experts in MXFP4 (blocks + scales) and a quantization_config, as the
  published gpt-oss checkpoints are laid out."""
  out.mkdir()
  tensors = load_file(str(bf16_dir / "model.safetensors"))
  quantised = {}
  for name, array in tensors.items():
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
      quantised[name + "_blocks"], quantised[name + "_scales"] = _quantise(array)
    else:
      quantised[name] = array
  save_file(quantised, str(out / "model.safetensors"), metadata={"format": "pt"})
  config = json.loads((bf16_dir / "config.json").read_text())
  config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
      "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
  (out / "config.json").write_text(json.dumps(config))
  return out


def test_a_published_layout_checkpoint_converts_to_the_parameters_of_its_bf16_twin(tmp_path):
  model = H.build_hf_model("gpt_oss")
  _representable_experts(model)
  bf16_dir = tmp_path / "bf16"
  model.save_pretrained(str(bf16_dir))
  published = _as_published(bf16_dir, tmp_path / "mxfp4")
  assert any(name.endswith("_blocks") for name in load_file(str(published / "model.safetensors")))
  # transformers reads the layout the test wrote (dequantising on CPU) as the bf16 twin: it is the real one.
  theirs = H.transformers.AutoModelForCausalLM.from_pretrained(str(published)).state_dict()
  for name, value in model.state_dict().items():
    assert torch.equal(theirs[name], value), name
  hf_to_maxtext.convert(str(bf16_dir), str(tmp_path / "from_bf16"), [])
  hf_to_maxtext.convert(str(published), str(tmp_path / "from_mxfp4"), [])
  jax.tree.map(np.testing.assert_array_equal, _load(tmp_path / "from_mxfp4", True),
               _load(tmp_path / "from_bf16", True))


def test_another_quantisation_method_is_refused_in_one_line(tmp_path):
  model = H.build_hf_model("gpt_oss")
  hf_dir = tmp_path / "hf"
  model.save_pretrained(str(hf_dir))
  config = json.loads((hf_dir / "config.json").read_text())
  config["quantization_config"] = {"quant_method": "bitsandbytes"}
  (hf_dir / "config.json").write_text(json.dumps(config))
  with pytest.raises(Exception, match="quant_method='bitsandbytes'; only the published MXFP4") as info:
    hf_to_maxtext.convert(str(hf_dir), str(tmp_path / "out"), [])
  assert "\n" not in str(info.value) and not (tmp_path / "out").exists()
