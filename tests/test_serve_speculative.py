"""The OpenAI-compatible server with speculative decoding (speculative_tokens=3, a smaller draft
named by draft_model_name + draft_overrides), driven by the official `openai` client: greedy text
equals the model's uncached greedy decode, streams join to the same text, max_tokens and stop
sequences are honoured, logprobs of speculated tokens equal the model's own log-softmax, and
/health and /metrics show the acceptance counters."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="needs openai (EXTRAS=test bash setup.sh)")
uvicorn = pytest.importorskip("uvicorn", reason="needs uvicorn (pip install -r requirements.txt)")
try:  # the openai client's own HTTP library (httpx2 in openai 3.x, httpx before)
  import httpx2 as httpx
except ImportError:
  httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers", reason="the tokenizer needs transformers (EXTRAS=test bash setup.sh)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from MaxText.configuration.config import Config  # noqa: E402
from MaxText.platform import sharding  # noqa: E402
from MaxText.inference.speculative_engine import SpeculativeEngine  # noqa: E402
from MaxText.serve import build_app, build_server  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "inference"))
sys.path.insert(0, str(Path(__file__).parent / "input_pipeline"))
sys.path.insert(0, str(Path(__file__).parent))
from decode_test_utils import one_device_mesh, uncached_greedy  # noqa: E402
from tests.uvicorn_thread import UvicornThread  # noqa: E402
from sft_fixtures import CHATML, write_tokenizer, without_markers  # noqa: E402
from test_serve import LIMITS, MODEL, PROMPTS  # noqa: E402

DRAFT = "base_emb_dim=16,base_num_query_heads=2,base_num_kv_heads=1,head_dim=8,base_mlp_dim=32," \
        "base_num_decoder_layers=1,vocab_size=272"


class SpeculativeServed:
  def __init__(self, tmp: Path):
    self.tokenizer_dir = write_tokenizer(tmp / "tok", without_markers(CHATML))
    self.config = Config.for_testing(**MODEL, **LIMITS, tokenizer_path=str(self.tokenizer_dir), speculative_tokens=3,
                                     draft_model_name="default", draft_overrides=DRAFT)
    self.server = build_server(self.config, mesh=one_device_mesh())
    self.engine, self.params = self.server.scheduler.engine, self.server.scheduler.params
    assert isinstance(self.engine, SpeculativeEngine)
    self.http = UvicornThread(build_app(self.server, api_key=""))
    self.url = self.http.url
    self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)
    # What test_serve's helpers read: the target's spec and parameters.
    self.target_params = self.params[0]

  def greedy(self, ids: list[int], max_tokens: int) -> list[int]:
    out = uncached_greedy(self.engine.spec, self.target_params, ids, max_tokens, MODEL["max_target_length"])
    eos = 2
    return out[:out.index(eos) + 1] if eos in out else out

  def close(self) -> None:
    self.http.close()
    self.server.scheduler.stop()


def model_logprobs(served: SpeculativeServed, ids: list[int]) -> np.ndarray:
  """log p(token i | tokens < i), i >= 1, from one full forward pass of the target."""
  tokens = jnp.asarray([ids])
  apply = sharding.unsharded()(served.engine.spec.apply)
  logits = apply(served.target_params, tokens, jnp.arange(len(ids))[None], jnp.ones_like(tokens))
  logprobs = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1)
  return np.asarray(jnp.take_along_axis(logprobs, tokens[0, 1:, None], axis=-1)[:, 0])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  s = SpeculativeServed(tmp_path_factory.mktemp("serve_spec"))
  yield s
  s.close()


@pytest.mark.slow  # a server start, two models' compilations and a dozen requests: about a minute on 2 cores
def test_greedy_text_streams_logprobs_and_metrics(served):
  codec = served.server.codec
  for prompt, max_tokens in zip(PROMPTS[:3], (12, 7, 10)):
    ids = codec.encode(prompt)
    expected = served.greedy(ids, max_tokens)
    out = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           logprobs=3)
    assert out.choices[0].text == codec.decode(expected)
    assert out.usage.completion_tokens == len(expected)
    # The speculated tokens' scores: the model's log-softmax at each position.
    lp = out.choices[0].logprobs
    np.testing.assert_allclose(lp.token_logprobs, model_logprobs(served, ids + expected)[len(ids) - 1:], atol=1e-4)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)  # tokens with the same text share a key
    chunks = list(served.client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                                   temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
  # A stop sequence cut inside a round: the text ends before it.
  ids = codec.encode(PROMPTS[0])
  full = codec.decode(served.greedy(ids, 12))
  stop = full[len(full) // 2:len(full) // 2 + 2]
  if stop.strip():
    cut = served.client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
  # Sampled requests are served too (their distribution: tests/inference/test_speculative.py).
  sampled = served.client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8, temperature=0.9, seed=3,
                                             n=2)
  assert len(sampled.choices) == 2
  health = httpx.get(f"{served.url}/health", timeout=30).json()
  assert health["speculative_tokens"] == 3 and health["speculative_proposed_tokens"] > 0
  assert 0 <= health["speculative_accepted_tokens"] <= health["speculative_proposed_tokens"]
  assert health["slots_in_use"] == 0 and health["pages_reserved"] == 0
  metrics = httpx.get(f"{served.url}/metrics", timeout=30).text
  proposed = float(re.search(r"^maxtext_serve_speculative_proposed_tokens_total (\S+)$", metrics, re.M).group(1))
  accepted = float(re.search(r"^maxtext_serve_speculative_accepted_tokens_total (\S+)$", metrics, re.M).group(1))
  rate = float(re.search(r"^maxtext_serve_speculative_acceptance_rate (\S+)$", metrics, re.M).group(1))
  assert proposed == health["speculative_proposed_tokens"] and accepted == health["speculative_accepted_tokens"]
  assert rate == pytest.approx(accepted / proposed, abs=1e-4)
