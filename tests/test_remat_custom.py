"""remat_policy=custom: each named activation placed on device, offloaded to the host or recomputed
by its own key (upstream MaxText's names), the fixed policies as placements of the same tensors."""

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.configuration import remat_policies
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from train_utils import Run

# An upstream recipe's tuning block, as written there: attention projections offloaded, the MLP's
# inputs kept in HBM, the rest recomputed.
RECIPE_BLOCK = dict(remat_policy="custom", decoder_layer_input="device", context="remat", mlpwi_0="device",
                    mlpwi_1="device", mlpwo="remat", query_proj="offload", key_proj="offload", value_proj="offload",
                    qkv_proj="offload", out_proj="device")
# Tiny models that between them produce every name a layer here tags (remat_policies.PRODUCED).
_TINY = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=128,
             base_num_decoder_layers=2, vocab_size=128, max_target_length=32, per_device_batch_size=1, print_config=False)
_MLA_MOE = dict(_TINY, decoder_block="deepseek3", base_num_kv_heads=4, head_dim=12, base_mlp_dim=32,
                attention_type="mla", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=6, num_experts=4, num_experts_per_tok=2)
_UNGATED = dict(_TINY, mlp_activations=["gelu"])


def _spelling(name: str) -> dict[str, str]:
  """The custom keys that spell preset `name` (those that differ from the defaults)."""
  defaults = remat_policies.BY_NAME["full"].placements()
  return {k: v for k, v in remat_policies.PRESET_PLACEMENTS[name].items() if v != defaults[k]}


def _lowered_text(**overrides) -> str:
  run = Run(Config.for_testing(**_TINY, **overrides))
  text = run.step_fn.lower(run.init(), next(run.data), run.rng).as_text()
  return re.sub(r"loc\([^)]*\)", "", text)  # source locations differ, the program does not


def test_recipe_block_reads_as_written():
  policy = Config.for_testing(**_TINY, **RECIPE_BLOCK).model.remat
  assert policy.name == "custom" and policy.keeps == "names"
  assert policy.device == ("out_proj", "mlpwi_0", "mlpwi_1")
  # qkv_proj names fused_qkv's matmul: in the policy, in no layer of this unfused model (a warning says so)
  assert policy.offload == ("query_proj", "key_proj", "value_proj", "qkv_proj")
  assert policy.saved_on_device == ("out", "mlp_in") and policy.saved_on_host == ("qkv",)


@pytest.mark.parametrize("overrides, message", [
    (dict(remat_policy="custom", query_proj="hbm"), r"^query_proj='hbm' is not a placement; use one of remat \| device \| offload$"),
    (dict(remat_policy="custom", decoder_layer_input="remat"), r"^decoder_layer_input=remat: a layer's input is where"),
    (dict(remat_policy="full", query_proj="offload", mlpwo="device"),
     r"^query_proj=offload, mlpwo=device place activations only with remat_policy=custom \(it is 'full'\); add "
     r"remat_policy=custom, or drop them$"),
])
def test_wrong_placements_are_one_line_errors(overrides, message):
  with pytest.raises(ConfigError, match=message):
    Config.for_testing(**_TINY, **overrides)


@pytest.mark.parametrize("written, got", [("off", "False"), ("yes", "True"), ("true", "True")])
def test_a_yaml_boolean_placement_is_named_as_yaml_read_it(tmp_path, written, got):
  """A recipe's `query_proj: off` reaches the config as False: the line says YAML read it so (it said only
  "got False", a value the user never typed)."""
  from MaxText.configuration.config import BASE_CONFIG_PATH, parse_overrides
  recipe = tmp_path / "recipe.yml"
  recipe.write_text(f"base_config: {BASE_CONFIG_PATH}\nremat_policy: custom\nquery_proj: {written}\n")
  with pytest.raises(ConfigError) as refused:
    parse_overrides(["train", str(recipe)])
  assert str(refused.value) == (f"query_proj must be a string like its default 'remat', got {got} (YAML reads an "
                                "unquoted true/false, yes/no or on/off as a boolean: quote it to mean the word)")


def test_a_key_no_layer_produces_is_accepted_with_one_warning(capsys):
  from MaxText.configuration import model_config
  model_config._WARNED_UNPRODUCED.discard("engram")
  for _ in range(2):
    policy = Config.for_testing(**_TINY, remat_policy="custom", engram="offload", kv_proj="device").model.remat
  assert policy.names == ()  # it places nothing
  lines = capsys.readouterr().err.strip().splitlines()
  assert [line for line in lines if "engram" in line] == [
      "warning: engram=offload places nothing: no layer here produces 'engram' (the key is accepted so that upstream "
      "recipes run as written)"]


