"""Every shipped model YAML builds abstractly and has its published parameter count.

`python3 -m tests.test_model_zoo` (from the repository root) prints the table that getting_started/Models.md holds.
"""

from __future__ import annotations

import functools
import math
import sys
from pathlib import Path

import jax
import pytest

from MaxText import models
from MaxText.platform.accelerators import DeviceTarget
from MaxText.configuration.config import MODELS_DIR, Config

REPO = Path(__file__).resolve().parent.parent
MODELS_MD = REPO / "getting_started" / "Models.md"
# A TPU target so the CPU defaults (a small model) stay out of the picture.
TPU256 = DeviceTarget(platform="tpu", device_kind="TPU v5 lite", num_devices=256)

# Parameter counts as published with each release (model cards / papers); exact where the
# checkpoint's count is published, otherwise the paper's headline figure. gpt3-52k is this
# project's own test model (named for its size).
PUBLISHED = {
    "llama2-7b": 6.74e9, "llama2-13b": 13.02e9, "llama2-70b": 68.98e9,
    "llama3-8b": 8.03e9, "llama3-70b": 70.55e9,
    "llama3.1-8b": 8.03e9, "llama3.1-70b": 70.55e9, "llama3.1-405b": 405.85e9,
    # Llama 3.2 model cards: tied embeddings, counted once.
    "llama3.2-1b": 1.24e9, "llama3.2-3b": 3.21e9,
    "mistral-7b": 7.24e9, "mixtral-8x7b": 46.7e9, "mixtral-8x22b": 141e9,
    "gemma-2b": 2.51e9, "gemma-7b": 8.54e9,
    "gemma2-2b": 2.61e9, "gemma2-9b": 9.24e9, "gemma2-27b": 27.23e9,
    "gpt3-6b": 6.7e9, "gpt3-175b": 175.0e9, "gpt3-52k": 52e3,
    # Gemma 3: text-only counts (the model cards' 4B/12B/27B include a 0.42B vision encoder).
    "gemma3-1b": 1.0e9, "gemma3-4b": 3.88e9, "gemma3-12b": 11.77e9, "gemma3-27b": 27.0e9,
    # ... and with it: the published google/gemma-3-{4b,12b,27b}-it checkpoints' tensor counts.
    "gemma3-4b-vision": 4.300079472e9, "gemma3-12b-vision": 12.18732504e9, "gemma3-27b-vision": 27.43240664e9,
    # Qwen3 model cards (sizes as the checkpoints count them; the cards round to 0.6B, 1.7B, ...).
    "qwen3-0.6b": 0.596e9, "qwen3-1.7b": 1.72e9, "qwen3-4b": 4.02e9, "qwen3-8b": 8.19e9, "qwen3-14b": 14.77e9,
    "qwen3-32b": 32.76e9, "qwen3-30b-a3b": 30.5e9, "qwen3-235b-a22b": 235.1e9,
    # Llama 4 Scout: the card's 109B total less the vision encoder and projector (0.87B, counted
    # from the published vision_config): the text model alone.
    "llama4-scout-17b-16e": 108.13e9,
    # Maverick: the card's 400B total (a headline figure) less the same vision encoder and projector.
    "llama4-maverick-17b-128e": 399.13e9,
    # ... and with them: the cards' totals.
    "llama4-scout-17b-16e-vision": 109e9, "llama4-maverick-17b-128e-vision": 400e9,
    # DeepSeek: V3's 671B without the 14B multi-token-prediction module; V2-Lite's model card.
    "deepseek3-671b": 671e9, "deepseek2-16b": 15.7e9,
    # DeepSeek-V3.2: V3's count plus 61 layers' indexers (13.96M each: 1536x64x128 + 7168x(128 + 64) + 256);
    # the hub lists 685B with the multi-token-prediction module, as for V3.
    "deepseek3.2-671b": 671.85e9,
    # OpenAI's gpt-oss model card (bf16 weights; the checkpoints store the experts in MXFP4).
    "gpt-oss-20b": 20.9e9, "gpt-oss-120b": 116.8e9,
    # OLMo 3: the Hugging Face hub's counts of the published checkpoints' tensors.
    "olmo3-7b": 7.3e9, "olmo3-32b": 32.2e9,
    # Kimi K2: the Hugging Face hub's count of the published checkpoint (the model card's headline: 1T).
    "kimi-k2-1t": 1.03e12,
    # Gemma 4 E2B, text decoder: the card's 2.3B effective parameters plus the per-layer embedding table
    # (35 x 256 x 262144 = 2.349B) they leave out; the card's 5.1B total adds the vision and audio encoders.
    "gemma4-e2b": 4.649e9,
    # Gemma 4 E4B: the card's 8B total holds the vision and audio encoders and its "4.5B effective" matches no
    # count of the published config (3% under the decoder without its per-layer embeddings), so this is
    # transformers' own text decoder of that config (tests/test_published_configs.py builds it) plus one scalar
    # a layer (HF's layer_scalar buffer; a parameter here).
    "gemma4-e4b": 7_463_013_418,
    # Gemma 4 31B: the model card's 30.7B dense parameters.
    "gemma4-31b": 30.7e9,
    # Gemma 4 26B A4B: no published text-only total was found (the name's 26B includes the vision encoder); this is
    # the count of the published config's text decoder, whose 3.82B active parameters match the card's 3.8B.
    "gemma4-26b-a4b": 25.233e9,
    # Qwen3-Next: the model card's 80B (its HF checkpoint drops the multi-token-prediction layer).
    "qwen3-next-80b-a3b": 80e9,
    # Qwen3.5: the model cards' "27B" and "35B in total" (the cards' headline figures, rounded to the billion; the
    # counts here are the text decoders, without the vision encoder (~0.45B by the published vision_config) or the
    # multi-token-prediction layer the checkpoints also hold).
    "qwen3.5-27b": 27e9, "qwen3.5-35b-a3b": 35e9, "qwen3.5-122b-a10b": 122e9, "qwen3.5-397b-a17b": 397e9,
    # Qwen3.5 0.8B/2B/4B/9B: the cards' figures are rounded totals with the vision encoder, so these are the text
    # decoders of the published configs as transformers builds them (tests/test_published_configs.py checks it,
    # and that the 9B's text, vision encoder and multi-token-prediction layer add up to its checkpoint).
    "qwen3.5-0.8b": 752_393_024, "qwen3.5-2b": 1_881_825_088, "qwen3.5-4b": 4_205_751_296, "qwen3.5-9b": 8_953_803_264,
}
# The `default` family has no published size: it follows global_parameter_scale.
UNPUBLISHED = {"default"}
MODEL_NAMES = sorted(p.stem for p in MODELS_DIR.glob("*.yml"))


