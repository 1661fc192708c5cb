"""The assembled model, above the generic layers (MaxText/layers/) and the families that bring their
own parts (MaxText/families/): the Transformer (transformer.py), its outputs and losses (outputs.py),
and ModelSpec with the parameter-tree helpers (spec.py).

What the rest of the code uses is re-exported here, so callers write `models.build_model_spec(cfg)`.
"""

from MaxText.models.outputs import AuxLosses, output_logits, sum_sown_losses, token_loss_sums
from MaxText.models.spec import (LAYER_STACKS, ModelSpec, Params, build_model_spec, shard_params_like, stack_layers,
                                 stacked_layer_key, unstack_layers)
from MaxText.models.transformer import Transformer, remat_policy

__all__ = ["AuxLosses", "LAYER_STACKS", "ModelSpec", "Params", "Transformer", "build_model_spec", "output_logits",
           "remat_policy", "shard_params_like", "stack_layers", "stacked_layer_key", "sum_sown_losses",
           "token_loss_sums", "unstack_layers"]
