#!/usr/bin/env bash
# Stop the object store started by infra/local/start-object-store.sh DATA_DIR (keeps the data).
#
#   infra/local/stop-object-store.sh DATA_DIR
set -euo pipefail
if [[ $# -ne 1 || "$1" == -h || "$1" == --help ]]; then
  sed -n '2,4s/^# \{0,1\}//p' "$0" >&2
  exit 2
fi
DATA_DIR="$(cd "$1" && pwd)"
PID_FILE="$DATA_DIR/weed.pid"
if [[ ! -f "$PID_FILE" ]]; then
  echo "no $PID_FILE: nothing to stop" >&2
  exit 0
fi
PID="$(cat "$PID_FILE")"
# Only signal a live weed process (the pid may have been reused since).
if kill -0 "$PID" 2>/dev/null && tr '\0' ' ' 2>/dev/null <"/proc/$PID/cmdline" | grep -Eq "weed .*mini "; then
  kill -TERM -- "-$PID" 2>/dev/null || kill -TERM "$PID"
  for _ in $(seq 1 100); do
    kill -0 "$PID" 2>/dev/null || break
    sleep 0.2
  done
  if kill -0 "$PID" 2>/dev/null; then
    echo "weed (pid $PID) did not stop within 20 s: killing it" >&2
    kill -KILL -- "-$PID" 2>/dev/null || kill -KILL "$PID" 2>/dev/null || true
  fi
  echo "stopped weed (pid $PID)" >&2
else
  echo "weed (pid $PID) is not running" >&2
fi
if [[ -f "$DATA_DIR/weed.sockets" ]]; then
  while read -r sock; do [[ "$sock" == /tmp/seaweedfs-*-grpc-*.sock ]] && rm -f "$sock"; done <"$DATA_DIR/weed.sockets"
fi
rm -f "$PID_FILE" "$DATA_DIR/s3.sock" "$DATA_DIR/filer.sock" "$DATA_DIR/weed.sockets"
