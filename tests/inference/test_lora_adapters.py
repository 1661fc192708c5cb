"""Many LoRA adapters at once (inference/lora_adapters.py): a batch that mixes adapters and the base
model gives each request the tokens of an engine with only its adapter merged into the weights."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

import jax
import numpy as np
import pytest

from MaxText.configuration.config import Config
from MaxText.convert import peft_adapters
from MaxText.errors import UserError
from MaxText.inference import lora_adapters
from MaxText.inference.engine import Engine
from MaxText.inference.sampling import RowParams
from MaxText.training import lora
from decode_test_utils import one_device_mesh

TINY = dict(base_emb_dim=32, base_num_query_heads=2, base_num_kv_heads=2, head_dim=16, base_mlp_dim=64,
            base_num_decoder_layers=2, vocab_size=64, max_target_length=32, max_prefill_predict_length=8,
            per_device_batch_size=1, print_config=False, dtype="float32")
PROMPTS = [[5, 9, 2], [7, 1, 3, 3, 8], [11, 4], [2, 2, 6, 1], [3, 1, 4, 1, 5]]
# (name, rank, alpha, targets): ranks and targets differ, so the tables pad and leave places empty.
ADAPTERS = [("alpha", 4, 8.0, ("q_proj", "v_proj")), ("beta", 2, 4.0, ("k_proj", "o_proj", "down_proj")),
            ("gamma", 4, 2.0, ("q_proj", "up_proj", "gate_proj", "v_proj")), ("kappa", 3, 6.0, ("q_proj", "o_proj"))]


def write_adapter(directory, rank: int, alpha: float, targets, seed: int, **keys) -> dict:
  """A random PEFT adapter of the tiny model in `directory`; returns our adapter leaves."""
  config = Config.for_testing(**{**TINY, **keys}, lora_rank=rank, lora_alpha=alpha,
                              lora_target_modules=",".join(targets))
  from MaxText import models

  abstract = models.build_model_spec(config.model).abstract_params  # shapes only: nothing to compile
  rng = np.random.default_rng(seed)
  adapters, base = lora.split(jax.tree.map(lambda x: (0.5 * rng.standard_normal(x.shape)).astype(x.dtype), abstract))
  peft_adapters.save(str(directory), lora.combine(adapters, base), config.model)
  return adapters


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  root = tmp_path_factory.mktemp("adapters")
  ours = {}
  for i, (name, rank, alpha, targets) in enumerate(ADAPTERS[:3]):
    ours[name] = write_adapter(root / name, rank, alpha, targets, seed=10 + i)
  config = Config.for_testing(**TINY, serve_lora_adapters=",".join(f"{n}={root / n}" for n, *_ in ADAPTERS[:3]),
                              serve_lora_slots=4)
  engine, registry = lora_adapters.load_engine(config, 4, "fresh", "base", one_device_mesh())
  return config, engine, registry, ours, root


def greedy(engine, params, prompts, rows, new_tokens: int = 6) -> list[list[int]]:
  """Every prompt in its own slot at once, greedy, `new_tokens` each."""
  state = engine.init_decode_state()
  out = []
  for slot, (prompt, row) in enumerate(zip(prompts, rows)):
    prefix = engine.prefill(params, [prompt], row_params=[row])
    state = engine.insert(prefix, state, slot)
    out.append([int(prefix.first_tokens_B[0])])
  for _ in range(new_tokens - 1):
    state, tokens = engine.generate(params, state)
    for slot in range(len(prompts)):
      out[slot].append(int(tokens[slot]))
  return out


_REFERENCE: list[Engine] = []


def merged_tokens(config, registry, ours, name, prompts) -> list[list[int]]:
  """The tokens of a plain engine whose weights have adapter `name` merged in (None: the base model)."""
  base = lora.split(jax.device_get(registry.params))[1]
  if name is None:
    params = base
  else:
    _, rank, alpha, _ = next(a for a in ADAPTERS if a[0] == name)
    params = lora.merge(lora.combine(ours[name], base), alpha / rank)
  if not _REFERENCE:  # one engine (its programs compiled once) for every merged model
    _REFERENCE.append(Engine(config, num_slots=1, mesh=one_device_mesh()))
  return [greedy(_REFERENCE[0], params, [prompt], [RowParams()])[0] for prompt in prompts]


def test_a_mixed_batch_gives_each_request_its_merged_adapters_tokens(served):
  config, engine, registry, ours, _ = served
  picks = ["alpha", None, "beta", "gamma", "alpha"]
  rows = [RowParams(adapter=0 if p is None else registry.acquire(p)) for p in picks]
  mixed = greedy(engine, registry.params, PROMPTS[:4], rows[:4])
  for slot, pick in enumerate(picks[:4]):
    assert mixed[slot] == merged_tokens(config, registry, ours, pick, [PROMPTS[slot]])[0], pick
  # the adapters change the tokens (else the comparison proves nothing)
  assert merged_tokens(config, registry, ours, None, [PROMPTS[0]])[0] != mixed[0]



def test_an_adapter_loaded_outside_the_registry_must_fit_the_tables(served: tuple, tmp_path: Path) -> None:
  """AdapterTable.set_row given an adapter of a rank above the tables' is one line naming both ranks (was: numpy's
  "could not broadcast input array from shape (32,8) into shape (32,4)"); the registry's add says the same earlier."""
  _, engine, registry, _, _ = served
  write_adapter(tmp_path / "wide", 8, 8.0, ("q_proj",), seed=5)
  wide = peft_adapters.load(str(tmp_path / "wide"), engine.cfg, engine.spec.abstract_params)
  with pytest.raises(UserError) as e:
    registry.table.set_row(registry.params, 1, wide)
  assert str(e.value) == ("a LoRA adapter of rank 8 on ['q_proj'] does not fit adapter tables of rank 4 "
                          f"(serve_lora_max_rank) on {list(registry.table.targets)}")


