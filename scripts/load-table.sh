#!/usr/bin/env bash
# `make load-table`: the README's load table. One `treeflash serve --max-batch 8` per arm, started,
# driven by `treeflash bench-load` at 1, 2, 4, 8 and 16 clients (64 tokens each), then stopped;
# where `make llama-cpp` has built llama-server, the same load on `llama-server -np 8` (8 slots,
# continuous batching) over the target as a bf16 GGUF and as its shipped Q4_1 GGUF, 2 threads;
# then one table and one plot of all arms (bench-out/load/table.md, load.png).
# BACKEND (default compiled) is our servers' --backend; a cold start compiles each tree-forward
# bucket once (minutes; inductor keeps them on disk), so a server gets up to 30 minutes to come up.
set -eu
TF=${TF:-.venv/bin/treeflash}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench-out/load}
PORT=${PORT:-8011}
TARGET=${TARGET:-smollm2-135m}
BACKEND=${BACKEND:-compiled}
LLAMA_SERVER=${LLAMA_SERVER:-.llama.cpp/build/bin/llama-server}
mkdir -p "$OUT"
pid=
trap '[ -n "$pid" ] && kill "$pid" 2> /dev/null' EXIT
arm() {  # name, server command...
  local name=$1; shift
  "$@" > "$OUT/$name.server.log" 2>&1 &
  pid=$!
  local up=
  for _ in $(seq 1800); do
    "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=5)" 2> /dev/null && up=1 && break
    kill -0 "$pid" 2> /dev/null || break
    sleep 1
  done
  [ -n "$up" ] || { echo "the $name server did not start; see $OUT/$name.server.log" >&2; exit 1; }
  "$TF" bench-load --url "http://127.0.0.1:$PORT" --clients 1,2,4,8,16 --max-tokens 64 --out "$OUT/$name" \
    2>&1 | tee "$OUT/$name.log"
  kill "$pid"; wait "$pid" 2> /dev/null || true
  pid=
}
serve() { echo "$TF" serve --target "$TARGET" --backend "$BACKEND" --port "$PORT" --max-batch 8 "$@"; }
arm plain $(serve --method vanilla)
arm treeflash+lookup-adaptive $(serve --tree-size auto)
arm treeflash+lookup-8 $(serve --tree-size 8)
arms=(plain="$OUT/plain" "treeflash+lookup, adaptive=$OUT/treeflash+lookup-adaptive"
      "treeflash+lookup, budget 8=$OUT/treeflash+lookup-8")
if [ -x "$LLAMA_SERVER" ]; then
  bf16=$OUT/$TARGET-bf16.gguf
  "$PY" -c "import sys; from treeflash.models import llamacpp; llamacpp.target_gguf(sys.argv[1], sys.argv[2])" "$TARGET" "$bf16"
  q4=$("$PY" -c "import sys; from treeflash.models import registry; print(registry.gguf_path(sys.argv[1]))" "$TARGET")
  llama() { echo "$LLAMA_SERVER" -m "$1" --host 127.0.0.1 --port "$PORT" -t 2 -np 8 -c 8192 --no-webui; }
  arm llama-server-bf16 $(llama "$bf16")
  arm llama-server-q4 $(llama "$q4")
  arms+=("llama-server -np 8, bf16=$OUT/llama-server-bf16" "llama-server -np 8, Q4=$OUT/llama-server-q4")
else
  echo "llama-server is not built (make llama-cpp): its arms are left out" >&2
fi
"$TF" bench-load --compare "${arms[@]}" --out "$OUT"
