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
import re
from typing import Any, Callable, Mapping, Protocol

from MaxText.paths import storage
from MaxText.configuration.data_config import TOKENIZER_TYPES
from MaxText.errors import ConfigError

# Llama 3's pre-tokenisation split and special-token block (facts of its published tokenizer).
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_NUM_TIKTOKEN_SPECIAL = 256
_MAX_RANK = 2**32 - _NUM_TIKTOKEN_SPECIAL  # tiktoken's ids are u32, the special tokens' among them


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
      raise ConfigError(f"tokenizer_path {path} is not a SentencePiece model: {str(e).splitlines()[0]}"
                        f"{_kind_hint(path, 'sentencepiece')}") from None
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
  loader, which cannot open gs:// and caches files by path (a rewritten file would read stale).
  tiktoken itself takes a repeated rank as a Rust panic (past `except Exception`), a rank outside
  u32 as an OverflowError, and a missing single byte as a panic at the first text holding it; a
  repeated token would silently keep its last rank. Each is refused here by its line."""
  ranks: dict[bytes, int] = {}
  line_of: dict[int, int] = {}  # rank -> its line
  for number, line in enumerate(storage.read_bytes(path).splitlines(), 1):
    if not line.strip():
      continue
    try:
      token_text, rank_text = line.split()
      token, rank = base64.b64decode(token_text), int(rank_text)
    except (ValueError, binascii.Error):
      raise ValueError(f"line {number} is not '<base64 token> <rank>': {line[:60]!r}") from None
    if not 0 <= rank < _MAX_RANK:
      raise ValueError(f"line {number} has rank {rank}, outside [0, {_MAX_RANK})")
    if token in ranks:
      raise ValueError(f"line {number} repeats the token {token!r} of line {line_of[ranks[token]]}")
    if rank in line_of:
      raise ValueError(f"line {number} repeats rank {rank} of line {line_of[rank]}")
    ranks[token], line_of[rank] = rank, number
  if not ranks:
    raise ValueError("it holds no ranks")
  missing = [b for b in range(256) if bytes([b]) not in ranks]
  if missing:
    raise ValueError(f"it ranks {256 - len(missing)} of the 256 single bytes (none for 0x{missing[0]:02x}); "
                     "a byte-level BPE ranks file ranks every byte, or text holding that byte cannot be encoded")
  return ranks


class TiktokenTokenizer:
  def __init__(self, path: str):
    import tiktoken

    try:
      ranks = _read_ranks(path)
    except (ValueError, OSError) as e:
      raise ConfigError(f"tokenizer_path {path} is not a tiktoken BPE ranks file: {e}"
                        f"{_kind_hint(path, 'tiktoken')}") from None
    # The special tokens follow the highest rank: with ranks that skip numbers, following their count
    # gave special ids among the ranks' and a vocab_size below the ids encode returns.
    num_base = max(ranks.values()) + 1
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
    file = storage.join(path, "tokenizer.json") if storage.is_dir(path) else path
    if file != path and not storage.is_file(file):
      model = storage.join(path, "tokenizer.model")  # a repository with only the slow tokenizer's file
      hint = (f"; it holds {model}: tokenizer_type=sentencepiece tokenizer_path={model}" if storage.is_file(model)
              else "; point tokenizer_path at the folder with the model's tokenizer.json")
      raise ConfigError(f"tokenizer_path {path} has no tokenizer.json{hint}")
    config_path = storage.join(storage.parent(file), "tokenizer_config.json")
    config = read_tokenizer_config(config_path)
    self._tok = read_hf_tokenizer(file, path, config)
    # A special token's spelling in a document or a prompt ("</s>" in web text) is data, as in the other two
    # kinds; text that needs control tokens (a chat template's) goes through input_pipeline/chat.py.
    self._tok.encode_special_tokens = True
    self.vocab_size = hf_vocab_size(self._tok)
    bos, eos = config_special_tokens(self._tok, file, config_path, config)
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


def token_text(value: object) -> str | None:
  """A tokenizer_config.json token entry's text: a plain string or {"content": ...}."""
  return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def read_hf_tokenizer(file: str, path: str, config: Mapping[str, Any] | None = None) -> Any:
  """`file`, a tokenizer.json, as a `tokenizers.Tokenizer` with the added tokens of the tokenizer_config.json beside
  it (`config`, that file's content, when the caller has read it); one ConfigError line naming the file when it is
  not one (the library raises its own untyped exception, and decoding a file that is not UTF-8 a
  UnicodeDecodeError)."""
  from tokenizers import Tokenizer as HFTokenizer

  try:
    backend = HFTokenizer.from_str(storage.read_bytes(file).decode("utf-8"))
  except Exception as e:  # noqa: BLE001 - the library raises its own untyped exception
    raise ConfigError(f"tokenizer_path {path}: cannot read {file} as a Hugging Face tokenizer "
                      f"({str(e).splitlines()[0] if str(e) else type(e).__name__}){_kind_hint(file, 'huggingface')}"
                      ) from None
  if not backend.get_vocab_size(with_added_tokens=False):  # else every text fails to encode, mid-run
    raise ConfigError(f"tokenizer_path {path}: {file} has an empty vocabulary; give the model's own tokenizer.json")
  config_path = storage.join(storage.parent(file), "tokenizer_config.json")
  _add_config_tokens(backend, file, config_path, read_tokenizer_config(config_path) if config is None else config)
  return backend


