"""Small corpora, tokenizers and prepared datasets built in temporary directories for the
input-pipeline tests (nothing is copied into the repository)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from MaxText.input_pipeline import prepare_data
from tests.conftest import SHAKESPEARE

NUM_DOCS = 48


def numbered_documents(num_docs: int = NUM_DOCS) -> list[str]:
  """Documents whose text says which document they are ("doc 7 ...") and of varied length."""
  rng = np.random.default_rng(0)
  words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
  return [f"doc {i} " + " ".join(rng.choice(words, size=int(rng.integers(1, 30)))) for i in range(num_docs)]


def doc_id_encoder(text: str) -> list[int]:
  """Encodes "doc N ..." as N + 10 repeated by the document's word count: rows then show which
  documents they hold, and lengths vary."""
  words = text.split()
  return [int(words[1]) + 10] * len(words)


def shakespeare_text() -> str:
  if not SHAKESPEARE.is_file():
    pytest.skip(f"{SHAKESPEARE} is absent (the shared tinyshakespeare corpus these tests train a tokenizer on)")
  return SHAKESPEARE.read_text(encoding="utf-8")


def prepare_corpus(directory: Path, documents: list[str], eval_fraction: float = 0.25, formats: str = "jsonl,arrayrecord",
                   name: str = "corpus") -> Path:
  """Writes the documents (one paragraph each) and runs prepare_data on them."""
  directory.mkdir(parents=True, exist_ok=True)
  source = directory / f"{name}.txt"
  source.write_text("\n\n".join(documents) + "\n", encoding="utf-8")
  assert prepare_data.main(["prepare_data", f"data_files={source}", f"output_path={directory / 'prepared'}",
                            f"formats={formats}", f"eval_fraction={eval_fraction}"]) == 0
  return directory / "prepared"


def read_jsonl(path: Path) -> list[str]:
  return [json.loads(line)["text"] for line in path.read_text().splitlines()]
