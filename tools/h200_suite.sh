#!/bin/bash
# Every GPU measurement of the open issues, on one H200, in parts that each fit a device call:
#   decode  decode / prefill / engine (pipelined and not) / HF (bench_decode; the pipelined
#           engine's steps traced), then prompt steps with and without prompt graphs
#           (bench_prompt_graphs), about 7 minutes
#   step    the decode step A/B: the TUNED tiles, PDL, cuBLAS (bench_step_ab), about 4
#   serve   cold start, bench_serve at concurrency 1 / 16 / 64 and the multi-turn run, then
#           concurrency 1 and 64 again with --no-overlap and with --no-pipelining, about 8
#   gate    the bf16 gate, about 6
#   cold    a server on an empty Triton cache at concurrency 64, and the Triton kernels its
#           rank first used after start-up (each one compiled while a request waited), about 3
#
#   OUT=/tmp/out bash tools/h200_suite.sh [decode] [step] [serve] [gate] [cold]   # from the repository root
#   (no part named: decode and serve)
#
# Needs the package importable (pip install -e . or PYTHONPATH) and a GPU; makes the random
# 4B checkpoint at /tmp/m4b on the GPU (never carried). Results land in $OUT.
set -u
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
[ -f /tmp/m4b/config.json ] || python3 -m tools.make_model --preset 4b --out /tmp/m4b --dtype bf16 --device cuda >/dev/null
say "checkpoint ready"
SERVE=(--model /tmp/m4b --served-model-name m4b --device cuda --dtype bfloat16 --max-num-seqs 64 --max-model-len 8192)
BENCH=(python3 -m tools.bench_serve --base-url http://127.0.0.1:8123 --model m4b --result-dir "$OUT")
start_server() {  # LOG [serve flags...]: in the background as $SERVER, until /health answers (200 s: a cold one compiles)
  local log=$1; shift
  python3 -m deltaserve.tools.cli serve "${SERVE[@]}" --port 8123 "$@" > "$log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 200); do curl -sf localhost:8123/health >/dev/null && break; sleep 1; done
}
PARTS=" ${*:-decode serve} "
if [[ $PARTS == *" decode "* ]]; then
# the pipelined engine runs last: its trace files overwrite the other's
DELTASERVE_STEP_TRACE=/tmp/step_trace timeout 330 python3 -m tools.bench_decode --model /tmp/m4b --batches 1 8 32 64 \
  --steps 8 --hf-batches 1 --hf-steps 8 --engine-pipelining off on overlap --out "$OUT/bench_decode.json" \
  > "$OUT/bench_decode.log" 2>&1
say "bench_decode rc=$?"
grep -E "^(model|prefill|engine|hf|profile)" "$OUT/bench_decode.log"
python3 -m tools.step_trace /tmp/step_trace --json "$OUT/step_trace.json" | grep -A9 -E "^steps of (1|64) items"
timeout 200 python3 -m tools.bench_prompt_graphs --model /tmp/m4b --reps 4 --out "$OUT/prompt_graphs.json" 2>&1 | grep -v "^{"
say "bench_prompt_graphs"
fi
if [[ $PARTS == *" step "* ]]; then
timeout 240 python3 -m tools.bench_step_ab --model /tmp/m4b --out "$OUT/step_ab.json" 2>&1 | grep -E "^(pdl|untuned|noepi|nopdl|cublas) "
say "step A/B"
fi
if [[ $PARTS == *" serve "* ]]; then
bench_random() {  # SUFFIX CONCURRENCY...: 1024 in / 256 out, 4 requests per stream
  local suffix=$1; shift
  for c in "$@"; do
    n=$(( c * 4 )); [ "$c" = 1 ] && n=4
    timeout 150 "${BENCH[@]}" --random-input-len 1024 --random-output-len 256 --ignore-eos --num-prompts $n \
      --max-concurrency $c --label "h200-4b-c$c$suffix" --result-filename "serve_c$c$suffix.json" 2>&1 \
      | grep -E "Output token throughput|Mean TTFT|Mean TPOT|Successful|Failed|engine_"
    say "bench_serve c=$c$suffix"
  done
}
timeout 150 python3 -m tools.coldstart --runs 2 --out "$OUT/coldstart.json" -- "${SERVE[@]}"
say "coldstart rc=$?"
start_server "$OUT/serve.log"
LONG=$(python3 -c "print('hello world ' * 500)")  # over 4096 characters: the tokenizer worker's path
curl -s -o /dev/null -w "first 1000-token prompt after start: %{time_total} s\n" localhost:8123/v1/completions \
  -H 'Content-Type: application/json' -d "{\"model\":\"m4b\",\"prompt\":\"$LONG\",\"max_tokens\":1}"
bench_random "" 1 16 64
timeout 150 "${BENCH[@]}" --multi-turn --num-conversations 12 --max-concurrency 4 --random-input-len 512 \
  --random-output-len 128 --ignore-eos --label h200-4b-multiturn --result-filename multiturn.json 2>&1 | tail -2
kill -TERM $SERVER; wait $SERVER; say "server exit code $?"
start_server "$OUT/serve_no_overlap.log" --no-overlap
bench_random _no_overlap 1 64
kill -TERM $SERVER; wait $SERVER; say "server (no overlap) exit code $?"
start_server "$OUT/serve_sync.log" --no-pipelining
bench_random _sync 1 64
kill -TERM $SERVER; wait $SERVER; say "server (no pipelining) exit code $?"
fi
if [[ $PARTS == *" cold "* ]]; then
  export TRITON_CACHE_DIR=$(mktemp -d)
  start_server "$OUT/serve_cold.log"
  say "server up (empty Triton cache)"
  timeout 90 "${BENCH[@]}" --random-input-len 1024 --random-output-len 256 --ignore-eos --num-prompts 192 \
    --max-concurrency 64 --label h200-4b-c64-cold --result-filename serve_c64_cold.json 2>&1 \
    | grep -E "Output token throughput|TTFT|Failed"
  kill -TERM $SERVER; wait $SERVER
  say "kernels first used after start-up: $(grep -c 'first used after start-up' "$OUT/serve_cold.log")"
  rm -rf "$TRITON_CACHE_DIR"; unset TRITON_CACHE_DIR
fi
if [[ $PARTS == *" gate "* ]]; then
  timeout 400 python3 -m tools.gate_bf16 --model /tmp/m4b --fp32-check --out "$OUT/gate_bf16.json" \
    > "$OUT/gate.log" 2>&1
  say "gate rc=$?"; tail -3 "$OUT/gate.log"
fi