@pytest.mark.slow  # a second table engine (paged, chunked prefill): about 30 s on a loaded CPU
def test_chunked_prefill_into_pages_carries_each_slots_adapter(served):
  """Prompts prefilled into pages chunk by chunk (page_prefill.py) decode with their slot's adapter too."""
  config, engine, registry, _, root = served
  picks = ["gamma", None, "alpha", "beta"]
  rows = [RowParams(adapter=0 if p is None else registry.acquire(p)) for p in picks]
  paged_config = Config.for_testing(**TINY, serve_lora_adapters=",".join(f"{n}={root / n}" for n, *_ in ADAPTERS[:3]),
                                    serve_lora_slots=4, kv_cache_layout="paged", kv_page_size=4, prefill_chunk_size=2,
                                    prefix_caching="false")
  paged, paged_registry = lora_adapters.load_engine(paged_config, 4, "fresh", "base", one_device_mesh(),
                                                    base_params=lora.split(jax.device_get(registry.params))[1])
  assert [a.row for a in paged_registry.adapters()] == [a.row for a in registry.adapters()]
  state = paged.init_decode_state()
  out = []
  for slot, (prompt, row) in enumerate(zip(PROMPTS, rows)):
    start, first = paged.begin_prompt(slot, prompt), None
    while first is None:
      state, start, first = paged.prefill_chunk(paged_registry.params, state, slot, prompt, start, row)
    out.append([int(jax.device_get(first[0])[0])])
  for _ in range(5):
    state, tokens = paged.generate(paged_registry.params, state)
    for slot in range(4):
      out[slot].append(int(tokens[slot]))
  assert out == greedy(engine, registry.params, PROMPTS[:4], rows)


@pytest.mark.slow  # a second table engine (paged, prefix caching): about 20 s on a loaded CPU
def test_prefix_caching_shares_pages_only_under_the_same_adapter(served):
  """A prompt cached under one adapter is reused by that adapter alone (not by another, nor by the base
  model), and every request's tokens equal the uncached dense engine's."""
  config, engine, registry, _, root = served
  cached_config = Config.for_testing(**TINY, serve_lora_adapters=",".join(f"{n}={root / n}" for n, *_ in ADAPTERS[:3]),
                                     serve_lora_slots=4, kv_cache_layout="paged", kv_page_size=2,
                                     prefix_caching="true")
  paged, paged_registry = lora_adapters.load_engine(cached_config, 4, "fresh", "base", one_device_mesh(),
                                                    base_params=lora.split(jax.device_get(registry.params))[1])
  prompt = [3, 1, 4, 1, 5, 9, 2, 6]  # three full pages can be shared (the last token is always prefilled)
  picks = ["alpha", None, "beta", "alpha"]
  rows = [RowParams(adapter=0 if p is None else paged_registry.acquire(p)) for p in picks]
  assert [a.row for a in paged_registry.adapters()] == [a.row for a in registry.adapters()]
  state, out, cached = paged.init_decode_state(), [], []
  for slot, (pick, row) in enumerate(zip(picks, rows)):
    key = paged_registry.cache_key(pick or "base")
    start = paged.begin_prompt(slot, prompt, cache_key=key)
    cached.append(start)
    first = None
    while first is None:
      state, start, first = paged.prefill_chunk(paged_registry.params, state, slot, prompt, start, row)
    out.append([int(jax.device_get(first[0])[0])])
  assert cached == [0, 0, 0, 6]
  for _ in range(5):
    state, tokens = paged.generate(paged_registry.params, state)
    for slot in range(4):
      out[slot].append(int(tokens[slot]))
  assert out == greedy(engine, registry.params, [prompt] * 4, rows)
  assert len({tuple(o) for o in out}) == 3  # the adapters change the tokens (else equality proves nothing)
  # A key belongs to one load: an adapter loaded again, in the same row, caches under a new key.
  key = paged_registry.cache_key("beta")
  paged_registry.release("beta")
  paged_registry.remove("beta")
  again = paged_registry.add("beta", str(root / "beta"))
  assert paged_registry.cache_key("beta") not in (key, b"") and paged_registry.cache_key("base") == b""
  assert again.row == rows[2].adapter


