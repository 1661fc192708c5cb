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
from typing import Any, Callable, Protocol

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
    return self._sp.DecodeIds(_in_vocabulary(ids, self.vocab_size))

  def special_id(self, text: str) -> int | None:
    """The id of the control token spelled `text` (decode writes none of them), else None."""
    piece = self._sp.PieceToId(text)
    return piece if 0 <= piece < self.vocab_size and self._sp.IdToPiece(piece) == text and (
        self._sp.IsControl(piece)) else None


def _in_vocabulary(ids: list[int], vocab_size: int) -> list[int]:
  """`ids` without those past the tokenizer's vocabulary, which have no text: a model's vocab_size is often
  padded beyond its tokenizer's, and it may sample a padding id (the library raised on it, after a whole
  decode). Hugging Face tokenizers leave such ids out of the text the same way."""
  return [i for i in ids if 0 <= i < vocab_size]


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
    return self._enc.decode(_in_vocabulary(ids, self.vocab_size))


class HuggingFaceTokenizer:
  def __init__(self, path: str):
    from tokenizers import Tokenizer as HFTokenizer

    file = storage.join(path, "tokenizer.json") if storage.is_dir(path) else path
    if file != path and not storage.is_file(file):
      model = storage.join(path, "tokenizer.model")  # a repository with only the slow tokenizer's file
      hint = (f"; it holds {model}: tokenizer_type=sentencepiece tokenizer_path={model}" if storage.is_file(model)
              else "; point tokenizer_path at the folder with the model's tokenizer.json")
      raise ConfigError(f"tokenizer_path {path} has no tokenizer.json{hint}")
    try:
      self._tok = HFTokenizer.from_str(storage.read_bytes(file).decode("utf-8"))
    except Exception as e:  # noqa: BLE001 - the library raises its own untyped exception
      raise ConfigError(f"tokenizer_path {path}: cannot read {file} as a Hugging Face tokenizer ({e})") from None
    # A special token's spelling in a document or a prompt ("</s>" in web text) is data, as in the other two
    # kinds; text that needs control tokens (a chat template's) goes through input_pipeline/chat.py.
    self._tok.encode_special_tokens = True
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    config = storage.join(storage.parent(file), "tokenizer_config.json")
    bos, eos = _special_tokens(config)
    for name, token in (("bos_token", bos), ("eos_token", eos)):
      if token and self._tok.token_to_id(token) is None:  # else the run would go on without it, silently
        raise ConfigError(f"{config} names {name} {token!r}, which {file} does not hold: the two files are from "
                          "different tokenizers; use the model's own pair")
    self.bos_id = self._tok.token_to_id(bos) if bos else None
    self.eos_id = self._tok.token_to_id(eos) if eos else None

  def encode(self, text: str) -> list[int]:
    # The pipeline adds bos/eos itself (add_bos/add_eos), so the post-processor's are left out.
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids: list[int]) -> str:
    return self._tok.decode(list(ids))

  def special_id(self, text: str) -> int | None:
    """The id of the special token spelled `text` (decode skips them), else None."""
    token = self._tok.token_to_id(text)
    return token if token is not None and text and not self._tok.decode([token]) else None


def read_tokenizer_config(config_path: str) -> dict[str, Any]:
  """A tokenizer_config.json ({} when there is none); one ConfigError line when it is not a JSON object."""
  if not storage.is_file(config_path):
    return {}
  try:
    config = json.loads(storage.read_bytes(config_path))
  except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError; nested past json's limit
    raise ConfigError(f"{config_path} is not valid JSON ({' '.join(str(e).split())[:120] or type(e).__name__}); "
                      "replace it with the model's own tokenizer_config.json") from None
  if not isinstance(config, dict):
    raise ConfigError(f"{config_path} holds a JSON {type(config).__name__}, not the object of a tokenizer's config")
  return config


def _special_tokens(config_path: str) -> tuple[str | None, str | None]:
  """bos/eos token strings from a tokenizer_config.json (plain strings or {"content": ...})."""
  config = read_tokenizer_config(config_path)

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
