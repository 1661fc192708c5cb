"""serve_lora_adapters with an adapter whose target_modules names a module its file holds no tensors for: refused
from the adapter's own files and the model keys, before the engine is built and the base model's weights load
(was: refused by Registry.add only after both, minutes for a real model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from MaxText.configuration.config import Config
from MaxText.convert import peft_adapters
from MaxText.errors import UserError
from MaxText.inference import lora_adapters
from test_lora_adapters import TINY, write_adapter


def test_a_named_target_with_no_tensors_is_refused_before_the_engine_loads(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
  write_adapter(tmp_path / "a", 4, 8.0, ("q_proj", "v_proj"), seed=3)
  config = json.loads((tmp_path / "a" / peft_adapters.CONFIG_FILE).read_text())
  (tmp_path / "a" / peft_adapters.CONFIG_FILE).write_text(
      json.dumps({**config, "target_modules": ["q_proj", "v_proj", "k_proj"]}))

  def engine_built(*args: object, **kwargs: object) -> None:
    raise AssertionError("the engine was built (and the base weights loaded) before the refusal")

  monkeypatch.setattr(lora_adapters, "Engine", engine_built)
  with pytest.raises(UserError) as e:
    lora_adapters.load_engine(Config.for_testing(**TINY, serve_lora_adapters=f"bad={tmp_path / 'a'}"), 1, "", "base")
  assert f"{tmp_path / 'a'}: adapter_config.json selects model.layers.0.self_attn.k_proj (target_modules=['q_proj', " \
         "'v_proj', 'k_proj']) but adapter_model.safetensors holds no adapter for it (2 such module(s))" in str(e.value)
  assert "\n" not in str(e.value)
