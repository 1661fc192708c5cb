"""The step-time model's GPU row (MaxText/aot/step_time/gpu.py): a compiled GPU module priced at the
roofline. The module below is written in the GPU compiler's format (cuBLAS and cuBLASLt calls with
their dot dimension numbers, cuDNN attention with its score shape and mask, a scanned loop)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from MaxText.aot.step_time import gpu
from MaxText.errors import UserError

GEMM_CFG = ('backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
            '"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}')
FMHA_CFG = ('backend_config={"cudnn_fmha_backend_config":{"intermediate_tensor_shape":{"element_type":"BF16",'
            '"dimensions":["2","8","1024","1024"],"tuple_shapes":[]},"mask_type":"CAUSAL"}}')
MODULE = f"""HloModule jit_train_step

%body (p: (s32[], bf16[4,1024,1024], bf16[512,1024])) -> (s32[], bf16[4,1024,1024], bf16[512,1024]) {{
  %p = (s32[], bf16[4,1024,1024]{{2,1,0}}, bf16[512,1024]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %stack = bf16[4,1024,1024]{{2,1,0}} get-tuple-element(%p), index=1
  %h = bf16[512,1024]{{1,0}} get-tuple-element(%p), index=2
  %w = bf16[1024,1024]{{1,0}} fusion(%stack, %i), kind=kLoop, calls=%slice_layer
  %mm = (bf16[512,1024]{{1,0}}, s8[4194304]{{0}}) custom-call(%h, %w), custom_call_target="__cublas$gemm", {GEMM_CFG}
  %out = bf16[512,1024]{{1,0}} get-tuple-element(%mm), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[4,1024,1024]{{2,1,0}}, bf16[512,1024]{{1,0}}) tuple(%next, %stack, %out)
}}

%slice_layer (s: bf16[4,1024,1024], j: s32[]) -> bf16[1024,1024] {{
  %s = bf16[4,1024,1024]{{2,1,0}} parameter(0)
  %j = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = bf16[1,1024,1024]{{2,1,0}} dynamic-slice(%s, %j, %z, %z), dynamic_slice_sizes={{1,1024,1024}}
  ROOT %b = bf16[1024,1024]{{1,0}} bitcast(%ds)
}}

%cond (c: (s32[], bf16[4,1024,1024], bf16[512,1024])) -> pred[] {{
  %c = (s32[], bf16[4,1024,1024]{{2,1,0}}, bf16[512,1024]{{1,0}}) parameter(0)
  %k = s32[] get-tuple-element(%c), index=0
  %lim = s32[] constant(4)
  ROOT %lt = pred[] compare(%k, %lim), direction=LT
}}

