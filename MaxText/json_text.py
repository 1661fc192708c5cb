"""What json decodes that is not text: an unpaired UTF-16 surrogate escape (\\ud800) becomes a str that no
tokenizer encodes and UTF-8 cannot write. The data readers, the environments and the server's request parser
all refuse such values with one line."""

from __future__ import annotations

UNPAIRED_SURROGATE = ("holds an unpaired UTF-16 surrogate escape (\\ud800 to \\udfff without its pair), which is not "
                      "text")


def has_unpaired_surrogate(value: object) -> bool:
  """Whether a parsed JSON value holds a string with a lone surrogate: json decodes such an escape
  (\\ud800) into a str no tokenizer takes. In text decoded strictly only an escape makes one, so callers
  look only when the raw text holds `\\u`; json.loads given bytes decodes them with "surrogatepass", so
  a surrogate's own UTF-8 bytes make one too (the server's parser looks for those as well)."""
  pending = [value]
  while pending:
    item = pending.pop()
    if isinstance(item, dict):
      pending.extend(item)
      pending.extend(item.values())
    elif isinstance(item, list):
      pending.extend(item)
    elif isinstance(item, str):
      try:
        item.encode("utf-8")
      except UnicodeEncodeError:
        return True
  return False
