"""Session-wide fixtures for the input-pipeline tests: a SentencePiece tokenizer trained once on
the shared tinyshakespeare corpus, and a small prepared corpus in every format."""

from __future__ import annotations

from pathlib import Path

import pytest

from MaxText import train_tokenizer
from tests.input_pipeline.data_fixtures import numbered_documents, prepare_corpus, shakespeare_text


@pytest.fixture(scope="session")
def spm_model(tmp_path_factory) -> str:
  """A 512-token BPE SentencePiece model trained on tinyshakespeare (about 2 s)."""
  directory = tmp_path_factory.mktemp("tokenizer")
  corpus = directory / "corpus.txt"
  corpus.write_text(shakespeare_text(), encoding="utf-8")
  output = directory / "spm.model"
  train_tokenizer.train([str(corpus)], 512, str(output))
  return str(output)


@pytest.fixture(scope="session")
def prepared(tmp_path_factory) -> Path:
  """numbered_documents() prepared as jsonl, ArrayRecord and TFDS (train 36 / validation 12 documents)."""
  return prepare_corpus(tmp_path_factory.mktemp("corpus"), numbered_documents(), formats="jsonl,arrayrecord,tfds")
