"""What can be checked without running anything about the docs' commands and the repository's scripts:
each runs after the install its page (or the block, or the script's header) states
(tests/doc_installs.py), none hides a failing step's error, and none that runs here starts a server
on a fixed port or talks to one (tests/shell_text.py). tests/test_page_installs.py runs the pages
after their own installs, in CI."""

from __future__ import annotations

import pytest

from tests import doc_blocks, doc_installs, shell_text

BLOCKS, _ = doc_blocks.all_blocks()
COMMANDS = [b for b in BLOCKS if b.kinds & doc_blocks.COMMAND_KINDS]


def test_every_command_runs_after_the_install_its_page_states():
  problems = doc_installs.block_problems(BLOCKS)
  assert not problems, ("commands that need more than the install their page states (add an install block "
                        "`EXTRAS=... bash setup.sh` above them, or as the block's first line):\n  "
                        + "\n  ".join(problems))


def test_every_end_to_end_script_states_the_install_it_needs():
  problems = doc_installs.script_problems()
  assert not problems, "scripts whose header states too small an install:\n  " + "\n  ".join(problems)


def test_no_block_or_script_hides_a_failing_step():
  found = [f"{b.id}, line {n}: {why}" for b in COMMANDS for n, why in shell_text.hidden_errors(b.body)]
  for path in doc_installs.scripts():
    found += [f"{path.relative_to(doc_blocks.REPO_ROOT)}:{n}: {why}" for n, why in shell_text.hidden_errors(path.read_text())]
  assert not found, "steps whose error is hidden (let it show, or handle it):\n  " + "\n  ".join(found)


def test_nothing_that_runs_here_serves_or_calls_on_a_fixed_port():
  found = [f"{b.id}, line {n}: {why}" for b in COMMANDS if "cpu" in b.kinds for n, why in shell_text.fixed_ports(b.body)]
  for path in doc_installs.scripts():
    found += [f"{path.relative_to(doc_blocks.REPO_ROOT)}:{n}: {why}" for n, why in shell_text.fixed_ports(path.read_text())]
  assert not found, "\n  ".join(["fixed ports:"] + found)


# The checks can fail.

PAGE = """\
```bash cpu
python3 -m MaxText.train configs/base.yml run_name=t metric_trackers=wandb
lm_eval --model local-completions --tasks x --model_args base_url=http://HOST/v1/completions
python3 - <<'PY'
import transformers
PY
```

```bash cpu install
EXTRAS=hf,eval bash setup.sh
```

```bash cpu install
EXTRAS=tracking bash setup.sh
python3 -m MaxText.train configs/base.yml run_name=t metric_trackers=wandb
```

```bash cpu
python3 -m MaxText.train configs/sft.yml run_name=t metric_trackers=wandb
```
"""


def test_a_command_needing_an_extra_its_page_does_not_install_is_found():
  blocks, errors = doc_blocks.parse(PAGE, "page.md")
  assert not errors
  installs = doc_installs.installs(blocks)
  assert [installs[b.id] for b in blocks] == [frozenset(), {"hf", "eval"}, {"hf", "eval", "tracking"}, {"hf", "eval"}]
  problems = doc_installs.block_problems(blocks)
  first = [p for p in problems if p.startswith("page.md:1 ")]
  assert len(first) == 3 and all("(after bash setup.sh)" in p for p in first)
  assert any("metric_trackers=wandb: needs wandb" in p for p in first)
  assert any("lm_eval against a server: needs lm-eval[api]" in p for p in first)
  assert any("imports transformers: needs transformers" in p for p in first)
  # The tracking install of the third block is its own; the fourth needs it again.
  assert [p.split(" ")[0] for p in problems if not p.startswith("page.md:1 ")] == ["page.md:18"]


def test_lm_evals_client_needs_its_api_extra():
  """lm-eval without `[api]` lacks what `--model local-completions` imports (the eval extra as it was)."""
  plain, api = doc_installs.closure(["lm-eval>=0.4.5,<0.5"]), doc_installs.closure(["lm-eval[api]>=0.4.5,<0.5"])
  assert "tenacity" not in plain and {"tenacity", "aiohttp", "requests"} <= api
  assert "tenacity" in doc_installs.provided(frozenset({"eval"}))


@pytest.mark.parametrize("text,hidden", [
    ("lm_eval --model x 2>/dev/null | grep -E '^\\|'", True),
    ("python3 -m MaxText.train x >/dev/null 2>&1", True),
    ("python3 -m MaxText.train x | grep -E '^done' || true", True),
    ("python3 -m MaxText.train x &>/dev/null", True),
    ("python3 -m MaxText.train x | { grep -E '^done' || true; }", False),
    ("trap 'kill $SERVER 2>/dev/null || true' EXIT", False),
    ("kill -0 $SERVER 2>/dev/null || { echo gone; exit 1; }", False),
    ("if command -v nvidia-smi >/dev/null 2>&1; then echo gpu; fi", False),
    ("n=$(git rev-list --count HEAD 2>/dev/null || echo 0)", False),
    ("curl -sf http://x/health >/dev/null && break", False),
])
def test_a_hidden_error_is_found(text, hidden):
  assert bool(shell_text.hidden_errors(text)) == hidden, shell_text.hidden_errors(text)


@pytest.mark.parametrize("text,fixed", [
    ("python3 -m MaxText.serve configs/base.yml port=8011 &", True),
    ("python3 -m MaxText.serve configs/base.yml &", True),  # the default port, 8000
    ("curl -s http://127.0.0.1:8000/v1/completions", True),
    ("python3 -m MaxText.serve configs/base.yml port=0 >serve.log 2>&1 &", False),
    (': "${PORT:=0}"\npython3 -m MaxText.serve configs/base.yml port="$PORT" >log 2>&1 &', False),
    (': "${PORT:=8012}"\npython3 -m MaxText.serve configs/base.yml port="$PORT" >log 2>&1 &', True),
    ("curl -s $URL/completions", False),
])
def test_a_fixed_port_is_found(text, fixed):
  assert bool(shell_text.fixed_ports(text)) == fixed, shell_text.fixed_ports(text)


def test_the_entry_points_import_without_the_hf_extras():
  """The static check reads our own imports; a runtime package can pull an extra in by its own (llguidance.hf
  imports transformers), so the entry points are imported here with the hf extras' packages made unimportable."""
  import subprocess
  import sys

  script = ("import sys\n"
            "class Refuse:\n"
            "  def find_spec(self, name, path=None, target=None):\n"
            "    if name.split('.')[0] in ('transformers', 'torch'):\n"
            "      raise ImportError(f'{name} is an extra (EXTRAS=hf), not in the plain install')\n"
            "sys.meta_path.insert(0, Refuse())\n"
            "import MaxText.train, MaxText.train_compile, MaxText.decode, MaxText.serve, MaxText.plan\n")
  result = subprocess.run([sys.executable, "-c", script], cwd=doc_blocks.REPO_ROOT, capture_output=True, text=True,
                          check=False, timeout=300)
  assert result.returncode == 0, result.stderr.strip().splitlines()[-1:]
