"""benchmarks/plan_recipes.py's arguments: a recipe name with no configs/<name>.sh is one line naming it and the
recipes there are, before anything is planned or written (it was a FileNotFoundError traceback, after the output's
folder had been made)."""

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT


def test_an_unknown_recipe_is_one_line_naming_the_known_ones(tmp_path):
  out = tmp_path / "out" / "rows.jsonl"
  proc = subprocess.run([sys.executable, "benchmarks/plan_recipes.py", "recipes=v5e/33b,v5e/32b", f"output_path={out}"],
                        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr)
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: recipes=v5e/33b,v5e/32b: no recipe v5e/33b; known: "), lines
  assert "v5e/32b" in lines[0].split("known: ")[1].split(", ") and not (tmp_path / "out").exists()


def test_an_output_path_it_cannot_append_to_is_one_line_before_any_plan(tmp_path: Path) -> None:
  """A directory, gs:// or nothing (was: an IsADirectoryError or FileNotFoundError traceback after the first recipe's
  plan had run, or rows appended to a local folder named `gs:`)."""
  for path, words in ((str(tmp_path), f"output_path={tmp_path} is a directory; name a .jsonl file in it"),
                      ("gs://b/rows.jsonl", "output_path='gs://b/rows.jsonl': name a local .jsonl file"),
                      ("gs:/b/rows.jsonl", "output_path='gs:/b/rows.jsonl': name a local .jsonl file"),
                      ("", "output_path='': name a local .jsonl file")):
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "plan_recipes.py"), "recipes=v5e/32b",
                           f"output_path={path}"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", (path, proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.startswith(f"error: {words}") and proc.stderr.count("\n") == 1, (path, proc.stderr)
  assert [p.name for p in tmp_path.iterdir()] == []


def test_recipes_that_name_none_is_one_line_not_every_recipe(tmp_path: Path) -> None:
  """`recipes=,` (an empty shell variable in a list) planned every v5e and v5p recipe, hours of plans."""
  proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "plan_recipes.py"), "recipes=,",
                         f"output_path={tmp_path / 'rows.jsonl'}"], cwd=tmp_path, capture_output=True, text=True,
                        timeout=60)
  assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr)
  assert proc.stderr == "error: recipes=',' names no recipe; leave it out for every v5e and v5p recipe\n"
  assert list(tmp_path.iterdir()) == []
