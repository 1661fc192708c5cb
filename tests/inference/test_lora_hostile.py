"""PEFT adapter configs that do not describe plain base + (alpha / r) · B·A: each is either served as PEFT serves
it or refused in one line, never served as a plain LoRA adapter (a model nobody trained)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from MaxText.convert import peft_adapters
from MaxText.errors import UserError
from MaxText.inference import lora_adapters
from MaxText.inference.sampling import RowParams
from test_lora_adapters import TINY, engine_with_adapters, greedy, peft_generates, write_adapter


@pytest.fixture(scope="module")
def good(tmp_path_factory):
  """A rank-4 q_proj/v_proj adapter of the tiny model and the model it fits."""
  from MaxText import models
  from MaxText.configuration.config import Config

  root = tmp_path_factory.mktemp("hostile")
  write_adapter(root / "good", 4, 8.0, ("q_proj", "v_proj"), seed=3)
  config = Config.for_testing(**TINY, lora_rank=4, lora_alpha=8.0, lora_target_modules="q_proj,v_proj")
  return root / "good", config.model, models.build_model_spec(config.model).abstract_params


def _variant(good_dir: Path, tmp_path: Path, **keys) -> Path:
  """`good_dir`'s adapter with `keys` set in its config."""
  out = tmp_path / "variant"
  out.mkdir()
  config = json.loads((good_dir / peft_adapters.CONFIG_FILE).read_text())
  (out / peft_adapters.CONFIG_FILE).write_text(json.dumps({**config, **keys}))
  (out / peft_adapters.WEIGHTS_FILE).write_bytes((good_dir / peft_adapters.WEIGHTS_FILE).read_bytes())
  return out


@pytest.mark.parametrize("keys, words", [
    # PEFT builds a model of 1 layer from layer 0; the tensors alone read as a 2-layer adapter with one layer empty.
    ({"layer_replication": [[0, 1]]}, "layer_replication=[[0, 1]] is not supported (PEFT rebuilds the base model's "
                                      "layer stack"),
    ({"alora_invocation_tokens": [17, 3]}, "alora_invocation_tokens=[17, 3] is not supported (activated LoRA"),
    ({"arrow_config": {"top_k": 2}}, "arrow_config={'top_k': 2} is not supported (Arrow routes"),
    ({"kasa_config": {}, "use_bdlora": {"nblocks": 2}}, "use_bdlora={'nblocks': 2} is not supported (block-diagonal"),
    # PEFT subtracts these starts from the base weights again when it loads the adapter.
    ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa' trains the adapter against changed base weights"),
    ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights='pissa_niter_4' trains the adapter against changed"),
    ({"init_lora_weights": "olora"}, "convert it to a plain LoRA adapter first"),
    ({"init_lora_weights": "corda"}, "init_lora_weights='corda'"),
    ({"init_lora_weights": "loftq"}, "init_lora_weights='loftq'"),
    ({"use_rslora": "yes"}, "use_rslora=yes is not true or false"),
    # Were refused only as "tensors name no projection of this model", naming neither setting.
    ({"trainable_token_indices": [3, 5]}, "trainable_token_indices=[3, 5] is not supported (trained embedding rows"),
    ({"target_parameters": ["mlp.experts.gate_up_proj"]}, "target_parameters=['mlp.experts.gate_up_proj'] is not"),
], ids=["layer-replication", "alora", "arrow", "bdlora", "pissa", "pissa-niter", "olora", "corda", "loftq",
        "rslora-string", "trainable-tokens", "target-parameters"])
def test_an_adapter_peft_serves_otherwise_than_plain_lora_is_refused(good, tmp_path, keys, words):
  """Was: each loaded and served as base + (alpha / r) · B·A (the tensors are plain LoRA's), answering as another
  model than PEFT's."""
  bad = _variant(good[0], tmp_path, **keys)
  with pytest.raises(UserError) as e:
    peft_adapters.read_config(str(bad))
  assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("init", [True, False, "gaussian", "eva", "orthogonal", "mica", "lora_ga"])
def test_initialisations_that_leave_the_base_weights_load(good, tmp_path, init):
  assert peft_adapters.read_config(str(_variant(good[0], tmp_path, init_lora_weights=init)))[0] == 4


def test_null_flags_read_as_off_as_peft_reads_them(good, tmp_path):
  """Was: "use_dora=None is not supported" for a config PEFT loads as plain LoRA."""
  keys = {k: None for k in ("use_dora", "fan_in_fan_out", "use_rslora", "layer_replication", "use_bdlora",
                            "alora_invocation_tokens", "init_lora_weights", "rank_pattern", "modules_to_save")}
  assert peft_adapters.read_config(str(_variant(good[0], tmp_path, **keys))) == (4, ("q_proj", "v_proj"), 8.0)


