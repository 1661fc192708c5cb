"""Packing: segment boundaries, per-document positions, the attention mask they imply, padding,
truncation, long documents split across rows."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.errors import UserError
from MaxText.input_pipeline.packing import DocumentCursor, Position, pack_batch, pack_row
from MaxText.layers.masks import self_mask


def _cursor(docs: list[list[int]], position: Position = Position()) -> DocumentCursor:
  return DocumentCursor(lambda index: iter(docs[index:]), max_empty_run=len(docs), position=position)


def _docs(*lengths: int) -> list[list[int]]:
  """Document d is the tokens 100*d+0, 100*d+1, ...: every token says its document and place."""
  return [[100 * d + t for t in range(n)] for d, n in enumerate(lengths, start=1)]


def test_packed_row_keeps_documents_apart():
  row = pack_row(_cursor(_docs(4, 3, 5)), length=12, packing=True)
  # Pairs per document: 3, 2, 4 -> 9 of 12 positions used, 3 padding.
  np.testing.assert_array_equal(row["inputs_segmentation"], [1, 1, 1, 2, 2, 3, 3, 3, 3, 0, 0, 0])
  np.testing.assert_array_equal(row["targets_segmentation"], row["inputs_segmentation"])
  np.testing.assert_array_equal(row["inputs_position"], [0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 0, 0])
  np.testing.assert_array_equal(row["inputs"][:9], [100, 101, 102, 200, 201, 300, 301, 302, 303])
  np.testing.assert_array_equal(row["targets"][:9], [101, 102, 103, 201, 202, 301, 302, 303, 304])
  assert not row["inputs"][9:].any() and not row["targets"][9:].any()
  real = row["targets_segmentation"] > 0
  # Every target is the next token of the same document: no pair crosses a boundary.
  assert np.all(row["targets"][real] // 100 == row["inputs"][real] // 100)
  assert np.all(row["targets"][real] == row["inputs"][real] + 1)


def test_attention_mask_from_packed_segments_never_crosses_documents():
  row = pack_row(_cursor(_docs(4, 3, 5)), length=12, packing=True)
  mask = np.asarray(self_mask(jnp.asarray(row["inputs_segmentation"])[None]))[0]  # [L, L]
  doc = row["inputs"] // 100
  for q in range(9):
    visible = set(np.nonzero(mask[q])[0])
    expected = {k for k in range(q + 1) if doc[k] == doc[q]}
    assert visible == expected, (q, visible, expected)


def test_document_that_does_not_fit_starts_the_next_row():
  cursor = _cursor(_docs(5, 5, 3))
  first = pack_row(cursor, length=6, packing=True)
  np.testing.assert_array_equal(first["inputs_segmentation"], [1, 1, 1, 1, 0, 0])
  assert cursor.position == Position(1, 0)
  second = pack_row(cursor, length=6, packing=True)
  np.testing.assert_array_equal(second["inputs_segmentation"], [1, 1, 1, 1, 2, 2])
  np.testing.assert_array_equal(second["inputs"], [200, 201, 202, 203, 300, 301])


def test_document_longer_than_a_row_continues_with_positions_restarting():
  cursor = _cursor(_docs(2, 10))
  rows = [pack_row(cursor, length=4, packing=True) for _ in range(3)]
  np.testing.assert_array_equal(rows[0]["inputs"], [100, 200, 201, 202])
  np.testing.assert_array_equal(rows[0]["inputs_segmentation"], [1, 2, 2, 2])
  np.testing.assert_array_equal(rows[1]["inputs"], [203, 204, 205, 206])
  np.testing.assert_array_equal(rows[1]["targets"], [204, 205, 206, 207])
  np.testing.assert_array_equal(rows[1]["inputs_position"], [0, 1, 2, 3])
  np.testing.assert_array_equal(rows[2]["inputs"][:2], [207, 208])
  np.testing.assert_array_equal(rows[2]["inputs_segmentation"], [1, 1, 0, 0])
  assert pack_row(cursor, length=4, packing=True) is None


def test_without_packing_one_document_per_row_truncated_or_padded():
  cursor = _cursor(_docs(3, 9, 1, 4))
  batch, num_real = pack_batch(cursor, num_rows=4, length=5, packing=False)
  assert num_real == 3  # the 1-token document gives no pair and is skipped
  np.testing.assert_array_equal(batch["inputs_segmentation"][0], [1, 1, 0, 0, 0])
  np.testing.assert_array_equal(batch["inputs"][1], [200, 201, 202, 203, 204])  # truncated
  np.testing.assert_array_equal(batch["targets"][1], [201, 202, 203, 204, 205])
  np.testing.assert_array_equal(batch["inputs"][2], [400, 401, 402, 0, 0])
  assert not batch["inputs_segmentation"][3].any()  # data ran out: a padding row


def test_resuming_from_a_position_gives_the_same_rows():
  docs = _docs(*np.random.default_rng(1).integers(1, 15, size=40))
  cursor = _cursor(docs)
  rows = [pack_row(cursor, length=8, packing=True) for _ in range(12)]
  resumed = _cursor(docs)
  for i in range(12):
    resumed.seek(resumed.position)  # a fresh read from the position alone, as after a restore
    row = pack_row(resumed, length=8, packing=True)
    for name in row:
      np.testing.assert_array_equal(row[name], rows[i][name], err_msg=f"row {i} {name}")


def test_only_unusable_documents_is_an_error():
  cursor = DocumentCursor(lambda index: iter([[5]] * 100), max_empty_run=10)
  with pytest.raises(UserError, match="give no \\(input, target\\) pair"):
    pack_row(cursor, length=8, packing=True)
