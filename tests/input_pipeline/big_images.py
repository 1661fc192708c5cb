"""Decompression bombs for tests: a PNG of a huge solid-colour image that is a few hundred KB
encoded (written row by row, never held decoded), and the peak growth of this process's resident
memory while a call runs (sampled from /proc, so Pillow's C allocations count too)."""

from __future__ import annotations

import functools
import os
import struct
import threading
import time
import zlib
from typing import Any, Callable


def _chunk(kind: bytes, data: bytes) -> bytes:
  return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


@functools.lru_cache(maxsize=4)
def solid_png(width: int, height: int, rgb: tuple[int, int, int] = (200, 30, 60)) -> bytes:
  """An 8-bit RGB PNG of width x height pixels of one colour. A band of rows is compressed once
  and repeated: a full flush leaves each copy independent of what came before it."""
  row = b"\x00" + bytes(rgb) * width  # filter type 0, then the pixels
  band_rows = next(n for n in (100, 10, 1) if height % n == 0)
  band, copies = row * band_rows, height // band_rows
  compressor = zlib.compressobj(9)
  deflated = (compressor.compress(band) + compressor.flush(zlib.Z_FULL_FLUSH))[2:]  # without the zlib header
  checksum = 1
  for _ in range(copies):
    checksum = zlib.adler32(band, checksum)
  last = b"\x01\x00\x00\xff\xff"  # an empty final stored block
  idat = b"\x78\xda" + deflated * copies + last + struct.pack(">I", checksum)
  header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit, RGB, no interlace
  return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def _rss_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_growth(call: Callable[[], Any]) -> tuple[float, int, BaseException | None]:
  """(seconds `call` took, the most resident memory grew above where it started while it ran,
  the exception it raised or None)."""
  start_rss, peak, done = _rss_bytes(), [0], threading.Event()

  def sample() -> None:
    while not done.is_set():
      peak[0] = max(peak[0], _rss_bytes())
      time.sleep(0.002)

  sampler = threading.Thread(target=sample, daemon=True)
  sampler.start()
  raised: BaseException | None = None
  start = time.perf_counter()
  try:
    call()
  except Exception as e:  # the caller checks what was raised
    raised = e
  seconds = time.perf_counter() - start
  done.set()
  sampler.join()
  return seconds, max(peak[0], _rss_bytes()) - start_rss, raised
