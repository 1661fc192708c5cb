"""The server's admin routes for LoRA adapters (inference/lora_adapters.py, reached through
lora_admin.py: in this process or the engine's), behind its API key:

    GET    /v1/admin/lora_adapters         the loaded adapters (name, table row, rank, alpha, targets, use_rslora)
    POST   /v1/admin/lora_adapters         {"name": ..., "path": PEFT adapter directory}: load one, no restart
    DELETE /v1/admin/lora_adapters/{name}  unload one (409 while requests still decode with it)

A path names a file on the server, so these routes exist only when MAXTEXT_API_KEY is set (403
otherwise); the server's guard answers 401 to a request without the key.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import FastAPI, Request  # at module level: FastAPI resolves the handlers' annotations here

from MaxText.errors import UserError
from MaxText.inference import lora_admin
from MaxText.inference import openai_api as api

ROUTE = "/v1/admin/lora_adapters"


def _describe(adapter: lora_admin.LoadedAdapter) -> dict[str, Any]:
  return {**dataclasses.asdict(adapter), "targets": list(adapter.targets)}


def add_routes(app: FastAPI, registry: lora_admin.Admin, admin_allowed: bool) -> None:
  def allowed() -> None:
    if not admin_allowed:
      raise api.ApiError(403, "the LoRA admin routes need the server started with MAXTEXT_API_KEY set",
                         code="admin_disabled")

  @app.get(ROUTE)
  async def list_adapters() -> dict[str, Any]:
    allowed()
    return {"object": "list", "data": [_describe(a) for a in await registry.adapters()]}

  @app.post(ROUTE)
  async def add_adapter(http: Request) -> dict[str, Any]:
    allowed()
    body = api.parse_json(await http.body())
    if not isinstance(body, dict) or not isinstance(body.get("name"), str) or not isinstance(body.get("path"), str):
      raise api.ApiError(400, "the body must be a JSON object with a string name and path (a PEFT adapter directory)")
    extra = sorted(k for k, v in body.items() if k not in ("name", "path") and v is not None)
    if extra:  # e.g. "lora_alpha" or "rank": never answered as if honoured; the adapter's own config sets them
      name = str(extra[0])[:100]
      raise api.ApiError(400, f"{name} is not supported by POST {ROUTE}; remove it (an add takes name and path: rank, "
                         "alpha and targets come from the adapter's adapter_config.json)", name,
                         "unsupported_parameter")
    if not body["path"].strip():  # else the refusal reads " is not a PEFT LoRA adapter", naming no path
      raise api.ApiError(400, "path is empty; give the PEFT adapter directory on the server to load", "path",
                         "invalid_adapter")
    try:
      lora_admin.check_name(body["name"])
    except UserError as e:
      raise api.ApiError(400, str(e), "name", "invalid_name") from None
    try:
      lora_admin.check_path(body["path"])
    except UserError as e:
      raise api.ApiError(400, str(e), "path", "invalid_adapter") from None
    if body["name"] in registry.names() or body["name"] == registry.base_name:
      raise api.ApiError(409, f"the model name {body['name']!r} is taken (the base model's or a loaded adapter's); "
                         "choose another", "name", "name_taken")
    try:
      loaded = await registry.add(body["name"], body["path"])
    except lora_admin.NameTaken as e:  # loaded by a request that raced this one past the check above
      raise api.ApiError(409, str(e), "name", "name_taken") from None
    except lora_admin.SlotsFull as e:  # the server's state refuses, not this adapter: was a 400 naming the path
      raise api.ApiError(409, str(e), None, "adapter_slots_full") from None
    except UserError as e:
      raise api.ApiError(400, str(e), "path", "invalid_adapter") from None
    return _describe(loaded)

  @app.delete(ROUTE + "/{name:path}")  # a name may hold "/" (Hugging Face's org/adapter); %2F for it works too
  async def remove_adapter(name: str) -> dict[str, Any]:
    allowed()
    try:
      removed = await registry.remove(name)
    except lora_admin.UnknownAdapter:
      raise api.ApiError(404, f"no LoRA adapter named {name!r} is loaded", "name", "model_not_found") from None
    except lora_admin.AdapterBusy as e:
      raise api.ApiError(409, str(e), "name", "adapter_busy") from None
    return {**_describe(removed), "deleted": True}


def add_absent_routes(app: FastAPI) -> None:
  """The admin routes of a server without adapter tables: one line on how to start one with them (a bare
  404 "Not Found" reads as a wrong address)."""
  def absent() -> None:
    raise api.ApiError(404, "this server holds no LoRA adapter tables: start it with serve_lora_slots=N (and "
                       "serve_lora_max_rank=R, the largest rank to be added) to add adapters through these routes",
                       code="lora_disabled")

  @app.api_route(ROUTE, methods=["GET", "POST"])
  async def no_adapters() -> None:
    absent()

  @app.api_route(ROUTE + "/{name:path}", methods=["DELETE"])
  async def no_adapter(name: str) -> None:
    absent()
