"""Model building blocks (Flax NNX). Shape legend used in every file here:

B batch, L query length, S key length (in decode: the cache length), D emb_dim, N query heads,
K kv heads, G query heads per kv head (N // K), H head_dim, F mlp_dim, V vocab_size.
A file's own legend adds letters and never reuses these: moe.py (E experts, k top-k,
C capacity, A routed assignments), pipeline.py (P stages, R passes, J layers per stage and pass,
M microbatches, m rows per microbatch, T iterations).
"""
