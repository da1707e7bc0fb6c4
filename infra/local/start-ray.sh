#!/usr/bin/env bash
# Start a local Ray head node with token authentication and the job server on 127.0.0.1.
#
#   infra/local/start-ray.sh [PORT]        (PORT: the GCS port, default 6379)
#
# Environment: GENREC_RAY_NUM_CPUS (default 2), GENREC_RAY_NUM_GPUS (default: autodetect),
#   GENREC_RAY_DASHBOARD_PORT (default 8265), GENREC_RAY_DIR (Ray's temp dir, default /tmp/genrec-ray),
#   GENREC_RAY_OBJECT_STORE_MB (default: Ray's, 30% of memory). The other ports Ray opens (dashboard agent,
#   Ray client server) are picked free (GENREC_RAY_AGENT_PORT sets the agent's), so this head can run beside
#   other Ray clusters on the machine.
# Token: RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH when set, else ~/.ray/auth_token
#   (`ray get-auth-token --generate` creates it on first use). The token is never printed.
# Clients (ray job submit, ray.init) need RAY_AUTH_MODE=token and the same token (see infra/README.md).
# stdout: the address for `ray job submit --address`, http://127.0.0.1:PORT.
# Stop with infra/local/stop-ray.sh.
set -euo pipefail

if [[ $# -gt 1 || "${1:-}" == -h || "${1:-}" == --help ]]; then
  sed -n '2,17s/^# \{0,1\}//p' "$0" >&2
  exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PORT="${1:-6379}"
DASHBOARD_PORT="${GENREC_RAY_DASHBOARD_PORT:-8265}"
NUM_CPUS="${GENREC_RAY_NUM_CPUS:-2}"
RAY_DIR="${GENREC_RAY_DIR:-/tmp/genrec-ray}"
[[ "$PORT" =~ ^[0-9]+$ ]] || { echo "error: PORT must be a number, got '$PORT'" >&2; exit 2; }

if [[ -x "$ROOT/.venv/bin/ray" ]]; then BIN="$ROOT/.venv/bin"; else BIN="$(dirname "$(command -v ray)")"; fi
[[ -x "$BIN/ray" ]] || { echo "error: no ray executable (make install)" >&2; exit 1; }
# Job entrypoints (`python -m jobs.nightly`) resolve `python` on the head's PATH: the venv comes first.
export PATH="$BIN:$PATH"

mkdir -p "$RAY_DIR"
RAY_DIR="$(cd "$RAY_DIR" && pwd)"
SID_FILE="$RAY_DIR/head.sid"
if [[ -f "$SID_FILE" ]] && [[ -n "$(ps -o pid= -s "$(cat "$SID_FILE")" 2>/dev/null)" ]]; then
  echo "error: a Ray head started by this script is already running (session $(cat "$SID_FILE")); run infra/local/stop-ray.sh" >&2
  exit 1
fi

export RAY_AUTH_MODE=token
if [[ -z "${RAY_AUTH_TOKEN:-}" && -z "${RAY_AUTH_TOKEN_PATH:-}" ]]; then
  ray get-auth-token --generate >/dev/null   # creates ~/.ray/auth_token when missing, else reads it
  chmod 600 "$HOME/.ray/auth_token"          # Ray writes it world-readable
fi
export RAY_USAGE_STATS_ENABLED=0
unset RAY_ADDRESS

# Ray's fixed defaults for these (52365, 10001) collide with any other Ray head on the machine.
read -r AGENT_PORT CLIENT_PORT < <(python - <<'PYEOF'
import socket
socks = []
while len(socks) < 2:
    s = socket.socket(); s.bind(("", 0))
    if 10002 <= s.getsockname()[1] <= 19999:  # Ray's worker port range
        continue
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
PYEOF
)
AGENT_PORT="${GENREC_RAY_AGENT_PORT:-$AGENT_PORT}"
ARGS=(--head --port "$PORT" --dashboard-host 127.0.0.1 --dashboard-port "$DASHBOARD_PORT"
  --include-dashboard true --num-cpus "$NUM_CPUS" --temp-dir "$RAY_DIR" --disable-usage-stats
  --dashboard-agent-listen-port "$AGENT_PORT" --ray-client-server-port "$CLIENT_PORT")
[[ -n "${GENREC_RAY_NUM_GPUS:-}" ]] && ARGS+=(--num-gpus "$GENREC_RAY_NUM_GPUS")
[[ -n "${GENREC_RAY_OBJECT_STORE_MB:-}" ]] && ARGS+=(--object-store-memory "$((GENREC_RAY_OBJECT_STORE_MB * 1024 * 1024))")

# Ray processes inherit this directory as their cwd: a job submitted without --working-dir runs in the checkout,
# so relative paths in a config (the demo config: data/, models/, out/) resolve against it.
cd "$ROOT"
# setsid: every Ray process of this head (workers included) stays in one session whose id is saved,
# so stop-ray.sh stops exactly this head (`ray stop` would stop every Ray cluster on the machine).
setsid ray start "${ARGS[@]}" >"$RAY_DIR/ray-start.log" 2>&1 </dev/null &
SID=$!
echo "$SID" >"$SID_FILE"
if ! wait "$SID"; then
  echo "error: ray start failed; last lines of $RAY_DIR/ray-start.log:" >&2
  tail -n 30 "$RAY_DIR/ray-start.log" >&2
  "$ROOT/infra/local/stop-ray.sh" >/dev/null 2>&1 || true
  exit 1
fi

ADDRESS="http://127.0.0.1:$DASHBOARD_PORT"
# Wait until the job server answers an authenticated request and the head's job agent listens.
for _ in $(seq 1 60); do
  if python -c "import socket, sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), 1)" "$AGENT_PORT" 2>/dev/null \
      && ray job list --address "$ADDRESS" >/dev/null 2>&1; then
    echo "Ray head ready: GCS 127.0.0.1:$PORT (ray.init(address=...)), jobs $ADDRESS, logs $RAY_DIR/session_latest/logs" >&2
    echo "Clients need: export RAY_AUTH_MODE=token (plus RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)" >&2
    echo "$ADDRESS"
    exit 0
  fi
  sleep 1
done
echo "error: the Ray job server at $ADDRESS did not answer within 60 s; see $RAY_DIR/session_latest/logs" >&2
"$ROOT/infra/local/stop-ray.sh" >/dev/null 2>&1 || true
exit 1
