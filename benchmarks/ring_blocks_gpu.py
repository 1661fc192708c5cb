"""The ring's cuDNN pair kernel on one GPU: correctness against the chunked JAX kernel, and time.

Checks (each prints CHECK <name> ok|FAIL <max error>; the exit status is 1 if any fails):
- every kind of chunk pair (above the diagonal, on it, below it, beyond a window) forward: output
  and log-sum-exp; backward with global statistics (two pairs merged): dQ, dK, dV;
- the whole ring, and all_gather, on a one-device mesh with load balancing (its two chunks give a
  diagonal, a full and a skipped pair) against dense attention, values and gradients;
- all_to_all's full-sequence cuDNN kernel (attention_kernels.cudnn_flash_attention) against dense.
Then times one pair's forward + backward with each kernel, and one whole causal sequence in one
cuDNN call against the ring's pairs on one device (TIME lines).

  python3 benchmarks/ring_blocks_gpu.py            # on a GPU
  python3 benchmarks/ring_blocks_gpu.py kernel=chunked small=true   # the script itself, on CPU
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.configuration import tool_args
from benchmarks import bench_args
from MaxText.layers import attention, attention_kernels, masks, ring_attention, ring_blocks

FAILED: list[str] = []


def check(name: str, got, want, tol: float) -> None:
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  err = float(np.max(np.abs(got - want))) if got.size else 0.0
  scale = float(np.max(np.abs(want))) if want.size else 1.0
  ok = np.all(np.isfinite(got)) and err <= tol * max(scale, 1.0)
  print(f"CHECK {name} {'ok' if ok else 'FAIL'} max_err={err:.3e} scale={scale:.3e}", flush=True)
  if not ok:
    FAILED.append(name)


def inputs(batch, length, heads, kv_heads, head_dim, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (batch, length, kv_heads, heads // kv_heads, head_dim)) / np.sqrt(head_dim)
  k = jax.random.normal(keys[1], (batch, length, kv_heads, head_dim))
  v = jax.random.normal(keys[2], (batch, length, kv_heads, head_dim))
  do = jax.random.normal(keys[3], q.shape)
  return tuple(x.astype(dtype) for x in (q, k, v, do))


def segments(batch, length):
  """Documents crossing chunk boundaries and a padding tail (segment 0) on the first row."""
  pos = np.arange(length)
  first = np.where(pos < length * 3 // 8, 1, np.where(pos < length * 7 // 8, 2, 0))
  rows = [first] + [np.full(length, 3)] * (batch - 1)
  return jnp.asarray(np.stack(rows), jnp.int32)


def pair_checks(kernel, chunk, window, dtype, tol):
  ref = ring_blocks.ChunkedBlocks(0.0, 64, 64)
  q, k, v, do = inputs(2, chunk, 8, 4, 64, dtype)
  k2, v2 = inputs(2, chunk, 8, 4, 64, dtype, seed=1)[1:3]
  seg = segments(2, chunk)
  f32 = lambda *xs: tuple(x.astype(jnp.float32) for x in xs)  # noqa: E731
  win = masks.window_scalar(window)
  tag = f"window={window}"
  for m in (-1, 0, 1, 2, 3):
    offset = jnp.int32(m * chunk)
    out, lse = jax.jit(kernel.forward)(q, k, v, seg, seg, win, offset)
    r_out, r_lse = ref.forward(*f32(q, k, v), seg, seg, win, offset)
    seen = np.asarray(jnp.isfinite(r_lse))
    rows = np.moveaxis(seen, 3, 1)[..., None]  # a row that sees nothing has lse -inf; its output is ignored
    check(f"pair_forward_out m={m} {tag}", np.where(rows, out, 0), np.where(rows, r_out, 0), tol)
    check(f"pair_forward_lse m={m} {tag}", np.where(seen, lse, 0), np.where(seen, r_lse, 0), tol)
    check(f"pair_forward_unseen_rows m={m} {tag}", np.isfinite(np.asarray(lse)), seen, 0)
    # Global statistics: this pair merged with a diagonal pair over another key chunk.
    g_out, g_lse = ring_attention.merge(ref.forward(*f32(q, k2, v2), seg, seg, win, jnp.int32(0)), (r_out, r_lse))
    g_lse = jnp.where(jnp.isfinite(g_lse), g_lse, jnp.inf)
    delta = jnp.einsum("blkgh,blkgh->bkgl", do.astype(jnp.float32), g_out)
    got = jax.jit(kernel.backward)(q, k, v, seg, seg, win, offset, do, g_out.astype(dtype), g_lse, delta)
    want = ref.backward(*f32(q, k, v), seg, seg, win, offset, do.astype(jnp.float32), g_out, g_lse, delta)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
      check(f"pair_backward_{name} m={m} {tag}", a, b, tol)


def one_device(strategy: str, kernel, window, balanced: bool = True):
  """(q, k, v, seg) -> out: the ring or all_gather strategy on a one-device mesh (balanced: the
  shard's two chunks give a diagonal, a full and a skipped pair)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("sequence",))
  spec = jax.sharding.PartitionSpec(None, "sequence")
  run = ring_attention.ring_shard if strategy == "ring" else ring_attention.gathered_shard

  def attend(q, k, v, seg):
    return jax.shard_map(lambda q, k, v, s: run(q, k, v, s, window, ("sequence",), 1, balanced, kernel),
                         mesh=mesh, in_specs=(spec, spec, spec, spec), out_specs=spec, check_vma=False)(q, k, v, seg)
  return attend


def ring_check(kernel_for, length, window, dtype, tol, strategy="ring"):
  """The ring (or all_gather) on a one-device mesh against dense attention."""
  q, k, v, _ = inputs(2, length, 8, 4, 64, dtype, seed=2)
  q = q.reshape(2, length, 8, 64)
  seg = segments(2, length)
  attend = one_device(strategy, kernel_for(length // 2), window)

  def ring(q, k, v):
    return attend(q, k, v, seg)

  def dense(q, k, v):
    return attention.dot_product_attention(q, k, v, seg, window)

  weights = jnp.arange(1.0, length + 1)[None, :, None, None]
  loss = lambda fn, *a: jnp.sum(jnp.sin(fn(*a).astype(jnp.float32)) * weights)  # noqa: E731
  out = jax.jit(ring)(q, k, v)
  grads = jax.jit(jax.grad(functools.partial(loss, ring), argnums=(0, 1, 2)))(q, k, v)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  r_out = dense(*f32)
  r_grads = jax.grad(functools.partial(loss, dense), argnums=(0, 1, 2))(*f32)
  valid = np.asarray(seg > 0)[:, :, None, None]
  check(f"{strategy}_out window={window}", np.where(valid, out, 0), np.where(valid, r_out, 0), tol)
  for name, a, b in zip(("dq", "dk", "dv"), grads, r_grads):
    check(f"{strategy}_{name} window={window}", a, b, tol * 4)


def all_to_all_kernel_check(dtype, tol):
  q, k, v, _ = inputs(2, 512, 8, 4, 64, dtype, seed=3)
  q = q.reshape(2, 512, 8, 64)
  seg = segments(2, 512)
  out = jax.jit(functools.partial(attention_kernels.cudnn_flash_attention, window_size=100))(q, k, v, seg)
  ref = attention.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)), seg, 100)
  valid = np.asarray(seg > 0)[:, :, None, None]
  check("all_to_all_cudnn_full_sequence", np.where(valid, out, 0), np.where(valid, ref, 0), tol)