@pytest.mark.slow  # a table engine and three reference engines: about a minute on a loaded CPU
def test_quantized_weights_serve_each_adapter_as_an_engine_of_that_adapter_alone(served):
  """quantize_weights=int8 with adapter tables: the base kernels 8-bit, the tables float; each row of a
  mixed batch gives the tokens of an int8 engine holding only its adapter (unmerged, as GRPO's rollouts)."""
  from MaxText.layers.weight_quantization import QuantizedWeight

  config, _, registry, ours, root = served
  base = lora.split(jax.device_get(registry.params))[1]
  q_config = Config.for_testing(**TINY, serve_lora_adapters=",".join(f"{n}={root / n}" for n, *_ in ADAPTERS[:3]),
                                serve_lora_slots=4, quantize_weights="int8")
  engine, q_registry = lora_adapters.load_engine(q_config, 4, "fresh", "base", one_device_mesh(), base_params=base)
  kernels = [x for x in jax.tree.leaves(q_registry.params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
             if isinstance(x, QuantizedWeight)]
  assert kernels  # the base kernels are stored 8-bit
  picks = ["alpha", None, "beta"]
  rows = [RowParams(adapter=0 if p is None else q_registry.acquire(p)) for p in picks]
  mixed = greedy(engine, q_registry.params, PROMPTS[:3], rows)
  for slot, pick in enumerate(picks):
    keys: dict = {}
    params = base
    if pick is not None:
      _, rank, alpha, targets = next(a for a in ADAPTERS if a[0] == pick)
      keys = dict(lora_rank=rank, lora_alpha=alpha, lora_target_modules=",".join(targets))
      params = lora.combine(ours[pick], base)
    alone = Engine(Config.for_testing(**TINY, **keys, quantize_weights="int8"), num_slots=1, mesh=one_device_mesh())
    assert mixed[slot] == greedy(alone, alone.prepare_params(params), [PROMPTS[slot]], [RowParams()])[0], pick


@pytest.mark.slow  # a table engine and a draft: about a minute on a loaded CPU
def test_a_draft_without_adapters_proposes_and_the_target_verifies_with_each_slots_adapter(served):
  """speculative_tokens with adapter tables: a small draft (no adapters) proposes, the table target verifies
  with each slot's row; greedy rounds give each request the tokens plain decoding with its adapter gives."""
  from MaxText.inference import speculative_engine

  config, engine, registry, _, root = served
  spec_config = Config.for_testing(**TINY, serve_lora_adapters=",".join(f"{n}={root / n}" for n, *_ in ADAPTERS[:3]),
                                   serve_lora_slots=4, speculative_tokens=3, draft_model_name="default",
                                   draft_overrides="base_emb_dim=16,base_num_query_heads=2,base_num_kv_heads=2,"
                                                   "head_dim=8,base_mlp_dim=32,base_num_decoder_layers=1,vocab_size=64")
  target, spec_registry = lora_adapters.load_engine(spec_config, 4, "fresh", "base", one_device_mesh(),
                                                    base_params=lora.split(jax.device_get(registry.params))[1])
  rounds, draft_params = speculative_engine.with_named_draft(speculative_engine.named_draft_config(spec_config),
                                                             target, 3)
  params = (spec_registry.params, draft_params)
  picks = ["alpha", None, "beta", "gamma"]
  rows = [RowParams(adapter=0 if p is None else spec_registry.acquire(p)) for p in picks]
  state, out = rounds.init_decode_state(), []
  for slot, (prompt, row) in enumerate(zip(PROMPTS, rows)):
    prefix = rounds.prefill(params, [prompt], row_params=[row])
    state = rounds.insert(prefix, state, slot)
    out.append([int(jax.device_get(prefix.first_tokens_B)[0])])
  while min(len(o) for o in out) < 6:
    state, emitted = rounds.decode_step(params, state)
    for slot in range(4):
      out[slot] += [int(t) for t in np.asarray(emitted.tokens)[slot, :int(np.asarray(emitted.counts)[slot])]]
  assert [o[:6] for o in out] == greedy(engine, registry.params, PROMPTS[:4], rows)



@pytest.mark.slow  # a table engine with an MTP module and its rounds: about 10 s on an idle CPU
def test_mtp_heads_draft_for_adapters_and_each_slot_gets_its_adapters_greedy_tokens(served):
  """speculative_tokens with adapter tables and no named draft: the base's MTP head proposes from the adapted
  hidden states, the table target verifies with each slot's row; a mixed batch's greedy rounds give each
  request the tokens plain decoding with its adapter gives (as the served tables' own test, merged)."""
  from MaxText.inference import speculative_engine

  _, _, _, _, root = served
  keys = dict(TINY, mtp_num_layers=1, serve_lora_slots=4,
              serve_lora_adapters=",".join(f"{n}={root / n}" for n, *_ in ADAPTERS[:3]))
  target, registry = lora_adapters.load_engine(Config.for_testing(**keys, speculative_tokens=3), 4, "fresh", "base",
                                               one_device_mesh())
  rounds, draft_params = speculative_engine.with_draft(Config.for_testing(**keys, speculative_tokens=3), target)
  assert draft_params is None and rounds.draft is None  # the MTP heads: the target's own parameters
  picks = ["beta", "alpha", None, "gamma"]
  rows = [RowParams(adapter=0 if p is None else registry.acquire(p)) for p in picks]
  params = (registry.params, None)
  state, out = rounds.init_decode_state(), []
  prefix = rounds.prefill(params, PROMPTS[:4], row_params=rows)
  for slot in range(4):
    state = rounds.insert(prefix, state, slot, row=slot)
    out.append([int(jax.device_get(prefix.first_tokens_B)[slot])])
  while min(len(o) for o in out) < 8:
    state, emitted = rounds.decode_step(params, state)
    for slot in range(4):
      out[slot] += [int(t) for t in np.asarray(emitted.tokens)[slot, :int(np.asarray(emitted.counts)[slot])]]
  expected = greedy(target, registry.params, PROMPTS[:4], rows, new_tokens=8)
  assert [o[:8] for o in out] == expected
  assert expected[0] != greedy(target, registry.params, PROMPTS[:1], [RowParams()], new_tokens=8)[0]  # adapters count


# ---------------------------------------------------------------- the server: model names, admin routes
KEY = "lora-key"
SERVE_MODEL = dict(base_emb_dim=32, base_num_query_heads=4, base_num_kv_heads=2, head_dim=8, base_mlp_dim=64,
                   base_num_decoder_layers=2, vocab_size=272, max_target_length=32, max_prefill_predict_length=16,
                   dtype="float32", print_config=False, tokenizer_type="huggingface", add_bos=False,
                   serve_max_slots=4, serve_max_tokens=6, serve_model_name="tiny",
                   scan_layers=False)  # unrolled layers here; the engine test above runs the scanned stack


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  pytest.importorskip("uvicorn", reason="needs uvicorn (pip install -r requirements.txt)")
  import httpx
  sys.path.insert(0, str(Path(__file__).parent.parent / "input_pipeline"))
  from sft_fixtures import CHATML, write_tokenizer, without_markers
  from tests.uvicorn_thread import UvicornThread
  from MaxText.serve import build_app, build_server

  root = tmp_path_factory.mktemp("serve_lora")
  ours = {name: write_adapter(root / name, rank, alpha, targets, seed=20 + i, **SERVE_MODEL)
          for i, (name, rank, alpha, targets) in enumerate(ADAPTERS)}
  write_adapter(root / "wide", 8, 8.0, ("q_proj",), seed=3, **SERVE_MODEL)  # rank 8 > the tables' 4
  for liar, rank, claimed in (("wide_liar", 8, 4), ("narrow_liar", 2, 4)):  # configs whose r is not their tensors'
    write_adapter(root / liar, rank, 8.0, ("q_proj",), seed=4, **SERVE_MODEL)
    written = json.loads((root / liar / peft_adapters.CONFIG_FILE).read_text())
    (root / liar / peft_adapters.CONFIG_FILE).write_text(json.dumps({**written, "r": claimed}))
  tok = write_tokenizer(root / "tok", without_markers(CHATML))
  config = Config.for_testing(**SERVE_MODEL, tokenizer_path=str(tok), serve_lora_slots=3, serve_lora_max_rank=4,
                              serve_lora_adapters=",".join(f"{n}={root / n}" for n, *_ in ADAPTERS[:2]))
  srv = build_server(config, mesh=one_device_mesh())
  http = UvicornThread(build_app(srv, api_key=KEY))
  client = httpx.Client(base_url=http.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
  yield config, srv, client, ours, root
  client.close()
  http.close()
  srv.scheduler.stop()


def _expected(config, srv, ours, name, ids) -> list[int]:
  from MaxText import models
  from decode_test_utils import uncached_greedy

  base = lora.split(jax.device_get(srv.adapters.params))[1]
  params = base
  if name != "tiny":
    _, rank, alpha, _ = next(a for a in ADAPTERS if a[0] == name)
    params = lora.merge(lora.combine(ours[name], base), alpha / rank)
  spec = models.build_model_spec(Config.for_testing(**SERVE_MODEL).model)
  return uncached_greedy(spec, params, ids, 6, config.model.max_target_length)


def test_server_picks_adapters_by_model_name_and_adds_and_removes_them_without_restart(server):
  from concurrent.futures import ThreadPoolExecutor

  config, srv, client, ours, root = server
  ids = [[5, 9, 2, 40, 7], [7, 1, 3, 3, 8, 100], [11, 4, 200], [2, 2, 6, 1, 50]]

  def complete(model: str, prompt: list[int]):
    return client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0})

  def expected_text(name: str, prompt: list[int]) -> str:
    out = _expected(config, srv, ours, name, prompt)
    eos = 2  # "</s>" in sft_fixtures.SPECIAL
    return srv.codec.decode(out[:out.index(eos) + 1] if eos in out else out)

  assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny", "alpha", "beta"]
  # 401 without the key; a third adapter loads while the server runs
  assert httpx_post_without_key(client, {"name": "kappa", "path": str(root / "kappa")}).status_code == 401
  added = client.post("/v1/admin/lora_adapters", json={"name": "kappa", "path": str(root / "kappa")})
  assert added.status_code == 200 and added.json()["row"] == 3, added.text
  assert client.get("/v1/admin/lora_adapters").json()["data"][-1]["name"] == "kappa"
  picks = ["alpha", "tiny", "beta", "kappa"]
  with ThreadPoolExecutor(4) as pool:  # requests for different adapters share the decode steps
    responses = list(pool.map(complete, picks, ids))
  for pick, prompt, response in zip(picks, ids, responses):
    assert response.status_code == 200, response.text
    assert response.json()["model"] == pick
    assert response.json()["choices"][0]["text"] == expected_text(pick, prompt), pick
  assert responses[0].json()["choices"][0]["text"] != expected_text("tiny", ids[0])  # the adapter changes the text
  removed = client.delete("/v1/admin/lora_adapters/kappa")
  assert removed.status_code == 200 and removed.json()["deleted"], removed.text
  gone = complete("kappa", ids[0])
  assert gone.status_code == 404 and "'kappa'" in gone.json()["error"]["message"]
  assert client.delete("/v1/admin/lora_adapters/kappa").status_code == 404
  srv.adapters.acquire("alpha")  # a request in flight holds its adapter
  busy = client.delete("/v1/admin/lora_adapters/alpha")
  assert busy.status_code == 409 and "1 requests in flight" in busy.json()["error"]["message"]
  srv.adapters.release("alpha")


