"""What images cost in training: the vision tower's throughput, and multimodal SFT beside text-only SFT of
the same language model, on the local devices.

    python3 benchmarks/multimodal_bench.py [steps=5] [batch=4] [max_target_length=512]
        [max_images_per_row=2] [published_tower=true]

The model is Gemma 3 (`gemma3-4b-vision`'s architecture: 5 local : 1 global layers, SigLIP tower, average-pooling
projector) at a size a CPU trains: a 6-layer text model of width 512 and a 6-layer tower of width 384 on 224 x 224
images in 14 x 14 patches, pooled to 64 soft tokens. Each row of the multimodal batch holds `max_images_per_row` images;
the text-only batch has the same tokens (the placeholders become ordinary tokens) and no tower. Printed:
- the tower (encoder and projector, forward only) in images/s, as the server and decode.py run it;
- the train step of each, in tokens/s (each figure the fastest of steps calls, alternating), and the share of the multimodal step the tower takes (the two steps'
  difference over the multimodal step: the tower's forward and backward);
- with published_tower=true, the published SigLIP-So400m tower at 896 x 896 (forward, one image at a time).
The last line is machine-readable: `RESULT images_per_s=... mm_tokens_per_s=... text_tokens_per_s=... tower_share=...`.
Figures: getting_started/Multimodal.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from MaxText.configuration import tool_args  # noqa: E402  (key=value arguments, the old --flags kept)
from benchmarks import bench_args  # noqa: E402

TEXT: dict[str, Any] = dict(base_emb_dim=512, base_num_query_heads=8, base_num_kv_heads=4, head_dim=64, base_mlp_dim=2048,
            base_num_decoder_layers=6, vocab_size=8192)
# The placeholders at the top of the small vocabulary.
TOKENS: dict[str, Any] = dict(image_token_id=8191, boi_token_id=8189, eoi_token_id=8190)
TOWER: dict[str, Any] = dict(vision_emb_dim=384, vision_mlp_dim=1536, vision_num_layers=6, vision_num_heads=6, vision_patch_size=14,
             vision_image_size=224, mm_tokens_per_image=64)


# The old names of options named after the config keys they set (the old --flags work with a warning).
RENAMED = {"length": "max_target_length", "images": "max_images_per_row"}


def fastest_call(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
  """Seconds of each of `fns` after a call that compiles it: the calls alternate, and each keeps its fastest, so
  that other load on the machine moves every figure alike and as little as it can."""
  import jax

  for fn in fns.values():
    jax.block_until_ready(fn())
  best = {name: float("inf") for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      best[name] = min(best[name], time.perf_counter() - start)
  return best


def image_rows(batch: int, length: int, images: int, run: list[int], rng: Any) -> Any:
  """[batch, length + 1] token rows, each with `images` copies of one image's token `run` among text."""
  import numpy as np

  rows = rng.integers(0, TOKENS["boi_token_id"], size=(batch, length + 1)).astype(np.int32)
  stride = (length + 1) // images
  if stride < len(run) + 1:
    raise SystemExit(f"max_target_length={length} is too short for {images} images of {len(run)} tokens each")
  for i in range(images):
    rows[:, i * stride + 1:i * stride + 1 + len(run)] = run
  return rows


def batch_of(rows: Any, pixels: Any | None, sharding: Any) -> dict[str, Any]:
  """The five token fields (one document per row, loss on every text target) and pixel_values."""
  import jax
  import numpy as np

  inputs, targets = rows[:, :-1], rows[:, 1:]
  ones = np.ones_like(inputs)
  weights = np.where(targets == TOKENS["image_token_id"], 0, ones).astype(np.int32)
  fields = dict(inputs=inputs, targets=targets, inputs_position=np.broadcast_to(np.arange(inputs.shape[1]), inputs.shape),
                inputs_segmentation=ones, targets_segmentation=weights)
  if pixels is not None:
    fields["pixel_values"] = pixels
  return {name: jax.device_put(np.ascontiguousarray(value), sharding) for name, value in fields.items()}


def train_step_call(config: Any, batch: dict[str, Any]) -> Callable[[], Any]:
  """One train step of `config`'s run on `batch` per call, from its own state."""
  import jax

  from MaxText.training.run_assembly import build_run

  run = build_run(config)
  holder, rng = [run.init_state(0)], jax.random.key(0)

  def one() -> Any:
    holder[0], metrics = run.train_step(holder[0], batch, rng)
    return metrics

  return one


