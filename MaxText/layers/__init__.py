"""Model building blocks (Flax NNX). Shape legend used in every file here:

B batch, L query length, S key length, D emb_dim, N query heads, K kv heads,
G query heads per kv head (N // K), H head_dim, F mlp_dim, V vocab_size.
"""
