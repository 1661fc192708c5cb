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
from MaxText.errors import ConfigError
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
                     if (path, word) not in ALLOWED})
  assert not unlisted, ("a family named outside MaxText/families/ (give the family record the part, or list it in "
                        "ALLOWED with why it is not a family reference): " + "; ".join(unlisted))
  seen = {(path, word) for path, _, word in found}
  stale = sorted(set(ALLOWED) - seen)
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


GEMMA3_VISION = dict(decoder_block="gemma3", use_multimodal=True, attention="dot_product", vision_emb_dim=32,
                     vision_mlp_dim=48, vision_num_layers=2, vision_num_heads=4, vision_patch_size=8,
                     vision_image_size=64, mm_tokens_per_image=16, image_token_id=122, boi_token_id=120,
                     eoi_token_id=121, vocab_size=128, print_config=False)


def _even_layers(values):
  if values["vision_num_layers"] % 2:
    raise ConfigError(f"the made-up tower needs an even vision_num_layers, got {values['vision_num_layers']}")


def test_a_new_vision_family_brings_its_key_checks_through_its_record(monkeypatch):
  """The config checks a vision family's own keys with its tower's checks and its image format's
  options, found through its record: a made-up family with Gemma 3's tower but its own checks."""
  base = families.family_for_decoder_block("gemma3")
  made_up = dataclasses.replace(base, name="made_up", hf_model_types=(), decoder_blocks=("made_up",),
                                vision=dataclasses.replace(base.vision, check_keys=_even_layers),
                                image_format=dataclasses.replace(base.image_format, name="Made Up",
                                                                 option_keys=("image_max_tiles",)))
  monkeypatch.setitem(families._FAMILIES, "made_up", made_up)  # noqa: SLF001  (registered for this test)
  model = {**GEMMA3_VISION, "decoder_block": "made_up"}
  assert Config.for_testing(**{**model, "mm_tokens_per_image": 12}).model.vision.use_multimodal  # no Gemma 3 square
  with pytest.raises(ConfigError, match="the made-up tower needs an even vision_num_layers, got 3"):
    Config.for_testing(**{**model, "vision_num_layers": 3})
  with pytest.raises(ConfigError, match=re.escape("image_pan_and_scan=True is Gemma 3's option; decoder_block "
                                                  "'made_up' cuts images its own way (Made Up: image_max_tiles)")):
    Config.for_testing(**model, image_pan_and_scan=True)
  with pytest.raises(ConfigError, match="use_multimodal=True is supported for decoder_block gemma3, llama4, made_up; "
                                        "got 'llama2'"):
    Config.for_testing(**{**GEMMA3_VISION, "decoder_block": "llama2"})


def test_a_family_whose_layer_reads_per_layer_shapes_may_set_them(monkeypatch):
  base = families.families()["gemma4"]
  assert base.per_layer_shapes and not families.families()["gemma3"].per_layer_shapes
  monkeypatch.setitem(families._FAMILIES, "made_up", dataclasses.replace(  # noqa: SLF001  (registered for this test)
      base, name="made_up", hf_model_types=(), decoder_blocks=("made_up",)))
  keys = {**base.model_keys(dict(base.reference_hf_configs["gemma4"])), "print_config": False}
  assert Config.for_testing(**{**keys, "decoder_block": "made_up"}).model.layer_shapes.active
  with pytest.raises(ConfigError, match="need decoder_block gemma4, made_up; got 'gemma3'"):
    Config.for_testing(**{**keys, "decoder_block": "gemma3"})