def tower_call(config: Any, images: int) -> Callable[[], Any]:
  """The tower (encoder and projector) on `images` images per call."""
  import jax
  import numpy as np
  from flax import nnx

  from MaxText import models
  from MaxText.platform import sharding

  with nnx.use_eager_sharding(False):  # one device: no shardings to place
    model = models.Transformer(config.model, rngs=nnx.Rngs(params=0))
  graphdef, state = nnx.split(model)
  size = config.model.vision.vision_image_size
  pixels = np.random.default_rng(0).uniform(-1, 1, (images, 3, size, size)).astype(np.float32)
  embed = jax.jit(sharding.unsharded()(lambda s, p: nnx.merge(graphdef, s).image_embeddings(p)))
  return lambda: embed(state, pixels)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--batch", type=int, default=4, help="rows per step")
  parser.add_argument("--max_target_length", type=int, default=512)
  parser.add_argument("--max_images_per_row", type=int, default=2, help="images per row")
  parser.add_argument("--published_tower", action="store_true",
                      help="also time gemma3-4b-vision's own tower (SigLIP-So400m at 896 x 896) on one image")
  args = tool_args.parse_args(parser, None, renamed=RENAMED)
  for key in ("steps", "batch", "max_target_length", "max_images_per_row"):
    bench_args.at_least(key, getattr(args, key), 1)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  import jax
  import numpy as np

  from MaxText.configuration.config import Config

  common = dict(model_name="gemma3-4b-vision", **TEXT, **TOKENS, dtype="float32", remat_policy="none",
                per_device_batch_size=args.batch / jax.device_count(), max_target_length=args.max_target_length,
                objective="sft", dataset_type="hf", hf_data_files="unused.jsonl", tokenizer_type="huggingface",
                tokenizer_path="unused",
                eval_interval=-1, print_config=False)
  multimodal = Config.for_testing(**common, **TOWER, max_images_per_row=args.max_images_per_row)
  text = Config.for_testing(**{**common, "model_name": "gemma3-4b"})
  from MaxText import families
  from MaxText.families.image_format import PreparedImage

  vision, size = multimodal.model.vision, multimodal.model.vision.vision_image_size
  image_format = families.family_for_decoder_block(multimodal.model.decoder_block).image_format
  assert image_format is not None
  one_view = PreparedImage(np.zeros((1, 3, size, size), np.float32))  # an image of one view, as the model's format writes it
  run = image_format.run_ids(vision, one_view, multimodal.model.vocab_size)
  rng = np.random.default_rng(0)
  rows = image_rows(args.batch, args.max_target_length, args.max_images_per_row, run, rng)
  pixels = rng.uniform(-1, 1, (args.batch, args.max_images_per_row, 3, size, size)).astype(np.float32)

  from MaxText.training.run_assembly import build_run

  sharding = build_run(text).batch_sharding
  tower_images = args.batch * args.max_images_per_row
  seconds = fastest_call({"tower": tower_call(multimodal, tower_images),
                          "multimodal": train_step_call(multimodal, batch_of(rows, pixels, sharding)),
                          "text": train_step_call(text, batch_of(rows, None, sharding))}, args.steps)
  tower_s, mm_s, text_s = seconds["tower"], seconds["multimodal"], seconds["text"]
  tokens = args.batch * args.max_target_length
  share = max(mm_s - text_s, 0.0) / mm_s
  print(f"devices: {jax.device_count()} {jax.devices()[0].platform}; batch {args.batch} x {args.max_target_length} tokens, "
        f"{args.max_images_per_row} images of {size} x {size} per row "
        f"({args.max_images_per_row * len(run)} image tokens)")
  print(f"tower (forward): {tower_images / tower_s:.1f} images/s ({1e3 * tower_s / tower_images:.1f} ms per image)")
  print(f"multimodal SFT step: {mm_s:.3f} s, {tokens / mm_s:,.0f} tokens/s")
  print(f"text-only SFT step:  {text_s:.3f} s, {tokens / text_s:,.0f} tokens/s")
  print(f"the tower's share of the multimodal step: {share:.1%}")
  if args.published_tower:
    published = Config.for_testing(model_name="gemma3-4b-vision", base_num_decoder_layers=6, dtype="float32",
                                   per_device_batch_size=1 / jax.device_count(), max_target_length=512,
                                   print_config=False)
    one_image = fastest_call({"published": tower_call(published, 1)}, 1)["published"]
    vision = published.model.vision
    print(f"published tower (SigLIP-So400m, {vision.vision_image_size} x {vision.vision_image_size}, forward): "
          f"{one_image:.2f} s per image")
  print(f"RESULT images_per_s={tower_images / tower_s:.2f} mm_tokens_per_s={tokens / mm_s:.1f} "
        f"text_tokens_per_s={tokens / text_s:.1f} tower_share={share:.3f}")


if __name__ == "__main__":
  bench_args.run(main)
