"""Each page's commands after exactly the install the page (or the block) states, in a fresh venv.

The docs test runs every block in the environment CI installs, EXTRAS=test, which holds every
extra: a page that needs more than it tells its reader to install passes there. Here each `cpu`
block whose page or block states another install (`EXTRAS=hf,eval bash setup.sh`;
tests/doc_installs.py says which install a block runs after) runs in a venv that has that install
and nothing else, and must pass as the docs test would (exit status and quoted output). One venv per
distinct EXTRAS set, shared by its blocks; pip takes the packages from its cache where CI's own
install left them. The plain install's pages stay in the docs test: their venv would mean running
most of the docs twice, more than CI's budget holds (.ci/run), and tests/test_setup_install.py
trains in it; tests/test_doc_installs.py checks statically what every block imports and calls.

Real installs download: -m slow with MAXTEXT_INSTALL_TEST=1 only (.ci/run's docs stage), as
tests/test_setup_install.py. Under that setting the docs test leaves these blocks to this one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import doc_blocks, doc_installs, venv_install

BLOCKS, _ = doc_blocks.all_blocks()
OWN = doc_installs.after_own_install(BLOCKS)
_VENVS: dict[frozenset[str], venv_install.Venv | str] = {}  # extras -> the venv, or why its install failed


@pytest.fixture(scope="session")
def venv_root(tmp_path_factory) -> Path:
  return tmp_path_factory.mktemp("page_installs")


def _venv(extras: frozenset[str], root: Path) -> venv_install.Venv:
  if extras not in _VENVS:
    try:
      _VENVS[extras] = venv_install.install(",".join(sorted(extras)), root / "-".join(sorted(extras)))
    except AssertionError as e:
      _VENVS[extras] = str(e)
  venv = _VENVS[extras]
  assert not isinstance(venv, str), venv
  return venv


@pytest.mark.slow
@pytest.mark.parametrize("block", [pytest.param(b, id=f"{b.id}-after-{'+'.join(sorted(OWN[b.id]))}")
                                   for b in BLOCKS if b.id in OWN])
def test_page_block_after_its_own_install(block: doc_blocks.Block, venv_root: Path, tmp_path: Path) -> None:
  why = venv_install.skip_reason()
  if why is not None:
    pytest.skip(why)
  if any("corpus" in b.tags for b in _chain(block)) and not doc_blocks.CORPUS.exists():
    pytest.skip(f"needs {doc_blocks.CORPUS} (the shared data beside the repository), which is absent")
  venv = _venv(OWN[block.id], venv_root)
  problem = doc_blocks.check(block, doc_blocks.run(block, tmp_path, bin_dir=venv.bin))
  assert problem is None, f"after {doc_installs.describe(OWN[block.id])}: {problem}"


def _chain(block: doc_blocks.Block) -> list[doc_blocks.Block]:
  chain = [block]
  while chain[0].after is not None:
    chain.insert(0, chain[0].after)
  return chain
