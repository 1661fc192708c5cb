"""Adversarial checks of the FLOPs / throughput / MFU accounting (MaxText/training/metrics.py and the peak table of
MaxText/platform/accelerators.py): Gated DeltaNet stacks against the matmuls of the model's jaxpr, the numbers the
step line prints, and the published peaks by device kind."""

import math

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core
import pytest

from MaxText import models
from MaxText.configuration.config import Config
from MaxText.layers import attention_kernels
from MaxText.platform import accelerators, sharding
from MaxText.training import metrics

BATCH, LENGTH = 2, 32
SMALL = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=96,
             vocab_size=128, base_num_decoder_layers=8, scan_layers=False, ici_data_parallelism=8,
             ici_fsdp_parallelism=1, print_config=False, dtype="float32", max_target_length=LENGTH)
# 2 key heads of 16, 4 value heads of 8, conv width 4.
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
              linear_conv_kernel_dim=4)


def _jaxpr_matmuls(config: Config) -> float:
  spec = models.build_model_spec(config.model)
  tokens = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.int32)
  jaxpr = jax.make_jaxpr(sharding.unsharded()(spec.apply))(spec.abstract_params, tokens, tokens, tokens).jaxpr
  return _matmul_flops(jaxpr)


def _matmul_flops(jaxpr: jax_core.Jaxpr) -> float:
  """2·M·K·N of every dot_general, a scan's body once per iteration (the recurrent form scans the tokens)."""
  total = 0.0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (lhs_contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in lhs_contract)
    elif eqn.primitive.name == "ragged_dot_general":
      (rows, contract), (_, _, out) = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
      total += 2 * rows * contract * out
    times = eqn.params["length"] if eqn.primitive.name == "scan" else 1
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(sub, jax_core.ClosedJaxpr):
          total += times * _matmul_flops(sub.jaxpr)
        elif isinstance(sub, jax_core.Jaxpr):
          total += times * _matmul_flops(sub)
  return total


@pytest.mark.parametrize("overrides", [
    dict(model_name="qwen3-next-80b-a3b", num_experts=4, num_experts_per_tok=2),
    dict(model_name="qwen3.5-2b"),
    dict(model_name="qwen3.5-2b", attention_layer_pattern=["local", "global"], sliding_window_size=8),
    dict(model_name="qwen3.5-2b", full_attention_interval=0, attention_type="gated_deltanet"),
], ids=["qwen3-next", "qwen3.5", "qwen3.5-windows", "all-deltanet"])
def test_gated_deltanet_layers_count_their_own_work(monkeypatch, overrides):
  """A hybrid stack (every 4th layer full attention) counted every layer as full attention with the dense MLP on
  the DeltaNet layers (Qwen3-Next's MoE ran there), no output gates: about a third of Qwen3-Next's FLOPs missing.
  In the recurrent form the model's matmuls are the formula less the state's decay and write (elementwise there,
  4 of the 8 multiply-adds per state element) and the conv's taps."""
  monkeypatch.setattr(attention_kernels, "linear_attention_form", lambda *args, **kwargs: "recurrent")
  config = Config.for_testing(**SMALL, **LINEAR, **overrides)
  cfg = config.model
  linear = 8 if cfg.attn.attention_type == "gated_deltanet" else 6  # DeltaNet layers of the 8
  weights, attention = metrics.forward_flops_per_sequence(cfg, LENGTH, causal=False)
  elementwise = LENGTH * linear * (4 * 4 * 16 * 8 + 2 * 4 * (2 * 2 * 16 + 4 * 8))
  assert _jaxpr_matmuls(config) == BATCH * (weights + attention - elementwise)


def test_only_full_attention_layers_attend():
  """Qwen3-Next's real shape: 12 of its 48 layers attend (causal L²/2 each); the other 36 cost linear in length."""
  cfg = Config.for_testing(model_name="qwen3-next-80b-a3b", print_config=False).model
  length = 4096
  assert metrics.attended_pairs(cfg, length) == 12 * length**2 / 2
  _, attention = metrics.forward_flops_per_sequence(cfg, length)
  recurrence = 8 * 32 * 128 * 128  # per token: 32 value heads' [128 x 128] states, 4 multiply-adds per element
  assert attention == 2 * 16 * 2 * 256 * 12 * length**2 / 2 + 36 * length * recurrence
  # Doubling the length doubles the DeltaNet layers' share and quadruples the attention layers'.
  _, twice = metrics.forward_flops_per_sequence(cfg, 2 * length)
  assert twice == 2 * 16 * 2 * 256 * 12 * (2 * length)**2 / 2 + 36 * 2 * length * recurrence


