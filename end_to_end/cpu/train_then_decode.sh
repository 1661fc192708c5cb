#!/usr/bin/env bash
# Train → params-only checkpoint → decode, on CPU: tinyshakespeare -> SentencePiece tokenizer ->
# a small model trained STEPS steps (hf JSONL input) -> generate_param_only_checkpoint (unrolled
# layers, the faster decode layout on CPU) -> MaxText.decode greedy and top-k on a prompt, with
# the model keys read from the model_config.yml beside the checkpoint (no model_name).
#   bash end_to_end/cpu/train_then_decode.sh [OUTPUT_DIR]
#   STEPS=300 PROMPT="ROMEO:" CORPUS=path/to/text bash end_to_end/cpu/train_then_decode.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
: "${STEPS:=300}" "${PROMPT:=ROMEO:}" "${CORPUS:=../shared/data/tinyshakespeare.txt}"
OUT="${1:-$(mktemp -d)}"
mkdir -p "$OUT"
if [[ ! -f "$CORPUS" ]]; then
  echo "error: corpus $CORPUS not found (set CORPUS=...)" >&2
  exit 2
fi

DATA="$OUT/data"
python3 -m MaxText.input_pipeline.prepare_data data_files="$CORPUS" output_path="$DATA" name=tinyshakespeare \
  formats=jsonl eval_fraction=0.1 2>&1 | grep '^prepare_data'
python3 -m MaxText.train_tokenizer data_files="$DATA/jsonl/train.jsonl" vocab_size=1024 \
  output_path="$OUT/tokenizer.model"

# The model of tinyshakespeare.sh (~0.5M parameters besides the embeddings), checkpointed once at the end.
MODEL=(base_emb_dim=128 base_num_query_heads=4 base_num_kv_heads=2 head_dim=32 base_mlp_dim=384
       base_num_decoder_layers=2 vocab_size=1024)
python3 -m MaxText.train configs/base.yml run_name=shakespeare base_output_directory="$OUT" "${MODEL[@]}" \
  max_target_length=128 per_device_batch_size=8 learning_rate=3e-3 warmup_steps_fraction=0.05 steps="$STEPS" \
  log_period=50 print_config=False checkpoint_period="$STEPS" async_checkpointing=False cpu_peak_tflops=0.1 \
  dataset_type=hf hf_path=json hf_data_files="$DATA/jsonl/train.jsonl" tokenizer_path="$OUT/tokenizer.model" \
  | grep -E '^(step|done)'

python3 -m MaxText.generate_param_only_checkpoint configs/base.yml run_name=shakespeare \
  base_output_directory="$OUT" "${MODEL[@]}" param_only_checkpoint_path="$OUT/params" force_unroll=True \
  print_config=False | grep -E '^wrote'

# No model keys here: they come from $OUT/params/model_config.yml.
DECODE=(load_parameters_path="$OUT/params" tokenizer_path="$OUT/tokenizer.model" prompt="$PROMPT"
        max_prefill_predict_length=16 max_target_length=96 scan_layers=False print_config=False)
python3 -m MaxText.decode configs/base.yml "${DECODE[@]}" | tee "$OUT/decode_greedy.txt"
python3 -m MaxText.decode configs/base.yml "${DECODE[@]}" decode_sampling_strategy=topk decode_sampling_top_k=20 \
  decode_sampling_temperature=0.8 decode_sampling_seed=1 | tee "$OUT/decode_topk.txt"

for f in "$OUT/decode_greedy.txt" "$OUT/decode_topk.txt"; do
  grep -q '^completion: ' "$f" && grep -q '^generated ids: \[' "$f" && grep -q 'tokens/s' "$f" \
    || { echo "error: $f lacks the completion, ids or throughput lines" >&2; exit 1; }
done
echo "end_to_end ok: trained $STEPS steps, wrote a params-only checkpoint, decoded \"$PROMPT\" (outputs in $OUT)"