@pytest.mark.slow  # a second server (paged, a draft): about a minute on a loaded CPU
def test_a_server_with_a_draft_and_prefix_caching_gives_each_adapter_its_own_tokens(server):
  """serve_lora_adapters beside speculative_tokens (a named draft) and prefix caching: each request gets
  its adapter's greedy text, and a cached prompt is reused by the same adapter only."""
  import httpx
  from tests.uvicorn_thread import UvicornThread
  from MaxText.serve import build_app, build_server

  config, _, _, ours, root = server
  draft = "base_emb_dim=16,base_num_query_heads=2,base_num_kv_heads=2,head_dim=8,base_mlp_dim=32," \
          "base_num_decoder_layers=1,vocab_size=272"
  spec_config = Config.for_testing(**SERVE_MODEL, tokenizer_path=config.data.tokenizer_path, serve_lora_slots=3,
                                   serve_lora_max_rank=4,
                                   serve_lora_adapters=",".join(f"{n}={root / n}" for n, *_ in ADAPTERS[:2]),
                                   kv_cache_layout="paged", kv_page_size=2, prefix_caching="true",
                                   speculative_tokens=2, draft_model_name="default", draft_overrides=draft)
  srv = build_server(spec_config, mesh=one_device_mesh())
  http = UvicornThread(build_app(srv, api_key=KEY))
  try:
    client = httpx.Client(base_url=http.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    prompt = [5, 9, 2, 40, 7, 1, 3, 3, 8]
    cached = []
    for pick in ["alpha", "tiny", "beta", "alpha"]:
      before = srv.scheduler.load()["prefix_cached_tokens"]
      response = client.post("/v1/completions", json={"model": pick, "prompt": prompt, "max_tokens": 6,
                                                       "temperature": 0})
      assert response.status_code == 200, response.text
      out = _expected(config, srv, ours, pick, prompt)
      expected = srv.codec.decode(out[:out.index(2) + 1] if 2 in out else out)  # 2: "</s>"
      assert response.json()["choices"][0]["text"] == expected, pick
      cached.append(srv.scheduler.load()["prefix_cached_tokens"] - before)
    assert cached == [0, 0, 0, 8]
    client.close()
  finally:
    http.close()
    srv.scheduler.stop()


def httpx_post_without_key(client, body):
  import httpx

  return httpx.post(f"{client.base_url}/v1/admin/lora_adapters", json=body, timeout=60)


@pytest.mark.parametrize("body, status, words", [
    ({"name": "tiny", "path": "x"}, 409, "'tiny' is taken"),
    ({"name": "alpha", "path": "x"}, 409, "'alpha' is taken"),
    ({"name": "w", "path": "{root}/wide"}, 400, "rank 8, more than this server's serve_lora_max_rank=4"),
    # r=4 fits the tables, the tensors' rank 8 does not (was: "this model needs [4, 32] ... another base model?")
    ({"name": "w", "path": "{root}/wide_liar"}, 400, "its config says r=4 but its lora_A tensors have rank 8"),
    ({"name": "w", "path": "{root}/narrow_liar"}, 400, "its config says r=4 but its lora_A tensors have rank 2"),
    ({"name": "g", "path": "{root}/gamma"}, 400, "targets ['gate_proj', 'up_proj'], which this server's adapter"),
    ({"name": "n", "path": "{root}/nowhere"}, 400, "is not a PEFT LoRA adapter"),
    # Names DELETE cannot reach (added, they held their row until a restart): a dot segment, a control character.
    ({"name": "..", "path": "{root}/alpha"}, 400, "may hold neither control characters nor '.' or '..' between"),
    ({"name": "org/./a", "path": "{root}/alpha"}, 400, "DELETE /v1/admin/lora_adapters/NAME could not name it"),
    ({"name": "a\nb", "path": "{root}/alpha"}, 400, "could not name it), got 'a\\nb'"),
    ({"name": "w", "path": ""}, 400, "path is empty"),  # was " is not a PEFT LoRA adapter", naming no path
])
def test_admin_refusals_are_one_line(server, body, status, words):
  _, _, client, _, root = server
  body = {k: v.replace("{root}", str(root)) for k, v in body.items()}
  response = client.post("/v1/admin/lora_adapters", json=body)
  assert response.status_code == status, response.text
  assert words in response.json()["error"]["message"] and "\n" not in response.json()["error"]["message"]
  if body["path"].endswith("/alpha"):  # a loadable adapter: the name is the culprit, not the path
    assert response.json()["error"]["param"] == "name", response.text


def test_an_add_with_every_row_taken_is_a_409_naming_the_slots(server):
  """All serve_lora_slots rows taken: a 409 adapter_slots_full, the adapter untouched (was: 400 invalid_adapter with
  param "path", as if the adapter were at fault); the add succeeds once a row is free."""
  _, srv, client, _, root = server
  assert client.post("/v1/admin/lora_adapters", json={"name": "fill", "path": str(root / "kappa")}).status_code == 200
  try:
    full = client.post("/v1/admin/lora_adapters", json={"name": "more", "path": str(root / "kappa")})
    assert full.status_code == 409, full.text
    assert full.json()["error"]["code"] == "adapter_slots_full" and full.json()["error"]["param"] is None
    assert full.json()["error"]["message"] == "all serve_lora_slots=3 adapter rows are taken; remove an adapter first"
  finally:
    assert client.delete("/v1/admin/lora_adapters/fill").status_code == 200
  assert "more" not in srv.adapters.names()


def test_a_request_that_fails_before_the_scheduler_gives_its_adapter_back(server):
  """A request's jobs failing to build after its adapter was held (its grammar's matcher raising) left the adapter
  "in flight" for ever: DELETE answered 409 until a restart."""
  import types

  _, srv, _, _, _ = server

  class Broken:
    def constraint(self):
      raise RuntimeError("the matcher failed")

  choices = [types.SimpleNamespace(index=i, prompt=[5, 6], max_tokens=2, row=RowParams(), images=None) for i in (0, 1)]
  request = types.SimpleNamespace(choices=choices, grammar=Broken(), logprobs=None)  # n=2: two holds
  with pytest.raises(RuntimeError, match="the matcher failed"):
    srv._submit_to_adapter(request, False, lambda event: None, "alpha")
  assert srv.adapters._in_flight["alpha"] == 0


def test_a_name_too_long_is_refused_without_echoing_it():
  """A 10 KB name was echoed whole into the 400's message."""
  from MaxText.inference import lora_admin

  with pytest.raises(UserError) as error:
    lora_admin.check_name("n" * 10_000)
  assert str(error.value).endswith(f"got 10000 characters, {'n' * 40!r}...") and len(str(error.value)) < 200


def test_an_adapter_named_like_a_hub_repo_is_served_and_removed(server):
  """A name with "/" (org/adapter) is added, picked by `model` and removed by DELETE, its slash raw or %2F (was: a 404
  from DELETE, the adapter holding its row until a restart)."""
  _, srv, client, _, root = server
  for name, url in (("org/kappa", "org/kappa"), ("org/kappa2", "org%2Fkappa2")):
    added = client.post("/v1/admin/lora_adapters", json={"name": name, "path": str(root / "kappa")})
    assert added.status_code == 200, added.text
    used = client.post("/v1/completions", json={"model": name, "prompt": [5, 6], "max_tokens": 1})
    assert used.status_code == 200 and used.json()["model"] == name, used.text
    removed = client.delete(f"/v1/admin/lora_adapters/{url}")
    assert removed.status_code == 200 and removed.json()["name"] == name, removed.text
  assert "org/kappa" not in srv.adapters.names() and "org/kappa2" not in srv.adapters.names()


def test_a_name_taken_by_a_racing_add_is_a_409_as_the_route_check_gives(server, monkeypatch):
  """Two adds of one name at once both pass the route's check; the second is refused by the registry, as 409
  name_taken like the check's own answer (was: a 400 invalid_adapter)."""
  _, srv, client, _, root = server
  monkeypatch.setattr(srv.adapters, "names", lambda: [])  # as if "alpha" were loaded after the route looked
  response = client.post("/v1/admin/lora_adapters", json={"name": "alpha", "path": str(root / "alpha")})
  assert response.status_code == 409 and response.json()["error"]["code"] == "name_taken", response.text
  assert "already loaded" in response.json()["error"]["message"]


def test_unknown_model_names_the_adapter_and_the_served_ones(server):
  _, _, client, _, _ = server
  response = client.post("/v1/completions", json={"model": "delta", "prompt": [5, 6], "max_tokens": 2})
  assert response.status_code == 404
  assert response.json()["error"]["message"] == ("the model 'delta' does not exist; this server serves 'tiny' and the "
                                                 "LoRA adapters 'alpha', 'beta'")


# ---------------------------------------------------------------- against PEFT on the HF model
def peft_generates(peft: Any, hf: Any, tmp_path: Path, specs: dict[str, dict[str, Any]], picks: list[str | None],
                   prompts: list[list[int]], new_tokens: int, seed: Callable[[str], int]) -> list[list[int]]:
  """Each prompt's greedy tokens from PEFT's `generate` with the adapter `picks` names (None: the base model),
  each adapter built from its LoraConfig keyword arguments in `specs`, given random weights (lora_B starts at
  zero: an adapter that changes nothing proves nothing) and saved under tmp_path/<name>."""
  import torch

  expected = []
  for pick, prompt in zip(picks, prompts):
    model = hf.build_hf_model("llama3.1")
    if pick is not None:
      model = peft.get_peft_model(model, peft.LoraConfig(**specs[pick], lora_dropout=0.0))
      generator = torch.Generator().manual_seed(seed(pick))
      with torch.no_grad():
        for name, param in model.named_parameters():
          if "lora_" in name:
            param.copy_(0.3 * torch.randn(param.shape, generator=generator))
      model.save_pretrained(str(tmp_path / pick))
    with torch.no_grad():
      out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    expected.append(out[0, len(prompt):].tolist())
  return expected


def engine_with_adapters(hf: Any, tmp_path: Path, names: Iterable[str], num_slots: int) -> tuple[Any, Any]:
  """A table engine of the HF base model serving the adapters peft_generates saved under tmp_path."""
  base_model = hf.build_hf_model("llama3.1")
  config = hf.our_config(base_model, dtype="float32", max_prefill_predict_length=8,
                         serve_lora_adapters=",".join(f"{n}={tmp_path / n}" for n in names))
  base = hf.our_params(base_model, hf.our_config(base_model), tmp_path / "base")
  return lora_adapters.load_engine(config, num_slots, "", "base", one_device_mesh(), base_params=base)


@pytest.mark.slow  # PEFT and transformers' generate on CPU: about 40 s
def test_a_mixed_batch_gives_what_peft_generates_for_each_adapter(tmp_path):
  """Two PEFT adapters saved by PEFT itself and the base model, in one batch: each row's greedy tokens
  are what `PeftModel.generate` (the base model's `generate` for the base row) gives for its prompt."""
  peft = pytest.importorskip("peft", reason="needs peft (EXTRAS=test bash setup.sh)")
  sys.path.insert(0, str(Path(__file__).parent.parent))
  import hf_families as hf

  specs = {"p": dict(r=4, lora_alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"]),
           "r": dict(r=2, lora_alpha=2.0, target_modules=["k_proj", "o_proj", "up_proj"])}
  prompts = [[5, 17, 3, 99, 42], [7, 1, 120, 8], [64, 2, 2, 31, 9, 11]]
  picks, new_tokens = ["p", None, "r"], 6
  expected = peft_generates(peft, hf, tmp_path, specs, picks, prompts, new_tokens, seed=lambda pick: specs[pick]["r"])
  engine, registry = engine_with_adapters(hf, tmp_path, specs, len(prompts))
  rows = [RowParams(adapter=0 if p is None else registry.acquire(p)) for p in picks]
  assert greedy(engine, registry.params, prompts, rows, new_tokens) == expected
  assert expected[0] != greedy(engine, registry.params, prompts[:1], [RowParams()], new_tokens)[0]


def test_admin_routes_are_off_without_an_api_key_and_echo_scores_only_the_base_model(server):
  import httpx
  from tests.uvicorn_thread import UvicornThread
  from MaxText.serve import build_app

  _, srv, client, _, root = server
  open_app = UvicornThread(build_app(srv, api_key=""))
  try:
    response = httpx.post(f"{open_app.url}/v1/admin/lora_adapters", json={"name": "x", "path": str(root / "kappa")},
                          timeout=60)
    assert response.status_code == 403 and "MAXTEXT_API_KEY" in response.json()["error"]["message"]
  finally:
    open_app.close()
  echo = client.post("/v1/completions", json={"model": "alpha", "prompt": [5, 6], "max_tokens": 0, "echo": True,
                                              "logprobs": 0})
  assert echo.status_code == 400 and "base model only" in echo.json()["error"]["message"]


@pytest.mark.parametrize("keys, words", [
    (dict(serve_lora_adapters="nameless"), "serve_lora_adapters items are name=path"),
    (dict(serve_lora_adapters="a=/x", speculative_tokens=2), "speculative_tokens=2 needs a draft model"),
    (dict(serve_lora_adapters="a=/x", lora_rank=4), "beside a base model with lora_rank=0"),
    (dict(serve_lora_adapters="a={root}/head"), "LoRA adapters target ['lm_head'], which this model cannot serve"),
    (dict(serve_lora_adapters="a={root}/nothing"), "is not a PEFT LoRA adapter"),
    (dict(serve_lora_adapters="a={root}/liar"), "its config says r=1000000000000 but its lora_A tensors have rank 2"),
    # These four were refused only by Registry.add, after the engine and the base weights loaded, and with the admin
    # route's advice: "already loaded; remove it first", "all serve_lora_slots=1 adapter rows are taken; remove an
    # adapter first", "restart with serve_lora_max_rank >= 2".
    (dict(serve_lora_adapters="x={root}/ok,x={root}/ok"), "serve_lora_adapters names 'x' twice"),
    (dict(serve_lora_adapters="base={root}/ok"), "serve_lora_adapters names an adapter 'base', the base model's own"),
    (dict(serve_lora_adapters="x={root}/ok,y={root}/ok", serve_lora_slots=1),
     "serve_lora_slots=1 holds fewer adapters than the 2 serve_lora_adapters names; set serve_lora_slots >= 2"),
    (dict(serve_lora_adapters="x={root}/ok", serve_lora_max_rank=1, serve_lora_slots=1),
     "has rank 2, more than serve_lora_max_rank=1; set serve_lora_max_rank >= 2"),
])
def test_start_up_refusals_are_one_line(tmp_path, monkeypatch, keys, words):
  """liar: a config whose r is far beyond its tensors' is refused before tables of that rank are allocated (was: an
  out-of-memory traceback at start). Every refusal comes before the engine is built (minutes for a real model)."""
  import json

  def no_engine(*args, **kwargs):
    raise AssertionError("the engine was built before the refusal")

  monkeypatch.setattr(lora_adapters, "Engine", no_engine)
  write_adapter(tmp_path / "liar", 2, 4.0, ("q_proj",), seed=1)
  write_adapter(tmp_path / "ok", 2, 4.0, ("q_proj",), seed=2)
  liar = json.loads((tmp_path / "liar" / peft_adapters.CONFIG_FILE).read_text())
  (tmp_path / "liar" / peft_adapters.CONFIG_FILE).write_text(json.dumps({**liar, "r": 10**12}))
  (tmp_path / "head").mkdir()
  (tmp_path / "head" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2,
                                                                      "target_modules": ["lm_head"]}))
  (tmp_path / "head" / "adapter_model.safetensors").write_bytes(_safetensors(
      {"base_model.model.lm_head.lora_A.weight": np.zeros((2, 32), np.float32),
       "base_model.model.lm_head.lora_B.weight": np.zeros((64, 2), np.float32)}, "F32"))
  keys = {k: v.replace("{root}", str(tmp_path)) if isinstance(v, str) else v for k, v in keys.items()}
  config = Config.for_testing(**TINY, **keys)
  with pytest.raises(UserError) as e:
    lora_adapters.load_engine(config, 2, "", "base", one_device_mesh())
  assert words in str(e.value) and "\n" not in str(e.value)


