#!/usr/bin/env bash
# `make load-table`: the README's load table. One `treeflash serve --max-batch 8` per arm, started,
# driven by `treeflash bench-load` at 1, 2, 4, 8 and 16 clients (64 tokens each), then stopped;
# then one table and one plot of all arms (bench-out/load/table.md, load.png).
set -eu
TF=${TF:-.venv/bin/treeflash}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench-out/load}
PORT=${PORT:-8011}
mkdir -p "$OUT"
pid=
trap '[ -n "$pid" ] && kill "$pid" 2> /dev/null' EXIT
arm() {  # name, server options...
  local name=$1; shift
  "$TF" serve --port "$PORT" --max-batch 8 "$@" > "$OUT/$name.server.log" 2>&1 &
  pid=$!
  local up=
  for _ in $(seq 300); do
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
arm plain --method vanilla
arm treeflash+lookup-adaptive --tree-size auto
arm treeflash+lookup-8 --tree-size 8
"$TF" bench-load --compare plain="$OUT/plain" "treeflash+lookup, adaptive=$OUT/treeflash+lookup-adaptive" \
  "treeflash+lookup, budget 8=$OUT/treeflash+lookup-8" --out "$OUT"
