"""Feature combinations of the decode engine and the server, each against the plain engine or a one-line
refusal: here the server's first chats arriving together (a chat template and a grammar compiler are built at
the first request that needs them, on the worker threads requests are parsed on)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="chat templates need transformers (EXTRAS=test bash setup.sh)")

from MaxText.inference import serve_codec  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent.parent / "input_pipeline"))
from sft_fixtures import CHATML, without_markers, write_tokenizer  # noqa: E402

THREADS = 4


def _one_at_a_time(build, entered: list[int]):
  """`build` that fails when entered while another call runs (as transformers' lazy module did: "module
  'transformers' has no attribute 'PreTrainedTokenizerFast'"), and lingers so that a racing call would enter."""
  inside = threading.Lock()

  def guarded(*args, **kwargs):
    if not inside.acquire(blocking=False):
      raise AttributeError("built by two threads at once")
    try:
      entered.append(1)
      time.sleep(0.3)
      return build(*args, **kwargs)
    finally:
      inside.release()
  return guarded


def _together(call) -> list[BaseException]:
  """`call` on THREADS threads released at once; what they raised."""
  start, errors = threading.Barrier(THREADS), []

  def run():
    start.wait(30)
    try:
      call()
    except BaseException as e:  # noqa: BLE001 - collected for the assertion
      errors.append(e)
  threads = [threading.Thread(target=run) for _ in range(THREADS)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  return errors


def test_first_chats_and_grammars_arriving_together_build_the_tokenizer_and_compiler_once(tmp_path, monkeypatch):
  """Before: each of the first concurrent chats (or constrained chats) saw no tokenizer yet and built one, at
  the same time; with transformers 5 that was a 500 for some of them. Now one builds and the others wait."""
  tokenizer = write_tokenizer(tmp_path / "tok", without_markers(CHATML))
  loads: list[int] = []
  monkeypatch.setattr(serve_codec.chat_lib, "load_chat_tokenizer",
                      _one_at_a_time(serve_codec.chat_lib.load_chat_tokenizer, loads))
  codec, _ = serve_codec.build(serve_codec.CodecSpec("huggingface", str(tokenizer), False, 272))
  assert _together(lambda: codec.chat([{"role": "user", "content": "to be"}])) == []
  assert len(loads) == 1

  compiles: list[int] = []
  monkeypatch.setattr(serve_codec.grammar, "Compiler", _one_at_a_time(serve_codec.grammar.Compiler, compiles))
  codec, _ = serve_codec.build(serve_codec.CodecSpec("huggingface", str(tokenizer), False, 272))
  compilers: list[object] = []
  assert _together(lambda: compilers.append(codec.grammars())) == []
  assert len(compiles) == 1 and len({id(c) for c in compilers}) == 1


@pytest.mark.slow  # two adapter-table engines through the scheduler: about 30 s on a loaded CPU
def test_k_steps_paged_prefix_chunked_int8_and_adapters_together_give_the_plain_engines_tokens(tmp_path):
  """LoRA adapters x quantize_weights=int8 x paged + prefix caching + chunked prefill x decode_steps_per_call=4,
  through the scheduler with more jobs than slots, max_tokens ending inside a call, prompts sharing pages across
  and within adapters, twice (the second wave reuses cached pages): each job's greedy tokens and scores are those of
  the dense int8 engine with the same tables at one step per call, and every page and slot comes back."""
  import numpy as np

  from MaxText.configuration.config import Config
  from MaxText.inference import lora_adapters
  from MaxText.inference import scheduler as sched
  from MaxText.inference.engine import Engine
  from MaxText.inference.sampling import RowParams
  from decode_test_utils import one_device_mesh
  from test_lora_adapters import ADAPTERS, TINY, write_adapter
  from test_speculative_serving import Sink

  for i, (name, rank, alpha, targets) in enumerate(ADAPTERS[:3]):
    write_adapter(tmp_path / name, rank, alpha, targets, seed=10 + i)
  spec = ",".join(f"{n}={tmp_path / n}" for n, *_ in ADAPTERS[:3])
  base = Engine(Config.for_testing(**TINY), mesh=one_device_mesh()).model.params("", 1)
  prompts = [[5, 9, 2, 7, 1, 3, 3, 8], [5, 9, 2, 7, 1, 3, 3, 8], [11, 4], [5, 9, 2, 7, 6], [5, 9, 2, 7, 1, 3, 3],
             [5, 9, 2, 7, 1, 3, 3, 8], [7]]
  picks = ["alpha", None, "beta", "alpha", "gamma", "beta", None]
  max_tokens = [7, 5, 9, 3, 6, 10, 1]

  def serve(slots: int, **keys) -> tuple[list[list[Sink]], dict]:
    config = Config.for_testing(**TINY, serve_lora_adapters=spec, serve_lora_slots=4, quantize_weights="int8", **keys)
    engine, registry = lora_adapters.load_engine(config, slots, "fresh", "base", one_device_mesh(), base_params=base)
    held = [registry.hold(p, 2) if p else (0, b"") for p in picks]
    scheduler = sched.Scheduler(engine, registry.params, max_queue=16).start()
    waves = []
    try:
      for _ in range(2):
        sinks = [Sink() for _ in prompts]
        scheduler.submit([sched.Job(i, p, n, RowParams(adapter=row), s, cache_key=key)
                          for i, (p, n, (row, key), s) in enumerate(zip(prompts, max_tokens, held, sinks))])
        for sink in sinks:
          assert sink.done.wait(300), "a job did not end"
        waves.append(sinks)
      return waves, scheduler.load()
    finally:
      scheduler.stop(30)

  plain, _ = serve(1)
  got, load = serve(3, kv_cache_layout="paged", kv_page_size=4, prefix_caching="true", prefill_chunk_size=3,
                    decode_steps_per_call=4)
  for want_wave, got_wave in zip(plain, got):
    for i, (want, sink) in enumerate(zip(want_wave, got_wave)):
      assert sink.reason == want.reason == "length" and sink.tokens == want.tokens, (i, picks[i])
      np.testing.assert_allclose(sink.logprobs, want.logprobs, atol=2e-4)
  assert load["prefix_cached_tokens"] > 0  # the combination was exercised: pages were shared
  assert load["pages_reserved"] == 0 and load["pages_free"] == load["pages_total"] and load["active"] == 0
  assert len({tuple(s.tokens) for s in plain[0][:2]}) == 2  # one prompt, two adapters: different tokens
