"""Tokenizers behind one small interface: `encode(text) -> list[int]` plus the special ids.

Three kinds, chosen by `tokenizer_type`:
  sentencepiece  a SentencePiece `.model` file (what `python3 -m MaxText.train_tokenizer` writes);
  tiktoken       a BPE ranks file (`<base64 token> <rank>` per line), laid out like Llama 3:
                 256 special tokens follow the ranks, the first two being begin/end of text;
  huggingface    a `tokenizer.json` (or a directory holding one, with its tokenizer_config.json
                 naming the bos/eos tokens), read with the `tokenizers` library.
Every kind loads from local files only: nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Protocol

from MaxText.errors import ConfigError

TOKENIZER_TYPES = ("sentencepiece", "tiktoken", "huggingface")

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
      self._sp.Load(path)
    except (OSError, RuntimeError) as e:
      raise ConfigError(f"tokenizer_path {path} is not a SentencePiece model: {str(e).splitlines()[0]}") from None
    self.vocab_size = self._sp.GetPieceSize()
    self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
    self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else None

  def encode(self, text: str) -> list[int]:
    return self._sp.EncodeAsIds(text)

  def decode(self, ids: list[int]) -> str:
    return self._sp.DecodeIds(list(ids))


class TiktokenTokenizer:
  def __init__(self, path: str):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    try:
      ranks = load_tiktoken_bpe(path)
    except (ValueError, OSError, UnicodeDecodeError) as e:
      raise ConfigError(f"tokenizer_path {path} is not a tiktoken BPE ranks file: {e}") from None
    num_base = len(ranks)
    names = ["<|begin_of_text|>", "<|end_of_text|>"] + [
        f"<|reserved_special_token_{i}|>" for i in range(_NUM_TIKTOKEN_SPECIAL - 2)]
    special = {name: num_base + i for i, name in enumerate(names)}
    self._enc = tiktoken.Encoding(name=Path(path).name, pat_str=_LLAMA3_PATTERN, mergeable_ranks=ranks,
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

    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    try:
      self._tok = HFTokenizer.from_file(str(file))
    except Exception as e:  # noqa: BLE001 - the library raises its own untyped exception
      raise ConfigError(f"tokenizer_path {path}: cannot read {file} as a Hugging Face tokenizer ({e})") from None
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    bos, eos = _special_tokens(file.parent / "tokenizer_config.json")
    self.bos_id = self._tok.token_to_id(bos) if bos else None
    self.eos_id = self._tok.token_to_id(eos) if eos else None

  def encode(self, text: str) -> list[int]:
    # The pipeline adds bos/eos itself (add_bos/add_eos), so the post-processor's are left out.
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids: list[int]) -> str:
    return self._tok.decode(list(ids))


def _special_tokens(config_path: Path) -> tuple[str | None, str | None]:
  """bos/eos token strings from a tokenizer_config.json (plain strings or {"content": ...})."""
  if not config_path.is_file():
    return None, None
  config = json.loads(config_path.read_text())

  def text(value: object) -> str | None:
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None

  return text(config.get("bos_token")), text(config.get("eos_token"))


def load_tokenizer(tokenizer_type: str, path: str) -> Tokenizer:
  if tokenizer_type not in TOKENIZER_TYPES:
    raise ConfigError(f"tokenizer_type must be one of {', '.join(TOKENIZER_TYPES)}; got {tokenizer_type!r}")
  if not path:
    raise ConfigError("tokenizer_path is empty: real datasets need a tokenizer "
                      "(train one with `python3 -m MaxText.train_tokenizer`)")
  if not Path(path).exists():
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
