#!/usr/bin/env bash
# The official `openai` client's tool-calling flow end to end against MaxText.serve, with a tiny
# model taught by SFT on CPU to call a calculator (grpo_tools.sh's task and SFT stage,
# calculator_sft.sh, with the tools offered in every episode and the calculator called in
# TOOL_SHARE of them):
#   chat request with tools=[calculator] -> a reply with tool_calls (finish_reason "tool_calls")
#   -> this script runs the call (MaxText/rl/calculator.py) and sends the assistant turn back with
#   a `tool` message -> the final answer text ("#### <product>"),
# for N held-out prompts, greedy, whole replies and streamed ones (the tool_call deltas assembled);
# asserts that at least MIN_CALLS of the prompts got a call whose arguments parse, in both modes.
#   bash end_to_end/cpu/serve_tools.sh [OUTPUT_DIR]
# Needs the test extra (EXTRAS=test bash setup.sh): the openai client, and transformers for the chat template.
# PORT=...: the server's port; 0 (the default) takes a free one, which the server's start-up line names.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
: "${SFT_STEPS:=600}" "${TOOL_SHARE:=0.9}" "${N:=16}" "${MIN_CALLS:=0.75}" "${PORT:=0}"
OUT="${1:-$(mktemp -d)}"
mkdir -p "$OUT"
OFFER_TOOLS=1
source end_to_end/cpu/calculator_sft.sh

: > "$OUT/serve.log"  # there before the loop below reads it, whenever the server starts writing
python3 -m MaxText.serve configs/base.yml "${MODEL[@]}" load_parameters_path="$OUT/sft" add_bos=False \
  max_prefill_predict_length=96 port="$PORT" >"$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
# The address from this server's own start-up line (printed once its port is bound), never whatever
# else answers on a port.
URL=""
for _ in $(seq 300); do
  URL=$(sed -n 's|^serve: model .* on \(http://[^ ]*\)/v1 .*|\1|p' "$OUT/serve.log")
  [[ -n "$URL" ]] && break
  kill -0 $SERVER 2>/dev/null || { echo "error: the server exited:" >&2; tail -3 "$OUT/serve.log" >&2; exit 1; }
  sleep 1
done
[[ -n "$URL" ]] || { echo "error: the server named no address in 300 s:" >&2; tail -3 "$OUT/serve.log" >&2; exit 1; }

python3 - "$URL/v1" "$DATA/heldout.jsonl" "$N" "$MIN_CALLS" <<'PY'
import json, sys
import openai
from MaxText.rl import calculator

url, heldout, n, min_calls = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
client = openai.OpenAI(base_url=url, api_key="unused")
records = [json.loads(line) for line in open(heldout)][:n]
ASK = dict(model="default", tools=calculator.TOOLS, temperature=0, max_tokens=48)


def reply(messages, stream):
  """(content, tool calls as {id, name, arguments}, finish_reason) of one chat request."""
  if not stream:
    choice = client.chat.completions.create(messages=messages, **ASK).choices[0]
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in choice.message.tool_calls or []]
    return choice.message.content, calls, choice.finish_reason
  content, calls, finish = "", {}, None
  for chunk in client.chat.completions.create(messages=messages, stream=True, **ASK):
    delta = chunk.choices[0].delta
    content += delta.content or ""
    for c in delta.tool_calls or []:  # a call's pieces share its index
      call = calls.setdefault(c.index, {"id": None, "name": "", "arguments": ""})
      call["id"] = c.id or call["id"]
      call["name"] += (c.function.name or "") if c.function else ""
      call["arguments"] += (c.function.arguments or "") if c.function else ""
    finish = chunk.choices[0].finish_reason or finish
  return content or None, [calls[i] for i in sorted(calls)], finish


for stream in (False, True):
  called = right = 0
  for record in records:
    messages = [{"role": "user", "content": record["prompt"]}]
    content, calls, finish = reply(messages, stream)
    try:
      arguments = [json.loads(c["arguments"]) for c in calls]
    except ValueError:
      arguments = []
    if not calls or not arguments or finish != "tool_calls" or any(c["name"] != "calculator" for c in calls):
      print(f"  no call: {record['prompt']!r} -> {content!r} ({finish})")
      continue
    called += 1
    messages.append({"role": "assistant", "content": content, "tool_calls": [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls]})
    messages += [{"role": "tool", "tool_call_id": c["id"], "content": calculator.answer_call(a)}
                 for c, a in zip(calls, arguments)]
    final, more_calls, finish = reply(messages, stream)
    right += final is not None and final.strip() == f"#### {record['answer']}"
    if record is records[0]:
      print(f"  {record['prompt']!r} -> {arguments} -> tool {messages[-1]['content']!r} -> {final!r} ({finish})")
  mode = "streamed" if stream else "whole"
  print(f"{mode}: {called}/{len(records)} prompts got a calculator call whose arguments parse; "
        f"{right} final answers are the product")
  if called < min_calls * len(records):
    sys.exit(f"error: {mode} replies called the tool on {called}/{len(records)} prompts, fewer than MIN_CALLS={min_calls}")
PY
echo "end_to_end ok: served tool calls through the openai client, whole and streamed"
