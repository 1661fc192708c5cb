"""Turning tokenised documents into fixed-length rows: packed (several documents per row) or padded.

Each document of n tokens gives n - 1 (input, target) pairs: inputs = tokens[:-1], targets =
tokens[1:], so no target is ever predicted from another document's tokens. A row holds L pairs:
  inputs_segmentation / targets_segmentation  1, 2, ... per document in the row, 0 on padding
  inputs_position                             0, 1, ... restarting at every document
Attention masks by segment id and the loss skips segment 0, so packing changes neither.
A document may carry a 0/1 weight per token (supervised fine-tuning: 1 on the assistant's tokens);
a pair whose target has weight 0 gets targets_segmentation 0, so the loss skips it while the
input still attends within its document.

Packing is greedy and in order: a document that does not fit in the row's remaining space
starts the next row, unless it is longer than a whole row, in which case it fills the rest of
this row and continues in the next (a continuation restarts its positions at 0). So the next
row always begins at (document index, pair offset), and that pair is the pipeline's entire
resumable state.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import numpy as np

from MaxText.errors import UserError
from MaxText.input_pipeline.batch_spec import FIELDS, NUM_CHANNELS, PIXEL_VALUES


@dataclasses.dataclass(frozen=True)
class ImageDocument:
  """A document with images: int32 [2, n] tokens and 0/1 target weights; each view's (an image,
  a pan-and-scan crop, a Llama 4 tile) float32 [3, R, R] pixel values and its placeholder run
  [start, end) in the tokens, in token order; which image each view belongs to (the views of one
  image are never split between rows; None: every view is an image of its own)."""
  tokens: np.ndarray
  pixels: np.ndarray  # float32 [k, 3, R, R]
  runs: np.ndarray  # int32 [k, 2]
  image_of_run: np.ndarray | None = None  # int32 [k], non-decreasing

  def units(self) -> list[tuple[int, int, int, int]]:
    return image_units(self.runs, self.image_of_run)


def image_units(runs: np.ndarray, image_of_run: np.ndarray | None) -> list[tuple[int, int, int, int]]:
  """(first run, number of runs, start of its first run, end of its last) per image, in order."""
  owners = np.arange(len(runs)) if image_of_run is None else np.asarray(image_of_run)
  firsts = np.flatnonzero(np.diff(np.concatenate([[-1], owners])))
  ends = np.concatenate([firsts[1:], [len(owners)]])
  return [(int(a), int(b - a), int(runs[a, 0]), int(runs[b - 1, 1])) for a, b in zip(firsts, ends)]


@dataclasses.dataclass(frozen=True)
class ImageSlots:
  """A batch row's image capacity: `per_row` slots of [3, size, size] pixel values."""
  per_row: int
  size: int


@dataclasses.dataclass(frozen=True)
class Position:
  index: int = 0  # the document the next row starts in
  offset: int = 0  # (input, target) pairs of that document already emitted


@dataclasses.dataclass(frozen=True)
class Located:
  """A document with its own index, from readers whose indices are not consecutive (streaming.py)."""
  index: int
  document: object


class DocumentCursor:
  """Reads documents index, index+1, ... through `read_from(index)`, an iterator of token lists
  (finite for eval data, endless for repeated train data); remembers the current document so a
  document that moves to the next row is not read twice."""

  def __init__(self, read_from: Callable[[int], Iterator[list[int]]], max_empty_run: int,
               position: Position = Position(), explain_empty: Callable[[], str | None] | None = None):
    self._read_from, self.max_empty_run = read_from, max_empty_run
    # The encoder's account of a run of empty documents (e.g. every sample too long), if it has one.
    self.explain_empty = explain_empty
    self.seek(position)

  def seek(self, position: Position) -> None:
    self.position = position
    self._docs = self._read_from(position.index)
    self._current: np.ndarray | None = None
    self._images: ImageDocument | None = None
    self._loaded = False

  def current(self) -> np.ndarray | None:
    """The current document as int32 [2, n] (tokens, 0/1 target weights), or None past the end
    of finite data. A plain token list weighs every token 1."""
    if not self._loaded:
      document = next(self._docs, None)
      if isinstance(document, Located):
        self.position = Position(document.index, self.position.offset)
        document = document.document
      self._images = document if isinstance(document, ImageDocument) else None
      self._current = None if document is None else _weighted(document)
      self._loaded = True
    return self._current

  def settle(self) -> None:
    """Loads the document the position names, so a reader of Located documents has put its own
    index there (a position saved past a stream's file end then names the next file)."""
    if self.position.offset == 0:
      self.current()

  def current_images(self) -> ImageDocument | None:
    """The current document's images, when it has any."""
    self.current()
    return self._images

  def advance(self, pairs: int = 0) -> None:
    """Consumes `pairs` more pairs of the current document, or moves to the next one (pairs=0)."""
    if pairs:
      self.position = Position(self.position.index, self.position.offset + pairs)
    else:
      self.position = Position(self.position.index + 1, 0)
      self._loaded = False


def _weighted(document: object) -> np.ndarray:
  if isinstance(document, ImageDocument):
    return document.tokens
  array = np.asarray(document, np.int32)
  return array if array.ndim == 2 else np.stack([array, np.ones_like(array)])


