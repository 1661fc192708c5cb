"""A tool that reads no training data (startup.Tool(reads_data=False): the server, decode, the
logit checker, the converters, the params-only export) starts from the config a model was
fine-tuned with (configs/sft.yml, dpo.yml, grpo.yml as the base) though it names no data: the
checks of where data comes from are the training tools' alone. Start-up only: nothing is
loaded or compiled."""

from __future__ import annotations

from pathlib import Path

import pytest

from MaxText import decode, generate_param_only_checkpoint, logit_checker, serve, startup
from MaxText.configuration import config as config_lib
from MaxText.convert import hf_to_maxtext, maxtext_to_hf
from MaxText.errors import ConfigError
from MaxText.rl import evaluate

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TINY = ["base_emb_dim=32", "base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=8", "base_mlp_dim=64",
        "base_num_decoder_layers=2", "vocab_size=272", "print_config=False"]
NO_DATA_TOOLS = [serve, decode, logit_checker, generate_param_only_checkpoint, hf_to_maxtext, maxtext_to_hf]


@pytest.mark.parametrize("tool", NO_DATA_TOOLS, ids=lambda m: m.TOOL.name)
def test_a_tool_that_reads_no_data_starts_from_the_sft_config(tool):
  config = startup.start(tool.TOOL, [tool.TOOL.name, str(CONFIGS / "sft.yml"), *TINY]).config
  assert config.data.objective == "sft" and config.data.dataset_type == "hf" and not config.data.hf_data_files
  assert not tool.TOOL.reads_data


@pytest.mark.parametrize("base", ["sft.yml", "dpo.yml", "grpo.yml"])
def test_the_server_starts_from_every_fine_tuning_config(base):
  config = startup.start(serve.TOOL, ["serve", str(CONFIGS / base), *TINY]).config
  assert config.decode.serve_max_slots >= 1


@pytest.mark.parametrize("base", ["sft.yml", "dpo.yml", "grpo.yml"])
def test_training_still_checks_its_data_keys(base):
  with pytest.raises(ConfigError, match="dataset_type=hf needs hf_path or hf_data_files"):
    config_lib.load_config(["train", str(CONFIGS / base), *TINY])
  with pytest.raises(ConfigError, match="dataset_type=hf needs hf_path or hf_data_files"):
    startup.start(evaluate.TOOL, ["evaluate", str(CONFIGS / base), *TINY])  # reads prompt records