@pytest.mark.parametrize("overrides, line", [
    (dict(query_wa_proj="offload"), "query_wa_proj=offload places nothing: no layer of llama2 produces 'query_wa_proj' "
     "(attention_type=gqa: only MLA names it)"),
    (dict(moe_mlpwo="device"), "moe_mlpwo=device places nothing: no layer of llama2 produces 'moe_mlpwo' (num_experts=1: no "
     "routed experts)"),
    (dict(mlpwi="offload"), "mlpwi=offload places nothing: no layer of llama2 produces 'mlpwi' (mlp_activations=['silu', "
     "'linear']: the gated MLP's input projections are mlpwi_0 and mlpwi_1)"),
    (dict(_UNGATED, mlpwi_1="device"), "mlpwi_1=device places nothing: no layer of llama2 produces 'mlpwi_1' "
     "(mlp_activations=['gelu']: the ungated MLP names its input projection mlpwi)"),
    (dict(_MLA_MOE, context="device"), "context=device places nothing: no layer of deepseek3 produces 'context' "
     "(attention_type=mla names the attention kernel's output attention_out)"),
    (dict(_MLA_MOE, q_lora_rank=0, mla_q="offload"), "mla_q=offload places nothing: no layer of deepseek3 produces 'mla_q' "
     "(q_lora_rank=0: MLA's query has no down-projection)"),
    # a quantized matmul or an adapter keeps the fused projections apart (linears.fused_outputs), each named
    (dict(fused_mlp=True, quantization="int8", mlpwi="device"), "mlpwi=device places nothing: no layer of llama2 produces "
     "'mlpwi' (quantization=int8: fused_mlp's projections run apart, named mlpwi_0 and mlpwi_1)"),
    (dict(fused_mlp=True, lora_rank=4, lora_target_modules=["up_proj", "o_proj"], mlpwi="offload"),
     "mlpwi=offload places nothing: no layer of llama2 produces 'mlpwi' (LoRA on up_proj: fused_mlp's projections run "
     "apart, named mlpwi_0 and mlpwi_1)"),
    (dict(base_num_kv_heads=4, fused_qkv=True, quantization="int8", qkv_proj="offload"), "qkv_proj=offload places "
     "nothing: no layer of llama2 produces 'qkv_proj' (quantization=int8: fused_qkv's projections run apart, named "
     "query_proj, key_proj, value_proj)"),
], ids=["mla_on_gqa", "experts_on_dense", "mlpwi_gated", "mlpwi_1_ungated", "context_on_mla", "mla_q_without_rank",
        "fused_mlp_quantized", "fused_mlp_lora", "fused_qkv_quantized"])
def test_a_name_the_model_does_not_produce_is_one_warning(capsys, overrides, line):
  """A placement of a tensor this model has no layer for (MLA's on a GQA model, the experts' on a dense one)
  places nothing: a warning says which key turns it off (was silent)."""
  from MaxText.configuration import model_config
  model_config._WARNED_UNPRODUCED.clear()
  Config.for_testing(**{**_TINY, **overrides, "remat_policy": "custom"})
  assert [l for l in capsys.readouterr().err.splitlines() if l.startswith("warning:")] == [f"warning: {line}"]


def test_the_names_a_model_produces_are_not_warned_about(capsys):
  from MaxText.configuration import model_config
  model_config._WARNED_UNPRODUCED.clear()
  Config.for_testing(**_MLA_MOE, remat_policy="custom", query_wa_proj="offload", mla_q="device", kv_wa_proj="device",
                     mla_kv="device", attention_out="offload", moe_mlpwi_0="device", moe_mlpwi_1="offload",
                     moe_mlpwo="device", mlpwi_0="device", mlpwi_1="device", mlpwo="offload")
  Config.for_testing(**_TINY, remat_policy="custom", context="device", mlpwi_0="offload", mlpwi_1="device")
  Config.for_testing(**_UNGATED, remat_policy="custom", mlpwi="offload")
  Config.for_testing(**_TINY, fused_mlp=True, quantization="int8", remat_policy="custom", mlpwi_0="device")
  Config.for_testing(**_TINY, fused_mlp=True, lora_rank=4, lora_target_modules=["gate_proj"], remat_policy="custom",
                     mlpwi_1="offload")
  assert "warning:" not in capsys.readouterr().err


def test_a_quantized_or_adapted_fused_mlp_keeps_its_parts_names():
  """What the warnings above rest on: quantized, or with an adapter, fused_mlp runs its two matmuls apart and
  mlpwi_0 is kept (the warning said it placed nothing), mlpwi nothing."""
  from MaxText.layers import quantization
  with quantization.use_quantization("int8"):
    assert _saved_names("mlp", fused_mlp=True, quantization="int8", remat_policy="custom", mlpwi_0="device",
                        mlpwi="device") == [("2,8,128", "mlpwi_0")]
  assert _saved_names("mlp", fused_mlp=True, lora_rank=4, lora_target_modules=["gate_proj", "up_proj"],
                      remat_policy="custom", mlpwi_0="device", mlpwi="device") == [("2,8,128", "mlpwi_0")]


def test_every_preset_but_none_is_a_placement():
  from MaxText.aot import plan_remat
  cfg = Config.for_testing(**_TINY).model
  assert set(remat_policies.PRESET_PLACEMENTS) == set(remat_policies.NAMES) - {"none", "custom"}
  for name, placements in remat_policies.PRESET_PLACEMENTS.items():
    assert set(placements) == set(remat_policies.TENSORS) and placements["decoder_layer_input"] == "device", name
    policy = remat_policies.custom(placements)
    preset = remat_policies.by_name(name)
    # The same tensors in the same places, and the planner's same memory and recompute figures.
    assert (set(policy.device), set(policy.offload)) == (set(preset.device), set(preset.offload)), name
    assert (policy.saved_on_device, policy.saved_on_host) == (preset.saved_on_device, preset.saved_on_host), name
    assert plan_remat.rerun_flops(cfg, policy, 32) == plan_remat.rerun_flops(cfg, preset, 32), name


