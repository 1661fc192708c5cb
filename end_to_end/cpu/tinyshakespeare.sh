#!/usr/bin/env bash
# Real data end to end on CPU: tinyshakespeare -> SentencePiece tokenizer -> the same train/eval
# documents prepared for hf (JSONL), grain (ArrayRecord) and tfds (a TFDS builder over the JSONL,
# stored as ArrayRecord, no TensorFlow needed) -> a small model trained on each with evaluation on
# the held-out split -> asserts on the eval loss.
#   bash end_to_end/cpu/tinyshakespeare.sh [OUTPUT_DIR]
#   STEPS=300 EVAL_THRESHOLD=4.6 DATASET_TYPES="grain hf tfds" CORPUS=path/to/text bash end_to_end/cpu/tinyshakespeare.sh
# The eval-loss threshold is justified at its assertion below.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# Knobs (environment): STEPS, EVAL_THRESHOLD, DATASET_TYPES, CORPUS.
: "${STEPS:=300}" "${EVAL_THRESHOLD:=4.6}" "${DATASET_TYPES:=grain hf tfds}" "${CORPUS:=../shared/data/tinyshakespeare.txt}"
OUT="${1:-$(mktemp -d)}"
mkdir -p "$OUT"
if [[ ! -f "$CORPUS" ]]; then
  echo "error: corpus $CORPUS not found (set CORPUS=...)" >&2
  exit 2
fi

DATA="$OUT/data"
python3 -m MaxText.input_pipeline.prepare_data data_files="$CORPUS" output_path="$DATA" name=tinyshakespeare \
  formats=jsonl,arrayrecord,tfds eval_fraction=0.1 2>&1 | grep '^prepare_data'
# The tokenizer sees only the train split, so the eval loss is measured on text it never saw.
python3 -m MaxText.train_tokenizer data_files="$DATA/jsonl/train.jsonl" vocab_size=1024 \
  output_path="$OUT/tokenizer.model"

# ~0.5M parameters besides the embeddings; 8 x 128 tokens a step (one epoch of the ~380k train
# tokens is ~370 steps).
MODEL=(base_emb_dim=128 base_num_query_heads=4 base_num_kv_heads=2 head_dim=32 base_mlp_dim=384
       base_num_decoder_layers=2 vocab_size=1024 max_target_length=128 per_device_batch_size=8
       learning_rate=3e-3 warmup_steps_fraction=0.05 steps="$STEPS" eval_interval=50 eval_steps=10
       log_period=50 print_config=False enable_checkpointing=False cpu_peak_tflops=0.1
       tokenizer_path="$OUT/tokenizer.model" grain_worker_count=1)
declare -A SOURCE=(
  [grain]="grain_train_files=$DATA/arrayrecord/train.array_record grain_eval_files=$DATA/arrayrecord/validation.array_record"
  [hf]="hf_path=json hf_data_files=$DATA/jsonl/train.jsonl hf_eval_files=$DATA/jsonl/validation.jsonl"
  [tfds]="dataset_path=$DATA/tfds dataset_name=local_text/tinyshakespeare train_split=train eval_split=validation"
)
for kind in $DATASET_TYPES; do
  # shellcheck disable=SC2086 # SOURCE entries are lists of key=value words
  python3 -m MaxText.train configs/base.yml run_name="shakespeare_$kind" base_output_directory="$OUT" \
    dataset_type="$kind" ${SOURCE[$kind]} "${MODEL[@]}" | tee "$OUT/stdout_$kind.txt" | grep -E '^(step|eval|done)'
done

python3 - "$OUT" "$EVAL_THRESHOLD" $DATASET_TYPES <<'PY'
import collections, json, math, pathlib, sys
sys.path.insert(0, ".")
from MaxText.input_pipeline.tokenizer import DocumentEncoder, load_tokenizer

out, threshold, kinds = pathlib.Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
# The bar a model must clear to show it uses context: the cross-entropy on the eval split of a
# unigram model (add-one smoothed token frequencies of the train split).
encode = DocumentEncoder(load_tokenizer("sentencepiece", str(out / "tokenizer.model")), True, True)
docs = lambda split: [encode(json.loads(l)["text"]) for l in (out / "data/jsonl" / f"{split}.jsonl").open()]
counts = collections.Counter(t for d in docs("train") for t in d[1:])
total, vocab = sum(counts.values()), 1024
eval_targets = [t for d in docs("validation") for t in d[1:]]
unigram = -sum(math.log((counts[t] + 1) / (total + vocab)) for t in eval_targets) / len(eval_targets)
print(f"unigram cross-entropy on the eval split: {unigram:.3f} (ln vocab {math.log(vocab):.3f})")
for kind in kinds:
  records = [json.loads(l) for l in (out / f"shakespeare_{kind}" / "metrics.jsonl").read_text().splitlines()]
  evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
  waits = [r["input_wait_s"] for r in records if "input_wait_s" in r]
  final = evals[max(evals)]
  curve = ", ".join(f"{s}: {l:.3f}" for s, l in sorted(evals.items()))
  print(f"{kind}: eval loss {curve}; median input wait {sorted(waits)[len(waits) // 2] * 1e3:.2f} ms/step")
  # Measured at 300 steps (2 cores): final eval loss 4.09 for grain and hf (same document order)
  # and 4.27 for tfds (TFDS shuffles records when preparing, so other eval batches), against 6.03
  # for the unigram baseline. The default threshold 4.6 leaves ~0.3 nats for other machines and
  # XLA versions while still requiring 1.4 nats of context use; fewer STEPS need a higher one.
  assert final < unigram - 1.0, (kind, final, unigram)
  assert final < threshold, (kind, final, threshold)
  assert list(evals.values()) == sorted(evals.values(), reverse=True) or final == min(evals.values()), (kind, evals)
print(f"end_to_end ok: final eval loss below {threshold} and at least 1 nat under the unigram baseline for {', '.join(kinds)}")
PY
