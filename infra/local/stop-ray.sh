#!/usr/bin/env bash
# Stop the Ray head started by infra/local/start-ray.sh, and only that one.
#
#   infra/local/stop-ray.sh                (GENREC_RAY_DIR as for start-ray.sh, default /tmp/genrec-ray)
#
# Unlike `ray stop`, which stops every Ray process on the machine, this signals the processes of the
# session that start-ray.sh created (its id is in GENREC_RAY_DIR/head.sid): SIGTERM, then SIGKILL after 5 s.
set -euo pipefail
if [[ $# -gt 0 ]]; then
  sed -n '2,7s/^# \{0,1\}//p' "$0" >&2
  exit 2
fi
RAY_DIR="${GENREC_RAY_DIR:-/tmp/genrec-ray}"
SID_FILE="$RAY_DIR/head.sid"
if [[ ! -f "$SID_FILE" ]]; then
  echo "no $SID_FILE: nothing to stop" >&2
  exit 0
fi
SID="$(cat "$SID_FILE")"
[[ "$SID" =~ ^[0-9]+$ ]] || { echo "error: bad session id in $SID_FILE" >&2; exit 1; }

session_pids() { ps -e -o pid=,sid= | awk -v sid="$SID" '$2 == sid { print $1 }'; }

PIDS="$(session_pids)"
if [[ -z "$PIDS" ]]; then
  echo "Ray head (session $SID) is not running" >&2
else
  # The raylet first (so that its workers and agents exit with it), then everything else.
  for pid in $PIDS; do
    if tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -q "/raylet/raylet "; then kill -TERM "$pid" 2>/dev/null || true; fi
  done
  sleep 1
  for pid in $(session_pids); do kill -TERM "$pid" 2>/dev/null || true; done
  for _ in $(seq 1 25); do
    [[ -z "$(session_pids)" ]] && break
    sleep 0.2
  done
  LEFT="$(session_pids)"
  if [[ -n "$LEFT" ]]; then
    # (gcs_server usually ignores SIGTERM for a while; `ray stop` escalates the same way.)
    echo "killing Ray processes still running after 5 s: $(echo $LEFT)" >&2
    for pid in $LEFT; do kill -KILL "$pid" 2>/dev/null || true; done
  fi
  echo "stopped Ray head (session $SID)" >&2
fi
rm -f "$SID_FILE"