def test_a_lora_bias_adapter_is_refused_naming_lora_bias(good, tmp_path):
  """Was refused as bias='none' trained bias tensors, naming a setting the config does not have."""
  from safetensors.numpy import load, save

  bad = _variant(good[0], tmp_path, lora_bias=True)
  tensors = load((bad / peft_adapters.WEIGHTS_FILE).read_bytes())
  b_name = next(k for k in tensors if k.endswith(".lora_B.weight"))
  tensors[b_name.replace(".weight", ".bias")] = np.zeros(tensors[b_name].shape[0], np.float32)
  (bad / peft_adapters.WEIGHTS_FILE).write_bytes(save(tensors))
  with pytest.raises(UserError, match=r"lora_bias=True \(a trained bias on lora_B"):
    peft_adapters.read_config(str(bad))


def test_a_pickled_adapter_names_its_file_and_how_to_resave_it(good, tmp_path):
  (tmp_path / "bin").mkdir()
  (tmp_path / "bin" / peft_adapters.CONFIG_FILE).write_text((good[0] / peft_adapters.CONFIG_FILE).read_text())
  (tmp_path / "bin" / "adapter_model.bin").write_bytes(b"\x80\x02}q\x00.")
  with pytest.raises(UserError) as e:
    peft_adapters.read_config(str(tmp_path / "bin"))
  assert "adapter_model.bin, a PyTorch pickle" in str(e.value) and "safe_serialization=True" in str(e.value)


def test_a_weights_file_given_as_the_path_asks_for_its_directory(good):
  with pytest.raises(UserError, match=r"\(give the directory that holds them, not adapter_model.safetensors\)$"):
    peft_adapters.read_config(str(good[0] / peft_adapters.WEIGHTS_FILE))


def test_tensors_named_from_another_model_class_show_this_models_names(good, tmp_path):
  """An adapter saved from the bare decoder (HF's LlamaModel: base_model.model.layers...) where this model's are
  base_model.model.model.layers...: PEFT would load none of them onto the causal LM, so it is refused, and the line
  shows the expected naming (was: only the foreign name and a guess of another family or depth)."""
  from safetensors.numpy import load, save

  good_dir, model, abstract = good
  bad = _variant(good_dir, tmp_path)
  tensors = load((bad / peft_adapters.WEIGHTS_FILE).read_bytes())
  (bad / peft_adapters.WEIGHTS_FILE).write_bytes(save({k.replace("base_model.model.model.", "base_model.model."): v
                                                       for k, v in tensors.items()}))
  with pytest.raises(UserError) as e:
    peft_adapters.read_config(str(bad))
    peft_adapters.load(str(bad), model, abstract)
  assert "e.g. base_model.model.layers.0.self_attn.q_proj.lora_A.weight, where this model's are named like " \
         "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in str(e.value)
  assert "\n" not in str(e.value)


def _sliced(good_dir: Path, tmp_path: Path, module: str, rank: int, **keys) -> Path:
  """`good_dir`'s adapter with `module`'s tensors cut to `rank` and `keys` set in its config."""
  from safetensors.numpy import load, save

  out = _variant(good_dir, tmp_path, **keys)
  tensors = load((out / peft_adapters.WEIGHTS_FILE).read_bytes())
  cut = {k: (v[:rank] if ".lora_A." in k else v[:, :rank]) if f".{module}." in k else v for k, v in tensors.items()}
  (out / peft_adapters.WEIGHTS_FILE).write_bytes(save(cut))
  return out


def test_rank_and_alpha_patterns_give_each_module_its_own_scale(good, tmp_path):
  good_dir, model, abstract = good
  path = _sliced(good_dir, tmp_path, "v_proj", 2, rank_pattern={"v_proj": 2},
                 alpha_pattern={"layers.1.self_attn.q_proj": 2.0})
  assert peft_adapters.read_config(str(path))[0] == 4
  adapter = peft_adapters.load(str(path), model, abstract)
  scales = {(leaf[0][-1], leaf[1]): (pair[0].shape[-1], adapter.scale_of(leaf))
            for leaf, pair in adapter.leaves.items()}
  # scanned layers: the leaf's index is its layer
  assert scales == {("query", (0,)): (4, 2.0), ("query", (1,)): (4, 0.5), ("value", (0,)): (2, 4.0),
                    ("value", (1,)): (2, 4.0)}, scales
  assert adapter.rank == 4


