"""Many LoRA adapters beside one base model, decoded in the same batch.

The engine is built from `table_config`: its model has a LoRA adapter place in every targeted
projection (the adapter table's targets, at the table's rank). `AdapterTable` turns each such
place into a table (layers/lora_rows.py): lora_a [N + 1, in dims..., r], lora_b [N + 1, r, out
dims...] (after the layer dim of a scanned stack), where row 0 stays all zeros (the base model)
and each loaded adapter owns one other row: its PEFT weights (convert/peft_adapters.load) in our
layout, zero-padded to rank r, PEFT's scale (lora_alpha / r, per module under rank_pattern / alpha_pattern,
/ sqrt(r) with use_rslora) folded into lora_b. A request picks
a row through its sampling row (sampling.RowParams.adapter), which travels with the slot like its
temperature (decode_state.RowSampling.adapter_B); the engine's model calls run inside
lora_rows.use_rows, so every adapted projection adds x · A[row] · B[row] per batch row.

Adding or removing an adapter rewrites one row of every table: the tables keep their shapes, so
nothing recompiles, and the new parameters replace the old ones between two engine calls. The
server maps OpenAI `model` names to rows (`Registry`); its admin routes are in lora_routes.py.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from MaxText.configuration.config import Config
from MaxText.configuration.model_checks import MLP_LORA_TARGETS, lora_targets
from MaxText.convert import peft_adapters
from MaxText.errors import UserError
from MaxText.inference import job_events, lora_admin, speculative_engine
from MaxText.inference.lora_admin import (AdapterBusy as AdapterBusy, LoadedAdapter as LoadedAdapter,  # JAX-free
                                          NameTaken as NameTaken, SlotsFull as SlotsFull,
                                          UnknownAdapter as UnknownAdapter)
from MaxText.inference.engine import Engine, note_layer_layout
from MaxText.models import LAYER_STACKS
from MaxText.paths import storage_retry
from MaxText.platform import distributed
from MaxText.training import lora, model_assembly
from MaxText.training.model_assembly import Params

BASE_ROW = 0
# Targets a table cannot take: MLA's kv_b_proj kernel is read merged (its adapter folded in) by absorbed decoding.
NO_TABLE_TARGETS = ("kv_b_proj",)


def table_targets(config: Config) -> tuple[str, ...]:
  """Every projection of this model an adapter table can sit on (dense MLPs only, as lora_rank > 0)."""
  valid = lora_targets(config.values)
  moe = config.model.moe.num_experts > 1
  return tuple(t for t in valid if t not in NO_TABLE_TARGETS and not (moe and t in MLP_LORA_TARGETS))


def table_config(config: Config, rank: int, targets: Sequence[str]) -> Config:
  """`config` with an adapter place of `rank` on each of `targets`: an engine built from it can hold tables."""
  if rank < 1:
    raise UserError(f"serve_lora_max_rank must be >= 1 to hold LoRA adapters, got {rank}")
  values = {**config.values, "lora_rank": rank, "lora_alpha": float(rank), "lora_target_modules": tuple(targets)}
  return Config(values, config.target, reads_data=False)


def _path_keys(path: tuple[Any, ...]) -> tuple[str, ...]:
  return tuple(str(getattr(k, "key", k)) for k in path)


def table_places(abstract: Params) -> dict[tuple[tuple[str, ...], str], tuple[tuple[int, ...], int, Any]]:
  """(dense's path, lora leaf name) -> the single adapter's shape, its layer dims in front, its dtype."""
  places = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
    keys = _path_keys(path)
    if keys[-1] in lora.ADAPTER_KEYS:
      lead = 1 if keys[0] in LAYER_STACKS else 0  # a scanned stack: the layer dim comes first
      places[(keys[:-1], keys[-1])] = (tuple(leaf.shape), lead, leaf.dtype)
  return places


class AdapterTable:
  """Rows of the engine's adapter tables: `with_tables` gives the parameters zero tables of
  `capacity` adapters (+ the base row), `set_row` writes an adapter's weights into a row."""

  def __init__(self, engine: Engine, capacity: int):
    if capacity < 1:
      raise UserError(f"serve_lora_slots must be >= 1 to hold LoRA adapters, got {capacity}")
    self.engine, self.capacity = engine, capacity
    self.rank = engine.cfg.lora.lora_rank
    self.targets = tuple(engine.cfg.lora.lora_target_modules)
    self._places = table_places(engine.spec.abstract_params)
    shardings = {_path_keys(p): s for p, s in jax.tree_util.tree_flatten_with_path(engine.param_shardings)[0]}
    self._shardings = {}
    for (dense, key), (_, lead, _) in self._places.items():
      spec = tuple(shardings[dense + (key,)].spec)
      spec = spec + (None,) * (len(self._places[(dense, key)][0]) - len(spec))
      self._shardings[(dense, key)] = NamedSharding(engine.mesh, PartitionSpec(*spec[:lead], None, *spec[lead:]))
    self._set = jax.jit(self._set_fn, out_shardings=self._shardings)

  def with_tables(self, params: Params) -> Params:
    """`params` (the engine's, its adapter leaves whatever they hold) with all-zero adapter tables."""
    def table(path: tuple[Any, ...], leaf: Any) -> Any:
      keys = _path_keys(path)
      if keys[-1] not in lora.ADAPTER_KEYS:
        return leaf
      shape, lead, dtype = self._places[(keys[:-1], keys[-1])]
      return jax.device_put(jnp.zeros(shape[:lead] + (self.capacity + 1,) + shape[lead:], dtype),
                            self._shardings[(keys[:-1], keys[-1])])
    try:
      return jax.tree_util.tree_map_with_path(table, params)
    except jax.errors.JaxRuntimeError as e:  # serve_lora_slots or serve_lora_max_rank far too large
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      size = sum(int(np.prod(shape)) * (self.capacity + 1) * np.dtype(dtype).itemsize
                 for shape, _, dtype in self._places.values())
      raise UserError(f"the LoRA adapter tables ({self.capacity} adapter rows and the base model's, rank {self.rank}) "
                      f"need {size / 2**30:.3g} GiB, more than the devices could allocate: lower serve_lora_slots or "
                      "serve_lora_max_rank") from None

  def check(self, rank: int, targets: Sequence[str], name: str) -> None:
    """UserError when an adapter of `rank` on `targets` does not fit the tables."""
    if rank > self.rank:
      raise UserError(f"LoRA adapter {name!r} has rank {rank}, more than this server's serve_lora_max_rank="
                      f"{self.rank}; restart with serve_lora_max_rank >= {rank}")
    outside = [t for t in targets if t not in self.targets]
    if outside:
      raise UserError(f"LoRA adapter {name!r} targets {outside}, which this server's adapter tables do not cover "
                      f"({list(self.targets)}: the start-up adapters' targets)")

  def row_values(self, adapter: peft_adapters.PeftAdapter | None) -> dict[tuple[tuple[str, ...], str], np.ndarray]:
    """Each table leaf's row for `adapter` (None: zeros), rank-padded, its scale folded into lora_b."""
    if adapter is not None:  # one loaded outside `Registry.add` has not met `check`: numpy would fail or drop leaves
      outside = [t for t in adapter.targets if t not in self.targets]
      if adapter.rank > self.rank or outside:
        raise UserError(f"a LoRA adapter of rank {adapter.rank} on {list(adapter.targets)} does not fit adapter tables "
                        f"of rank {self.rank} (serve_lora_max_rank) on {list(self.targets)}")
    out = {}
    for (dense, key), (shape, lead, dtype) in self._places.items():
      value = np.zeros(shape, np.float32)
      if adapter is not None:
        for index in (np.ndindex(*shape[:lead]) if lead else [()]):
          leaf = (dense, tuple(int(i) for i in index))
          pair = adapter.leaves.get(leaf)
          if pair is None:
            continue
          rank = pair[0].shape[-1]  # rank_pattern: a module's own rank, at most the adapter's
          if key == "lora_a":
            value[index][..., :rank] = pair[0]
          else:
            with np.errstate(over="ignore"):  # refused below, in one line
              value[index][:rank] = pair[1] * adapter.scale_of(leaf)
      with np.errstate(over="ignore"):
        out[(dense, key)] = value.astype(dtype)
      # Finite weights times a finite scale can still overflow: an inf row decoded NaN logits (token 0 on and on).
      if adapter is not None and not np.isfinite(out[(dense, key)]).all():
        scale = max((adapter.scale_of(leaf) for leaf in adapter.leaves if leaf[0] == dense), key=abs)
        raise UserError(f"its lora_B times its scale ({scale:.3g}, from lora_alpha) overflows {np.dtype(dtype).name} "
                        f"in {'/'.join(dense)}; lora_alpha or the lora_B weights are far too large")
    return out

  def set_row(self, params: Params, row: int, adapter: peft_adapters.PeftAdapter | None) -> Params:
    """New parameters: `params` with table row `row` holding `adapter` (None: zeros). One compiled
    program for every row; the other parameters are shared, not copied."""
    values = self.row_values(adapter)  # its refusals before any device work
    tables = {place: _subtree(params, place[0])[place[1]] for place in self._places}
    new = self._set(tables, values, jnp.int32(row))
    out = _copy_dicts(params)
    for (dense, key), value in new.items():
      _subtree(out, dense)[key] = value
    return out

  def _set_fn(self, tables: Mapping[Any, jax.Array], values: Mapping[Any, jax.Array], row: jax.Array
              ) -> dict[Any, jax.Array]:
    out = {}
    for place, table in tables.items():
      lead = self._places[place][1]
      moved = jnp.moveaxis(table, lead, 0)
      out[place] = jnp.moveaxis(moved.at[row].set(values[place].astype(table.dtype)), 0, lead)
    return out


def _subtree(params: Params, path: tuple[str, ...]) -> dict[str, Any]:
  node: Any = params
  for key in path:
    node = node[key]
  return dict[str, Any](node) if not isinstance(node, dict) else node


def _copy_dicts(params: Any) -> Any:
  return {k: _copy_dicts(v) for k, v in params.items()} if isinstance(params, dict) else params


class Registry:
  """The served adapters by name: `add` / `remove` change the engine's parameters through `swap`
  (called with the new parameters before a new name is usable, after an old one is gone);
  `acquire` / `release` count each adapter's requests in flight. Thread-safe."""

  def __init__(self, table: AdapterTable, base_name: str, params: Params, swap: Any = None):
    self.table, self.base_name = table, base_name
    self.params = params
    self.swap = swap  # callable(new params) -> None, e.g. setting the scheduler's parameters
    self._by_name: dict[str, LoadedAdapter] = {}
    self._in_flight: dict[str, int] = {}
    # Each load's own prefix-cache key: pages an adapter cached are never reused by another loaded in its row later.
    self._cache_keys: dict[str, bytes] = {}
    self._loads = 0
    self._lock = threading.Lock()  # names and in-flight counts: held briefly, requests take it
    self._changing = threading.Lock()  # an add or remove in progress

  def names(self) -> list[str]:
    with self._lock:
      return sorted(self._by_name)

  def adapters(self) -> list[LoadedAdapter]:
    with self._lock:
      return [self._by_name[n] for n in sorted(self._by_name)]

  def add(self, name: str, path: str) -> LoadedAdapter:
    """Loads the PEFT adapter in `path` as `name`; UserError (with no change) when it cannot be served.
    Reading it happens outside the lock that requests take, so serving goes on meanwhile."""
    lora_admin.check_name(name)
    lora_admin.check_path(path)
    with self._changing:  # one change of the tables at a time: the free row stays free
      with self._lock:
        if name == self.base_name:
          raise NameTaken(f"LoRA adapter name {name!r} is the base model's name; choose another")
        if name in self._by_name:
          raise NameTaken(f"a LoRA adapter named {name!r} is already loaded; remove it first or choose another name")
        free = sorted(set(range(1, self.table.capacity + 1)) - {a.row for a in self._by_name.values()})
      if not free:
        raise SlotsFull(f"all serve_lora_slots={self.table.capacity} adapter rows are taken; remove an adapter first")
      with storage_retry.one_request():  # a dead bucket fails this add, not the server's later gs:// reads
        rank, targets, _ = peft_adapters.read_config(path)
        check_stored_rank(name, path, rank)
        self.table.check(rank, targets, name)
        adapter = peft_adapters.load(path, self.table.engine.cfg, self.table.engine.spec.abstract_params)
      self.table.check(adapter.rank, adapter.targets, name)  # the targets its tensors name
      loaded = LoadedAdapter(name, free[0], adapter.rank, adapter.alpha, adapter.targets, adapter.use_rslora)
      try:
        new = self.table.set_row(self.params, loaded.row, adapter)
      except UserError as e:
        raise UserError(f"LoRA adapter {name!r} ({path}): {e}") from None
      self._set_params(new)  # before the name is usable
      with self._lock:
        self._by_name[name], self._in_flight[name] = loaded, 0
        self._loads += 1
        self._cache_keys[name] = f"lora-adapter {self._loads}\0".encode()
      return loaded

  def remove(self, name: str) -> LoadedAdapter:
    """Unloads `name` (UnknownAdapter; AdapterBusy while requests decode with it); its row is zeroed after
    the name is gone, so no new request can reach it."""
    with self._changing:
      with self._lock:
        if name not in self._by_name:
          raise UnknownAdapter(name)
        if self._in_flight[name]:
          raise AdapterBusy(f"LoRA adapter {name!r} has {self._in_flight[name]} requests in flight; retry when they "
                            "end")
        loaded = self._by_name.pop(name)
        del self._in_flight[name], self._cache_keys[name]
      self._set_params(self.table.set_row(self.params, loaded.row, None))
      return loaded

  def acquire(self, name: str) -> int:
    """The table row of `name` for one more request in flight (BASE_ROW for the base model)."""
    if name == self.base_name:
      return BASE_ROW
    with self._lock:
      if name not in self._by_name:
        raise UnknownAdapter(name)
      self._in_flight[name] += 1
      return self._by_name[name].row

  def hold(self, name: str, count: int) -> tuple[int, bytes]:
    """The table row and prefix-cache key (cache_key) of `name` for `count` more requests in flight, each
    released once; UnknownAdapter (nothing held) when it is not loaded."""
    if name == self.base_name:
      return BASE_ROW, b""
    with self._lock:
      if name not in self._by_name:
        raise UnknownAdapter(name)
      self._in_flight[name] += count
      return self._by_name[name].row, self._cache_keys[name]

  def releasing(self, name: str, emit: Callable[[job_events.Event], None]) -> Callable[[job_events.Event], None]:
    """A job's `emit` that releases `name` at the job's Done."""
    def emit_releasing(event: job_events.Event) -> None:
      if isinstance(event, job_events.Done):
        self.release(name)
      emit(event)
    return emit_releasing

  def cache_key(self, name: str) -> bytes:
    """What the KV pages of `name`'s prompts are cached under (engine begin_prompt's cache_key; b"" for the
    base model): prefix caching never hands one adapter's pages to another or to the base model."""
    if name == self.base_name:
      return b""
    with self._lock:
      if name not in self._cache_keys:
        raise UnknownAdapter(name)
      return self._cache_keys[name]

  def release(self, name: str) -> None:
    with self._lock:
      if name in self._in_flight and self._in_flight[name] > 0:
        self._in_flight[name] -= 1

  def _set_params(self, params: Params) -> None:
    self.params = params
    if self.swap is not None:
      self.swap(params)


def check_stored_rank(name: str, path: str, claimed: int) -> None:
  """UserError when the lora_A tensors of `path` have another rank than its config's r (`claimed`): PEFT refuses
  such an adapter, and the tables' rank check must see the rank the tensors have."""
  stored = peft_adapters.stored_rank(path)
  if stored != claimed:
    raise UserError(f"LoRA adapter {name!r} ({path}): its config says r={claimed} but its lora_A tensors have rank "
                    f"{stored}; fix adapter_config.json")


def parse_adapters(items: Sequence[str]) -> list[tuple[str, str]]:
  """serve_lora_adapters' name=path items."""
  out = []
  for item in items:
    name, sep, path = str(item).partition("=")
    if not sep or not name.strip() or not path.strip():
      raise UserError(f"serve_lora_adapters items are name=path (a PEFT adapter directory), got {item!r}")
    out.append((name.strip(), path.strip()))
  return out


def check_start_names(named: Sequence[tuple[str, str]], base_name: str, slots: int) -> None:
  """UserError for serve_lora_adapters' names that cannot all be served, found before anything loads: Registry.add
  finds the same only after the engine and the base model's weights (minutes for a real model), and with the
  admin route's advice ("remove it first")."""
  seen: set[str] = set()
  for name, path in named:
    lora_admin.check_name(name)
    lora_admin.check_path(path)
    if name == base_name:
      raise UserError(f"serve_lora_adapters names an adapter {name!r}, the base model's own name: choose another "
                      "(or another serve_model_name)")
    if name in seen:
      raise UserError(f"serve_lora_adapters names {name!r} twice; each adapter needs a name of its own")
    seen.add(name)
  if slots and slots < len(named):
    raise UserError(f"serve_lora_slots={slots} holds fewer adapters than the {len(named)} serve_lora_adapters names; "
                    f"set serve_lora_slots >= {len(named)} (or 0: as many as serve_lora_adapters)")


def load_engine(config: Config, num_slots: int, fresh_note: str, base_name: str,
                mesh: Any = None, base_params: Params | None = None) -> tuple[Engine, Registry]:
  """An engine with adapter tables and a registry holding serve_lora_adapters: the tables' rank is
  serve_lora_max_rank (0: the largest start-up adapter's), their targets the start-up adapters' (every
  target of the model when none is given), their rows serve_lora_slots (0: the start-up adapters').
  The base model's parameters: `base_params` when given, else load_parameters_path's (else fresh ones)."""
  d = config.decode
  if d.speculative_tokens:  # a draft's mistakes before anything loads (speculative_engine.with_draft builds it)
    speculative_engine.check_draft(config)
  if config.model.lora.lora_rank:
    raise UserError("serve LoRA adapters beside a base model with lora_rank=0 (a LoRA checkpoint: export it merged "
                    "with MaxText.generate_param_only_checkpoint, or its adapters with lora_peft_export_path)")
  named = parse_adapters(d.serve_lora_adapters)
  check_start_names(named, base_name, d.serve_lora_slots)
  peeks = [peft_adapters.read_config(path)[:2] for _, path in named]
  rank = d.serve_lora_max_rank or max((r for r, _ in peeks), default=0)
  targets = sorted({t for _, ts in peeks for t in ts}) or list(table_targets(config))
  unknown = [t for t in targets if t not in table_targets(config)]
  if unknown:
    raise UserError(f"LoRA adapters target {unknown}, which this model cannot serve from adapter tables "
                    f"(it can: {list(table_targets(config))})")
  for (name, adapter_path), (claimed, _) in zip(named, peeks):  # before tables of that rank are allocated
    check_stored_rank(name, adapter_path, claimed)
    peft_adapters.check_targets(adapter_path, config.model)
    if claimed > rank:  # Registry.add would refuse it only after the engine and the weights load
      raise UserError(f"LoRA adapter {name!r} ({adapter_path}) has rank {claimed}, more than serve_lora_max_rank="
                      f"{rank}; set serve_lora_max_rank >= {claimed} (or 0: the largest start-up adapter's)")
  table_cfg = table_config(config, rank, targets)
  path = model_assembly.parameters_path(config)
  engine = Engine(table_cfg, num_slots=num_slots, mesh=mesh)
  note_layer_layout(config)
  if base_params is None and not path:
    distributed.log(fresh_note)
  if base_params is None:  # read as a server without adapters reads them
    base_params = model_assembly.build_model(config, mesh=engine.mesh).params(path)
  table = AdapterTable(engine, d.serve_lora_slots or len(named))
  params = table.with_tables(lora.combine(lora.split(dict(engine.spec.abstract_params))[0], base_params))
  params = engine.prepare_params(params)  # quantize_weights: the base kernels 8-bit; the tables stay float
  if engine.weight_quantizer is not None:  # the line a server without adapters prints: the base model's bytes
    distributed.log(engine.weight_quantizer.describe(lora.split(dict(engine.spec.abstract_params))[1],
                                                     lora.split(params)[1]))
  registry = Registry(table, base_name, params)
  for name, adapter_path in named:
    registry.add(name, adapter_path)
  return engine, registry

