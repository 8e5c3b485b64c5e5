#!/bin/bash
# bench/collectives.py on netsim: W simulated hosts (one rank each) on links shaped to RATE.
#   bash bench/collectives_netsim.sh W RATE OUT [collectives.py args...]
# writes OUT.wW.json and OUT.wW.rankK.log (rank 0's log is the table); needs root (netsim).
set -euo pipefail
W=$1; RATE=$2; OUT=$3; shift 3
cd "$(dirname "$0")/.."
NETSIM=${NETSIM:-../shared/tools/netsim}
[ -x "$NETSIM" ] || NETSIM=bench/netsim
PY=${PYTHON:-.venv/bin/python}
flock /tmp/netsim.lock bash -c '
  set -e
  W=$1; RATE=$2; OUT=$3; NETSIM=$4; PY=$5; shift 5
  "$NETSIM" up "$W" "$RATE" >/dev/null
  trap "\"$NETSIM\" down >/dev/null" EXIT
  for k in $(seq 0 $((W - 1))); do
    "$NETSIM" exec "$k" env RANK=$k WORLD_SIZE=$W LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 \
      MASTER_ADDR=10.77.0.1 MASTER_PORT=29611 \
      "$PY" bench/collectives.py --json "$OUT.w$W.json" "$@" > "$OUT.w$W.rank$k.log" 2>&1 &
  done
  wait' _ "$W" "$RATE" "$OUT" "$NETSIM" "$PY" "$@"