ENTRY %main (stack: bf16[4,1024,1024], x: bf16[512,1024], q: bf16[2,1024,8,64], k: bf16[2,1024,8,64], v: bf16[2,1024,8,64], a8: f8e4m3fn[256,512], b8: f8e4m3fn[512,128], sa: f32[], sb: f32[]) -> bf16[512,1024] {{
  %stack = bf16[4,1024,1024]{{2,1,0}} parameter(0)
  %x = bf16[512,1024]{{1,0}} parameter(1)
  %q = bf16[2,1024,8,64]{{3,2,1,0}} parameter(2)
  %k = bf16[2,1024,8,64]{{3,2,1,0}} parameter(3)
  %v = bf16[2,1024,8,64]{{3,2,1,0}} parameter(4)
  %a8 = f8e4m3fn[256,512]{{1,0}} parameter(5)
  %b8 = f8e4m3fn[512,128]{{1,0}} parameter(6)
  %sa = f32[] parameter(7)
  %sb = f32[] parameter(8)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[4,1024,1024]{{2,1,0}}, bf16[512,1024]{{1,0}}) tuple(%zero, %stack, %x)
  %loop = (s32[], bf16[4,1024,1024]{{2,1,0}}, bf16[512,1024]{{1,0}}) while(%init), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"4"}}}}
  %fwd = (bf16[2,1024,8,64]{{3,2,1,0}}, f32[2,8,1024]{{2,1,0}}, u8[0]{{0}}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", {FMHA_CFG}
  %bwd = (bf16[2,1024,8,64]{{3,2,1,0}}, bf16[2,1024,8,64]{{3,2,1,0}}, bf16[2,1024,8,64]{{3,2,1,0}}, u8[0]{{0}}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmaxBackward", {FMHA_CFG}
  %f8 = (bf16[256,128]{{1,0}}, s8[1024]{{0}}) custom-call(%a8, %b8, %sa, %sb), custom_call_target="__cublas$lt$matmul$f8", {GEMM_CFG}
  ROOT %h = bf16[512,1024]{{1,0}} get-tuple-element(%loop), index=2
}}
"""

H200 = gpu.GPU_CHIPS["nvidia h200"]


def test_each_kernel_is_priced_at_its_roofline():
  est = gpu.estimate(MODULE, "NVIDIA H200")
  layer_gemm = 2.0 * 512 * 1024 * 1024
  per_matmul = 2.0 * 2 * 8 * 1024 * 1024 * 64
  attention = (2 + 5) * per_matmul * 0.5  # forward 2 matmuls, backward 5, causal halves both
  fp8_gemm = 2.0 * 256 * 128 * 512
  assert est.flops == pytest.approx(4 * layer_gemm + attention + fp8_gemm)
  # The loop's GEMM runs 4 times; each is compute-bound on an H200 at 512 x 1024 x 1024.
  gemm_bytes = 4 * (512 * 1024 * 2 + 1024 * 1024 * 2 + 512 * 1024 * 2) + (256 * 512 + 512 * 128 + 8 + 256 * 128 * 2)
  expected_gemm = 4 * max(layer_gemm / H200.peak_bf16, (512 * 1024 * 2 * 2 + 1024 * 1024 * 2) / H200.hbm) + \
      max(fp8_gemm / H200.peak_fp8, (256 * 512 + 512 * 128 + 8 + 256 * 128 * 2) / H200.hbm)
  assert est.seconds["gemm"] == pytest.approx(expected_gemm)
  assert est.seconds["attention"] == pytest.approx(attention / H200.peak_bf16)
  # The layer slice reads one layer of the stack per trip, not the whole stack.
  assert est.seconds["elementwise"] == pytest.approx(4 * 2 * 1024 * 1024 * 2 / H200.hbm, rel=1e-4)  # + scalars
  qkv = 2 * 1024 * 8 * 64 * 2
  attention_bytes = (3 * qkv + qkv + 2 * 8 * 1024 * 4) + (3 * qkv + 3 * qkv)  # cuDNN's workspace not counted
  slices = 4 * 2 * 1024 * 1024 * 2
  assert est.hbm_bytes == pytest.approx(gemm_bytes + attention_bytes + slices, rel=1e-4)
  assert est.kernels == 4 * 3 + 3 and est.collectives == 0  # per trip: slice, GEMM, the counter's add


def test_fp8_gemm_uses_the_fp8_peak_and_a_gpu_without_one_the_bf16_peak():
  fp8_only = gpu.estimate(MODULE, "NVIDIA H100 80GB HBM3").seconds["gemm"]
  on_a100 = gpu.estimate(MODULE, "NVIDIA A100-SXM4-80GB")
  assert on_a100.flops == gpu.estimate(MODULE, "NVIDIA H200").flops
  assert fp8_only < on_a100.seconds["gemm"]


def test_a_real_compiled_scan_counts_every_trip_and_reads_a_layer_per_trip():
  def loss(w: jax.Array, x: jax.Array) -> jax.Array:
    def layer(h: jax.Array, w_l: jax.Array) -> tuple[jax.Array, None]:
      return jnp.tanh(h @ w_l), None
    return jax.lax.scan(layer, x, w)[0].sum()

  w, x = jnp.ones((6, 256, 256), jnp.float32), jnp.ones((64, 256), jnp.float32)
  text = jax.jit(jax.grad(loss)).lower(w, x).compile().as_text()
  est = gpu.estimate(text, "NVIDIA H200")
  assert est.flops == pytest.approx(3 * 6 * 2 * 64 * 256 * 256)  # forward, and two matmuls per layer backward
  # Far below re-reading the 1.5 MB stack in every one of the 12 trips' slices and updates.
  assert est.hbm_bytes < 12 * 2 * 6 * 256 * 256 * 4


def test_unknown_gpu_is_one_line():
  with pytest.raises(UserError, match="no published figures for 'NVIDIA B200'.*step_time/gpu.py"):
    gpu.estimate(MODULE, "NVIDIA B200")