def test_a_rank_pattern_raising_a_modules_rank_is_the_rank_the_tensors_must_have(good, tmp_path):
  """r=2 with rank_pattern giving q_proj 4: the config's largest rank is 4, as its q_proj tensors (was: refused)."""
  good_dir, model, abstract = good
  path = _sliced(good_dir, tmp_path, "v_proj", 2, r=2, rank_pattern={"q_proj": 4})
  assert peft_adapters.read_config(str(path))[0] == 4
  lora_adapters.check_stored_rank("a", str(path), 4)
  assert peft_adapters.load(str(path), model, abstract).rank == 4


@pytest.mark.parametrize("keys, words", [
    ({"rank_pattern": {"q_proj": 0}}, "rank_pattern must map module names to ranks >= 1, got {'q_proj': 0}"),
    ({"alpha_pattern": {"q_proj": "x"}}, "alpha_pattern must map module names to finite numbers"),
    ({"rank_pattern": ["q_proj"]}, "rank_pattern must map module names to ranks >= 1"),
    ({"rank_pattern": {"(q": 2}}, "rank_pattern key '(q' is not a regular expression"),
], ids=["rank-0", "alpha-string", "rank-list", "bad-regex"])
def test_a_malformed_pattern_is_one_line(good, tmp_path, keys, words):
  with pytest.raises(UserError) as e:
    peft_adapters.read_config(str(_variant(good[0], tmp_path, **keys)))
  assert words in str(e.value) and "\n" not in str(e.value)


def test_a_module_whose_tensors_miss_its_pattern_rank_is_refused(good, tmp_path):
  good_dir, model, abstract = good
  path = _sliced(good_dir, tmp_path, "v_proj", 2, rank_pattern={"v_proj": 3})
  with pytest.raises(UserError, match=r"v_proj's adapter has rank 2 .* says r=3 for it \(r or rank_pattern\)"):
    peft_adapters.load(str(path), model, abstract)


@pytest.mark.parametrize("flag, scale", [(True, 8.0 / 2), (False, 8.0 / 4), (None, 8.0 / 4)])
def test_rank_stabilised_lora_scales_by_alpha_over_the_root_of_the_rank(good, tmp_path, flag, scale):
  """use_rslora: PEFT scales B·A by lora_alpha / sqrt(r) (was: refused). null reads as PEFT reads it: off."""
  good_dir, model, abstract = good
  adapter = peft_adapters.load(str(_variant(good_dir, tmp_path, use_rslora=flag)), model, abstract)
  assert adapter.scale == scale


# ---------------------------------------------------------------- against PEFT on the HF model
@pytest.mark.slow  # PEFT and transformers' generate on CPU, and a table engine
def test_rslora_and_per_module_ranks_and_alphas_generate_what_peft_generates(tmp_path):
  """An rsLoRA adapter, one with rank_pattern / alpha_pattern and a plain one, saved by PEFT, in one batch with the
  base model: each row's greedy tokens are PEFT's (was: both refused). With rsLoRA's scale read as alpha / r the
  rsLoRA row's tokens differ."""
  peft = pytest.importorskip("peft", reason="needs peft (EXTRAS=test bash setup.sh)")
  sys.path.insert(0, str(Path(__file__).parent.parent))
  import hf_families as hf

  # "pat": a rank and an alpha per module (rank_pattern keys match a name's end, alpha_pattern's a whole layer's)
  targets = ["q_proj", "v_proj", "down_proj"]
  specs = {"rs": dict(r=4, lora_alpha=8.0, use_rslora=True, target_modules=targets),
           "plain": dict(r=4, lora_alpha=8.0, target_modules=targets),
           "pat": dict(r=2, lora_alpha=8.0, target_modules=targets, rank_pattern={"v_proj": 4, "down_proj": 3},
                       alpha_pattern={"layers.1.self_attn.q_proj": 1.0, "v_proj": 20.0})}
  prompts = [[5, 17, 3, 99, 42], [7, 1, 120, 8], [64, 2, 2, 31, 9, 11], [3, 8, 100, 4, 4]]
  picks, new_tokens = ["rs", None, "plain", "pat"], 6
  expected = peft_generates(peft, hf, tmp_path, specs, picks, prompts, new_tokens, seed=lambda pick: 7)
  engine, registry = engine_with_adapters(hf, tmp_path, specs, len(prompts))
  assert [(a.name, a.rank, a.use_rslora) for a in registry.adapters()] == [("pat", 4, False), ("plain", 4, False),
                                                                         ("rs", 4, True)]
  rows = [RowParams(adapter=0 if p is None else registry.acquire(p)) for p in picks]
  assert greedy(engine, registry.params, prompts, rows, new_tokens) == expected
  # "plain" holds the same tensors (one seed): at alpha / r they give other tokens, so the scales are told apart
  plain_row = [RowParams(adapter=registry.acquire("plain"))]
  assert greedy(engine, registry.params, prompts[:1], plain_row, new_tokens)[0] != expected[0]


