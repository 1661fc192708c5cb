"""A family owns all of its parts: outside MaxText/families/ no code names a model family (identifiers,
attributes, imports, definitions and strings other than docstrings; comments are prose and not read),
and a family's layer class, vision tower and per-layer inputs reach the model through its `Family`
record alone, so adding a family, text or vision, touches families/ and its YAMLs only."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from MaxText import families, models
from MaxText.configuration.config import Config
from MaxText.layers.decoders import DecoderLayer
from MaxText.platform import sharding
from tests.conftest import REPO_ROOT

MAXTEXT = REPO_ROOT / "MaxText"
FAMILY_WORD = re.compile(r"(?i)(?:gemma|llama|qwen|deepseek|mixtral|gpt_oss|gpt-oss|olmo|gpt3|mistral)[\w.-]*")

# (file under MaxText/, the family word as found, lower-cased) -> why it is not a family reference.
ALLOWED: dict[tuple[str, str], str] = {
    ("configuration/model_checks.py", "llama3"): "rope_type llama3 is HF's name for a RoPE scaling kind",
    ("convert/engine.py", "llama3"): "rope_type llama3 is HF's name for a RoPE scaling kind",
    ("configuration/model_checks.py", "llama"): "an error line's prose: which releases use the option",
    ("configuration/model_checks.py", "deepseek"): "an error line's prose: DeepSeek Sparse Attention is the method's name",
    ("input_pipeline/tokenizer.py", "llama3_pattern"): "the Llama 3 tokenizer's pre-tokenisation regex, a tokenizer kind",
    ("inference/engine.py", "qwen3-next"): "an error line's prose: models with Gated DeltaNet layers, as examples",
    ("inference/engine.py", "qwen3.5"): "an error line's prose: models with Gated DeltaNet layers, as examples",
}
# Files still naming families while another change of issue 54 moves those checks into the family
# records; every hit in them is allowed until then, and a listed file with no hit left fails.
PENDING: dict[str, str] = {
    "configuration/vision_config.py": "the vision keys' per-block checks (Gemma 3's pan-and-scan, Llama 4's tiles)",
    "configuration/layer_shapes_config.py": "the per-layer-shape keys' block check (Gemma 4)",
}


def family_references(root: pathlib.Path) -> list[tuple[str, int, str]]:
  """(file relative to `root`, line, family word lower-cased) of every family named in code outside families/."""
  found = []
  for path in sorted(root.rglob("*.py")):
    relative = path.relative_to(root).as_posix()
    if relative.split("/")[0] == "families":
      continue
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
      texts: list[str] = []
      if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
        texts = [node.value]
      elif isinstance(node, ast.Name):
        texts = [node.id]
      elif isinstance(node, ast.Attribute):
        texts = [node.attr]
      elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        texts = [node.name]
      elif isinstance(node, (ast.Import, ast.ImportFrom)):
        texts = [alias.name for alias in node.names] + [getattr(node, "module", None) or ""]
      for text in texts:
        found += [(relative, node.lineno, word.lower()) for word in FAMILY_WORD.findall(text)]
  return sorted(found)


def test_no_family_is_named_outside_families():
  found = family_references(MAXTEXT)
  unlisted = sorted({f"{path}:{line} names {word!r}" for path, line, word in found
                     if (path, word) not in ALLOWED and path not in PENDING})
  assert not unlisted, ("a family named outside MaxText/families/ (give the family record the part, or list it in "
                        "ALLOWED with why it is not a family reference): " + "; ".join(unlisted))
  seen = {(path, word) for path, _, word in found}
  stale = sorted(set(ALLOWED) - seen) + sorted(set(PENDING) - {path for path, _, _ in found})
  assert not stale, f"allowed family references that no longer exist: {stale}"


def test_the_probe_finds_names_strings_and_imports_but_not_docstrings_or_families(tmp_path):
  (tmp_path / "families").mkdir()
  (tmp_path / "families" / "gemma.py").write_text("GEMMA = 'gemma'\n")
  (tmp_path / "model.py").write_text('"""Llama in a docstring."""\nfrom x import vision_llama4\n'
                                     'TOWERS = {"gemma3": 1}  # Qwen in a comment\nclass Olmo2Layer: pass\n')
  assert family_references(tmp_path) == [("model.py", 2, "llama4"), ("model.py", 3, "gemma3"),
                                         ("model.py", 4, "olmo2layer")]


class _ScaledOutputLayer(DecoderLayer):
  """A made-up family's layer: the shared block with one learned output scale."""

  def __init__(self, cfg, *, rngs):
    super().__init__(cfg, rngs=rngs)
    self.output_scale = nnx.Param(jnp.full((1,), 2.0), out_sharding=(None,))

  def __call__(self, x_BLD, *args, **kwargs):
    return super().__call__(x_BLD, *args, **kwargs) * self.output_scale[...].reshape(1, 1, 1)


def test_a_new_family_brings_its_layer_through_its_record_alone(tiny_overrides, monkeypatch):
  base = families.family_for_decoder_block("llama2")
  monkeypatch.setitem(families._FAMILIES, "made_up", dataclasses.replace(  # noqa: SLF001  (registered for this test)
      base, name="made_up", hf_model_types=(), decoder_blocks=("made_up",), layer=_ScaledOutputLayer))
  config = Config.for_testing(**tiny_overrides, decoder_block="made_up", scan_layers=False)
  spec = models.build_model_spec(config.model)
  assert spec.abstract_params["layers_0"]["output_scale"].shape == (1,)
  params = spec.init_params(jax.random.key(0))
  tokens = jnp.zeros((1, 8), jnp.int32)
  positions = jnp.arange(8)[None]
  logits = sharding.unsharded()(spec.apply)(params, tokens, positions, jnp.ones((1, 8), jnp.int32))
  assert logits.shape == (1, 8, 128)


def test_a_family_without_a_vision_tower_refuses_images_in_one_line(tiny_overrides):
  assert families.family_for_decoder_block("llama2").vision is None
  assert families.family_for_decoder_block("gemma3").vision is not None
  with pytest.raises(Exception, match="vision|multimodal"):
    models.build_model_spec(Config.for_testing(**tiny_overrides, decoder_block="llama2", use_multimodal=True).model)
