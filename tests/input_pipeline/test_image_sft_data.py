"""Multimodal SFT records → documents with images (input_pipeline/image_sft.py) and their packing
(packing.py): placeholder runs of the right length, weights only on the assistant's text, pixel
values equal to images.py's, truncation and packing never splitting an image, images in token
order in their row's slots, exact resume, and one-line refusals naming the image."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from MaxText.configuration.vision_config import VisionConfig
from MaxText.errors import UserError
from MaxText.families import gemma3_images
from MaxText.input_pipeline import chat, image_sft, images
from MaxText.input_pipeline.packing import DocumentCursor, ImageDocument, ImageSlots, Position, pack_batch, pack_row
from sft_fixtures import GEMMA3, IMAGE_SPECIAL, write_tokenizer

pytest.importorskip("transformers", reason="needs transformers (EXTRAS=test bash setup.sh)")
SIZE, TOKENS = 8, 4  # image side and soft tokens per image: tiny, the subject is the layout


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  return chat.load_chat_tokenizer(str(write_tokenizer(tmp_path_factory.mktemp("tok"), GEMMA3, IMAGE_SPECIAL)))


def vision(tokenizer, use_multimodal: bool = True) -> VisionConfig:
  ids = dict(zip(("boi_token_id", "eoi_token_id", "image_token_id"),
                 tokenizer.convert_tokens_to_ids(["<start_of_image>", "<end_of_image>", "<image_soft_token>"])))
  fields = {f.name: 0 for f in dataclasses.fields(VisionConfig)}
  return VisionConfig(**{**fields, "use_multimodal": use_multimodal, "mm_tokens_per_image": TOKENS,
                         "vision_image_size": SIZE, **ids, "freeze_vision_encoder": False,
                         "freeze_multimodal_projector": False})


def encoder(tokenizer, length: int = 256, max_images: int = 3, **kw) -> image_sft.ImageSftEncoder:
  return image_sft.ImageSftEncoder(tokenizer, length, True, True, True, vision(tokenizer, **kw), "gemma3", max_images)


def png(path: Path, colour: tuple[int, int, int], size: tuple[int, int] = (12, 10), fmt: str = "PNG") -> str:
  Image.new("RGB", size, colour).save(path, fmt)
  return str(path)


def data_url(colour: tuple[int, int, int]) -> str:
  buffer = io.BytesIO()
  Image.new("RGB", (6, 9), colour).save(buffer, "PNG")
  return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def record(*refs: str, answer: str = "a red fox") -> dict:
  parts = [{"type": "image", "image": ref} for ref in refs] + [{"type": "text", "text": "what is this"}]
  return {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}]}


def test_a_record_with_images_becomes_tokens_weights_and_pixel_values(tokenizer, tmp_path):
  red, blue = png(tmp_path / "red.png", (255, 0, 0)), data_url((0, 0, 255))
  document = encoder(tokenizer)(record(red, blue))
  assert isinstance(document, ImageDocument)
  tokens, weights = document.tokens
  image_id = vision(tokenizer).image_token_id
  assert document.runs.tolist() == [[s, s + TOKENS] for s in np.flatnonzero(tokens == image_id)[::TOKENS]]
  assert all((tokens[s:e] == image_id).all() for s, e in document.runs)
  assert not weights[tokens == image_id].any()
  assert tokenizer.decode(tokens[weights == 1]) == "a red fox<end_of_turn>"
  options = gemma3_images.ImageOptions(image_size=SIZE)
  expected = [gemma3_images.pixel_values(images.load(red), options)[0],
              gemma3_images.pixel_values(Image.open(io.BytesIO(base64.b64decode(blue.split(",")[1]))), options)[0]]
  np.testing.assert_array_equal(document.pixels, np.stack(expected))
  # The text around the images is what the chat template writes, each marker expanded.
  text = tokenizer.decode(tokens)
  run = "\n\n<start_of_image>" + "<image_soft_token>" * TOKENS + "<end_of_image>\n\n"
  assert text.startswith("<s><start_of_turn>user\n" + run + run + "what is this<end_of_turn>\n"), text


def test_text_records_stay_plain_documents_and_a_text_only_model_keeps_sft_behaviour(tokenizer):
  text = {"messages": [{"role": "user", "content": "to be"}, {"role": "assistant", "content": "or not"}]}
  ours = encoder(tokenizer)(text)
  assert isinstance(ours, np.ndarray)
  np.testing.assert_array_equal(ours, encoder(tokenizer, use_multimodal=False)(text))
  plain = chat.SftEncoder(tokenizer, 256, True, True, True)(text)
  np.testing.assert_array_equal(ours, plain)


def test_truncation_falls_before_an_image_it_would_cut(tokenizer, tmp_path):
  red = png(tmp_path / "red.png", (255, 0, 0))
  whole = encoder(tokenizer)(record(red, red, red))
  assert isinstance(whole, ImageDocument)
  second = whole.runs[1]
  # A row whose inputs end inside the second image's run: the document stops before that run.
  cut = encoder(tokenizer, length=int(second[0]) + 2)
  document = cut({"prompt": record(red, red, red)["messages"][:1],
                  "completion": [{"role": "assistant", "content": "a red fox"}]})
  # The only trained tokens come after the images, so the sample is dropped and counted.
  assert document.shape == (2, 0) and cut.dropped.count == 1
  answer_first = {"messages": [{"role": "user", "content": "what is this"},
                               {"role": "assistant", "content": [{"type": "text", "text": "a red fox"},
                                                                 {"type": "image", "image": red},
                                                                 {"type": "image", "image": red}]}]}
  full = encoder(tokenizer)(answer_first)
  assert isinstance(full, ImageDocument)
  short = encoder(tokenizer, length=int(full.runs[1][0]) + 2)(answer_first)
  assert isinstance(short, ImageDocument) and len(short.pixels) == 1
  assert short.tokens.shape[1] == full.runs[1][0]  # stopped before the second image's placeholders
  np.testing.assert_array_equal(short.runs, full.runs[:1])


def _refused(tokenizer, make, **kw) -> str:
  with pytest.raises(UserError) as raised:
    encoder(tokenizer, **kw)(make)
  assert "\n" not in str(raised.value)
  return str(raised.value)


def test_bad_images_and_records_are_one_line_errors(tokenizer, tmp_path):
  red = png(tmp_path / "red.png", (255, 0, 0))
  (tmp_path / "broken.png").write_bytes(b"not an image at all")
  tiff = png(tmp_path / "photo.tiff", (0, 255, 0), fmt="TIFF")
  assert "1 image(s) given to the model, a text-only model" in _refused(tokenizer, record(red), use_multimodal=False)
  message = _refused(tokenizer, record(str(tmp_path / "broken.png")))
  assert f"image {tmp_path / 'broken.png'}: cannot be decoded" in message
  assert f"image {tiff}: format TIFF is not supported" in _refused(tokenizer, record(tiff))
  assert f"image {tmp_path / 'missing.png'}: cannot be read" in _refused(tokenizer, record(str(tmp_path / "missing.png")))
  assert "3 image(s), more than max_images_per_row=2" in _refused(tokenizer, record(red, red, red), max_images=2)
  # An image marker or placeholder token typed in the text is that text (chat.ContentGuard), not an image's slot.
  for typed in ("<start_of_image>", "<image_soft_token>"):
    document = encoder(tokenizer)({"messages": [{"role": "user", "content": f"look {typed} here"},
                                                {"role": "assistant", "content": "a fox"}]})
    tokens = document.tokens[0] if isinstance(document, ImageDocument) else document[0]
    assert tokenizer.convert_tokens_to_ids(typed) not in tokens.tolist()
    assert typed in tokenizer.decode(tokens.tolist(), skip_special_tokens=False)


def _read_by_datasets(tmp_path, *files: list[dict]) -> list[dict]:
  """The records as `datasets` reads JSONL files in order (one type per column, the first file's)."""
  datasets = pytest.importorskip("datasets")
  tmp_path.mkdir()
  paths = []
  for i, records in enumerate(files):
    paths.append(tmp_path / f"{i}.jsonl")
    paths[-1].write_text("".join(json.dumps(r) + "\n" for r in records))
  return list(datasets.load_dataset("json", data_files={"train": [str(p) for p in paths]}, split="train",
                                    cache_dir=str(tmp_path / "cache")))


def test_contents_of_other_shapes_in_another_file_are_refused_not_mangled(tokenizer, tmp_path):
  """A file of string contents read before one of list contents turns the lists into JSON text (its
  images would be trained on as text); the other order splits the strings into characters."""
  red = png(tmp_path / "red.png", (255, 0, 0))
  text = {"messages": [{"role": "user", "content": "to be"}, {"role": "assistant", "content": "or not"}]}
  listed = record(red)  # every content a list
  listed["messages"][1]["content"] = [{"type": "text", "text": "a red fox"}]
  pair = {"prompt": "to be", "completion": "or not"}
  # A string file first: the lists of a file of mixed shapes become JSON text (its strings too: '"or not"').
  cases = (([text], [text, record(red)]),
           ([pair], [pair, {"prompt": record(red)["messages"][:1], "completion": record(red)["messages"][1:]}]),
           # A file of list contents first: the strings become lists of their characters.
           ([listed], [text]))
  for case, (first, then) in enumerate(cases):
    mangled = _read_by_datasets(tmp_path / f"case{case}", first, then)[-1]
    message = _refused(tokenizer, mangled)
    assert "give every message's content the same shape in every file" in message, message


def test_an_images_column_beside_bare_image_parts_says_where_images_go(tokenizer, tmp_path):
  """TRL's layout: {"type": "image"} parts and the images in a column of their own."""
  red = png(tmp_path / "red.png", (255, 0, 0))
  trl = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this"}]},
                      {"role": "assistant", "content": "a red fox"}], "images": [red]}
  assert "put each image in its part: {\"type\": \"image\", \"image\": PATH}" in _refused(tokenizer, trl)
  # TRL reads one image from an `image` column as well: that layout is named too, not each part's "needs its image".
  single = {**{k: v for k, v in trl.items() if k != "images"}, "image": red}
  assert "images are in an 'image' column beside bare" in _refused(tokenizer, single)


