"""Tokenizers behind one small interface: `encode(text) -> list[int]` plus the special ids.

Three kinds, chosen by `tokenizer_type`:
  sentencepiece  a SentencePiece `.model` file (what `python3 -m MaxText.train_tokenizer` writes);
  tiktoken       a BPE ranks file (`<base64 token> <rank>` per line), laid out like Llama 3:
                 256 special tokens follow the ranks, the first two being begin/end of text;
  huggingface    a `tokenizer.json` (or a directory holding one, with its tokenizer_config.json
                 naming the bos/eos tokens), read with the `tokenizers` library.
Every kind reads the user's files (local or gs://) into memory and builds the tokenizer from
their content; nothing is downloaded from a hub.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Callable, Protocol

from MaxText.paths import storage
from MaxText.configuration.data_config import TOKENIZER_TYPES
from MaxText.errors import ConfigError

# Llama 3's pre-tokenisation split and special-token block (facts of its published tokenizer).
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_NUM_TIKTOKEN_SPECIAL = 256


class Tokenizer(Protocol):
  vocab_size: int  # ids are in [0, vocab_size)
  bos_id: int | None
  eos_id: int | None

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: list[int]) -> str: ...


class SentencePieceTokenizer:
  def __init__(self, path: str):
    import sentencepiece as spm

    self._sp = spm.SentencePieceProcessor()
    try:
      self._sp.LoadFromSerializedProto(storage.read_bytes(path))  # from bytes: the file may be on gs://
    except (OSError, RuntimeError) as e:
      raise ConfigError(f"tokenizer_path {path} is not a SentencePiece model: {str(e).splitlines()[0]}") from None
    self.vocab_size = self._sp.GetPieceSize()
    self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
    self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else None

  def encode(self, text: str) -> list[int]:
    return self._sp.EncodeAsIds(text)

  def decode(self, ids: list[int]) -> str:
    return self._sp.DecodeIds(list(ids))


def _read_ranks(path: str) -> dict[bytes, int]:
  """`<base64 token> <rank>` lines (tiktoken's format). Parsed here rather than with tiktoken's
  loader, which cannot open gs:// and caches files by path (a rewritten file would read stale)."""
  ranks = {}
  for number, line in enumerate(storage.read_bytes(path).splitlines(), 1):
    if not line.strip():
      continue
    try:
      token, rank = line.split()
      ranks[base64.b64decode(token)] = int(rank)
    except (ValueError, binascii.Error):
      raise ValueError(f"line {number} is not '<base64 token> <rank>': {line[:60]!r}") from None
  if not ranks:
    raise ValueError("it holds no ranks")
  return ranks


class TiktokenTokenizer:
  def __init__(self, path: str):
    import tiktoken

    try:
      ranks = _read_ranks(path)
    except (ValueError, OSError) as e:
      raise ConfigError(f"tokenizer_path {path} is not a tiktoken BPE ranks file: {e}") from None
    num_base = len(ranks)
    names = ["<|begin_of_text|>", "<|end_of_text|>"] + [
        f"<|reserved_special_token_{i}|>" for i in range(_NUM_TIKTOKEN_SPECIAL - 2)]
    special = {name: num_base + i for i, name in enumerate(names)}
    self._enc = tiktoken.Encoding(name=storage.name(path), pat_str=_LLAMA3_PATTERN, mergeable_ranks=ranks,
                                  special_tokens=special)
    self.vocab_size = num_base + _NUM_TIKTOKEN_SPECIAL
    self.bos_id: int | None = special["<|begin_of_text|>"]
    self.eos_id: int | None = special["<|end_of_text|>"]

  def encode(self, text: str) -> list[int]:
    # Special-token text inside a document is data, not control: encode it as ordinary bytes.
    return self._enc.encode(text, disallowed_special=())

  def decode(self, ids: list[int]) -> str:
    return self._enc.decode(list(ids))


class HuggingFaceTokenizer:
  def __init__(self, path: str):
    from tokenizers import Tokenizer as HFTokenizer

    file = storage.join(path, "tokenizer.json") if storage.is_dir(path) else path
    try:
      self._tok = HFTokenizer.from_str(storage.read_bytes(file).decode("utf-8"))
    except Exception as e:  # noqa: BLE001 - the library raises its own untyped exception
      raise ConfigError(f"tokenizer_path {path}: cannot read {file} as a Hugging Face tokenizer ({e})") from None
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    bos, eos = _special_tokens(storage.join(storage.parent(file), "tokenizer_config.json"))
    self.bos_id = self._tok.token_to_id(bos) if bos else None
    self.eos_id = self._tok.token_to_id(eos) if eos else None

  def encode(self, text: str) -> list[int]:
    # The pipeline adds bos/eos itself (add_bos/add_eos), so the post-processor's are left out.
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids: list[int]) -> str:
    return self._tok.decode(list(ids))


def _special_tokens(config_path: str) -> tuple[str | None, str | None]:
  """bos/eos token strings from a tokenizer_config.json (plain strings or {"content": ...})."""
  if not storage.is_file(config_path):
    return None, None
  config = json.loads(storage.read_bytes(config_path))

  def text(value: object) -> str | None:
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None

  return text(config.get("bos_token")), text(config.get("eos_token"))


def load_tokenizer(tokenizer_type: str, path: str) -> Tokenizer:
  if tokenizer_type not in TOKENIZER_TYPES:
    raise ConfigError(f"tokenizer_type must be one of {', '.join(TOKENIZER_TYPES)}; got {tokenizer_type!r}")
  if not path:
    raise ConfigError("tokenizer_path is empty: real datasets need a tokenizer "
                      "(train one with `python3 -m MaxText.train_tokenizer`)")
  if not storage.exists(path):
    raise ConfigError(f"tokenizer_path {path} does not exist")
  kinds: dict[str, Callable[[str], Tokenizer]] = {
      "sentencepiece": SentencePieceTokenizer, "tiktoken": TiktokenTokenizer, "huggingface": HuggingFaceTokenizer}
  return kinds[tokenizer_type](path)


class DocumentEncoder:
  """text -> int32 token ids with the configured bos/eos around each document."""

  def __init__(self, tokenizer: Tokenizer, add_bos: bool, add_eos: bool):
    bos_id, eos_id = tokenizer.bos_id, tokenizer.eos_id
    if add_bos and bos_id is None:
      raise ConfigError("add_bos=True but the tokenizer defines no beginning-of-sequence token; set add_bos=False")
    if add_eos and eos_id is None:
      raise ConfigError("add_eos=True but the tokenizer defines no end-of-sequence token; set add_eos=False")
    self.tokenizer = tokenizer
    self._prefix = [bos_id] if add_bos and bos_id is not None else []
    self._suffix = [eos_id] if add_eos and eos_id is not None else []

  def __call__(self, text: str) -> list[int]:
    return self._prefix + self.tokenizer.encode(text) + self._suffix