def _safetensors(tensors: dict, dtype: str) -> bytes:
  """A safetensors file of `tensors` stored as `dtype` (its name in the format: F32, BF16, I32, ...)."""
  import json
  import struct

  header, data = {}, b""
  for name, array in tensors.items():
    raw = np.ascontiguousarray(array).tobytes()
    header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [len(data), len(data) + len(raw)]}
    data += raw
  head = json.dumps(header).encode()
  head += b" " * (-len(head) % 8)
  return struct.pack("<Q", len(head)) + head + data


@pytest.fixture(scope="module")
def one_adapter(tmp_path_factory):
  """A rank-2 q_proj adapter of the tiny model, its tensors as PEFT names them, and the model it fits."""
  from MaxText import models
  from safetensors.numpy import load

  root = tmp_path_factory.mktemp("one_adapter")
  write_adapter(root / "good", 2, 4.0, ("q_proj",), seed=5)
  tensors = load((root / "good" / peft_adapters.WEIGHTS_FILE).read_bytes())
  config = Config.for_testing(**TINY, lora_rank=2, lora_alpha=4.0, lora_target_modules="q_proj")
  return root, tensors, config.model, models.build_model_spec(config.model).abstract_params


def _config_text(root) -> str:
  return (root / "good" / peft_adapters.CONFIG_FILE).read_text()