def test_an_image_the_template_does_not_place_is_refused(tmp_path):
  unplaced = chat.load_chat_tokenizer(str(write_tokenizer(tmp_path / "tok", GEMMA3.replace("'<start_of_image>'", "''"),
                                                          IMAGE_SPECIAL)))
  red = png(tmp_path / "red.png", (255, 0, 0))
  assert "the text has 0 image marker(s) (<start_of_image>) but 1 image(s)" in _refused(unplaced, record(red))


def _image_doc(doc: int, length: int, runs: list[int]) -> ImageDocument:
  """Document `doc`: tokens 100*doc + t, except image runs of 3 tokens (id 7) at `runs`; image i
  of document d has pixels all equal to 10*d + i."""
  tokens = np.asarray([100 * doc + t for t in range(length)], np.int32)
  for start in runs:
    tokens[start:start + 3] = 7
  pixels = np.stack([np.full((3, 2, 2), 10 * doc + i, np.float32) for i in range(len(runs))])
  return ImageDocument(np.stack([tokens, np.ones_like(tokens)]), pixels,
                       np.asarray([[s, s + 3] for s in runs], np.int32).reshape(-1, 2))


def _cursor(docs: list, position: Position = Position()) -> DocumentCursor:
  return DocumentCursor(lambda index: iter(docs[index:]), max_empty_run=len(docs), position=position)