_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


def _add_config_tokens(backend: Any, file: str, config_path: str, config: Mapping[str, Any]) -> None:
  """The tokens of tokenizer_config.json's added_tokens_decoder that tokenizer.json's added_tokens lack, added as
  transformers adds them when it loads the pair (in id order; a spelling the vocabulary holds keeps its id, a new
  one takes the next): they were ignored, so such a token was split into pieces and its id never produced. Each
  must then have the id the config gives it; transformers silently keeps the one it got, an id the model never
  learned for that token."""
  entries = config.get("added_tokens_decoder")
  if not entries:
    return
  if not isinstance(entries, dict):
    raise ConfigError(f"{config_path}'s added_tokens_decoder is a {type(entries).__name__}, not an object of ids to "
                      "tokens; replace it with the model's own tokenizer_config.json")
  from tokenizers import AddedToken

  tokens: list[tuple[int, Any]] = []
  for key, entry in entries.items():
    try:  # an entry is AddedToken's fields ("__type" beside them in older saves)
      tokens.append((int(key), AddedToken(**{k: v for k, v in entry.items() if k in _ADDED_TOKEN_FIELDS})))
    except (ValueError, TypeError, AttributeError) as e:
      raise ConfigError(f"{config_path}'s added_tokens_decoder entry {str(key)[:40]!r} is not an id and a token "
                        f"({type(e).__name__}); replace it with the model's own tokenizer_config.json") from None
  tokens.sort(key=lambda item: item[0])
  fields = lambda t: tuple(getattr(t, name) for name in _ADDED_TOKEN_FIELDS)  # noqa: E731
  held = {fields(t) for t in backend.get_added_tokens_decoder().values()}
  before = {t.content: backend.token_to_id(t.content) for _, t in tokens}
  backend.add_tokens([t for _, t in tokens if fields(t) not in held])
  for index, token in tokens:
    got = backend.token_to_id(token.content)
    if got != index:
      how = f"{file} holds it as id {got}" if before[token.content] is not None else \
          f"added to {file} it gets id {got} (the next free one)"
      raise ConfigError(f"{config_path}'s added_tokens_decoder gives {token.content!r} id {index}, but {how}: the two "
                        "files are from different tokenizers; use the model's own pair")


def hf_vocab_size(backend: Any) -> int:
  """The ids a Hugging Face tokenizer can return: its highest id + 1. A vocabulary may skip ids, and its
  count (get_vocab_size) is then below ids that encode returns, which passed the vocab_size check."""
  return max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1


