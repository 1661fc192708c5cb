"""A shipped model YAML equals what its published Hugging Face config.json converts to (the family's
model_keys), for models whose YAML was written from the published shapes rather than converted: the
fields below are the published config.json's, as facts."""

from __future__ import annotations

import pytest

from MaxText import families
from MaxText.configuration.config import Config
from MaxText.convert import engine
from MaxText.layers.embeddings import rope_attention_scale

KIMI_K2 = dict(  # moonshotai/Kimi-K2-Instruct
    model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], vocab_size=163840, hidden_size=7168,
    intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64,
    num_key_value_heads=64, n_shared_experts=1, n_routed_experts=384, routed_scaling_factor=2.827, kv_lora_rank=512,
    q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_method="noaux_tc", n_group=1,
    topk_group=1, num_experts_per_tok=8, first_k_dense_replace=1, norm_topk_prob=True, scoring_func="sigmoid",
    hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_theta=50000.0, attention_bias=False, num_nextn_predict_layers=0,
    rope_scaling=dict(type="yarn", factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0,
                      mscale=1.0, mscale_all_dim=1.0))
DEEPSEEK_V32 = dict(  # deepseek-ai/DeepSeek-V3.2: V3's shapes (Kimi K2's architecture) plus the indexer
    KIMI_K2, model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"], vocab_size=129280,
    num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256, routed_scaling_factor=2.5, n_group=8,
    topk_group=4, first_k_dense_replace=3, max_position_embeddings=163840, rope_theta=10000.0,
    num_nextn_predict_layers=1, index_topk=2048, index_n_heads=64, index_head_dim=128,
    rope_scaling=dict(KIMI_K2["rope_scaling"], factor=40.0, beta_fast=32.0))
OLMO3_7B = dict(  # allenai/Olmo-3-1025-7B
    model_type="olmo3", architectures=["Olmo3ForCausalLM"], vocab_size=100278, hidden_size=4096,
    intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, hidden_act="silu",
    max_position_embeddings=65536, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
    rope_theta=500000.0, sliding_window=4096,
    rope_scaling=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=8192,
                      attention_factor=1.2079441541679836, beta_fast=32.0, beta_slow=1.0),
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(32)])
OLMO3_32B = dict(OLMO3_7B, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                 num_key_value_heads=8,
                 layer_types=["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(64)])
QWEN3_NEXT_80B = dict(  # Qwen/Qwen3-Next-80B-A3B-Instruct
    model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], vocab_size=151936, hidden_size=2048,
    intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    hidden_act="silu", max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False,
    attention_bias=False, rope_theta=10000000, partial_rotary_factor=0.25, full_attention_interval=4,
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
    linear_value_head_dim=128, moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=512,
    num_experts_per_tok=10, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])

# Qwen/Qwen3.5-35B-A3B and Qwen/Qwen3.5-27B: image-text checkpoints (their text_config; the vision_config left out).
_QWEN3_5_ROPE = {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                 "mrope_section": [11, 11, 10], "mrope_interleaved": True}
QWEN3_5_35B_A3B = dict(
    model_type="qwen3_5_moe", architectures=["Qwen3_5MoeForConditionalGeneration"], tie_word_embeddings=False,
    text_config=dict(
        model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, hidden_act="silu", attention_bias=False,
        attn_output_gate=True, max_position_embeddings=262144, rms_norm_eps=1e-6, rope_parameters=_QWEN3_5_ROPE,
        full_attention_interval=4, layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                                for i in range(40)],
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=32, moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=256,
        num_experts_per_tok=8, router_aux_loss_coef=0.001, mtp_num_hidden_layers=1, mamba_ssm_dtype="float32"))
QWEN3_5_27B = dict(
    model_type="qwen3_5", architectures=["Qwen3_5ForConditionalGeneration"], tie_word_embeddings=False,
    text_config=dict(
        {k: v for k, v in QWEN3_5_35B_A3B["text_config"].items()
         if k not in ("moe_intermediate_size", "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok",
                      "router_aux_loss_coef")},
        model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
        num_attention_heads=24, num_key_value_heads=4, linear_num_value_heads=48,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)]))

# Qwen/Qwen3.5-122B-A10B and Qwen/Qwen3.5-397B-A17B: the 35B-A3B's text_config with their shapes.
QWEN3_5_122B_A10B = dict(QWEN3_5_35B_A3B, text_config=dict(
    QWEN3_5_35B_A3B["text_config"], hidden_size=3072, num_hidden_layers=48, num_attention_heads=32,
    linear_num_value_heads=64, moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)]))
QWEN3_5_397B_A17B = dict(QWEN3_5_35B_A3B, text_config=dict(
    QWEN3_5_122B_A10B["text_config"], hidden_size=4096, num_hidden_layers=60, num_experts=512, num_experts_per_tok=10,
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(60)]))

