"""The run directory: one writer at a time (run_lease), the Orbax checkpoints and their per-host local tier (checkpointing, local_checkpoints), and SIGTERM as a checkpoint request (preemption)."""