def test_throughput_of_a_step_that_took_no_time_is_not_a_crash():
  flops = metrics.StepFlops(1.0, 0.5, 1.5)
  t = metrics.throughput(0.0, 4096, flops, 8, 100.0)  # ZeroDivisionError before
  assert all(math.isnan(x) for x in (t.tokens_per_s, t.tokens_per_s_per_device, t.tflops_per_s_per_device, t.mfu))
  line = metrics.format_step_line(3, 1.0, 0.0, t)
  assert "MFU n/a" in line and "nan TFLOP/s/device" in line
  assert math.isnan(metrics.throughput(float("nan"), 4096, flops, 8, 100.0).mfu)


def test_throughput_divides_by_devices_time_and_peak():
  flops = metrics.StepFlops(6.0, 2.0, 8.0)
  t = metrics.throughput(2.0, 4096, flops, 4, 2.0)
  assert (t.tokens_per_s, t.tokens_per_s_per_device, t.tflops_per_s_per_device, t.mfu) == (2048, 512, 1.0, 0.5)
  assert "MFU 50.00%" in metrics.format_step_line(1, 1.0, 2.0, t)
  unknown = metrics.throughput(2.0, 4096, flops, 4, math.nan)  # an unknown device kind's peak
  assert unknown.tflops_per_s_per_device == 1.0 and math.isnan(unknown.mfu)
  assert "MFU n/a" in metrics.format_step_line(1, 1.0, 2.0, unknown)


