"""Prefix caching for the paged KV cache: full pages of prompts, found again by their tokens.

A page's keys and values depend on its own tokens and on every token before it, so a page is
named by a chain hash: h_i = sha256(h_{i-1} + tokens of page i). Two prompts that agree on
their first k full pages share those k pages: the second request's slot points its block table
at them and prefills only the rest. Only full prompt pages are ever shared, and the page where
two prompts part is each request's own, so a shared page is never written (nothing to copy on
write). A page nobody holds any more stays indexed (its keys still valid) in least-recently-used
order, and is evicted, index entry first, only when the free list runs dry. A page holding an
image's placeholder tokens also hashes the image's digest (`salts`).
"""

from __future__ import annotations

import collections
import hashlib
from typing import Mapping, Sequence

import numpy as np


class PrefixIndex:
  """Chain hash -> page for full prompt pages, and the unheld indexed pages in LRU order."""

  def __init__(self, page_size: int):
    self.page_size = page_size
    self._page_of: dict[bytes, int] = {}
    self._hash_of: dict[int, bytes] = {}
    self._unheld: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first

  def chain(self, tokens: Sequence[int], num_pages: int, salts: Mapping[int, bytes] | None = None) -> list[bytes]:
    """The pages' chain hashes; `salts` (page index -> bytes) folds in what a page's keys depend on
    beyond its tokens: the images whose placeholder tokens it holds (inference/image_prompts.py)."""
    hashes, previous = [], b""
    for i in range(num_pages):
      page_tokens = np.asarray(tokens[i * self.page_size:(i + 1) * self.page_size], np.int64)
      previous = hashlib.sha256(previous + page_tokens.tobytes() + (salts or {}).get(i, b"")).digest()
      hashes.append(previous)
    return hashes

  def match(self, tokens: Sequence[int], max_pages: int, salts: Mapping[int, bytes] | None = None) -> list[int]:
    """The indexed pages holding the longest run of `tokens`' first full pages (at most max_pages)."""
    pages = []
    for digest in self.chain(tokens, max_pages, salts):
      page = self._page_of.get(digest)
      if page is None:
        break
      pages.append(page)
    return pages

  def register(self, tokens: Sequence[int], pages: Sequence[int], salts: Mapping[int, bytes] | None = None) -> None:
    """Indexes the full pages of a prompt now cached in `pages` (already indexed ones stay as they are)."""
    for digest, page in zip(self.chain(tokens, len(tokens) // self.page_size, salts), pages):
      if digest not in self._page_of and page not in self._hash_of:
        self._page_of[digest], self._hash_of[page] = page, digest

  def holds(self, page: int) -> bool:
    return page in self._hash_of

  def park(self, page: int) -> None:
    """An indexed page nobody holds: kept for reuse, first in line for eviction when oldest."""
    self._unheld[page] = None
    self._unheld.move_to_end(page)

  def unpark(self, page: int) -> None:
    self._unheld.pop(page, None)

  def is_parked(self, page: int) -> bool:
    return page in self._unheld

  @property
  def parked(self) -> int:
    return len(self._unheld)

  def evict(self) -> int:
    """The least recently released unheld page, out of the index (its contents are no longer valid)."""
    page, _ = self._unheld.popitem(last=False)
    del self._page_of[self._hash_of.pop(page)]
    return page