@pytest.mark.parametrize("config, weights, words", [
    ({"lora_alpha": [1]}, None, "lora_alpha=[1] is not a finite number"),
    ({"lora_alpha": "8"}, None, "lora_alpha=8 is not a finite number"),
    ("NaN", None, "lora_alpha=nan is not a finite number"),
    ({"target_modules": 5}, None, "target_modules must be a module name or a list of them"),
    ({"r": 0}, None, "r=0; a LoRA adapter's rank is >= 1"),
    ({"r": True}, None, "peft_type LORA with an integer r"),
    ("directory", None, "cannot read"),
    (None, b"\x00\x01 not safetensors", "is not a readable safetensors file"),
    (None, b"", "is not a readable safetensors file"),
    (None, "I32", "has dtype int32; LoRA weights are float32, float16 or bfloat16"),
    (None, "NaN", "holds NaN or infinite values"),
    # Both were "tensors name no projection of this model ... (an adapter of another model family or depth?)".
    ({"bias": "all"}, "bias", "holds 1 trained bias tensors (bias='all'), e.g. base_model.model.model.layers."),
    ({"modules_to_save": ["lm_head"]}, None, "modules_to_save=['lm_head'] (whole modules trained beside the adapter)"),
    # A rank per module without rank_pattern: was "this model needs [2, 32] ... (an adapter of another base model?)".
    (None, "rank-1-layer", "model.layers.1.self_attn.q_proj's adapter has rank 1 (lora_A [1, 32], lora_B [32, 1]) "
                           "where adapter_config.json says r=2 for it (r or rank_pattern); fix the config or the"),
    (None, "rank-1-b", "model.layers.1.self_attn.q_proj's adapter is lora_A [2, 32], lora_B [32, 1]; this model needs "
                       "[2, 32] and [32, 2]"),
    # numpy has no float8 type: was AttributeError "module 'numpy' has no attribute 'float8_e4m3fn'" (a 500).
    (None, "F8_E4M3", "lora_A.weight has dtype F8_E4M3; LoRA weights are float32, float16 or bfloat16"),
    # One half of a pair missing: was "has no place in this model (its projection takes no adapter here)", and
    # "tensors name no projection of this model" for a lora_B without its lora_A.
    (None, "no-B", "layers.1.self_attn.q_proj.lora_A.weight has no lora_B.weight beside it; each adapted module needs"),
    (None, "no-A", "layers.1.self_attn.q_proj.lora_B.weight has no lora_A.weight beside it; each adapted module needs"),
    # Tensors named with PEFT's adapter name inside (lora_A.default.weight): was "tensors name no projection".
    (None, "default", "holds no LoRA tensors (PEFT names them base_model.model.<module>.lora_A.weight and "
                      ".lora_B.weight); it holds e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.default"),
], ids=["alpha-list", "alpha-string", "alpha-nan", "targets-int", "rank-0", "rank-bool", "config-dir", "garbage",
        "empty", "int32", "nan-weights", "bias", "modules-to-save", "rank-per-module", "ranks-a-and-b", "float8",
        "lora-b-missing", "lora-a-missing", "adapter-name-in-tensor-names"])
