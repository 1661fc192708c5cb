"""llguidance compiles a grammar by recursion on the native stack: through a JSON schema's subschemas and the `$ref`s
between them, and through a Lark grammar's rules and terminals that name one another, a few native frames per level.
A chain of references deeper than the thread's stack allows is a segmentation fault: one request's grammar would end
the whole server. So every llguidance call that compiles a grammar runs here, on a thread of its own whose stack is
sized from `levels`, an upper bound of that recursion read from the grammar's text, and a grammar whose bound needs
more than MAX_STACK_BYTES is refused in one line instead (grammar.py turns it into a GrammarError, a 400).

The bound counts every bracket of the text twice (a JSON schema object or list, a Lark group) and every line once (a
Lark rule or terminal), as if each nested in the one before: a compile never holds one of them on the stack twice."""

from __future__ import annotations

import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")

STACK_PER_LEVEL = 32 << 10  # bytes per level of the bound: several times the frames one level takes
MIN_STACK_BYTES = 32 << 20
MAX_STACK_BYTES = 1 << 30  # virtual memory, reserved per compile; only the pages the recursion reaches are used
MAX_LEVELS = MAX_STACK_BYTES // STACK_PER_LEVEL
_STACK_SIZE_LOCK = threading.Lock()  # threading.stack_size is one setting for the whole process


class TooLarge(ValueError):
  """A grammar whose compile could need more stack than MAX_STACK_BYTES."""


def levels(text: str) -> int:
  """An upper bound of llguidance's recursion levels when it compiles `text` (the JSON that grammar_from_* write: a
  Lark grammar's line breaks are its `\\n` escapes there)."""
  brackets = text.count("{") + text.count("[") + text.count("(")
  return 1 + text.count("\n") + text.count("\\n") + 2 * brackets


def call(text: str, fn: Callable[[], T]) -> T:
  """fn(), which compiles `text`, on a thread with room for its recursion; TooLarge where none is granted."""
  need = levels(text)
  if need > MAX_LEVELS:
    raise TooLarge(f"it is too large to compile: {need} levels of rules, schema objects and brackets that may nest "
                   f"(at most {MAX_LEVELS}); split it or make it smaller")
  box: dict[str, Any] = {}

  def target() -> None:
    try:
      box["value"] = fn()
    except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
      box["error"] = e

  with _STACK_SIZE_LOCK:
    previous = threading.stack_size(max(MIN_STACK_BYTES, need * STACK_PER_LEVEL))
    try:
      thread = threading.Thread(target=target, name="grammar-compile", daemon=True)
      thread.start()
    except RuntimeError as e:  # the stack could not be reserved
      raise TooLarge(f"it is too large to compile on this server ({e})") from None
    finally:
      threading.stack_size(previous)
  thread.join()
  if "error" in box:
    raise box["error"]
  return box["value"]


__all__ = ["MAX_LEVELS", "TooLarge", "call", "levels"]