# ---------------------------------------------------------------- the admin route, on a stand-in registry
class _Admin:
  """lora_admin.Admin's answers without an engine: records the adds it is asked for."""
  base_name = "base"

  def __init__(self):
    self.added: list[tuple[str, str]] = []

  def names(self):
    return [n for n, _ in self.added]

  async def add(self, name: str, path: str):
    from MaxText.inference import lora_admin
    self.added.append((name, path))
    return lora_admin.LoadedAdapter(name, len(self.added), 4, 8.0, ("q_proj",))


def _route_client(admin: _Admin):
  """The admin routes over `admin`, answering ApiErrors as the server does."""
  from fastapi import FastAPI
  from fastapi.responses import JSONResponse
  from fastapi.testclient import TestClient
  from MaxText.inference import lora_routes
  from MaxText.inference import openai_api as api

  app = FastAPI()

  @app.exception_handler(api.ApiError)
  async def api_error(_, e):
    return JSONResponse(e.body(), status_code=e.status)

  lora_routes.add_routes(app, admin, admin_allowed=True)
  return TestClient(app)


@pytest.mark.parametrize("extra", [{"lora_alpha": 16}, {"rank": 8}, {"scale": 2.0}])
def test_an_add_with_a_field_it_would_ignore_is_a_400_naming_it(extra):
  """Was: loaded with the adapter's own alpha / rank, the field dropped without a word."""
  from MaxText.inference import lora_routes

  admin = _Admin()
  client = _route_client(admin)
  (field,) = extra
  response = client.post(lora_routes.ROUTE, json={"name": "a", "path": "/x", **extra})
  assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text
  assert response.json()["error"]["message"].startswith(f"{field} is not supported by POST /v1/admin/lora_adapters")
  assert admin.added == []
  ok = client.post(lora_routes.ROUTE, json={"name": "a", "path": "/x", "comment": None})  # null is no value
  assert ok.status_code == 200 and admin.added == [("a", "/x")], ok.text



@pytest.mark.parametrize("path, words", [
    ("/x" * 50_000, "a LoRA adapter's path is 100000 characters, longer than any file path (4096); got '/x/x/x"),
    ("/adapters/a\0b", "a LoRA adapter's path cannot hold a NUL character, got '/adapters/a\\x00b'"),
], ids=["100k-chars", "nul"])
def test_a_path_no_file_can_have_is_a_short_400(path, words):
  """Was: a 100 KB path echoed whole into a 100 KB error line; a NUL read as "is not a PEFT LoRA adapter"."""
  from MaxText.inference import lora_routes

  admin = _Admin()
  response = _route_client(admin).post(lora_routes.ROUTE, json={"name": "a", "path": path})
  assert response.status_code == 400 and response.json()["error"]["param"] == "path", response.text[:300]
  assert response.json()["error"]["message"].startswith(words) and len(response.text) < 400, response.text[:300]
  assert admin.added == []
  with pytest.raises(UserError, match="NUL character|longer than any file path"):  # serve_lora_adapters too
    lora_adapters.check_start_names([("a", path)], "base", 0)