# Qwen/Qwen3.5-0.8B, -4B and -9B: dense image-text checkpoints (text_config as published; vision_config kept for
# the count check below). The 0.8B and 4B tie the output projection to the token table.
QWEN3_5_9B = dict(
    QWEN3_5_27B, text_config=dict(
        QWEN3_5_27B["text_config"], hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
        num_attention_heads=16, num_key_value_heads=4, linear_num_value_heads=32,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(32)]),
    vision_config=dict(depth=27, hidden_size=1152, in_channels=3, intermediate_size=4304, num_heads=16,
                       num_position_embeddings=2304, out_hidden_size=4096, patch_size=16, spatial_merge_size=2,
                       temporal_patch_size=2))
QWEN3_5_4B = dict(
    {k: v for k, v in QWEN3_5_9B.items() if k != "vision_config"}, tie_word_embeddings=True, text_config=dict(
        QWEN3_5_9B["text_config"], hidden_size=2560, intermediate_size=9216, tie_word_embeddings=True))
QWEN3_5_0_8B = dict(
    QWEN3_5_4B, text_config=dict(
        QWEN3_5_4B["text_config"], hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
        num_attention_heads=8, num_key_value_heads=2, linear_num_value_heads=16,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(24)]))
# Qwen/Qwen3.5-2B: its config.json is not in the offline corpus. A public llama.cpp capture of the published
# checkpoint's graph (GGUF "qwen35", BF16) gives its shapes: width 2048, 24 layers, DeltaNet q/k/v 16 heads of 128
# each (a fused 2048 -> 6144 projection, 16 decay heads), full attention 8 query and 2 key/value heads of 256, an MLP
# of 6144, no separate output matrix; and its text trunk's count, which the test below holds transformers to.
# Its max_position_embeddings is not among what the graph gives, so it is left out (not compared).
QWEN3_5_2B = dict(QWEN3_5_0_8B, text_config={
    **{k: v for k, v in QWEN3_5_0_8B["text_config"].items() if k != "max_position_embeddings"},
    "hidden_size": 2048, "intermediate_size": 6144})
QWEN3_5_2B_GGUF_TEXT_PARAMETERS = 1_881_825_088
# The 9B checkpoint's safetensors index gives its total size: 19,306,216,416 bytes of bfloat16.
QWEN3_5_9B_CHECKPOINT_PARAMETERS = 19_306_216_416 // 2

_GEMMA4_ROPE = {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}
GEMMA4_E2B = dict(  # google/gemma-4-E2B (its text_config; the towers' configs left out)
    model_type="gemma4", architectures=["Gemma4ForConditionalGeneration"], tie_word_embeddings=True,
    text_config=dict(
        model_type="gemma4_text", hidden_size=1536, num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=1,
        head_dim=256, global_head_dim=512, num_global_key_value_heads=None, attention_k_eq_v=False, sliding_window=512,
        vocab_size=262144, vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256, num_kv_shared_layers=20,
        use_double_wide_mlp=True, intermediate_size=6144, max_position_embeddings=131072, rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=30.0, rope_parameters=_GEMMA4_ROPE,
        layer_types=["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(35)]))
# google/gemma-4-E4B: three public copies of its text_config agree (use_double_wide_mlp off, window 512, 5:1 layers).
GEMMA4_E4B = dict(GEMMA4_E2B, text_config=dict(
    GEMMA4_E2B["text_config"], hidden_size=2560, num_hidden_layers=42, num_key_value_heads=2, intermediate_size=10240,
    num_kv_shared_layers=18, use_double_wide_mlp=False,
    layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(42)]))
GEMMA4_31B = dict(  # google/gemma-4-31B
    model_type="gemma4", architectures=["Gemma4ForConditionalGeneration"], tie_word_embeddings=True,
    text_config=dict(
        model_type="gemma4_text", hidden_size=5376, intermediate_size=21504, num_hidden_layers=60, num_attention_heads=32,
        num_key_value_heads=16, num_global_key_value_heads=4, head_dim=256, global_head_dim=512, sliding_window=1024,
        max_position_embeddings=262144, hidden_activation="gelu_pytorch_tanh", attention_k_eq_v=True,
        hidden_size_per_layer_input=0, num_kv_shared_layers=0, final_logit_softcapping=30.0, vocab_size=262144,
        rms_norm_eps=1e-6, enable_moe_block=False, rope_parameters=_GEMMA4_ROPE,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(60)]))

GEMMA4_26B_A4B = dict(  # google/gemma-4-26B-A4B
    model_type="gemma4", architectures=["Gemma4ForConditionalGeneration"], tie_word_embeddings=True,
    text_config=dict(GEMMA4_31B["text_config"], hidden_size=2816, num_hidden_layers=30, intermediate_size=2112,
                     num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2, enable_moe_block=True,
                     num_experts=128, top_k_experts=8, moe_intermediate_size=704,
                     layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(30)]))