def test_upstreams_presets_keep_exactly_upstreams_names():
  """qkv_proj_offloaded offloads the query, key and value projections (not fused_qkv's qkv_proj, as
  upstream); save_dot_except_mlpwi keeps them and qkv_proj with out_proj and mlpwo in HBM,
  save_dot_with_context_except_mlp with the attention's output (context) and out_proj (upstream's
  kv_proj: no layer here names it). Upstream: src/maxtext/layers/decoders.py, get_remat_policy."""
  assert _spelling("qkv_proj_offloaded") == dict(query_proj="offload", key_proj="offload", value_proj="offload")
  assert _spelling("save_dot_except_mlpwi") == dict(query_proj="device", key_proj="device", value_proj="device",
                                                    qkv_proj="device", out_proj="device", mlpwo="device")
  assert _spelling("save_dot_with_context_except_mlp") == dict(query_proj="device", key_proj="device",
                                                               value_proj="device", qkv_proj="device",
                                                               context="device", out_proj="device")
  for name in ("qkv_proj_offloaded", "save_dot_except_mlpwi", "save_dot_with_context_except_mlp"):
    spelled = Config.for_testing(**_TINY, remat_policy="custom", **_spelling(name)).model.remat
    assert Config.for_testing(**_TINY, remat_policy=name).model.remat == dataclasses.replace(spelled, name=name)


@pytest.mark.parametrize("name", [
    "minimal",  # jax's dots policy against named tensors: the one whose spelling is not the same code path
    *[pytest.param(n, marks=pytest.mark.slow) for n in ("full", "save_qkv_proj", "save_dot_except_mlp",
                                                        "minimal_offloaded", "save_dot_except_mlp_offloaded",
                                                        "qkv_proj_offloaded", "save_dot_except_mlpwi",
                                                        "save_dot_with_context_except_mlp")]])
def test_preset_lowers_to_the_same_program_as_its_custom_spelling(name):
  assert _lowered_text(remat_policy=name) == _lowered_text(remat_policy="custom", **_spelling(name))


def test_a_custom_placement_trains_like_full_remat():
  """Where activations stay changes memory, not arithmetic."""
  def losses(**overrides):
    run = Run(Config.for_testing(**_TINY, **overrides))
    _, history = run.train(run.init(), 2)
    return [h["loss"] for h in history]
  np.testing.assert_allclose(losses(**RECIPE_BLOCK), losses(remat_policy="full"), rtol=1e-6)


@pytest.mark.parametrize("overrides", [_TINY, _MLA_MOE, _UNGATED], ids=["gqa_gated", "mla_moe", "ungated"])
def test_named_tensors_are_in_the_step(overrides):
  """Every name a key places is tagged in the traced step of a model that has it."""
  names = {"gqa_gated": {"decoder_layer_input", "query_proj", "key_proj", "value_proj", "context", "out_proj",
                         "mlpwi_0", "mlpwi_1", "mlpwo"},
           "mla_moe": {"decoder_layer_input", "query_wa_proj", "mla_q", "query_proj", "kv_wa_proj", "mla_kv",
                       "key_proj", "value_proj", "attention_out", "out_proj", "moe_mlpwi_0", "moe_mlpwi_1",
                       "moe_mlpwo"},
           "ungated": {"mlpwi", "mlpwo"}}
  key = "gqa_gated" if overrides is _TINY else "mla_moe" if overrides is _MLA_MOE else "ungated"
  run = Run(Config.for_testing(**overrides, remat_policy="custom"))
  jaxpr = str(jax.make_jaxpr(run.step_fn)(*run.assembly.abstract_inputs().as_args()))
  tagged = set(re.findall(r"\bname\[name=(\w+)\]", jaxpr)) | set(re.findall(r"name=(\w+)\s", jaxpr))
  assert names[key] <= tagged, sorted(names[key] - tagged)
  assert tagged & set(remat_policies.TENSORS) <= set(remat_policies.PRODUCED)
  # What config validation warns places nothing is what the step does not tag (all of it on the dense models)
  unproduced = set(remat_policies.not_produced(run.config.values))
  assert unproduced <= set(remat_policies.PRODUCED) - tagged, sorted(unproduced & tagged)
  if key != "mla_moe":
    assert unproduced == set(remat_policies.PRODUCED) - tagged, sorted(set(remat_policies.PRODUCED) - tagged - unproduced)


def test_every_produced_name_is_tagged_by_some_reference_model():
  covered = {"decoder_layer_input", "query_proj", "key_proj", "value_proj", "context", "out_proj", "mlpwi_0",
             "mlpwi_1", "mlpwo", "query_wa_proj", "mla_q", "kv_wa_proj", "mla_kv", "attention_out", "moe_mlpwi_0",
             "moe_mlpwi_1", "moe_mlpwo", "mlpwi", "qkv_proj"}  # qkv_proj: fused_qkv (test_fused_qkv_...)
  assert covered == set(remat_policies.PRODUCED)


