"""hf_to_maxtext on damaged or unsupported HF directories: each is one UserError line naming the file
or tensor, raised before anything is written (was: a SafetensorError, AttributeError, ValueError or
UnicodeDecodeError traceback, or an int8 tensor silently converted to floats)."""

from __future__ import annotations

import argparse
import json
import shutil
import struct
from pathlib import Path
from typing import Any, Callable

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import hf_families as H
from MaxText.convert import hf_to_maxtext
from MaxText.errors import UserError

WEIGHTS = "model.safetensors"
QUERY = "q_proj"  # the tensor the cases damage: the first layer's query projection


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
  root = tmp_path_factory.mktemp("hf")
  model = H.build_hf_model("mistral")
  model.save_pretrained(str(root / "one"))
  model.save_pretrained(str(root / "sharded"), max_shard_size="20KB")
  return {"one": root / "one", "sharded": root / "sharded"}


def _cut(d: Path) -> None:
  data = (d / WEIGHTS).read_bytes()
  (d / WEIGHTS).write_bytes(data[:len(data) // 2])


def _retyped(d: Path, convert: Callable[[np.ndarray], np.ndarray]) -> None:
  tensors = load_file(str(d / WEIGHTS))
  save_file({k: convert(v) if QUERY in k else v for k, v in tensors.items()}, str(d / WEIGHTS), metadata={"format": "pt"})


def _float8(d: Path) -> None:
  """The query projection stored as F8_E4M3 (safetensors.numpy cannot write it: the file is built here)."""
  header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
  blobs, offset = [], 0
  for name, value in load_file(str(d / WEIGHTS)).items():
    dtype = "F8_E4M3" if QUERY in name else {"float32": "F32", "bfloat16": "BF16"}[str(value.dtype)]
    raw = (value.astype(ml_dtypes.float8_e4m3fn) if QUERY in name else value).tobytes()
    header[name] = {"dtype": dtype, "shape": list(value.shape), "data_offsets": [offset, offset + len(raw)]}
    blobs.append(raw)
    offset += len(raw)
  text = json.dumps(header).encode()
  text += b" " * (-len(text) % 8)
  (d / WEIGHTS).write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def _config(d: Path, edit: Callable[[dict[str, Any]], object]) -> None:
  config = json.loads((d / "config.json").read_text())
  (d / "config.json").write_text(json.dumps(edit(config)))


def _as_cut_bin(d: Path) -> None:
  """The weights as a torch .bin pickle (older checkpoints), cut short."""
  import torch

  tensors = {k: torch.from_numpy(v.copy()) for k, v in load_file(str(d / WEIGHTS)).items()}
  (d / WEIGHTS).unlink()
  torch.save(tensors, d / "pytorch_model.bin")
  data = (d / "pytorch_model.bin").read_bytes()
  (d / "pytorch_model.bin").write_bytes(data[:len(data) // 2])


def _drop_second_shard(d: Path) -> None:
  sorted(d.glob("*.safetensors"))[1].unlink()


QUERY_0 = "model.layers.0.self_attn.q_proj.weight"


def _index_points_elsewhere(d: Path) -> None:
  """The index maps the query projection to a shard other than the one holding it (a stale index beside re-saved
  shards): the shard it names lacks the tensor."""
  index = json.loads((d / "model.safetensors.index.json").read_text())
  holder = index["weight_map"][QUERY_0]
  index["weight_map"][QUERY_0] = next(f.name for f in sorted(d.glob("*.safetensors")) if f.name != holder)
  (d / "model.safetensors.index.json").write_text(json.dumps(index))


def _dropped_from_its_shard(d: Path, suffix: str = ".safetensors") -> None:
  """The query projection left out of the shard the index names for it (that shard saved again without it)."""
  index_name = "model.safetensors.index.json" if suffix == ".safetensors" else "pytorch_model.bin.index.json"
  shard = d / json.loads((d / index_name).read_text())["weight_map"][QUERY_0]
  if suffix == ".safetensors":
    save_file({k: v for k, v in load_file(str(shard)).items() if k != QUERY_0}, str(shard), metadata={"format": "pt"})
    return
  import torch

  state = torch.load(shard, weights_only=True)
  del state[QUERY_0]
  torch.save(state, shard)


def _as_bin_shards(d: Path) -> None:
  """The shards as torch .bin files with their pytorch_model.bin.index.json (older checkpoints)."""
  import torch

  index = json.loads((d / "model.safetensors.index.json").read_text())
  renamed = {f.name: f.name.replace("model-", "pytorch_model-").replace(".safetensors", ".bin")
             for f in d.glob("*.safetensors")}
  for old, new in renamed.items():
    torch.save({k: torch.from_numpy(v.copy()) for k, v in load_file(str(d / old)).items()}, d / new)
    (d / old).unlink()
  (d / "model.safetensors.index.json").unlink()
  index["weight_map"] = {k: renamed[v] for k, v in index["weight_map"].items()}
  (d / "pytorch_model.bin.index.json").write_text(json.dumps(index))


def _as_bin_shards_one_missing(d: Path) -> None:
  """The .bin shards, the second gone."""
  _as_bin_shards(d)
  sorted(d.glob("pytorch_model-*.bin"))[1].unlink()


def _as_bin_shards_one_lacking_a_tensor(d: Path) -> None:
  _as_bin_shards(d)
  _dropped_from_its_shard(d, ".bin")


CASES = {
    "cut short": ("one", _cut, f"cannot read {{d}}/{WEIGHTS}: Error while deserializing header"),
    "empty": ("one", lambda d: (d / WEIGHTS).write_bytes(b""), f"cannot read {{d}}/{WEIGHTS}"),
    "a torch .bin cut short": ("one", _as_cut_bin, "cannot read {d}/pytorch_model.bin: "),
    "int8 weights": ("one", lambda d: _retyped(d, lambda v: v.astype(np.int8)),
                     "HF tensor model.layers.0.self_attn.q_proj.weight has dtype int8, not floating point"),
    "float8 weights": ("one", _float8, "tensor model.layers.0.self_attn.q_proj.weight of {d}/model.safetensors has "
                                       "dtype F8_E4M3, which the converter cannot read"),
    "a shape config.json does not give": ("one", lambda d: _retyped(d, lambda v: v[:-1]),
                                          "HF tensor model.layers.0.self_attn.q_proj.weight has shape (63, 64), "
                                          "which does not fit the model config"),
    "config.json a list": ("one", lambda d: (d / "config.json").write_text("[1, 2]"),
                           "{d}/config.json holds a JSON list, not the object"),
    "config.json not UTF-8": ("one", lambda d: (d / "config.json").write_bytes(b'{"model_type": "\xff"}'),
                              "cannot parse {d}/config.json: 'utf-8' codec can't decode"),
    "config.json lacks a key": ("one", lambda d: _config(d, lambda c: {k: v for k, v in c.items() if k != "hidden_size"}),
                                "{d}/config.json has no 'hidden_size', which a mistral config always has"),
    "config.json a value of another type": ("one", lambda d: _config(d, lambda c: {**c, "rms_norm_eps": [1e-5]}),
                                            "{d}/config.json has a value the mistral converter cannot read (TypeError"),
    # Was the shape line alone: nothing named the null field that gave the reshape its 4 heads.
    "num_key_value_heads null on grouped weights": ("one", lambda d: _config(d, lambda c: {**c,
                                                                                         "num_key_value_heads": None}),
                                                    "(config.json's num_key_value_heads is null, read as "
                                                    "num_attention_heads=4: set it to the checkpoint's count"),
    # Was read as unset (the query heads), then a shape line.
    "num_key_value_heads 0": ("one", lambda d: _config(d, lambda c: {**c, "num_key_value_heads": 0}),
                              "HF config.json num_key_value_heads=0 is not a positive whole number"),
    # Was "the model config does not match config.json (ours vs HF): base_emb_dim: 64.0 vs '64'".
    "a number written as text": ("one", lambda d: _config(d, lambda c: {**c, "hidden_size": "64"}),
                                 "{d}/config.json: hidden_size is the text '64' where a number belongs"),
    # Was "(ValueError: dictionary update sequence element #0 has length 1; 2 is required)".
    "rope_scaling a string": ("one", lambda d: _config(d, lambda c: {**c, "rope_scaling": "linear"}),
                              "HF config rope_scaling='linear' is not an object of RoPE settings"),
    # transformers keeps a stored lm_head that differs from the embedding (untied); was converted tied, lm_head dropped.
    "tied with an lm_head of its own": ("one", lambda d: _config(d, lambda c: {**c, "tie_word_embeddings": True}),
                                        "but the checkpoint's lm_head.weight differs from its model.embed_tokens."
                                        "weight, so transformers leaves them untied"),
    "fp8 quantisation": ("one", lambda d: _config(d, lambda c: {**c, "quantization_config": {"quant_method": "fp8"}}),
                         "this checkpoint is quantised with quant_method='fp8'"),
    "a shard the index names is missing": ("sharded", _drop_second_shard,
                                           "{d}/model.safetensors.index.json names 1 shard(s) that are not in {d}, "
                                           "e.g. model-00002-of-"),
    "a torch shard the index names is missing": ("sharded", _as_bin_shards_one_missing,
                                                 "{d}/pytorch_model.bin.index.json names 1 shard(s) that are not in "
                                                 "{d}, e.g. pytorch_model-00002-of-"),
    # Was converted without a word (the tensor found in another shard) or stopped later on a parameter the
    # checkpoint did not fill, naming neither the index nor the shard.
    "the index maps a tensor to a shard that lacks it": ("sharded", _index_points_elsewhere,
                                                          "{d}/model.safetensors.index.json maps " + QUERY_0 + " to "
                                                          "model-000"),
    "a shard lacks a tensor the index maps to it": ("sharded", _dropped_from_its_shard,
                                                    "{d}/model.safetensors.index.json maps " + QUERY_0 + " to model-000"),
    "a torch shard lacks a tensor the index maps to it": ("sharded", _as_bin_shards_one_lacking_a_tensor,
                                                          "{d}/pytorch_model.bin.index.json maps " + QUERY_0 + " to "
                                                          "pytorch_model-000"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_hf_directory_is_one_line_naming_the_culprit(case: str, hf_dirs: dict[str, Path], tmp_path: Path
                                                              ) -> None:
  source, damage, message = CASES[case]
  d = tmp_path / "hf"
  shutil.copytree(hf_dirs[source], d)
  damage(d)
  with pytest.raises(UserError) as raised:
    hf_to_maxtext.convert(str(d), str(tmp_path / "out"), [])
  assert message.format(d=d) in str(raised.value) and "\n" not in str(raised.value)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing written, no staging left


@pytest.mark.parametrize("source", ["one", "sharded"])
def test_weights_beside_the_ones_transformers_loads_are_left_alone(source: str, hf_dirs: dict[str, Path],
                                                                  tmp_path: Path) -> None:
  """Mistral's repositories hold consolidated.safetensors (the original weights, in their own tensor names) beside
  model.safetensors or the shards the index names; reading every *.safetensors stopped the conversion with "HF
  tensor(s) have no mapping in the mistral converter"."""
  d = tmp_path / "hf"
  shutil.copytree(hf_dirs[source], d)
  save_file({"layers.0.attention.wq.weight": np.zeros((4, 4), np.float32)}, str(d / "consolidated.safetensors"))
  hf_to_maxtext.convert(str(d), str(tmp_path / "out"), [])
  assert (tmp_path / "out").is_dir()


def test_a_torch_checkpoint_converts_beside_its_trainers_settings(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
  """A fine-tuned repository's pytorch_model.bin sits beside training_args.bin (a pickle of the trainer's settings,
  not weights), which torch.load(weights_only=True) refuses: reading every *.bin stopped the conversion."""
  import torch

  d = tmp_path / "hf"
  shutil.copytree(hf_dirs["one"], d)
  torch.save({k: torch.from_numpy(v.copy()) for k, v in load_file(str(d / WEIGHTS)).items()}, d / "pytorch_model.bin")
  (d / WEIGHTS).unlink()
  torch.save(argparse.Namespace(learning_rate=1e-5), d / "training_args.bin")
  hf_to_maxtext.convert(str(d), str(tmp_path / "out"), [])
  assert (tmp_path / "out").is_dir()


def test_a_tied_checkpoint_that_also_stores_its_lm_head_converts(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
  """An lm_head.weight equal to the embedding beside tie_word_embeddings (older saves kept the copy) is the tie."""
  from safetensors.numpy import save_file

  d = tmp_path / "hf"
  shutil.copytree(hf_dirs["one"], d)
  tensors = load_file(str(d / WEIGHTS))
  save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].copy()}, str(d / WEIGHTS),
            metadata={"format": "pt"})
  _config(d, lambda c: {**c, "tie_word_embeddings": True})
  hf_to_maxtext.convert(str(d), str(tmp_path / "out"), [])
  assert (tmp_path / "out").is_dir()
