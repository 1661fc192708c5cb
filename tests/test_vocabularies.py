"""Each vocabulary has one owner the rest follows: the remat policies (MaxText/configuration/remat_policies.py)
and the mesh axes with their config keys (MaxText/platform/mesh_axes.py)."""

import dataclasses
import re

import jax
import pytest

from MaxText.configuration import remat_policies
from MaxText.configuration.config import read_descriptions
from MaxText.configuration.config_groups import MeshConfig
from MaxText.layers import remat
from MaxText.platform.mesh_axes import GROUPS, MESH_AXES, MeshAxis


def test_base_yml_names_every_remat_policy():
  listed = re.match(r"([\w |]+):", read_descriptions()["remat_policy"]).group(1)
  assert tuple(name.strip() for name in listed.split("|")) == remat_policies.NAMES


@pytest.mark.parametrize("name", [n for n in remat_policies.NAMES if n != "custom"])
def test_every_fixed_remat_policy_has_a_jax_policy(name):
  policy = remat.checkpoint_policy(name)
  assert policy == "none" if name == "none" else callable(policy)


def test_custom_is_resolved_from_its_placements_not_by_name():
  with pytest.raises(AssertionError, match="ModelConfig.remat"):
    remat.checkpoint_policy("custom")
  assert callable(remat.checkpoint_policy(remat_policies.custom({"query_proj": "offload", "mlpwo": "device"})))


def test_only_named_policies_name_tensors_and_only_saving_ones_offload():
  for policy in remat_policies.REMAT_POLICIES:
    if policy.name != "custom":  # its tensors come from the placement keys
      assert (policy.keeps in ("names", "dots")) == bool(policy.names), policy.name
    assert not policy.offloaded or policy.keeps in ("dots", "names"), policy.name
    assert set(policy.names) <= set(remat_policies.PRODUCED), policy.name


def test_mesh_config_has_one_key_per_axis_and_group():
  fields = {f.name for f in dataclasses.fields(MeshConfig) if f.name.endswith("_parallelism")}
  assert fields == {axis.key(group) for axis in MeshAxis for group in GROUPS}
  assert MeshAxis.STAGE.ici_key == "ici_pipeline_parallelism" and MESH_AXES[:2] == ("data", "stage")
  assert all(MeshAxis.of_key(axis.key(group)) == (group, axis) for axis in MeshAxis for group in GROUPS)
  assert MeshAxis.of_key("ici_parallelism") is None and MeshAxis.of_key("remat_policy") is None


def test_a_mesh_takes_the_axis_names():
  mesh = jax.make_mesh((1,) * len(MESH_AXES), MESH_AXES)
  assert mesh.axis_names == MESH_AXES