def _saved_names(layer_name: str, all_residuals: bool = False, **overrides) -> list[str]:
  """The named tensors one layer (attention, MLA, MoE or MLP) of a tiny model keeps for its backward pass under
  the config's remat policy, in jax's words (print_saved_residuals); the weights are constants here, so
  a tensor only a weight's gradient would need is not kept."""
  import contextlib
  import io

  from flax import nnx

  from MaxText.layers import attention, mla, mlp, moe, remat
  from MaxText.platform import sharding
  cfg = Config.for_testing(**{**_TINY, "base_num_kv_heads": 4, **overrides}, dtype="float32",
                           attention="dot_product").model
  with nnx.use_eager_sharding(False):
    layer = {"attention": attention.Attention, "mla": mla.MultiHeadLatentAttention, "moe": moe.MoeBlock,
             "mlp": mlp.MlpBlock}[layer_name](cfg, rngs=nnx.Rngs(0))
  graph, state = nnx.split(layer)
  positions, segments = jnp.broadcast_to(jnp.arange(8), (2, 8)), jnp.ones((2, 8), jnp.int32)

  def loss(x):
    module = nnx.merge(graph, state)
    return (module(x, positions, segments) if layer_name in ("attention", "mla") else module(x)).sum()
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed), sharding.unsharded():
    jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(loss, policy=remat.checkpoint_policy(cfg.remat)),
                                            jnp.ones((2, 8, 64), jnp.float32))
  if all_residuals:  # every saved residual but the layer's input: (shape, what jax says it is)
    return sorted(re.findall(r"\[([\d,]+)\] (output of \w+|named '\w+')", printed.getvalue()))
  return re.findall(r"\[([\d,]+)\] named '(\w+)'", printed.getvalue())


def test_fused_qkv_proj_places_the_one_matmuls_output(capsys):
  """Upstream names fused_qkv's matmul output qkv_proj (src/maxtext/layers/attentions.py, qkv_projection):
  [B, L, 3, N, H] kept by qkv_proj=device; unfused, the key places nothing and a warning says why."""
  assert _saved_names("attention", fused_qkv=True, remat_policy="custom", qkv_proj="device") == [
      ("2,8,3,4,16", "qkv_proj")]
  from MaxText.configuration import model_config
  model_config._WARNED_UNPRODUCED.discard("qkv_proj")
  assert _saved_names("attention", fused_qkv=False, remat_policy="custom", qkv_proj="device") == []
  assert "warning: qkv_proj=device places nothing: no layer of llama2 produces 'qkv_proj' (fused_qkv=False)" in (
      capsys.readouterr().err)


def test_fused_mlp_names_its_one_matmuls_output_mlpwi(capsys):
  """Upstream's fused_mlp names the stacked [B, L, 2, F] output mlpwi and the two parts nothing
  (src/maxtext/layers/linears.py, MlpBlock); a placement of a part then places nothing, with a warning."""
  assert _saved_names("mlp", fused_mlp=True, remat_policy="custom", mlpwi="device") == [("2,8,2,128", "mlpwi")]
  from MaxText.configuration import model_config
  model_config._WARNED_UNPRODUCED.difference_update({"mlpwi_0", "mlpwi_1"})
  assert _saved_names("mlp", fused_mlp=True, remat_policy="custom", mlpwi_0="device", mlpwi_1="device") == []
  assert ("warning: mlpwi_0=device places nothing: no layer of llama2 produces 'mlpwi_0' (fused_mlp=True names its "
          "one matmul mlpwi)") in capsys.readouterr().err
  assert [n for _, n in _saved_names("mlp", remat_policy="custom", mlpwi_0="device")] == ["mlpwi_0"]


@pytest.mark.slow  # four train-step compiles of a tiny MoE model
def test_moe_presets_that_keep_expert_tensors_train_like_full_remat():
  """The experts' tensors kept in HBM or offloaded (minimal_offloaded's jax policy: dots or names) change
  memory, not arithmetic."""
  def losses(**overrides):
    run = Run(Config.for_testing(**_TINY, **_MOE, sparse_matmul=True, capacity_factor=-1.0, **overrides))
    _, history = run.train(run.init(), 2)
    return [h["loss"] for h in history]
  reference = losses(remat_policy="full")
  for name in ("minimal", "minimal_offloaded", "save_dot_except_mlpwi"):
    np.testing.assert_allclose(losses(remat_policy=name), reference, rtol=1e-6, err_msg=name)


def test_mla_key_proj_is_each_heads_whole_key():
  """Upstream's attention_mla.py names each head's whole key key_proj: its no-position part and the
  shared rotated one (8 + 4 wide here; was the 8-wide no-position part alone)."""
  mla_only = {k: v for k, v in _MLA_MOE.items() if k not in ("num_experts", "num_experts_per_tok")}
  assert _saved_names("mla", **mla_only, remat_policy="custom", key_proj="device", value_proj="device") == [
      ("2,8,4,6", "value_proj"), ("2,8,4,12", "key_proj")]


def test_mla_presets_recompute_the_down_projections_as_upstreams():
  """Upstream's save_qkv_proj and save_dot_except_mlp name the query, key and value (and the fused qkv_proj,
  kv_proj), not MLA's query_wa_proj and kv_wa_proj: the down-projections are recomputed (were kept here)."""
  mla_only = {k: v for k, v in _MLA_MOE.items() if k not in ("num_experts", "num_experts_per_tok")}
  for name in ("save_qkv_proj", "save_dot_except_mlp"):
    assert sorted(n for _, n in _saved_names("mla", **mla_only, remat_policy=name)) == [
        "key_proj", "query_proj", "value_proj"], name


