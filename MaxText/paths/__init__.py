"""Paths: every file a run reads or writes, local or gs:// (storage), bounded retries for remote calls (storage_retry), and the cloud endpoints from the environment (cloud_env)."""