def _row_images(row: dict) -> list[float]:
  return [float(p[0, 0, 0]) for p in row["pixel_values"] if p.any()]


SLOTS = ImageSlots(per_row=2, size=2)


def test_a_row_holds_its_images_in_token_order_and_zeros_after_them():
  docs = [_image_doc(1, 8, [1]), np.stack([np.arange(200, 205), np.ones(5, int)]), _image_doc(3, 9, [0, 4])]
  cursor = _cursor(docs)
  first = pack_row(cursor, 16, True, SLOTS)
  # Document 3's two images do not fit the one free slot: it starts the next row.
  assert _row_images(first) == [10.0] and first["pixel_values"].shape == (2, 3, 2, 2)
  assert not first["pixel_values"][1].any() and cursor.position == Position(2, 0)
  second = pack_row(cursor, 16, True, SLOTS)
  assert _row_images(second) == [30.0, 31.0]
  assert (second["inputs"] == 7).sum() == 6 and (first["inputs"] == 7).sum() == 3


def test_a_long_document_continues_from_an_image_it_would_cut_and_resumes_exactly():
  docs = [_image_doc(1, 20, [2, 7, 12]), _image_doc(2, 6, [1])]
  rows = []
  cursor = _cursor(docs)
  while (row := pack_row(cursor, 8, True, SLOTS)) is not None:
    rows.append((row, cursor.position))
  for row, _ in rows:
    inputs = row["inputs"]
    assert (inputs == 7).sum() == 3 * len(_row_images(row))  # every image's run whole in its row
  assert [_row_images(r) for r, _ in rows] == [[10.0], [11.0, 12.0], [], [20.0]]
  assert rows[0][1] == Position(0, 7)  # cut before the second image's run (pairs 7..9 would not fit)
  # Resuming at any row's saved position gives the same rows again.
  for k in range(len(rows) - 1):
    again = pack_row(_cursor(docs, rows[k][1]), 8, True, SLOTS)
    for name in again:
      np.testing.assert_array_equal(again[name], rows[k + 1][0][name], err_msg=f"row {k + 1} {name}")


def test_without_packing_the_rest_after_a_cut_image_is_dropped():
  row = pack_row(_cursor([_image_doc(1, 20, [2, 6])]), 7, False, SLOTS)
  assert _row_images(row) == [10.0] and row["inputs_segmentation"].tolist() == [1] * 6 + [0]


def test_padding_rows_have_zero_images_and_a_batch_stacks_them():
  batch, real = pack_batch(_cursor([_image_doc(1, 6, [1])]), 3, 8, True, SLOTS)
  assert real == 1 and batch["pixel_values"].shape == (3, 2, 3, 2, 2) and batch["inputs"].shape == (3, 8)
  assert not batch["pixel_values"][1:].any() and batch["pixel_values"][0, 0].all()


def test_an_image_longer_than_a_row_is_one_error_line():
  with pytest.raises(UserError, match="an image's 3 placeholder tokens do not fit in a row of max_target_length=2"):
    pack_row(_cursor([_image_doc(1, 8, [0])]), 2, True, SLOTS)