def test_an_adapter_whose_scaled_weights_overflow_is_refused_with_no_change(good, tmp_path):
  """Finite lora_B weights times a finite lora_alpha / r beyond float32's range: the table row held inf, and every
  request for the adapter decoded NaN logits (token 0 again and again) without a word."""
  import types

  from safetensors.numpy import load, save

  good_dir, model, abstract = good
  big = _variant(good_dir, tmp_path, lora_alpha=1e29)
  tensors = load((big / peft_adapters.WEIGHTS_FILE).read_bytes())
  (big / peft_adapters.WEIGHTS_FILE).write_bytes(save({k: v * 1e12 if ".lora_B." in k else v
                                                       for k, v in tensors.items()}))
  table = object.__new__(lora_adapters.AdapterTable)  # the tables' rows without an engine: nothing compiles
  table.engine = types.SimpleNamespace(cfg=model, spec=types.SimpleNamespace(abstract_params=abstract))
  table.capacity, table.rank, table.targets = 2, 4, ("q_proj", "v_proj")
  table._places = lora_adapters.table_places(abstract)
  registry = lora_adapters.Registry(table, "base", abstract)
  with pytest.raises(UserError) as e:
    registry.add("big", str(big))
  assert str(e.value) == (f"LoRA adapter 'big' ({big}): its lora_B times its scale (2.5e+28, from lora_alpha) overflows "
                          "float32 in layers/self_attention/query; lora_alpha or the lora_B weights are far too large")
  assert registry.names() == [] and registry.params is abstract
  # the same adapter at its own alpha fits
  fine = peft_adapters.load(str(good_dir), model, abstract)
  assert all(np.isfinite(v).all() for v in table.row_values(fine).values())


# ---------------------------------------------------------------- target_modules against the tensors
def _stand_in_registry(model, abstract):
  """A Registry over the model's abstract parameters: Registry.add's reads and checks, nothing compiled."""
  import types

  table = object.__new__(lora_adapters.AdapterTable)
  table.engine = types.SimpleNamespace(cfg=model, spec=types.SimpleNamespace(abstract_params=abstract))
  table.capacity, table.rank, table.targets = 2, 4, ("q_proj", "v_proj", "k_proj")
  table._places = lora_adapters.table_places(abstract)
  return lora_adapters.Registry(table, "base", abstract)


@pytest.mark.parametrize("keys, module", [
    ({"target_modules": ["q_proj"]}, "model.layers.0.self_attn.v_proj"),
    ({"target_modules": ".*q_proj"}, "model.layers.0.self_attn.v_proj"),
    ({"exclude_modules": ["v_proj"]}, "model.layers.0.self_attn.v_proj"),
    ({"layers_to_transform": [0]}, "model.layers.1.self_attn.q_proj"),
    ({"layers_to_transform": 1, "layers_pattern": "layers"}, "model.layers.0.self_attn.q_proj"),
], ids=["not-listed", "regex", "excluded", "other-layer", "layer-pattern"])
def test_tensors_of_a_module_the_config_does_not_select_are_refused_naming_it(good, tmp_path, keys, module):
  """PEFT puts LoRA layers only on the modules the config selects and drops the other tensors without a word (peft
  0.21); was: served with every tensor applied, a model PEFT does not load. Refused at the add route and at start."""
  good_dir, model, abstract = good
  bad = _variant(good_dir, tmp_path, **keys)
  with pytest.raises(UserError) as e:
    _stand_in_registry(model, abstract).add("bad", str(bad))
  assert f"{bad}: adapter_model.safetensors holds the adapter of {module}, which adapter_config.json does not " \
         "select" in str(e.value) and "\n" not in str(e.value)
  from MaxText.configuration.config import Config
  from test_lora_adapters import TINY
  with pytest.raises(UserError, match=f"holds the adapter of {module}"):  # serve_lora_adapters: before the engine
    lora_adapters.load_engine(Config.for_testing(**TINY, serve_lora_adapters=f"bad={bad}"), 1, "", "base")


def test_a_named_target_with_no_tensors_is_refused_naming_the_module(good, tmp_path):
  """target_modules names k_proj, which the model has, but the file holds none of its tensors: PEFT starts it from
  its initialisation (random with init_lora_weights=false); was: served as if k_proj were not a target."""
  good_dir, model, abstract = good
  bad = _variant(good_dir, tmp_path, target_modules=["q_proj", "v_proj", "k_proj"])
  registry = _stand_in_registry(model, abstract)
  with pytest.raises(UserError) as e:
    registry.add("bad", str(bad))
  assert f"{bad}: adapter_config.json selects model.layers.0.self_attn.k_proj (target_modules=['q_proj', 'v_proj', " \
         "'k_proj']) but adapter_model.safetensors holds no adapter for it (2 such module(s))" in str(e.value)
  assert "\n" not in str(e.value) and registry.names() == []


def test_a_target_the_model_does_not_have_is_left_alone_as_peft_leaves_it(good, tmp_path):
  """A target list written for several architectures (c_attn is GPT-2's): PEFT adapts the modules that exist."""
  good_dir, model, abstract = good
  adapter = peft_adapters.load(str(_variant(good_dir, tmp_path, target_modules=["q_proj", "v_proj", "c_attn"])),
                               model, abstract)
  assert adapter.targets == ("q_proj", "v_proj") and len(adapter.leaves) == 4