_MOE = dict(num_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize("layer, overrides, extra", [
    ("moe", _MOE, [("2,8,4", "output of dot_general")]),  # the router's logits
    ("moe", dict(_MOE, sparse_matmul=True), [("2,8,4", "output of dot_general")]),
    ("mla", {k: v for k, v in _MLA_MOE.items() if k not in _MOE}, []),
], ids=["moe_capacity", "moe_sparse_matmul", "mla"])
def test_minimal_keeps_beside_its_spelling_only_the_unnamed_weight_matmuls(layer, overrides, extra):
  """minimal runs jax's dots policy besides the names, so it also keeps a weight matmul no key names: of a MoE
  layer the router's logits [B, L, experts], which its custom spelling recomputes; of an MLA layer nothing more
  (the other presets lower to their spellings' programs on these models too: Remat.md)."""
  preset = _saved_names(layer, all_residuals=True, **overrides, remat_policy="minimal")
  spelled = _saved_names(layer, all_residuals=True, **overrides, remat_policy="custom", **_spelling("minimal"))
  for kept in extra:
    preset.remove(kept)
  assert preset == spelled


@pytest.mark.parametrize("sparse", [False, True], ids=["capacity", "sparse_matmul"])
@pytest.mark.parametrize("overrides, kept, kept_sparse", [
    # upstream's moe.py names each expert output both ways (wi_1 on its sparse_matmul path only moe_mlpwi_1),
    # so its presets that keep mlpwi_0/mlpwi_1/mlpwo keep the experts' too
    (dict(remat_policy="save_dot_except_mlpwi"), ["mlpwo"], ["mlpwo"]),
    (dict(remat_policy="minimal"), ["mlpwi_0", "mlpwi_1", "mlpwo"], ["mlpwi_0", "mlpwo"]),
    (dict(remat_policy="save_dot_except_mlp"), [], []),
    (dict(remat_policy="custom", mlpwi_1="device"), ["mlpwi_1"], []),
    (dict(remat_policy="custom", moe_mlpwi_1="device", mlpwo="device"), ["moe_mlpwi_1", "mlpwo"],
     ["moe_mlpwi_1", "mlpwo"]),
], ids=["save_dot_except_mlpwi", "minimal", "save_dot_except_mlp", "mlpwi_1", "moe_mlpwi_1+mlpwo"])
def test_moe_presets_and_keys_keep_the_expert_tensors_upstreams_do(sparse, overrides, kept, kept_sparse):
  names = [name for _, name in _saved_names("moe", sparse_matmul=sparse, **_MOE, **overrides)]
  assert names == (kept_sparse if sparse else kept)


def test_planner_keeps_of_a_sparse_matmul_moe_what_minimal_keeps():
  """Under minimal (and minimal_offloaded, on the host), the experts' input projections the planner counts
  per token and layer are those print_saved_residuals shows: sparse_matmul's wi_1, named only moe_mlpwi_1,
  is recomputed (the planner counted it kept)."""
  from MaxText.aot import plan_remat
  saved = _saved_names("moe", sparse_matmul=True, **_MOE, remat_policy="minimal")
  tokens = 2 * 8
  kept_in = sum(math.prod(int(d) for d in shape.split(",")) for shape, name in saved if name.startswith("mlpwi"))
  cfg = Config.for_testing(**{**_TINY, "base_num_kv_heads": 4}, sparse_matmul=True, **_MOE).model
  attention = plan_remat.kept_width(cfg, remat_policies.by_name("save_dot_except_mlp"), on_host=False)
  minimal = plan_remat.kept_width(cfg, remat_policies.by_name("minimal"), on_host=False)
  # besides wi_0 of the 2 chosen experts: their wo rows (2 x emb) and the router's logits (a dot, 4 experts)
  assert minimal - attention - 2 * cfg.emb_dim - 4 == kept_in / tokens == 2 * 128
  assert plan_remat.kept_width(cfg, remat_policies.by_name("minimal_offloaded"), on_host=True) == minimal


# ------------------------------------------------------------------ the planner prices placements

def _estimate(topology_name: str = "v5e-4", **overrides):
  """The planner's analytical estimate of exactly this config (tests/test_plan.analytic)."""
  from test_plan import analytic
  return analytic(topology_name, **dict(_PLAN_MODEL, **overrides))


_PLAN_MODEL = dict(base_emb_dim=1024, base_num_query_heads=8, base_num_kv_heads=4, head_dim=128, base_mlp_dim=4096,
                   base_num_decoder_layers=4, vocab_size=1024, max_target_length=2048, per_device_batch_size=2)


@pytest.mark.parametrize("name", ["save_qkv_proj", "minimal_offloaded"])
def test_planner_prices_a_preset_and_its_spelling_alike(name):
  preset, spelled = _estimate(remat_policy=name), _estimate(remat_policy="custom", **_spelling(name))
  assert spelled.activations == pytest.approx(preset.activations)
  assert spelled.host_activations == pytest.approx(preset.host_activations)
  assert spelled.step_s == pytest.approx(preset.step_s)


def test_planner_moves_each_offloaded_tensor_to_the_host():
  """Per token and layer: 2 bytes per element of each offloaded tensor, off HBM and onto the host."""
  tokens_layers = 2 * 2048 * 4  # sequences per chip x length x layers
  device = _estimate(remat_policy="custom", mlpwi_0="device", mlpwi_1="device", mlpwo="device")
  host = _estimate(remat_policy="custom", mlpwi_0="offload", mlpwi_1="offload", mlpwo="offload")
  moved = tokens_layers * 2 * (2 * 4096)  # mlpwo places nothing: only the residual add reads it
  assert host.host_activations == pytest.approx(moved)
  assert device.activations - host.activations == pytest.approx(moved)
  assert host.host_s > 0 == device.host_s
  stream = _estimate(remat_policy="custom", decoder_layer_input="offload")
  assert stream.host_activations == pytest.approx(tokens_layers * 2 * 1024)


def test_planner_searches_placements_beside_the_presets():
  from MaxText.aot import plan_search
  names = [f"custom:{n}" for n in remat_policies.SEARCHED_PLACEMENTS]
  assert set(names) <= set(plan_search.SEARCHED_REMAT)
  config = Config.for_testing(**_TINY)
  from MaxText.aot.plan_model import ModelShape
  from MaxText.platform import accelerators
  model = ModelShape.of(config.model, config.optim)
  policy_words = lambda c: {w for w in plan_search.describe(c, shown=("remat_policy",)).split()  # noqa: E731
                            if w.startswith("custom:") or w in remat_policies.NAMES}
  found = {w for c in plan_search.candidates(model, accelerators.tpu_topology("v5e-4"), 1, {"ici_tensor_parallelism": 1,
                                           "ici_sequence_parallelism": 1, "ici_fsdp_transpose_parallelism": 1,
                                           "ici_expert_parallelism": 1, "ici_pipeline_parallelism": 1,
                                           "optimizer_memory_host_offload": False, "gradient_accumulation_steps": 1},
                                           8, 32, rules=config.mesh.logical_axis_rules) for w in policy_words(c)}
  assert {"custom:attn_hbm_mlp_host", "custom:qkv_host", "custom:minimal_input_host", "full", "minimal"} <= found
  # A custom policy the user fixed keeps the user's placements.
  fixed = {"remat_policy": "custom", "query_proj": "offload", "ici_tensor_parallelism": 1}
  labels = {w for c in plan_search.candidates(model, accelerators.tpu_topology("v5e-4"), 1, fixed, 8, 32,
                                              rules=config.mesh.logical_axis_rules)
            for w in policy_words(c)}
  assert labels == {"custom:query_proj=offload"}


@pytest.mark.slow  # one AOT compile for v5e-4: one to three minutes on a loaded 2-core machine
def test_an_offloaded_placement_is_host_memory_and_host_transfers_in_the_tpu_compile(capsys):
  """What a placement offloads is in XLA's host memory space, at least what the planner counts
  (8 layers x 4 sequences x 512 tokens x q, k and v of 128 each, in bf16), and the step-time model
  prices its transfers."""
  from MaxText import train_compile
  from MaxText.aot import plan_remat
  from MaxText.configuration.config import BASE_CONFIG_PATH
  overrides = dict(base_emb_dim=256, base_num_query_heads=2, base_num_kv_heads=2, head_dim=64, base_mlp_dim=512,
                   base_num_decoder_layers=8, vocab_size=256, max_target_length=512, per_device_batch_size=4,
                   print_config=False, remat_policy="custom", query_proj="offload", key_proj="offload",
                   value_proj="offload", mlpwo="device")
  argv = [f"{k}={v}" for k, v in dict(overrides, compile_topology="v5e-4").items()]
  assert train_compile.main(["train_compile", str(BASE_CONFIG_PATH), *argv]) == 0
  out = capsys.readouterr().out
  host = re.search(r"^\s+host memory\s+([\d.]+) MiB", out, re.M)
  transfers = re.search(r"host transfers ([\d.]+) ms", out)
  assert host and transfers and float(transfers.group(1)) > 0, out
  model = Config.for_testing(**overrides).model
  counted = plan_remat.offloaded_activations(model, model.remat, 4 * 512)
  assert counted == 8 * 4 * 512 * 3 * 128 * 2
  assert counted <= float(host.group(1)) * 2**20 <= 2 * counted, out


def _fill_setup(model_overrides: dict, settings: dict, topology_name: str = "v5e-4"):
  """(the model's shape, the fill generator, the full-remat candidate, its estimate, the v5e-4 topology)."""
  from MaxText.aot import plan_model, plan_search
  from MaxText.layers.attention import select_kernel
  from MaxText.platform import accelerators
  config = Config.for_testing(**model_overrides)
  model = plan_model.ModelShape.of(config.model, config.optim)
  topology = accelerators.tpu_topology(topology_name)
  seq_len = config.data.max_target_length
  base = dict(settings, remat_policy="full")
  estimate = plan_model.estimate(model, base, topology, 1, seq_len, config.mesh.logical_axis_rules,
                                 select_kernel(config.model.attn.attention, "tpu", config.model))
  return model, plan_search.PlacementFill(model, seq_len), base, estimate, topology


_FILL_SETTINGS = dict(ici_fsdp_parallelism=4, per_device_batch_size=2, gradient_accumulation_steps=1,
                      optimizer_memory_host_offload=False)


def _room_for(names, model_overrides: dict, settings: dict) -> float:
  """The bytes per chip `names` take in HBM for `settings` (bf16, every layer)."""
  from MaxText.aot import plan_remat
  widths = plan_remat.tensor_widths(Config.for_testing(**model_overrides).model)
  tokens = settings["per_device_batch_size"] * model_overrides["max_target_length"]
  return sum(widths[n] for n in names) * tokens * 2 * model_overrides["base_num_decoder_layers"]


def _limit(estimate, room: float) -> float:
  """The HBM limit that leaves `room` bytes beside what the full-remat candidate holds."""
  return estimate.total - max(estimate.gradients, estimate.activations) + estimate.activations + room + 1.0


def test_the_planner_fills_free_memory_with_the_tensors_that_spare_the_most_recompute():
  """Device-only placements between the presets' steps: from the full-remat candidate, the tensors with the
  most re-run FLOPs per byte, as many as the free HBM holds; none without room; offloaded ones only where the
  host link beats the recompute."""
  model, fill, base, estimate, topology = _fill_setup(_PLAN_MODEL, _FILL_SETTINGS)
  per_byte = [spared / width for _, width, spared in fill.order]
  assert per_byte == sorted(per_byte, reverse=True)
  # The MLP's output projection spares nothing: no backward op needs it (the residual add passes gradients on).
  assert "mlpwo" not in [name for names, _, _ in fill.order for name in names]
  assert fill.variants(base, estimate, topology, _limit(estimate, 0.0), {}) == []
  (first,), (second,) = (names for names, _, _ in fill.order[:2])
  room = _room_for((first, second), _PLAN_MODEL, _FILL_SETTINGS)
  (placed,) = fill.variants(base, estimate, topology, _limit(estimate, room), {})
  keys = {k: v for k, v in placed.items() if k in remat_policies.TENSORS}
  assert keys == {first: "device", second: "device"} and placed["remat_policy"] == "custom"
  # Priced by the same model: more kept, less recompute, more HBM, nothing on the host.
  custom = _estimate(remat_policy="custom", **keys)
  assert custom.recompute_flops < estimate.recompute_flops and custom.host_activations == 0 == custom.host_s
  assert custom.activations - estimate.activations == pytest.approx(room)
  assert fill.variants(base, estimate, topology, _limit(estimate, room), {"remat_policy": "full"}) == []


def test_a_fast_host_link_adds_a_mixed_placement(monkeypatch):
  from MaxText.aot import plan_model
  model, fill, base, estimate, topology = _fill_setup(_PLAN_MODEL, _FILL_SETTINGS)
  (first,) = fill.order[0][0]
  room = _room_for((first,), _PLAN_MODEL, _FILL_SETTINGS)
  assert len(fill.variants(base, estimate, topology, _limit(estimate, room), {})) == 1  # v5e's link: never pays
  fast = plan_model.Links(ici=plan_model.LINKS["v5e"].ici, dcn=plan_model.LINKS["v5e"].dcn, host=1e18)
  monkeypatch.setitem(plan_model.LINKS, "v5e", fast)
  device, mixed = fill.variants(base, estimate, topology, _limit(estimate, room), {})
  assert {k: v for k, v in device.items() if k in remat_policies.TENSORS} == {first: "device"}
  assert {k: v for k, v in mixed.items() if k in remat_policies.TENSORS} == {
      first: "device", **{name: "offload" for names, _, _ in fill.order[1:] for name in names}}


def test_the_fill_keeps_mlas_key_and_value_together():
  """MLA's key_proj and value_proj split one up-projection, which neither spares alone: the fill orders them as
  one unit and keeps both or neither (alone they spare nothing, so the fill kept neither)."""
  mla = dict(_PLAN_MODEL, decoder_block="deepseek3", base_num_kv_heads=8, head_dim=192, attention_type="mla",
             q_lora_rank=512, kv_lora_rank=256, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
  _, fill, base, estimate, topology = _fill_setup(mla, _FILL_SETTINGS)
  units = [names for names, _, _ in fill.order]
  assert ("key_proj", "value_proj") in units and ("key_proj",) not in units and ("value_proj",) not in units
  before = units[:units.index(("key_proj", "value_proj")) + 1]
  placed = [{k for k, v in c.items() if k in remat_policies.TENSORS and v == "device"} for c in fill.variants(
      base, estimate, topology, _limit(estimate, _room_for([n for u in before for n in u], mla, _FILL_SETTINGS)), {})]
  assert {"key_proj", "value_proj"} <= placed[0]
  # with room for one of them only, the pair is left out
  room = _room_for([n for u in before[:-1] for n in u] + ["key_proj"], mla, _FILL_SETTINGS)
  placed = [{k for k, v in c.items() if k in remat_policies.TENSORS and v == "device"} for c in fill.variants(
      base, estimate, topology, _limit(estimate, room), {})]
  assert placed and all(not {"key_proj", "value_proj"} & p for p in placed)


# A model whose matmuls decide the compiled FLOPs; unscanned, so the cost analysis counts every layer.
_FLOPS_MODEL = dict(base_emb_dim=256, base_num_query_heads=4, base_num_kv_heads=4, head_dim=64, base_mlp_dim=1024,
                    base_num_decoder_layers=2, vocab_size=128, max_target_length=128, print_config=False,
                    scan_layers=False, attention="dot_product")


def _filled_but_last(fill: Any, base: Any, estimate: Any, topology: Any, model_overrides: dict[str, Any],
                     settings: dict[str, Any]) -> dict[str, str]:
  """The one placement the generator gives with room for every projection but out_proj (its last, at the
  same FLOPs per byte as the attention projections); with room for all six it gives none, as that is
  what minimal keeps (mlpwo places nothing in this pre-norm layer: only the residual add reads it)."""
  projections = [n for names, _, _ in fill.order for n in names if n != "context"]
  assert projections[-1] == "out_proj"
  assert {n: "device" for n in projections} in fill.presets
  assert fill.variants(base, estimate, topology, _limit(estimate, _room_for(projections, model_overrides,
                                                                             settings)), {}) == []
  room = _room_for(projections[:-1], model_overrides, settings)
  (placed,) = fill.variants(base, estimate, topology, _limit(estimate, room), {})
  keys = {k: v for k, v in placed.items() if k in remat_policies.TENSORS}
  assert keys == {n: "device" for n in ("query_proj", "key_proj", "value_proj", "mlpwi_0", "mlpwi_1")}
  return keys


@pytest.mark.slow  # two v5e-4 AOT compiles of a tiny unscanned model: a minute or two on a loaded 2-core machine
def test_a_tpu_compile_reruns_the_scores_with_query_and_key_kept():
  """Where a CPU compile of an unscanned dot_product model computes QK^T once for the forward and the backward
  with query_proj and key_proj kept (test_a_filled_placement_is_priced_like_its_compile), the v5e-4 compile
  computes it twice: with the QK-norm, keeping them drops only the norms' and RoPE's elementwise re-run, as
  the planner prices (no matmul spared, the scores re-run whatever is kept)."""
  from MaxText import train_compile
  from MaxText.aot import plan_remat
  from MaxText.configuration.config import BASE_CONFIG_PATH
  from MaxText.training import run_assembly
  model = dict(base_emb_dim=256, base_num_query_heads=4, base_num_kv_heads=4, head_dim=64, base_mlp_dim=512,
               base_num_decoder_layers=2, vocab_size=256, max_target_length=256, per_device_batch_size=1,
               print_config=False, scan_layers=False, attention="dot_product", use_qk_norm=True)
  kept = dict(query_proj="device", key_proj="device")

  def tpu_flops(**policy) -> float:
    argv = [f"{k}={v}" for k, v in dict(model, compile_topology="v5e-4", **policy).items()]
    config, devices, _ = train_compile.load_target_config(["train_compile", str(BASE_CONFIG_PATH), *argv])
    run = run_assembly.build_run(config, devices=devices, compiled_step=False)
    cost = run.train_step.lower(*run.abstract_inputs().as_args()).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])
  dropped = tpu_flops(remat_policy="full") - tpu_flops(remat_policy="custom", **kept)
  scores = 2 * 4 * 64 * 256 * 256 * 2  # one [L, L] QK^T per head and layer, one sequence per chip
  assert 0 < dropped < 0.1 * scores
  cfg = Config.for_testing(**model).model
  assert plan_remat.rerun_flops(cfg, remat_policies.by_name("full"), 256) == plan_remat.rerun_flops(
      cfg, remat_policies.custom(kept), 256)


