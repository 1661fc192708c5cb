"""One of two real processes (jax.distributed on 127.0.0.1, gloo collectives, 2 CPU devices each)
building global batches from a grain dataset; writes what it saw as JSON for test_multiprocess_data.

    python3 two_process_worker.py PROCESS_ID PORT TRAIN_FILE TOKENIZER OUTPUT_JSON [DATA_MIXTURE_JSON]

With DATA_MIXTURE_JSON the batches come from that mixture and each step's tokens per source and
global target segments are written too.
"""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402


def main() -> None:
  process_id, port, train_file, tokenizer, output = sys.argv[1:6]
  mix = json.loads(sys.argv[6]) if len(sys.argv) > 6 else []
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=int(process_id),
                             initialization_timeout=120)
  from MaxText.platform import sharding
  from MaxText.configuration.config import Config
  from MaxText.input_pipeline import create_data_iterator

  config = Config.for_testing(dataset_type="grain", grain_train_files=train_file, tokenizer_path=tokenizer,
                              vocab_size=512, max_target_length=16, per_device_batch_size=2, print_config=False,
                              run_name="two_process", data_mixture=mix)
  data = create_data_iterator(config, sharding.create_mesh(config.mesh))
  local, full, tokens, segments = [], [], [], []
  for _ in range(3):
    batch = next(data)
    if mix:
      tokens.append(data.last_tokens)
      segments.append(np.asarray(multihost_utils.process_allgather(batch["targets_segmentation"], tiled=True)).tolist())
    shards = sorted(batch["inputs"].addressable_shards, key=lambda s: s.index[0].start or 0)
    local.append(np.concatenate([np.asarray(s.data) for s in shards]).tolist())
    full.append(np.asarray(multihost_utils.process_allgather(batch["inputs"], tiled=True)).tolist())
  result = {"shard": [data.shard.index, data.shard.count, data.shard.rows], "local": local, "global": full,
            "state": data.get_state(), "tokens": tokens, "segments": segments}
  with open(output, "w") as f:
    json.dump(result, f)
  data.close()
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
