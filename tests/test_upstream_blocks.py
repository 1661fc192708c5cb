"""benchmarks/upstream_blocks.py: a path that holds no upstream recipe file is one line and a non-zero exit,
not a line per file and success; a checkout's blocks are read and tried."""

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import upstream_blocks
from MaxText.errors import UserError

_RECIPE = '''
from benchmarks.benchmark_utils import MaxTextModel
tiny = MaxTextModel(model_name="tiny-v5e-8", model_type="llama2-7b", tuning_params={
    "per_device_batch_size": 1, "remat_policy": "custom", "decoder_layer_input": "offload", "query_proj": "device"})
wrong = MaxTextModel(model_name="wrong-v5e-8", model_type="llama2-7b", tuning_params={"query_proj": "hbm"})
'''


@pytest.mark.parametrize("where, message", [
    ("missing", r"^upstream=\S+missing does not exist: name a MaxText checkout, or its bare git directory$"),
    ("empty", r"^upstream=\S+empty holds no benchmarks/\{maxtext_v5e_model_configs.py\}: name a MaxText checkout"),
])
def test_a_path_that_is_no_checkout_is_one_line(tmp_path, where, message):
  (tmp_path / "empty").mkdir()
  with pytest.raises(UserError, match=message):
    upstream_blocks.main([f"upstream={tmp_path / where}", "files=maxtext_v5e_model_configs.py"])
  with pytest.raises(UserError, match=r"^files=, names no recipe file"):
    upstream_blocks.main([f"upstream={tmp_path}", "files=,"])


def test_the_command_exits_non_zero_with_one_line(tmp_path):
  done = subprocess.run([sys.executable, upstream_blocks.__file__, f"upstream={tmp_path}"], capture_output=True,
                        text=True, check=False)
  assert done.returncode == 2 and done.stdout == ""
  assert done.stderr.startswith(f"error: upstream={tmp_path} holds no benchmarks/") and done.stderr.count("\n") == 1


def test_a_checkouts_blocks_are_tried(tmp_path, capsys):
  (tmp_path / "benchmarks").mkdir()
  (tmp_path / "benchmarks" / "maxtext_v5e_model_configs.py").write_text(_RECIPE)
  assert upstream_blocks.main([f"upstream={tmp_path}"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0] == f"maxtext_trillium_model_configs.py: not in {tmp_path}"
  assert "maxtext_v5e_model_configs.py tiny-v5e-8 (llama2-7b, v5e-8): loads" in out
  assert any(line.startswith("maxtext_v5e_model_configs.py wrong-v5e-8 (llama2-7b, v5e-8): error: query_proj='hbm'")
             for line in out)
  assert "maxtext_v5e_model_configs.py: 1 of 2 blocks load" in out


def test_a_recipe_file_that_cannot_be_read_is_one_line(tmp_path, capsys):
  (tmp_path / "benchmarks").mkdir()
  (tmp_path / "benchmarks" / "maxtext_v5e_model_configs.py").write_text("import a_module_upstream_has_and_we_do_not\n")
  assert upstream_blocks.main([f"upstream={tmp_path}", "files=maxtext_v5e_model_configs.py"]) == 0
  assert capsys.readouterr().out == ("maxtext_v5e_model_configs.py: cannot be read here (ModuleNotFoundError: No module "
                                     "named 'a_module_upstream_has_and_we_do_not')\n")


def test_a_block_on_a_slice_that_does_not_exist_or_with_a_dcn_degree_not_a_number_is_its_own_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
  """Each is an error line of its own and the other blocks are still tried (was: `v5e-3` in a block's name stopped the
  whole command with "unknown compile_topology"; dcn_data_parallelism="auto" with a ValueError traceback), as is a
  file that is not UTF-8 or that calls exit()."""
  recipe = _RECIPE + '''
odd = MaxTextModel(model_name="odd_v5e-3", model_type="llama2-7b", tuning_params={"per_device_batch_size": 1})
auto = MaxTextModel(model_name="auto-v5e-8", model_type="llama2-7b", tuning_params={"dcn_data_parallelism": "auto"})
'''
  (tmp_path / "benchmarks").mkdir()
  (tmp_path / "benchmarks" / "maxtext_v5e_model_configs.py").write_text(recipe)
  (tmp_path / "benchmarks" / "maxtext_v5p_model_configs.py").write_bytes(b"# caf\xe9\nimport sys\nsys.exit(3)\n")
  files = "files=maxtext_v5p_model_configs.py,maxtext_v5e_model_configs.py"
  assert upstream_blocks.main([f"upstream={tmp_path}", files]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0] == "maxtext_v5p_model_configs.py: cannot be read here (SystemExit: 3)"
  assert any(line.startswith("maxtext_v5e_model_configs.py odd_v5e-3 (llama2-7b, v5e-3): error: unknown "
                             "compile_topology 'v5e-3'") for line in out), out
  assert ("maxtext_v5e_model_configs.py auto-v5e-8 (llama2-7b): error: dcn_data_parallelism='auto' is not a whole "
          "number of slices") in out
  assert out[-1] == "maxtext_v5e_model_configs.py: 1 of 4 blocks load"