def config_special_tokens(backend: Any, file: str, config_path: str, config: dict[str, Any]
                          ) -> tuple[str | None, str | None]:
  """The bos/eos token texts `config` (tokenizer_config.json) names, each refused unless `backend` holds it: the run
  would go on without it, or (transformers) with a new token past the vocabulary."""
  bos, eos = token_text(config.get("bos_token")), token_text(config.get("eos_token"))
  for name, token in (("bos_token", bos), ("eos_token", eos)):
    if token and backend.token_to_id(token) is None:
      raise ConfigError(f"{config_path} names {name} {token!r}, which {file} does not hold: the two files are from "
                        "different tokenizers; use the model's own pair")
  return bos, eos


_KIND_FILES = {"sentencepiece": "SentencePiece model", "tiktoken": "tiktoken BPE ranks file",
               "huggingface": "Hugging Face tokenizer.json"}
_RANKS_LINE = re.compile(rb"[A-Za-z0-9+/]+={0,2} +[0-9]+")


def _looks_like(data: bytes) -> str | None:
  """The tokenizer_type whose file `data` looks like, else None."""
  head = data.lstrip()
  if head.startswith(b"{") and b'"model"' in data:  # not its tokenizer_config.json
    return "huggingface"
  if _RANKS_LINE.fullmatch(head.split(b"\n", 1)[0].strip()):
    return "tiktoken"
  import sentencepiece as spm

  try:
    spm.SentencePieceProcessor().LoadFromSerializedProto(data)
  except RuntimeError:
    return None
  return "sentencepiece"


def _kind_hint(path: str, tokenizer_type: str) -> str:
  """What to do when `path` did not load as a `tokenizer_type` file: the tokenizer_type it looks like, or the file
  to give (a directory, an empty file)."""
  try:
    if storage.is_dir(path):
      if storage.is_file(storage.join(path, "tokenizer.json")):
        return "; it is a directory holding tokenizer.json: set tokenizer_type=huggingface"
      model = storage.join(path, "tokenizer.model")
      return (f"; it is a directory: set tokenizer_path={model}" if storage.is_file(model)
              else "; it is a directory: point tokenizer_path at the tokenizer's file")
    beside = storage.join(storage.parent(path), "tokenizer.json")
    if storage.name(path) != "tokenizer.json" and storage.is_file(beside):  # its tokenizer_config.json, say
      return f"; its folder holds {beside}: set tokenizer_type=huggingface tokenizer_path={storage.parent(path)}"
    data = storage.read_bytes(path)
  except OSError:
    return ""
  if not data.strip():
    return "; the file is empty: copy the tokenizer's file again"
  kind = _looks_like(data)
  if kind is not None and kind != tokenizer_type:
    return f"; it looks like a {_KIND_FILES[kind]}: set tokenizer_type={kind}"
  return f"; give the model's own {_KIND_FILES[tokenizer_type]}"


def load_tokenizer(tokenizer_type: str, path: str) -> Tokenizer:
  if tokenizer_type not in TOKENIZER_TYPES:
    raise ConfigError(f"tokenizer_type must be one of {', '.join(TOKENIZER_TYPES)}; got {tokenizer_type!r}")
  if not path:
    raise ConfigError("tokenizer_path is empty: real datasets need a tokenizer "
                      "(train one with `python3 -m MaxText.train_tokenizer`)")
  if not storage.exists(path):
    raise ConfigError(f"tokenizer_path {path} does not exist")
  if storage.is_dir(path):
    if tokenizer_type != "huggingface":  # a gs:// one read as no bytes, a local one as an OSError
      raise ConfigError(f"tokenizer_path {path} is not a {_KIND_FILES[tokenizer_type]}"
                        f"{_kind_hint(path, tokenizer_type)}")
  elif not storage.size(path):  # each library named something else ("unk is not defined", "EOF while parsing")
    raise ConfigError(f"tokenizer_path {path} is an empty file; copy the tokenizer's file again")
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
