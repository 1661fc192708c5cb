#!/usr/bin/env bash
# The README's first run, checked: trains the CPU default model and asserts that the
# loss fell well below the bigram floor ln(8) and that every output file exists.
#   bash end_to_end/cpu_first_run.sh [OUTPUT_DIR]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${1:-$(mktemp -d)}"
mkdir -p "$OUT"
python3 -m MaxText.train configs/base.yml run_name=e2e_first base_output_directory="$OUT" print_config=False \
  | tee "$OUT/stdout.txt"
python3 - "$OUT/e2e_first" <<'PY'
import json, math, pathlib, sys
run = pathlib.Path(sys.argv[1])
records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
losses = [r["loss"] for r in records if "loss" in r]
first, last = sum(losses[:3]) / 3, sum(losses[-10:]) / 10
assert len(losses) == 100, len(losses)
assert last < math.log(8) < first, (first, last)
assert list((run / "tensorboard").glob("events.out.tfevents.*")) and (run / "config.yml").is_file()
print(f"end_to_end ok: loss {first:.3f} -> {last:.3f} over {len(losses)} steps")
PY