def milliseconds(step, args: tuple, repeats: int) -> float:
  """Mean wall time of a jitted step after one warm-up call (compile)."""
  jax.block_until_ready(step(*args))
  start = time.perf_counter()
  for _ in range(repeats):
    result = step(*args)
  jax.block_until_ready(result)
  return (time.perf_counter() - start) / repeats * 1e3


def timing(kernels: dict, chunk: int, heads: int, kv_heads: int, head_dim: int, dtype, repeats: int = 10):
  q, k, v, do = inputs(1, chunk, heads, kv_heads, head_dim, dtype)
  seg = jnp.ones((1, chunk), jnp.int32)
  win = masks.window_scalar(None)
  for name, kernel in kernels.items():
    for kind, m in (("diagonal", 0), ("full", 1)):
      offset = jnp.int32(m * chunk)

      @jax.jit
      def step(q, k, v, do):
        out, lse = kernel.forward(q, k, v, seg, seg, win, offset)
        delta = jnp.einsum("blkgh,blkgh->bkgl", do.astype(jnp.float32), out)
        grads = kernel.backward(q, k, v, seg, seg, win, offset, do, out.astype(dtype), lse, delta)
        return out, grads

      ms = milliseconds(step, (q, k, v, do), repeats)
      causal = 0.5 if kind == "diagonal" else 1.0
      flops = 4 * chunk * chunk * heads * head_dim * causal * 3.5  # forward 2 matmuls, backward 5 (dQ, dK, dV, dP, S)
      print(f"TIME kernel={name} pair={kind} chunk={chunk} heads={heads}/{kv_heads} head_dim={head_dim} "
            f"fwd+bwd_ms={ms:.2f} tflops={flops / ms / 1e9:.1f}", flush=True)