@pytest.mark.parametrize("kind, peak", [
    ("NVIDIA L40S", 362.0),  # was the L4's 121 ("nvidia l4" is a prefix of its name): MFU three times too high
    ("NVIDIA L40", 181.0),
    ("NVIDIA L4", 121.0),
    ("NVIDIA H100 PCIe", 756.0),  # was the SXM part's 989
    ("NVIDIA H100 80GB HBM3", 989.0),
    ("NVIDIA H200", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A10G", None),
    ("NVIDIA L4X", None),  # no known kind's figure for an unknown one
    ("TPU v5 lite", 197.0),
    ("TPU v5", 459.0),
    ("cpu", None),
])
def test_published_peak_by_device_kind(kind, peak):
  assert accelerators.known_peak_tflops(kind) == peak


@pytest.mark.parametrize("kind, generation", [
    ("TPU v4", "v4"), ("TPU v5 lite", "v5e"), ("TPU v5e", "v5e"), ("TPU v5", "v5p"), ("TPU v5p", "v5p"),
    ("TPU v6 lite", "v6e"), ("TPU v6e", "v6e"), ("TPU7x", "tpu7x"),
    ("TPU v4 lite", None),  # v4i, an inference chip: was read as v4 by prefix (its peak, memory and torus)
    ("TPU v5 lite pod", None), ("TPU7", None), ("TPU v3", None), ("TPU v40", None), ("TPU8i", None),
])
def test_a_tpu_generation_is_matched_by_the_whole_device_kind(kind, generation):
  """JAX's device kinds (jax.experimental.pallas.tpu's chip_version_from_device_kind lists them) name one chip each;
  a longer kind that starts with a known one is another chip, not it."""
  found = accelerators.tpu_generation_of(kind)
  assert (found.name if found else None) == generation
  if generation is None:
    assert accelerators.known_peak_tflops(kind) is None


def test_a_forward_only_sparse_attention_model_counts_its_indexer():
  """A DeepSeek-V3.2 teacher (forward_only) runs its lightning indexer to choose its keys: it was left out."""
  from tests.test_flops import DSA
  student = Config.for_testing(**DSA).model
  teacher = Config.for_testing(**DSA, index_topk=48).model
  alone = metrics.training_tflops_per_step(student, BATCH, 128)
  both = metrics.training_tflops_per_step(student, BATCH, 128, forward_only=[teacher])
  weights, attention = metrics.forward_flops_per_sequence(teacher, 128)
  index_weights, index_scores = metrics.indexer_flops_per_sequence(teacher, 128)
  assert index_weights > 0 and index_scores > 0
  assert math.isclose(both.total_tflops - alone.total_tflops,
                      BATCH * (weights + attention + index_weights + index_scores) / 1e12)


GEMMA3_VISION = dict(decoder_block="gemma3", use_multimodal=True, attention="dot_product", vision_emb_dim=32,
                     vision_mlp_dim=48, vision_num_layers=2, vision_num_heads=4, vision_patch_size=8,
                     vision_image_size=64, mm_tokens_per_image=16, image_token_id=122, boi_token_id=120,
                     eoi_token_id=121, vocab_size=128, base_emb_dim=64, print_config=False)
LLAMA4_VISION = dict(decoder_block="llama4", use_multimodal=True, vision_emb_dim=32, vision_mlp_dim=128,
                     vision_num_layers=2, vision_num_heads=4, vision_patch_size=4, vision_image_size=32,
                     mm_tokens_per_image=16, vision_pixel_shuffle_ratio=0.5, vision_adapter_dim=48, image_token_id=122,
                     boi_token_id=120, eoi_token_id=121, vocab_size=128, attention_layer_pattern=["global"],
                     base_emb_dim=64, print_config=False)


@pytest.mark.parametrize("overrides", [GEMMA3_VISION, LLAMA4_VISION], ids=["gemma3", "llama4"])
def test_the_vision_tower_counts_its_matmuls(overrides):
  """An image-text model's tower (patch embedding, encoder layers, Llama 4's adapter, the projector) was not in the
  model FLOPs at all: a sixth more than Gemma 3 4B's text count with one image a 4096-token row went uncounted."""
  from flax import nnx

  from MaxText.configuration import model_checks
  from MaxText.layers import vision_tower

  cfg = Config.for_testing(**overrides).model
  tower = model_checks.family_of(cfg.decoder_block).vision
  with nnx.use_eager_sharding(False):
    encoder, projector = nnx.eval_shape(lambda: (tower.encoder(cfg, rngs=nnx.Rngs(0)),
                                                 tower.projector(cfg, rngs=nnx.Rngs(1))))
  views = 3
  pixels = jnp.zeros((views, 3, cfg.vision.vision_image_size, cfg.vision.vision_image_size), jnp.float32)
  graphdef, state = nnx.split((encoder, projector))

  def soft_tokens(state, pixels):
    return vision_tower.image_embeddings(*nnx.merge(graphdef, state), pixels)

  with sharding.unsharded():
    jaxpr = jax.make_jaxpr(soft_tokens)(state, pixels).jaxpr
  view = tower.flops_per_view(cfg)
  assert _matmul_flops(jaxpr) == views * (view.encoder_weights + view.encoder_scores + view.projector)


def test_a_frozen_vision_encoder_is_counted_forward_only():
  """Pixels need no gradient: a frozen encoder runs forward only, a projector training behind it its forward and
  weight gradient; a LoRA run freezes the whole tower. max_images_per_row views a row, padding slots included."""
  def step(**overrides):
    cfg = Config.for_testing(**GEMMA3_VISION, **overrides).model
    return metrics.training_tflops_per_step(cfg, 4, 64, images_per_row=2).total_tflops * 1e12

  cfg = Config.for_testing(**GEMMA3_VISION).model
  text = metrics.training_tflops_per_step(cfg, 4, 64).total_tflops * 1e12
  view = metrics.model_checks.family_of("gemma3").vision.flops_per_view(cfg)
  encoder, projector = view.encoder_weights + view.encoder_scores, view.projector
  assert step() - text == pytest.approx(8 * 3 * (encoder + projector))
  assert step(freeze_vision_encoder=True) - text == pytest.approx(8 * (encoder + 2 * projector))
  assert step(freeze_vision_encoder=True, freeze_multimodal_projector=True) - text == pytest.approx(
      8 * (encoder + projector))
  assert step(freeze_multimodal_projector=True) - text == pytest.approx(8 * 3 * (encoder + projector))
  assert metrics.batch_words(4, 64, 2) == "4 sequences x 64 tokens + 2 image view(s) a sequence"