@pytest.mark.parametrize("model_name,hf", [("kimi-k2-1t", KIMI_K2), ("olmo3-7b", OLMO3_7B),
                                           ("olmo3-32b", OLMO3_32B), ("deepseek3.2-671b", DEEPSEEK_V32),
                                           ("gemma4-e2b", GEMMA4_E2B), ("gemma4-e4b", GEMMA4_E4B),
                                           ("gemma4-31b", GEMMA4_31B),
                                           ("gemma4-26b-a4b", GEMMA4_26B_A4B),
                                           ("qwen3-next-80b-a3b", QWEN3_NEXT_80B),
                                           ("qwen3.5-35b-a3b", QWEN3_5_35B_A3B), ("qwen3.5-27b", QWEN3_5_27B),
                                           ("qwen3.5-122b-a10b", QWEN3_5_122B_A10B),
                                           ("qwen3.5-397b-a17b", QWEN3_5_397B_A17B),
                                           ("qwen3.5-0.8b", QWEN3_5_0_8B), ("qwen3.5-2b", QWEN3_5_2B),
                                           ("qwen3.5-4b", QWEN3_5_4B), ("qwen3.5-9b", QWEN3_5_9B)])
def test_the_yaml_is_what_the_published_config_converts_to(model_name, hf):
  """Every key the converter sets (the architecture, and max_position_embeddings, the length config.json declares)
  has the YAML's value; YaRN's attention factor, given outright in a config.json or left to its formula in a YAML,
  scales alike."""
  keys = engine.hf_model_keys(families.family_for_hf_config(hf), hf)
  assert "max_position_embeddings" in keys or model_name == "qwen3.5-2b"
  converted, shipped = Config.for_testing(**keys), Config.for_testing(model_name=model_name)
  differ = {k: (converted[k], shipped[k]) for k in keys if k != "rope_attention_factor" and converted[k] != shipped[k]}
  assert not differ, f"{model_name}: (converted, shipped) differ: {differ}"
  assert rope_attention_scale(converted.model.rope) == pytest.approx(rope_attention_scale(shipped.model.rope), 1e-12)


@pytest.mark.parametrize("model_name,hf", [("qwen3.5-0.8b", QWEN3_5_0_8B), ("qwen3.5-2b", QWEN3_5_2B),
                                           ("qwen3.5-4b", QWEN3_5_4B), ("qwen3.5-9b", QWEN3_5_9B)])
def test_small_qwen3_5_counts_are_the_published_checkpoints(model_name, hf):
  """The cards' 0.8B/2B/4B/9B are rounded totals with the vision encoder, so the count is held to transformers' own
  text decoder built from the published config (for the 2B, read from a GGUF graph, also to that graph's count); for
  the 9B, that plus the vision encoder and the multi-token-prediction layer (one full-attention layer, a 2H -> H
  projection, three norms) is the checkpoint."""
  torch = pytest.importorskip("torch")
  hf_models = pytest.importorskip("transformers")
  from tests.test_model_zoo import parameter_count

  config = hf_models.Qwen3_5Config(**{k: v for k, v in hf.items() if k not in ("model_type", "architectures")})
  with torch.device("meta"):
    model = hf_models.Qwen3_5ForConditionalGeneration(config)
  counts = {name: p.numel() for name, p in model.named_parameters()}
  vision = sum(n for name, n in counts.items() if ".visual." in name)
  text = sum(counts.values()) - vision
  assert parameter_count(model_name)[1] == text
  if model_name == "qwen3.5-2b":  # the shapes were read from a GGUF graph: its own count must agree
    assert text == QWEN3_5_2B_GGUF_TEXT_PARAMETERS
  if "vision_config" in hf:
    width = hf["text_config"]["hidden_size"]
    full_layer = sum(n for name, n in counts.items() if ".layers.3." in name and ".visual." not in name)
    mtp = full_layer + 2 * width * width + 3 * width
    assert text + vision + mtp == pytest.approx(QWEN3_5_9B_CHECKPOINT_PARAMETERS, rel=1e-5)


@pytest.mark.parametrize("model_name,hf", [("gemma4-e2b", GEMMA4_E2B), ("gemma4-e4b", GEMMA4_E4B)])
def test_gemma4_counts_are_transformers_text_decoders(model_name, hf):
  """Transformers' own Gemma4ForCausalLM built from the published text_config, plus one scalar a layer (HF's
  `layer_scalar` buffer is a parameter here, so that it trains). The E4B card's 8B total adds the vision and audio
  encoders; its "4.5B effective" (without the per-layer embeddings) is 3% under this decoder's 4.64B."""
  torch = pytest.importorskip("torch")
  hf_models = pytest.importorskip("transformers")
  from tests.test_model_zoo import parameter_count

  config = hf_models.Gemma4TextConfig(**hf["text_config"])
  with torch.device("meta"):
    model = hf_models.Gemma4ForCausalLM(config)
  text = sum(p.numel() for p in model.parameters())
  assert parameter_count(model_name)[1] == text + config.num_hidden_layers
