"""hf_to_maxtext on weights numpy would cast without a word: a complex tensor (its imaginary part dropped) and
NaN or infinite values (the checkpoint then converts, and every tool that loads it refuses it as diverged). Each is
one line naming the HF tensor, before anything is written (was: converted)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import hf_families as H
from MaxText.convert import hf_to_maxtext
from MaxText.errors import UserError

WEIGHTS = "model.safetensors"
QUERY = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
  root = tmp_path_factory.mktemp("hf") / "mistral"
  H.build_hf_model("mistral").save_pretrained(str(root))
  return root


def _with_nan(v: np.ndarray) -> np.ndarray:
  v = v.copy()
  v.reshape(-1)[-1] = np.nan
  return v


def _with_inf(v: np.ndarray) -> np.ndarray:
  v = v.copy()
  v.reshape(-1)[0] = -np.inf
  return v


CASES: dict[str, tuple[Callable[[np.ndarray], np.ndarray], str]] = {
    "complex": (lambda v: v.astype(np.complex64), f"HF tensor {QUERY} has dtype complex64, not real floating point"),
    "one NaN": (_with_nan, f"HF tensor {QUERY} holds NaN or infinite values"),
    "one -inf": (_with_inf, f"HF tensor {QUERY} holds NaN or infinite values"),
    "bfloat16 NaN": (lambda v: _with_nan(v).astype(ml_dtypes.bfloat16), f"HF tensor {QUERY} holds NaN or infinite"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_weight_numpy_would_cast_silently_is_one_line_naming_it(case: str, hf_dir: Path, tmp_path: Path) -> None:
  edit, message = CASES[case]
  d = tmp_path / "hf"
  shutil.copytree(hf_dir, d)
  tensors = load_file(str(d / WEIGHTS))
  save_file({k: edit(v) if k == QUERY else v for k, v in tensors.items()}, str(d / WEIGHTS), metadata={"format": "pt"})
  with pytest.raises(UserError) as raised:
    hf_to_maxtext.convert(str(d), str(tmp_path / "out"), [])
  assert message in str(raised.value) and "\n" not in str(raised.value)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_a_tensor_in_two_shards_is_one_line_naming_both_files(tmp_path: Path) -> None:
  """Which copy transformers keeps depends on the load order; was: "sets token_embedder/embedding a second time",
  naming neither file."""
  d = tmp_path / "hf"
  H.build_hf_model("mistral").save_pretrained(str(d), max_shard_size="20KB")
  first, second = sorted(d.glob("model-*.safetensors"))[:2]
  name, value = next(iter(load_file(str(first)).items()))
  save_file({**load_file(str(second)), name: value * 2}, str(second), metadata={"format": "pt"})
  with pytest.raises(UserError) as raised:
    hf_to_maxtext.convert(str(d), str(tmp_path / "out"), [])
  assert str(raised.value).startswith(f"HF tensor {name} is in both {first} and {second}"), str(raised.value)
  assert "\n" not in str(raised.value) and not (tmp_path / "out").exists()
