"""MLA's key/value down-projection (kv_wa_proj, kv_lora_rank + qk_rope_head_dim wide) as the planner prices it
against a v5e-4 AOT compile: the matmul keeping it spares, and the memory it holds."""

import pytest

from MaxText.configuration import remat_policies
from MaxText.configuration.config import BASE_CONFIG_PATH, Config

# 192 wide (128 + 64): not a multiple of the TPU's 128 lanes, as DeepSeek-V3's 576 (512 + 64) is not.
_MLA = dict(decoder_block="deepseek3", base_emb_dim=256, base_num_query_heads=4, base_num_kv_heads=4, head_dim=128,
            base_mlp_dim=512, vocab_size=256, print_config=False, attention="dot_product", attention_type="mla",
            q_lora_rank=96, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64)


def _tpu_compile(model: dict, **policy):
  from MaxText import train_compile
  from MaxText.training import run_assembly
  argv = [f"{k}={v}" for k, v in dict(model, compile_topology="v5e-4", **policy).items()]
  config, devices, _ = train_compile.load_target_config(["train_compile", str(BASE_CONFIG_PATH), *argv])
  run = run_assembly.build_run(config, devices=devices, compiled_step=False)
  return run.train_step.lower(*run.abstract_inputs().as_args()).compile()


def _flops(compiled) -> float:
  cost = compiled.cost_analysis()
  return float((cost[0] if isinstance(cost, list) else cost)["flops"])


@pytest.mark.slow  # four v5e-4 AOT compiles, two of an 8-layer model: about 5 minutes on a loaded 2-core machine
def test_kv_wa_proj_is_priced_as_the_tpu_compile_keeps_it():
  """Kept, kv_wa_proj spares its down-projection's re-run, as the planner prices it (within the norm's and RoPE's
  elementwise work); and it holds its own width in HBM: the heap with it kept, less the heap with mla_kv (the
  normed latent, 128 wide) kept, is the planner's difference of the two (every kept placement here also raises
  the heap by about 2 x emb_dim per token over full remat's, alike for both; getting_started/Remat.md)."""
  from MaxText.aot import plan_remat
  model = dict(_MLA, base_num_decoder_layers=2, max_target_length=256, per_device_batch_size=1, scan_layers=False)
  dropped = _flops(_tpu_compile(model, remat_policy="full")) - _flops(
      _tpu_compile(model, remat_policy="custom", kv_wa_proj="device"))
  cfg = Config.for_testing(**model).model
  spared = plan_remat.rerun_flops(cfg, remat_policies.by_name("full"), 256) - plan_remat.rerun_flops(
      cfg, remat_policies.custom({"kv_wa_proj": "device"}), 256)
  assert spared == 2 * 256 * 2 * 256 * (128 + 64)  # layers x tokens x 2 x emb_dim x width
  assert abs(dropped - spared) < 0.03 * spared, (dropped, spared)

  model = dict(_MLA, base_num_decoder_layers=8, max_target_length=512, per_device_batch_size=8)
  cfg = Config.for_testing(**model).model
  heap = {name: _tpu_compile(model, remat_policy="custom", **{name: "device"}).memory_analysis().temp_size_in_bytes
          for name in ("kv_wa_proj", "mla_kv")}
  tokens_layers = 8 * 512 * 8  # sequences per chip x length x layers
  planned = {name: plan_remat.kept_width(cfg, remat_policies.custom({name: "device"}), on_host=False) * 2 * tokens_layers
             for name in heap}
  assert planned["kv_wa_proj"] - planned["mla_kv"] == 64 * 2 * tokens_layers
  measured = heap["kv_wa_proj"] - heap["mla_kv"]
  assert abs(measured - (planned["kv_wa_proj"] - planned["mla_kv"])) < 0.05 * planned["kv_wa_proj"], (measured, planned)