def test_a_malformed_adapter_is_one_line_naming_what_is_wrong(one_adapter, tmp_path, config, weights, words):
  """What the admin route and serve_lora_adapters read: each is a UserError (a 400, an `error:` line), not a traceback
  or an adapter of NaNs that answers garbage (was: TypeError / ValueError / SafetensorError, NaN weights served)."""
  import json

  root, tensors, model, abstract = one_adapter
  bad = tmp_path / "bad"
  bad.mkdir()
  text = _config_text(root)
  if config == "NaN":
    text = json.dumps({**json.loads(text), "lora_alpha": "X"}).replace('"X"', "NaN")
  elif config == "directory":
    (bad / peft_adapters.CONFIG_FILE).mkdir()
  elif config is not None:
    text = json.dumps({**json.loads(text), **config})
  if config != "directory":
    (bad / peft_adapters.CONFIG_FILE).write_text(text)
  blob = (root / "good" / peft_adapters.WEIGHTS_FILE).read_bytes()
  if weights == "I32":
    blob = _safetensors({k: v.astype(np.int32) for k, v in tensors.items()}, "I32")
  elif weights == "NaN":
    blob = _safetensors({k: np.where(v > 0, np.nan, v).astype(np.float32) for k, v in tensors.items()}, "F32")
  elif weights == "bias":
    bias = next(k for k in tensors if k.endswith(".lora_A.weight")).replace("lora_A.weight", "bias")
    blob = _safetensors({**tensors, bias: np.zeros(8, np.float32)}, "F32")
  elif weights == "rank-1-layer":
    blob = _safetensors({k: (v[:1] if "lora_A" in k else v[:, :1]) if ".layers.1." in k else v
                         for k, v in tensors.items()}, "F32")
  elif weights == "rank-1-b":
    blob = _safetensors({k: v[:, :1] if ".layers.1." in k and "lora_B" in k else v for k, v in tensors.items()}, "F32")
  elif weights == "F8_E4M3":
    blob = _safetensors({k: np.zeros(v.shape, np.uint8) for k, v in tensors.items()}, "F8_E4M3")
  elif weights in ("no-A", "no-B"):
    blob = _safetensors({k: v for k, v in tensors.items() if not (".layers.1." in k and f"lora_{weights[-1]}" in k)},
                        "F32")
  elif weights == "default":
    blob = _safetensors({k.replace(".weight", ".default.weight"): v for k, v in tensors.items()}, "F32")
  elif weights is not None:
    blob = weights
  (bad / peft_adapters.WEIGHTS_FILE).write_bytes(blob)
  with pytest.raises(UserError) as e:
    peft_adapters.read_config(str(bad))
    peft_adapters.load(str(bad), model, abstract)
  assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("targets", ["all-linear", ".*q_proj", ["self_attn.q_proj"]])
def test_an_adapter_whose_config_names_its_targets_by_pattern_is_served(one_adapter, tmp_path, targets):
  """PEFT's target_modules may be "all-linear", a regex or module-path suffixes: the targets a server checks and sizes
  its tables by are those its tensors adapt (was: "LoRA adapters target ['all-linear'], which this model cannot serve"
  at start, a 400 from the admin route)."""
  import json

  root, _, _, _ = one_adapter
  (tmp_path / "a").mkdir()
  config = json.loads(_config_text(root))
  (tmp_path / "a" / peft_adapters.CONFIG_FILE).write_text(json.dumps({**config, "target_modules": targets}))
  (tmp_path / "a" / peft_adapters.WEIGHTS_FILE).write_bytes((root / "good" / peft_adapters.WEIGHTS_FILE).read_bytes())
  assert peft_adapters.read_config(str(tmp_path / "a")) == (2, ("q_proj",), 4.0)
  if targets == "all-linear":  # the server's own path, once
    _, registry = lora_adapters.load_engine(Config.for_testing(**TINY, serve_lora_adapters=f"a={tmp_path / 'a'}"), 1,
                                            "", "base", one_device_mesh())
    assert registry.names() == ["a"] and registry.adapters()[0].targets == ("q_proj",)