def _empty_row(length: int, images: ImageSlots | None = None) -> dict[str, np.ndarray]:
  row = {name: np.zeros(length, np.int32) for name in FIELDS}
  if images is not None:
    row[PIXEL_VALUES] = np.zeros((images.per_row, NUM_CHANNELS, images.size, images.size), np.float32)
  return row


def _image_cut(document: ImageDocument, start: int, take: int, free: int) -> tuple[int, int, int]:
  """(pairs to take, the first view inside them, how many views): `take` shortened to end before
  the first image whose runs it would cut, or before the first image past the `free` slots."""
  first, count = None, 0
  for first_run, num_runs, unit_start, unit_end in document.units():
    if unit_end <= start:
      continue  # emitted with an earlier part of the document
    if unit_start >= start + take:
      break
    if unit_end > start + take or count + num_runs > free:
      return unit_start - start, first_run if first is None else first, count
    first = first_run if first is None else first
    count += num_runs
  return take, 0 if first is None else first, count


def _unfit_image(document: ImageDocument, first: int, length: int, per_row: int) -> str:
  """Why an image cannot start an empty row: its views outnumber the slots, or its runs outrun the row."""
  _, num_runs, unit_start, unit_end = next(u for u in document.units() if u[0] == first)
  if num_runs > per_row:
    return (f"an image's {num_runs} views need more than max_images_per_row={per_row} slots; raise "
            "max_images_per_row")
  what = "placeholder tokens" if num_runs == 1 else f"tokens (its {num_runs} views' placeholder runs and between)"
  return f"an image's {unit_end - unit_start} {what} do not fit in a row of max_target_length={length}; " \
         "raise max_target_length"


def pack_row(cursor: DocumentCursor, length: int, packing: bool,
             images: ImageSlots | None = None) -> dict[str, np.ndarray] | None:
  """One row of `length` pairs from the cursor onwards; None when the data has ended. With
  `images` the row also holds its documents' pixel values."""
  row, filled, segment, empty_run, placed = _empty_row(length, images), 0, 1, 0, 0
  while filled < length:
    document = cursor.current()
    if document is None:
      break
    tokens, weights = document
    remaining = len(tokens) - 1 - cursor.position.offset
    if remaining <= 0:  # a document too short to give a pair (or already used up)
      empty_run += 1
      if empty_run > cursor.max_empty_run:
        explained = cursor.explain_empty() if cursor.explain_empty is not None else None
        raise UserError(explained or f"{empty_run} documents in a row give no (input, target) pair: every "
                        "document needs at least 2 tokens after tokenisation (check the text column and add_bos/add_eos)")
      cursor.advance()
      continue
    empty_run = 0
    space = length - filled
    if remaining > space and filled > 0 and (remaining <= length or not packing):
      break  # it fits in a row of its own: start the next row with it
    take = min(remaining, space)
    start = cursor.position.offset
    document_images = cursor.current_images()
    if document_images is not None:
      if images is None:
        raise UserError("a document has images but the batches have no image slots; set max_images_per_row")
      fitting, first, count = _image_cut(document_images, start, take, images.per_row - placed)
      if fitting < take and filled > 0 and (remaining <= length or not packing) or fitting == 0 < filled:
        break  # its images do not fit here: start the next row with it (or its continuation)
      if fitting == 0:
        raise UserError(_unfit_image(document_images, first, length, images.per_row))
      take = fitting
      row[PIXEL_VALUES][placed:placed + count] = document_images.pixels[first:first + count]
      placed += count
    _place(row, filled, tokens[start:start + take], tokens[start + 1:start + take + 1],
           weights[start + 1:start + take + 1], segment)
    filled, segment = filled + take, segment + 1
    if take < remaining and packing:
      cursor.advance(take)  # a long document continues in the next row
    else:
      cursor.advance()  # done with it (without packing the rest is truncated)
    if not packing:
      break
  return row if filled else None


def _place(row: dict[str, np.ndarray], at: int, inputs: np.ndarray, targets: np.ndarray, target_weights: np.ndarray,
           segment: int) -> None:
  span = slice(at, at + len(inputs))
  row["inputs"][span], row["targets"][span] = inputs, targets
  row["inputs_position"][span] = np.arange(len(inputs), dtype=np.int32)
  row["inputs_segmentation"][span] = segment
  row["targets_segmentation"][span] = segment * (target_weights != 0)


def pack_batch(cursor: DocumentCursor, num_rows: int, length: int, packing: bool,
               images: ImageSlots | None = None) -> tuple[dict[str, np.ndarray], int]:
  """[num_rows, length] int32 arrays (and with `images` [num_rows, per_row, 3, R, R] pixel values)
  and how many rows hold data; past the end of finite data the remaining rows are all padding
  (segment 0), so they add nothing to a loss."""
  rows = []
  for _ in range(num_rows):
    row = pack_row(cursor, length, packing, images)
    if row is None:
      break
    rows.append(row)
  num_real = len(rows)
  rows += [_empty_row(length, images) for _ in range(num_rows - num_real)]
  return {name: np.stack([r[name] for r in rows]) for name in rows[0]}, num_real