@pytest.mark.slow  # three CPU compiles and two v5e-4 AOT compiles: about a minute on a loaded 2-core machine
def test_a_filled_placement_is_priced_like_its_compile():
  """The generator's placement with room for every projection but the last it orders (room for all of
  them spells minimal, a searched preset, which it does not repeat): the re-run FLOPs it spares are what
  the compiled step drops (CPU cost analysis), and its memory is within the planner's tolerance of the
  v5e-4 compile's heap (on test_plan's model, whose heap activations decide), with nothing on the host."""
  from MaxText import plan
  from MaxText.aot import plan_remat
  from test_plan import SMALL, analytic, argv, assert_in_heap_or_vmem
  settings = dict(_FILL_SETTINGS, per_device_batch_size=1)
  model, fill, base, estimate, topology = _fill_setup(_FLOPS_MODEL, settings)
  keys = _filled_but_last(fill, base, estimate, topology, _FLOPS_MODEL, settings)

  def compiled_flops(**overrides) -> float:
    run = Run(Config.for_testing(**_FLOPS_MODEL, per_device_batch_size=1, **overrides))
    cost = run.step_fn.lower(run.init(), next(run.data), run.rng).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])
  full, filled, none = (compiled_flops(remat_policy="full"), compiled_flops(remat_policy="custom", **keys),
                        compiled_flops(remat_policy="none"))
  cfg = Config.for_testing(**_FLOPS_MODEL).model
  rerun = lambda policy: plan_remat.rerun_flops(cfg, policy, 128)  # noqa: E731  (one sequence per device)
  spared = rerun(remat_policies.by_name("full")) - rerun(remat_policies.custom(keys))
  # With query_proj and key_proj both kept (the kernel's inputs), the backward's QK^T of this unscanned
  # dot_product model has the forward's operands, and XLA's CPU compile computes it once: [L, L] scores per head
  # and layer. The TPU compile the planner prices does not (test_a_tpu_compile_reruns_the_scores_...).
  merged_scores = 2 * cfg.num_query_heads * cfg.head_dim * 128 * 128 * cfg.num_decoder_layers
  assert full - filled == pytest.approx(spared + merged_scores, rel=0.03)
  assert filled > none  # the scores and the attention output are still re-run

  # The memory on test_plan's model whose heap its activations decide, with that model's fill.
  settings = dict(_FILL_SETTINGS, per_device_batch_size=4)
  model, fill, base, estimate, topology = _fill_setup(SMALL, settings)
  keys = _filled_but_last(fill, base, estimate, topology, SMALL, settings)
  overrides = dict(SMALL, remat_policy="custom", per_device_batch_size=4, **keys)
  priced = analytic("v5e-4", **overrides)
  heap = plan.compile_figures(argv(compile_topology="v5e-4", **overrides))
  assert heap["status"] == "compiled" and heap["host_bytes"] == 0 == priced.host_activations
  assert_in_heap_or_vmem(priced.total, heap)  # 2.04x the heap: VMEM holds the temporaries