@pytest.mark.parametrize("alpha, scale", [(None, 8.0), (0, 0.0), (0.5, 0.5)], ids=["missing", "zero", "half"])
def test_lora_alpha_reads_as_peft_reads_it(one_adapter, tmp_path, alpha, scale):
  """A config without lora_alpha has PEFT's default 8 and lora_alpha 0 scales the adapter by 0, as PEFT loads them
  (was: both read as the rank, an adapter applied at another strength than PEFT's)."""
  import json

  root, _, _, _ = one_adapter
  (tmp_path / "a").mkdir()
  config = {k: v for k, v in json.loads(_config_text(root)).items() if k != "lora_alpha"}
  (tmp_path / "a" / peft_adapters.CONFIG_FILE).write_text(json.dumps(config if alpha is None else
                                                                      {**config, "lora_alpha": alpha}))
  (tmp_path / "a" / peft_adapters.WEIGHTS_FILE).write_bytes((root / "good" / peft_adapters.WEIGHTS_FILE).read_bytes())
  assert peft_adapters.read_config(str(tmp_path / "a"))[2] == scale


def test_a_bfloat16_adapter_loads_as_its_float32_values(one_adapter, tmp_path):
  """PEFT saves an adapter in its weights' dtype, often bfloat16 (was: KeyError 'BF16', a 500 from the admin route)."""
  import ml_dtypes

  root, tensors, model, abstract = one_adapter
  (tmp_path / "bf16").mkdir()
  (tmp_path / "bf16" / peft_adapters.CONFIG_FILE).write_text(_config_text(root))
  rounded = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
  (tmp_path / "bf16" / peft_adapters.WEIGHTS_FILE).write_bytes(_safetensors(rounded, "BF16"))
  (tmp_path / "f32").mkdir()
  (tmp_path / "f32" / peft_adapters.CONFIG_FILE).write_text(_config_text(root))
  (tmp_path / "f32" / peft_adapters.WEIGHTS_FILE).write_bytes(
      _safetensors({k: v.astype(np.float32) for k, v in rounded.items()}, "F32"))
  bf16 = peft_adapters.load(str(tmp_path / "bf16"), model, abstract)
  f32 = peft_adapters.load(str(tmp_path / "f32"), model, abstract)
  assert bf16.leaves.keys() == f32.leaves.keys() and bf16.leaves
  for key in f32.leaves:
    for ours, theirs in zip(bf16.leaves[key], f32.leaves[key]):
      np.testing.assert_array_equal(ours, theirs)


def test_an_adapter_add_from_a_dead_bucket_fails_alone(monkeypatch):
  """POST /v1/admin/lora_adapters naming a gs:// path whose bucket does not answer: that add is one line, and the
  server's later gs:// reads are tried again. Before, the add marked the whole process's storage down: every later
  gs:// adapter failed at once with the first one's message, however the storage came back."""
  import types

  from MaxText.paths import storage, storage_retry

  monkeypatch.setattr(storage_retry, "_state", storage_retry._State(budget=0.5))
  monkeypatch.setattr(storage_retry, "_probe", lambda bucket, timeout: None)

  class Refused:
    def exists(self):
      raise ConnectionRefusedError(111, "Connection refused")

  monkeypatch.setattr(storage, "as_path", lambda path: Refused())
  registry = lora_adapters.Registry(types.SimpleNamespace(capacity=2), "tiny", {})
  with pytest.raises(UserError, match=r"^gs://dead: checking .*adapter_config.json failed for \d+ s \(connection "
                                      r"refused\); .* try again once it is back$"):
    registry.add("remote", "gs://dead/adapters/remote")
  assert not storage_retry.is_down() and registry.names() == []


def test_adapter_tables_too_large_to_allocate_are_one_line(monkeypatch):
  """serve_lora_slots=1000000000 (or a rank of that size): the tables' allocation failed in a JAX RESOURCE_EXHAUSTED
  traceback. The failure stands in for a real one (allocating terabytes may succeed lazily and get the process killed)."""
  table = object.__new__(lora_adapters.AdapterTable)
  table.capacity, table.rank = 10**9, 4
  table._places = {(("layers", "q_proj"), "lora_a"): ((32, 4), 0, np.dtype("float32"))}
  table._shardings = {(("layers", "q_proj"), "lora_a"): None}

  def exhausted(*args, **kwargs):
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 512000000512 bytes.")

  monkeypatch.setattr(lora_adapters.jnp, "zeros", exhausted)
  with pytest.raises(UserError, match=r"^the LoRA adapter tables \(1000000000 adapter rows and the base model's, rank "
                                      r"4\) need 477 GiB, .*: lower serve_lora_slots or serve_lora_max_rank$"):
    table.with_tables({"layers": {"q_proj": {"lora_a": np.zeros((32, 4), np.float32)}}})


def test_negative_table_sizes_are_config_errors():
  from MaxText.errors import ConfigError

  with pytest.raises(ConfigError, match="serve_lora_slots and serve_lora_max_rank must be >= 0"):
    Config.for_testing(**TINY, serve_lora_slots=-1)
  # A rank without adapters or slots built no tables: the server had no admin routes, silently.
  with pytest.raises(ConfigError, match="serve_lora_max_rank=8 sizes LoRA adapter tables, which a server has only"):
    Config.for_testing(**TINY, serve_lora_max_rank=8)
  assert Config.for_testing(**TINY, serve_lora_max_rank=8, serve_lora_slots=2).decode.serve_lora_max_rank == 8


def test_an_adapter_swap_keeps_a_speculative_engines_draft_parameters():
  from MaxText import serve

  assert serve._with_target(("target", "draft"), "new") == ("new", "draft")
  assert serve._with_target("target", "new") == "new"


def test_quantized_base_weights_are_announced_as_without_adapters(tmp_path, capsys):
  """quantize_weights with adapter tables prints the line a server without adapters prints (the base model's
  kernels and bytes, the tables left out); it printed nothing."""
  from MaxText.inference import engine as engine_lib

  write_adapter(tmp_path / "a", 2, 4.0, ("q_proj",), seed=1)
  config = Config.for_testing(**TINY, quantize_weights="int8")
  engine_lib.load_engine(config, 2, "", one_device_mesh())
  plain = [line for line in capsys.readouterr().out.splitlines() if line.startswith("quantize_weights=int8:")]
  assert len(plain) == 1 and "kernel arrays of the decoder stored 8-bit" in plain[0]
  tables = Config.for_testing(**TINY, quantize_weights="int8", serve_lora_adapters=f"a={tmp_path / 'a'}")
  lora_adapters.load_engine(tables, 2, "", "base", one_device_mesh())
  assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("quantize_weights=")] == plain
