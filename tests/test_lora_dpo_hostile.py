"""Hostile input to LoRA training and export: a tool reading a LoRA run with other LoRA keys, export
directories that collide, and the advice a refused LoRA resume gives. (DPO's own hostile input is in
tests/test_dpo.py; LoRA's config errors in tests/test_lora.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from MaxText.configuration import config as config_lib
from MaxText.configuration import run_record
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError, UserError

LORA_RUN = "base_emb_dim: 64\nlora_rank: 4\nlora_alpha: 8.0\nlora_target_modules: [q_proj, v_proj]\n"


def _run_dir(tmp_path: Path, text: str) -> Path:
  run_dir = tmp_path / "runs" / "r"
  (run_dir / "checkpoints" / "2").mkdir(parents=True, exist_ok=True)
  (run_dir / "config.yml").write_text(text)
  return run_dir


def _tool(tmp_path: Path, *given: str) -> dict:
  """A tool that reads the run (generate_param_only_checkpoint, decode, ...) started with `given` keys."""
  argv = ["t", f"base_output_directory={tmp_path / 'runs'}", "run_name=r", *given]
  return config_lib.load_config(argv, environ={}, reads_run=True)


@pytest.mark.parametrize("given, message", [
    # was: merged with scale 16/4 instead of the trained 8/4, silently
    ("lora_alpha=16", "lora_alpha=16.0 (saved: 8.0): contradicts the model saved in"),
    # was: the v_proj adapters were left out of the merged export, silently
    ("lora_target_modules=q_proj", "lora_target_modules=['q_proj'] (saved: ['q_proj', 'v_proj'])"),
    ("lora_rank=0", "lora_rank=0 (saved: 4)"),
])
def test_a_tool_reading_a_lora_run_refuses_lora_keys_that_contradict_it(tmp_path, given, message):
  _run_dir(tmp_path, LORA_RUN)
  with pytest.raises(ConfigError) as raised:
    _tool(tmp_path, given)
  assert message in str(raised.value), str(raised.value)


def test_a_tool_reading_a_run_takes_its_lora_keys_and_accepts_the_same_ones(tmp_path):
  _run_dir(tmp_path, LORA_RUN)
  values = _tool(tmp_path)
  assert (values["lora_rank"], values["lora_alpha"], tuple(values["lora_target_modules"])) == (4, 8.0, ("q_proj", "v_proj"))
  assert _tool(tmp_path, "lora_rank=4", "lora_alpha=8", "lora_target_modules=q_proj,v_proj")["lora_alpha"] == 8.0
  # A plain run has no adapters: unused LoRA keys are no contradiction, asking for adapters is.
  _run_dir(tmp_path, "base_emb_dim: 64\nlora_rank: 0\nlora_alpha: 8.0\n")
  assert _tool(tmp_path, "lora_alpha=16")["lora_rank"] == 0
  with pytest.raises(ConfigError, match=r"lora_rank=4 \(saved: 0\)"):
    _tool(tmp_path, "lora_rank=4")


@pytest.mark.parametrize("adapter, merged", [("out", "out"), ("out/adapter", "out"), ("out", "out/merged/"),
                                             ("out/", "out")])
def test_the_peft_export_and_the_merged_export_need_directories_of_their_own(tiny_overrides, tmp_path, adapter,
                                                                            merged):
  """was: the adapter was written first, then the merged save failed on the directory it had made."""
  with pytest.raises(ConfigError, match="overlap; each export needs a directory of its own"):
    Config.for_testing(**tiny_overrides, lora_rank=4, lora_peft_export_path=str(tmp_path / adapter),
                       param_only_checkpoint_path=str(tmp_path / merged))
  Config.for_testing(**tiny_overrides, lora_rank=4, lora_peft_export_path=str(tmp_path / "out-adapter"),
                     param_only_checkpoint_path=str(tmp_path / "out"))


def test_an_existing_peft_export_directory_is_refused_before_the_checkpoint_is_read(tiny_overrides, tmp_path):
  """was: the whole checkpoint was read (and restored onto devices) before the refusal."""
  from MaxText import generate_param_only_checkpoint

  (tmp_path / "adapter").mkdir()
  (tmp_path / "not-a-checkpoint").mkdir()
  config = Config.for_testing(**tiny_overrides, lora_rank=4, load_full_state_path=str(tmp_path / "not-a-checkpoint"),
                              param_only_checkpoint_path=str(tmp_path / "merged"),
                              lora_peft_export_path=str(tmp_path / "adapter"))
  with pytest.raises(UserError, match=r"adapter already exists; choose a new lora_peft_export_path"):
    generate_param_only_checkpoint.generate(config)
  assert not (tmp_path / "merged").exists()


def test_a_refused_lora_resume_points_at_the_merged_export(tiny_overrides, tmp_path):
  """was: "start a new run from these weights with load_parameters_path=<run>/checkpoints", which a LoRA run's
  checkpoints are refused as (they hold adapters)."""
  run_dir = _run_dir(tmp_path, LORA_RUN)
  config = Config.for_testing(**tiny_overrides, lora_rank=8, lora_alpha=8.0, lora_target_modules="q_proj,v_proj")
  with pytest.raises(ConfigError) as raised:
    run_record.check_resume(config, str(run_dir), "checkpoint step 2")
  assert "lora_rank: 4 -> 8" in str(raised.value)
  assert "MaxText.generate_param_only_checkpoint param_only_checkpoint_path=DIR) and start a new run from them with " \
         "load_parameters_path=DIR" in str(raised.value)
  assert "load_parameters_path=" + str(run_dir / "checkpoints") not in str(raised.value)