def sequence_timing(kernels: dict, length: int, dtype, repeats: int = 5):
  """Causal attention of one whole sequence, forward + backward: cuDNN in one call
  (attention_kernels.cudnn_flash_attention) against the ring's pairs on one device (balanced:
  two chunks, three pairs that compute), i.e. what cutting the sequence into pairs costs."""
  heads, kv_heads, head_dim = 32, 8, 128
  q, k, v, _ = inputs(1, length, heads, kv_heads, head_dim, dtype)
  q = q.reshape(1, length, heads, head_dim)
  seg = jnp.ones((1, length), jnp.int32)
  runs = {"whole sequence, cuDNN": lambda q, k, v: attention_kernels.cudnn_flash_attention(q, k, v, seg)}
  for name, kernel in kernels.items():
    runs[f"ring pairs, {name}"] = functools.partial(one_device("ring", kernel, None), seg=seg)
  for name, fn in runs.items():
    step = jax.jit(jax.value_and_grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32)),
                                      argnums=(0, 1, 2)))
    ms = milliseconds(step, (q, k, v), repeats)
    flops = 4 * length * length * heads * head_dim * 0.5 * 3.5
    print(f"TIME sequence={length} {name}: fwd+bwd_ms={ms:.2f} tflops={flops / ms / 1e9:.1f}", flush=True)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kernel", choices=("cudnn", "chunked"), default="cudnn")
  parser.add_argument("--small", action="store_true", help="short chunks and no timing (a CPU dry run)")
  args = tool_args.parse_args(parser, argv)
  print(f"devices: {jax.devices()}  jax {jax.__version__}", flush=True)
  dtype = jnp.bfloat16 if args.kernel == "cudnn" else jnp.float32
  tol = 3e-2 if dtype == jnp.bfloat16 else 1e-4
  chunk = 128 if args.small else 256
  for window in (None, 100, 300):
    kernel = ring_blocks.CudnnBlocks(window) if args.kernel == "cudnn" else ring_blocks.ChunkedBlocks(0.0, 32, 32)
    pair_checks(kernel, chunk, window, dtype, tol)
    make = ((lambda c: ring_blocks.CudnnBlocks(window)) if args.kernel == "cudnn"
            else (lambda c: ring_blocks.ChunkedBlocks(0.0, 32, 32)))
    ring_check(make, 2 * chunk, window, dtype, tol)
    ring_check(make, 2 * chunk, window, dtype, tol, strategy="all_gather")
  if args.kernel == "cudnn":
    all_to_all_kernel_check(dtype, tol)
  if not args.small:
    kernels = {"chunked": ring_blocks.ChunkedBlocks(0.0, 512, 512)}
    if args.kernel == "cudnn":
      kernels["cudnn"] = ring_blocks.CudnnBlocks(None)
    for chunk in (4096, 8192):
      timing(kernels, chunk, 32, 8, 128, jnp.bfloat16)
    if args.kernel == "cudnn":
      for length in (16384, 32768):
        sequence_timing({"cudnn": ring_blocks.CudnnBlocks(None), "chunked": ring_blocks.ChunkedBlocks(0.0, 512, 512)},
                        length, jnp.bfloat16)
  print(f"RESULT failed={len(FAILED)} {' | '.join(FAILED)}", flush=True)
  return 1 if FAILED else 0


if __name__ == "__main__":
  bench_args.run(main, with_argv=True)