@functools.cache  # the table's check reuses the counts the per-model tests made (the same worker runs this module)
def parameter_count(model_name: str) -> tuple[Config, int]:
  config = Config.for_testing(target=TPU256, model_name=model_name, print_config=False)
  spec = models.build_model_spec(config.model)  # jax.eval_shape underneath: no parameter memory
  return config, sum(math.prod(x.shape) for x in jax.tree.leaves(spec.abstract_params))


def _human(count: float) -> str:
  for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if count >= scale:
      return f"{count / scale:.2f}{unit}"
  return str(int(count))


def models_table() -> str:
  """The markdown table of getting_started/Models.md."""
  lines = ["| model_name | decoder_block | layers | emb_dim | heads (q/kv) x head_dim | mlp_dim | vocab "
           "| parameters | published |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for name in MODEL_NAMES:
    config, count = parameter_count(name)
    m = config.model
    published = _human(PUBLISHED[name]) if name in PUBLISHED else "n/a (scaled)"
    lines.append(f"| {name} | {m.decoder_block} | {m.num_decoder_layers} | {m.emb_dim} | "
                 f"{m.num_query_heads}/{m.num_kv_heads} x {m.head_dim} | {m.mlp_dim} | {m.vocab_size} | "
                 f"{count:,} | {published} |")
  return "\n".join(lines) + "\n"


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_builds_abstractly_with_its_published_size(name):
  _, count = parameter_count(name)
  if name in UNPUBLISHED:
    assert count > 0
    return
  assert name in PUBLISHED, f"add the published parameter count of {name} to PUBLISHED"
  assert abs(count - PUBLISHED[name]) <= 0.01 * PUBLISHED[name], f"{name}: {count:,} vs {PUBLISHED[name]:,.0f}"
  if name in ("qwen3-next-80b-a3b", "qwen3.5-27b", "qwen3.5-122b-a10b", "qwen3.5-397b-a17b", "qwen3.5-0.8b",
              "qwen3.5-2b", "qwen3.5-4b", "qwen3.5-9b", "gemma4-e4b"):  # the bar for a new family: within 0.5% of its card
    # (qwen3.5-35b-a3b's text decoder is 0.97% under the card's rounded 35B, which its vision encoder makes up)
    assert abs(count - PUBLISHED[name]) <= 0.005 * PUBLISHED[name], f"{name}: {count:,} vs {PUBLISHED[name]:,.0f}"


def test_models_md_lists_every_model_with_its_count():
  text = MODELS_MD.read_text()
  assert models_table() in text, "getting_started/Models.md is stale: regenerate with python3 -m tests.test_model_zoo"


if __name__ == "__main__":
  sys.stdout.write(models_table())
