"""Decoding a vision-language model (Gemma 3 with its vision tower) with images in the prompt, on
the tiny random model of tests/hf_families.py converted through the tensor table: greedy tokens of
the dense engine equal the no-cache forward pass and HF `generate`; the paged cache, chunked
prefill (chunks end before an image they cannot hold) and prefix caching (pages keyed by the
image's content) give the same tokens; two prompts with the same text and different images share
no page and answer differently; prompts with images admitted together share prefill calls."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.errors import UserError
from MaxText.inference import image_prompts
from MaxText.inference.engine import Engine, Request, serve
from MaxText.platform import sharding
from decode_test_utils import one_device_mesh
from test_paged_cache import _scheduled_outputs

NEW_TOKENS, TARGET, PREFILL = 6, 64, 48
BOI, EOI, IMAGE, PER_IMAGE = 120, 121, 122, 16


@pytest.fixture(scope="module")
def hf():
  pytest.importorskip("torch", reason="needs torch (EXTRAS=test bash setup.sh)")
  pytest.importorskip("transformers", reason="needs transformers (EXTRAS=test bash setup.sh)")
  import hf_families
  return hf_families


@pytest.fixture(scope="module")
def reference(hf, tmp_path_factory):
  model = hf.build_hf_multimodal_model("gemma3-vision")
  config = config_for(hf, model)
  return model, hf.our_params(model, config, tmp_path_factory.mktemp("staging"))


def config_for(hf, model, **overrides):
  return hf.our_config(model, dtype="float32", max_target_length=TARGET, max_prefill_predict_length=PREFILL,
                       **overrides)


def image_prompt(text_before: list[int], text_after: list[int], num_images: int = 1) -> list[int]:
  run = [BOI] + [IMAGE] * PER_IMAGE + [EOI]
  return text_before + run * num_images + text_after


def pixels(seed: int, count: int = 1) -> image_prompts.PromptImages:
  rng = np.random.default_rng(seed)
  return image_prompts.PromptImages.of(rng.uniform(-1, 1, size=(count, 3, 64, 64)).astype(np.float32))


PROMPTS = [image_prompt([2, 5, 17], [9, 33, 42]), image_prompt([2, 7], [11, 3, 8, 14, 6], num_images=2)]
IMAGES = [pixels(1), pixels(2, 2)]


def hf_greedy(hf, model, prompt: list[int], images: image_prompts.PromptImages, num_new: int) -> list[int]:
  ids = hf.torch.tensor([prompt])
  with hf.torch.no_grad():
    out = model.generate(ids, pixel_values=hf.torch.tensor(images.pixels_MCRR),
                         token_type_ids=(ids == IMAGE).long(), max_new_tokens=num_new, min_new_tokens=num_new,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
  return out[0, len(prompt):].tolist()


def uncached_greedy(engine: Engine, params, prompt: list[int], images: image_prompts.PromptImages,
                    num_new: int) -> list[int]:
  """The full forward pass over a fixed [1, TARGET] buffer each step (one compiled program)."""
  buffer = np.zeros((1, TARGET), np.int32)
  buffer[0, :len(prompt)] = prompt
  pixel_values = jnp.asarray(images.pixels_MCRR[None])
  apply = jax.jit(sharding.unsharded()(engine.spec.apply))
  out = []
  for step in range(num_new):
    last = len(prompt) + step - 1
    logits = apply(params, jnp.asarray(buffer), jnp.arange(TARGET)[None], jnp.ones((1, TARGET), jnp.int32), None,
                   pixel_values)
    out.append(int(jnp.argmax(logits[0, last])))
    buffer[0, last + 1] = out[-1]
  return out


def engine_greedy(engine: Engine, params, prompts, images) -> list[list[int]]:
  requests = [Request(list(p), NEW_TOKENS, images=i) for p, i in zip(prompts, images)]
  return [r.output for r in serve(engine, params, requests)]


def test_dense_greedy_with_images_equals_no_cache_and_hf(hf, reference):
  model, params = reference
  engine = Engine(config_for(hf, model), num_slots=2, mesh=one_device_mesh())
  got = engine_greedy(engine, params, PROMPTS, IMAGES)
  for prompt, images, ours in zip(PROMPTS, IMAGES, got):
    assert ours == hf_greedy(hf, model, prompt, images, NEW_TOKENS)
    assert ours == uncached_greedy(engine, params, prompt, images, NEW_TOKENS)
  assert got[0] != engine_greedy(engine, params, PROMPTS[:1], [pixels(7)])[0]  # the image matters


@pytest.mark.parametrize("overrides", [
    dict(kv_cache_layout="paged", kv_page_size=4, prefix_caching=False),
    pytest.param(dict(kv_cache_layout="paged", kv_page_size=4, prefix_caching=False, prefill_chunk_size=PER_IMAGE + 2),
                 marks=pytest.mark.slow),
    dict(kv_cache_layout="paged", kv_page_size=4, prefix_caching=True),
], ids=["paged", "chunked", "prefix-cached"])
def test_paged_chunked_and_prefix_cached_prefill_give_the_dense_tokens(hf, reference, overrides):
  """Chunks of 18 over prompts whose images start at 3 and 2: each chunk ends before an image run
  it would split, so every chunk holds whole images (or none)."""
  model, params = reference
  dense = engine_greedy(Engine(config_for(hf, model), num_slots=2, mesh=one_device_mesh()), params, PROMPTS, IMAGES)
  engine = Engine(config_for(hf, model, **overrides), num_slots=2, mesh=one_device_mesh())
  jobs = _scheduled_jobs(engine, params, PROMPTS, IMAGES)
  assert jobs == dense


def _scheduled_jobs(engine, params, prompts, images, loads=None):
  from MaxText.inference import scheduler as sched

  original = sched.Job.__init__
  queue = list(images)

  def with_images(self, *args, **kwargs):  # _scheduled_outputs builds text jobs: give each its images
    original(self, *args, **kwargs)
    self.images = queue.pop(0)

  sched.Job.__init__ = with_images  # type: ignore[method-assign]
  try:
    return _scheduled_outputs(engine, params, prompts, [NEW_TOKENS] * len(prompts), loads=loads)
  finally:
    sched.Job.__init__ = original  # type: ignore[method-assign]


@pytest.mark.parametrize("overrides,together_calls,one_each_calls", [
    (dict(prefix_caching=True), 1, 2),
    # A budget of 96: two rows of 48 tokens, which hold each prompt whole (24 and 43 tokens).
    pytest.param(dict(prefix_caching=False, prefill_chunk_size=96), 1, 2, marks=pytest.mark.slow)],
    ids=["prefix-cached", "chunked"])
def test_image_prompts_admitted_together_share_prefill_calls(hf, reference, overrides, together_calls, one_each_calls):
  """Prompts with different numbers of images are prefilled into pages as the rows of one call
  (their images padded to the most of a row), each getting the tokens it gets alone."""
  model, params = reference
  engine = Engine(config_for(hf, model, kv_cache_layout="paged", kv_page_size=4, **overrides), num_slots=2,
                  mesh=one_device_mesh())
  calls = {"prefills": 0}
  for name in ("_extend", "_extend_rows"):
    def counted(*args, _jitted=getattr(engine.page_prefill, name), **kwargs):
      calls["prefills"] += 1
      return _jitted(*args, **kwargs)
    setattr(engine.page_prefill, name, counted)
  alone = [_scheduled_jobs(engine, params, [prompt], [images])[0] for prompt, images in zip(PROMPTS, IMAGES)]
  alone_calls, calls["prefills"] = calls["prefills"], 0
  assert _scheduled_jobs(engine, params, PROMPTS, IMAGES) == alone
  assert (calls["prefills"], alone_calls) == (together_calls, one_each_calls)


def test_prefix_caching_keys_image_pages_by_the_image(hf, reference):
  """The same text with a different image shares only the pages before the image and answers
  differently; the same image again shares its pages too."""
  model, params = reference
  engine = Engine(config_for(hf, model, kv_cache_layout="paged", kv_page_size=4, kv_num_pages=32, prefix_caching=True),
                  num_slots=1, mesh=one_device_mesh())
  prompt = image_prompt([2, 5, 17, 40, 41, 42, 43, 44], [9, 33, 42])  # the image's run starts on page 2
  loads: list = []
  first, other, again = _scheduled_jobs(engine, params, [prompt] * 3, [pixels(1), pixels(3), pixels(1)], loads)
  # One slot: the requests run one after another. The second finds the two text pages before the
  # image's first page, the third every full page of the first.
  assert loads[0]["prefix_cached_tokens"] == 8 + (len(prompt) - 1) // 4 * 4
  assert other != first and again == first
  assert other == engine_greedy(Engine(config_for(hf, model), mesh=one_device_mesh()), params, [prompt], [pixels(3)])[0]


def test_chunks_smaller_than_an_image_and_mismatched_images_are_user_errors(hf, reference):
  model, params = reference
  with pytest.raises(UserError, match="prefill_chunk_size=8 is less than mm_tokens_per_image=16"):
    Engine(config_for(hf, model, kv_cache_layout="paged", prefill_chunk_size=8), mesh=one_device_mesh())
  engine = Engine(config_for(hf, model), mesh=one_device_mesh())
  with pytest.raises(UserError, match="1 image placeholder run.* but 2 image"):
    engine.prefill(params, [PROMPTS[0]], images=[pixels(1, 2)])
  with pytest.raises(UserError, match="but 0 image"):
    engine.prefill(params, [PROMPTS[0]])


def test_whole_runs_start_and_chunk_end_never_split_an_image():
  runs = [(5, 9), (10, 14)]
  assert image_prompts.whole_runs_start(12, [(1, 3), (10, 14)], 4) == 8  # inside a run: back to its page
  assert image_prompts.whole_runs_start(12, runs, 4) == 4  # and page 8 would split the first run
  assert image_prompts.whole_runs_start(4, runs, 4) == 4
  assert image_prompts.chunk_end(0, 8, runs) == 5 and image_prompts.chunk_end(5, 13, runs) == 10
  salts = image_prompts.page_salts(runs, pixels(0, 2), 4)
  assert sorted(salts) == [1, 2, 3] and len(salts[2]) == 64  # page 2 holds tokens of both images


def test_a_chunk_sharing_the_budget_never_splits_an_image():
  """A prompt's chunk in a call whose budget other prompts share ends before an image run it would split;
  an image run starting where the prompt goes on gets nothing until the budget left holds it."""
  import types

  from MaxText.inference.page_prefill import PagePrefill, _Plans

  plans = object.__new__(_Plans)
  plans.prompts, plans.starts, plans.runs = [[0] * 16] * 2, [0, 5], [[(5, 9), (10, 14)]] * 2
  engine_side = types.SimpleNamespace(snapshots=None)
  assert PagePrefill._piece_end(engine_side, plans, 0, 7) == 5  # before the run
  assert PagePrefill._piece_end(engine_side, plans, 1, 8) == 5  # the run at its start does not fit: nothing
  assert PagePrefill._piece_end(engine_side, plans, 1, 12) == 10  # the run whole, not the next


def test_decode_py_with_image_path_equals_hf_generate(hf, tmp_path):
  """MaxText.decode on a converted checkpoint, prompt_token_ids holding one image's run and
  image_path a PNG: the greedy ids equal HF generate on the same pixel values."""
  from pathlib import Path

  from PIL import Image

  from MaxText import decode, startup
  from MaxText.convert import hf_to_maxtext
  from MaxText.families import gemma3_images
  from MaxText.input_pipeline import images

  model = hf.build_hf_multimodal_model("gemma3-vision")
  model.save_pretrained(str(tmp_path / "hf"))
  hf_to_maxtext.convert(str(tmp_path / "hf"), str(tmp_path / "ckpt"), [])
  png = tmp_path / "a.png"
  Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 90, 3), dtype=np.uint8)).save(png)
  prompt = image_prompt([2, 5, 17], [9, 33, 42])
  base = str(Path(__file__).resolve().parents[2] / "configs" / "base.yml")
  config = startup.start(decode.TOOL, ["decode", base, f"load_parameters_path={tmp_path / 'ckpt'}", "dtype=float32",
                                       "max_target_length=30", "max_prefill_predict_length=24",
                                       f"prompt_token_ids={','.join(map(str, prompt))}", f"image_path={png}"]).config
  got = decode.decode(config)
  pixels = gemma3_images.pixel_values(images.load(str(png)), gemma3_images.ImageOptions(64))
  assert got == hf_greedy(hf, model, prompt, image_prompts.PromptImages.of(pixels), 30 - len(prompt) + 1)
