"""An unrolled stack's working memory in the analytical model (plan_model.estimate): FSDP gathers the largest of
its layers (ModelShape.layer_params from the `layers_<i>` subtrees; a scanned stack's are named `layers`), and one
layer's recompute and backward is the widest layer's, as Gemma 4's global layers are (metrics.layer_groups). Both
were priced from the stack's names alone: nothing gathered for an unrolled stack, the local layers' width for all."""

import pytest

from MaxText.aot import plan_model
from MaxText.configuration.config import Config

from tests.test_plan import SMALL, analytic


def test_an_unrolled_stack_holds_the_gathered_layer_a_scanned_one_does() -> None:
  scanned = analytic("v5e-4", **SMALL, per_device_batch_size=4, remat_policy="full")
  unrolled = analytic("v5e-4", **SMALL, per_device_batch_size=4, remat_policy="full", scan_layers=False)
  assert unrolled.activations == pytest.approx(scanned.activations)


@pytest.mark.slow
def test_gemma4_gathers_and_works_on_its_global_layer() -> None:
  """gemma4-31b: 60 layers, a global one (32 query heads and 4 key heads of 512, values its keys) every sixth
  beside local ones (16 key/value heads of 256); the global layer is the larger in parameters and in width."""
  d, n, mlp, vocab, layers, length = 5376, 32, 21504, 262144, 60, 2048
  config = Config.for_testing(model_name="gemma4-31b", print_config=False)
  model = plan_model.ModelShape.of(config.model, config.optim)
  global_layer = d * n * 512 * 2 + d * 4 * 512 + 3 * d * mlp  # query, output, keys (no values), gated MLP
  norms = model.layer_params - global_layer
  assert 0 < norms < 10 * d  # the layer's norm scales and scalar
  e = analytic("v5p-8", model_name="gemma4-31b", per_device_batch_size=1, max_target_length=length,
               remat_policy="full", print_config=False)
  saved = length * 2 * layers * d  # full remat: each layer's input
  working = length * 2 * (2 * d + (n + 2 * 4) * 512)  # the global layer's q/k/v width (20,480; local 16,384)
  logits = length * vocab * 4
  gathered = model.layer_params * 2 * 2  # two layers in flight, bf16
  assert e.activations == pytest.approx(saved + working + logits + gathered, rel=1e-6)
