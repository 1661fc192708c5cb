"""A model on a mesh from a checkpoint: mesh → model spec → parameter shardings → parameters
born sharded (read from a checkpoint, or freshly initialised).

The one assembly of a model on a mesh: training builds its state around it
(`run_assembly.build_run`, whose parameters-only start reads through `ModelOnMesh.read`), and the
tools that run or export a model without training it use it whole: decode and serve (through
`inference.engine.Engine`), the logit checker and the parameters-only export.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
from jax.sharding import Mesh

from MaxText import models
from MaxText.training import params_io
from MaxText.platform import sharding
from MaxText.paths import storage
from MaxText.configuration.config import Config
from MaxText.errors import UserError
from MaxText.configuration.model_config import ModelConfig
from MaxText.platform.sharding import Rules

Params = models.Params  # a nested dict of arrays, shaped like ModelSpec.abstract_params


@dataclasses.dataclass(frozen=True)
class ModelOnMesh:
  """A model spec on a mesh and the shardings its parameters are born in."""

  mesh: Mesh
  spec: models.ModelSpec
  rules: Rules
  param_shardings: Params  # NamedShardings, shaped like spec.abstract_params

  def params(self, path: str = "", seed: int = 0) -> Params:
    """From `path` (any of our checkpoint kinds, in either layer layout), else fresh from `seed`."""
    if path:
      return self.read(path)
    return jax.jit(self.spec.init_params, out_shardings=self.param_shardings)(jax.random.key(seed))

  def read(self, path: str, part: Callable[[Params], Params] | None = None) -> Params:
    """The parameters `part` picks out of the model's tree (all of them when None), read from
    `path` born sharded: a run that trains part of them (LoRA) reads the rest."""
    abstract, shardings = self.spec.abstract_params, self.param_shardings
    if part is not None:
      abstract, shardings = part(abstract), part(shardings)
    return params_io.load_params(path, abstract, shardings)


def build_model(config: Config, *, devices: Sequence[jax.Device] | None = None, mesh: Mesh | None = None,
                model: ModelConfig | None = None) -> ModelOnMesh:
  """The model of `config` (or `model`, a variant of its model config) on `mesh`, else on a mesh
  of `devices` (default: every device this process sees)."""
  mesh = mesh if mesh is not None else sharding.create_mesh(config.mesh, devices)
  rules = config.mesh.logical_axis_rules
  spec = models.build_model_spec(model if model is not None else config.model)
  return ModelOnMesh(mesh, spec, rules, models.shard_params_like(spec, mesh, rules))


def assemble_model(config: Config, path: str, *, devices: Sequence[jax.Device] | None = None,
                   mesh: Mesh | None = None, seed: int = 0) -> tuple[ModelOnMesh, Params]:
  """The model of `config` and its parameters from `path` ("" for fresh ones from `seed`)."""
  model = build_model(config, devices=devices, mesh=mesh)
  return model, model.params(path, seed)


def parameters_path(config: Config) -> str:
  """load_parameters_path, "" when none is given; one that does not exist is a UserError."""
  path = config.checkpoint.load_parameters_path
  if path and not storage.exists(path):
    raise UserError(f"checkpoint {path} does not exist (load_parameters_path)")
  return path
