#!/usr/bin/env bash
# Distillation on CPU: tinyshakespeare -> SentencePiece tokenizer -> a 4-layer teacher trained on the
# labels -> the same 2-layer student trained twice for the same steps on the same batches, once on
# the labels alone (objective=lm) and once distilled from the teacher (objective=distill) -> asserts
# that the distilled student's held-out cross-entropy is the lower one.
#   bash end_to_end/cpu/distill.sh [OUTPUT_DIR]
#   TEACHER_STEPS=600 STUDENT_STEPS=200 CORPUS=path/to/text bash end_to_end/cpu/distill.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# Knobs (environment): TEACHER_STEPS, STUDENT_STEPS, CORPUS, DISTILL (extra keys of the distilled run).
: "${TEACHER_STEPS:=600}" "${STUDENT_STEPS:=200}" "${CORPUS:=../shared/data/tinyshakespeare.txt}"
: "${DISTILL:=distill_loss=forward_kl distill_alpha=0.5 distill_temperature=1.0 distill_top_k=0}"
OUT="${1:-$(mktemp -d)}"
mkdir -p "$OUT"
if [[ ! -f "$CORPUS" ]]; then
  echo "error: corpus $CORPUS not found (set CORPUS=...)" >&2
  exit 2
fi

DATA="$OUT/data"
if [[ ! -f "$OUT/tokenizer.model" ]]; then
  python3 -m MaxText.input_pipeline.prepare_data data_files="$CORPUS" output_path="$DATA" name=tinyshakespeare \
    formats=jsonl eval_fraction=0.1 2>&1 | grep '^prepare_data'
  # The tokenizer sees only the train split, so the eval loss is measured on text it never saw.
  python3 -m MaxText.train_tokenizer data_files="$DATA/jsonl/train.jsonl" vocab_size=1024 \
    output_path="$OUT/tokenizer.model"
fi

COMMON=(dataset_type=hf hf_path=json hf_data_files="$DATA/jsonl/train.jsonl" hf_eval_files="$DATA/jsonl/validation.jsonl"
        tokenizer_path="$OUT/tokenizer.model" vocab_size=1024 max_target_length=128 per_device_batch_size=8
        eval_interval=50 eval_steps=10 log_period=50 print_config=False cpu_peak_tflops=0.1 warmup_steps_fraction=0.05)
# Both students: 2 layers of width 64; the teacher: 4 layers of width 128.
STUDENT=(base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=2 head_dim=16 base_mlp_dim=192
         base_num_decoder_layers=2 learning_rate=3e-3 steps="$STUDENT_STEPS" enable_checkpointing=False)

if [[ ! -f "$OUT/teacher/checkpoints/$TEACHER_STEPS/commit_success.txt" ]] && \
   ! ls -d "$OUT/teacher/checkpoints/$TEACHER_STEPS" >/dev/null 2>&1; then
  python3 -m MaxText.train configs/base.yml run_name=teacher base_output_directory="$OUT" "${COMMON[@]}" \
    base_emb_dim=128 base_num_query_heads=4 base_num_kv_heads=2 head_dim=32 base_mlp_dim=384 \
    base_num_decoder_layers=4 learning_rate=3e-3 steps="$TEACHER_STEPS" checkpoint_period="$TEACHER_STEPS" \
    | tee "$OUT/stdout_teacher.txt" | grep -E '^(step|eval|done)'
fi
python3 -m MaxText.train configs/base.yml run_name=labels base_output_directory="$OUT" "${COMMON[@]}" "${STUDENT[@]}" \
  | tee "$OUT/stdout_labels.txt" | grep -E '^(step|eval|done)'
# shellcheck disable=SC2086 # DISTILL is a list of key=value words
python3 -m MaxText.train configs/base.yml run_name=distilled base_output_directory="$OUT" "${COMMON[@]}" "${STUDENT[@]}" \
  objective=distill distill_teacher_path="$OUT/teacher/checkpoints" $DISTILL \
  | tee "$OUT/stdout_distilled.txt" | grep -E '^(step|eval|done|model|per step)'

python3 - "$OUT" <<'PY'
import json, pathlib, sys

out = pathlib.Path(sys.argv[1])
def evals(run, key):
  records = [json.loads(l) for l in (out / run / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r[key] for r in records if key in r}
teacher = evals("teacher", "eval_loss")
labels = evals("labels", "eval_loss")  # objective=lm: eval_loss is the held-out cross-entropy
distilled = evals("distilled", "eval_xent")  # objective=distill: eval_loss mixes in the KL; eval_xent is the same measure
for name, curve in (("teacher (4 layers)", teacher), ("student, labels only", labels), ("student, distilled", distilled)):
  print(f"{name}: held-out cross-entropy " + ", ".join(f"{s}: {l:.3f}" for s, l in sorted(curve.items())))
last = max(labels)
assert set(labels) == set(distilled), (labels, distilled)
print(f"final held-out cross-entropy at step {last}: teacher {teacher[max(teacher)]:.3f}, "
      f"labels only {labels[last]:.3f}, distilled {distilled[last]:.3f}")
assert distilled[last] < labels[last], (distilled[last], labels[last])
print("end_to_end ok: the distilled student's held-out cross-entropy is below the label-trained student's")
PY
