"""The docs stay true to the code: the architecture map names every module."""

from __future__ import annotations

from tests.conftest import REPO_ROOT

ARCHITECTURE = REPO_ROOT / "getting_started" / "Architecture.md"


def test_the_architecture_map_names_every_module():
  text = ARCHITECTURE.read_text()
  modules = sorted(p for p in (REPO_ROOT / "MaxText").rglob("*.py") if p.name != "__init__.py")
  unnamed = [str(p.relative_to(REPO_ROOT)) for p in modules if f"{p.stem}.py" not in text]
  assert not unnamed, f"getting_started/Architecture.md does not name {unnamed}: add each to the module map"
