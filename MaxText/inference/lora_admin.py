"""What the LoRA admin routes (lora_routes.py) ask of a server's adapters, without JAX: an HTTP
front-end process (serve_frontend.py) holds no registry and reaches the engine's (lora_adapters.Registry)
over its channel, the one-process server calls its registry here. The answers and refusals are the
same types either way, so the routes answer alike.
"""

from __future__ import annotations

import asyncio
import dataclasses
import unicodedata
from typing import Protocol, Sequence

from MaxText.errors import UserError


@dataclasses.dataclass(frozen=True)
class LoadedAdapter:
  name: str
  row: int
  rank: int
  alpha: float
  targets: tuple[str, ...]
  use_rslora: bool = False  # its scale is alpha / sqrt(rank), not alpha / rank


class UnknownAdapter(KeyError):
  """A `model` name that is neither the base model nor a loaded adapter."""


class AdapterBusy(Exception):
  """An adapter that requests in flight still decode with."""


class NameTaken(UserError):
  """An adapter name that is the base model's or a loaded adapter's."""


class SlotsFull(UserError):
  """Every adapter row of the tables is taken (serve_lora_slots): the server's state, not the adapter, refuses."""


def check_name(name: str) -> None:
  """UserError for a name no adapter may have."""
  if not name or name != name.strip() or len(name) > 200:
    shown = repr(name) if len(name) <= 200 else f"{len(name)} characters, {name[:40]!r}..."  # one readable line
    raise UserError(f"a LoRA adapter's name must be 1 to 200 characters without surrounding spaces, got {shown}")
  # The DELETE route takes the name in its URL path: clients and the router drop "." and ".." segments, and
  # the route does not match a control character, so such an adapter could never be removed.
  if any(unicodedata.category(c) == "Cc" for c in name) or {".", ".."} & set(name.split("/")):
    raise UserError(f"a LoRA adapter's name may hold neither control characters nor '.' or '..' between slashes "
                    f"(DELETE /v1/admin/lora_adapters/NAME could not name it), got {name!r}")


# Linux's PATH_MAX: no longer path names a file (a gs:// object name is at most 1024 bytes).
MAX_PATH_CHARS = 4096


def check_path(path: str) -> None:
  """UserError for an adapter path no file can have: every refusal of an adapter echoes its path, so a 100 KB one
  made a 100 KB error line, and a NUL read as a missing folder."""
  if len(path) > MAX_PATH_CHARS:
    raise UserError(f"a LoRA adapter's path is {len(path)} characters, longer than any file path ({MAX_PATH_CHARS}); "
                    f"got {path[:40]!r}...")
  if "\0" in path:
    raise UserError(f"a LoRA adapter's path cannot hold a NUL character, got {path[:200]!r}")


class Admin:
  """The adapters as the admin routes see them: `names` as last known here (a quick check before
  an add; the registry refuses a taken name again), the rest answered by the registry."""

  base_name: str

  def names(self) -> Sequence[str]:
    raise NotImplementedError

  async def adapters(self) -> list[LoadedAdapter]:
    raise NotImplementedError

  async def add(self, name: str, path: str) -> LoadedAdapter:
    """NameTaken, or UserError when the adapter cannot be served."""
    raise NotImplementedError

  async def remove(self, name: str) -> LoadedAdapter:
    """UnknownAdapter; AdapterBusy while requests decode with it."""
    raise NotImplementedError


class _Registry(Protocol):  # lora_adapters.Registry, not imported here: it loads JAX
  base_name: str

  def names(self) -> list[str]: ...

  def adapters(self) -> list[LoadedAdapter]: ...

  def add(self, name: str, path: str) -> LoadedAdapter: ...

  def remove(self, name: str) -> LoadedAdapter: ...


class LocalAdmin(Admin):
  """The registry in this process; adding and removing (reading weights, writing the tables) run off
  the event loop other requests share."""

  def __init__(self, registry: _Registry):
    self.registry = registry
    self.base_name = registry.base_name

  def names(self) -> Sequence[str]:
    return self.registry.names()

  async def adapters(self) -> list[LoadedAdapter]:
    return self.registry.adapters()

  async def add(self, name: str, path: str) -> LoadedAdapter:
    return await asyncio.to_thread(self.registry.add, name, path)

  async def remove(self, name: str) -> LoadedAdapter:
    return await asyncio.to_thread(self.registry.remove, name)
