#!/usr/bin/env bash
# Runs tests/e2e/app.e2e.mjs against the built app: a virtual display (Xvfb), tauri-driver
# (which starts WebKitWebDriver, which starts quince-app), and a fresh profile.
#   tests/e2e/run.sh [path/to/quince-app]
set -euo pipefail
cd "$(dirname "$0")/../.."
APP=${1:-target/debug/quince-app}
DRIVER=${TAURI_DRIVER:-target/tools/bin/tauri-driver}
PORT=${E2E_PORT:-4444}
export E2E_APP=$APP E2E_SHOTS=${E2E_SHOTS:-target/e2e-shots} E2E_DRIVER=http://127.0.0.1:$PORT
export QUINCE_DATA_DIR=$(mktemp -d /tmp/quince-e2e.XXXXXX)
# No user cache: the library must come from the app's own resources.
export HF_HUB_CACHE=$QUINCE_DATA_DIR/hf-cache
# Nor MLX's cache of compiled CPU kernels: the first load builds them, as on a fresh install,
# which makes it last long enough to send a message while it runs.
export TMPDIR=$QUINCE_DATA_DIR/tmp
mkdir -p "$TMPDIR"
rm -rf "$E2E_SHOTS"
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$QUINCE_DATA_DIR"' EXIT
# The library downloads from a stand-in for huggingface.co on 127.0.0.1 (nothing outside this
# machine is reachable): the untrained demo model (random weights: its replies run to their
# token limit) served as quince-test/tiny-demo over a slow link (64 KiB every 10 ms: about
# seven seconds for its 43 MB), so the progress bar is seen moving.
FAKE_HUB=${FAKE_HUB:-target/debug/fake-hub}
"$FAKE_HUB" --repo quince-test/tiny-demo --dir "${E2E_HUB_MODEL:-target/untrained-model}" \
  --chunk-delay-ms 10 > "$QUINCE_DATA_DIR/fake-hub.url" &
for _ in $(seq 100); do [ -s "$QUINCE_DATA_DIR/fake-hub.url" ] && break; sleep 0.1; done
export HF_ENDPOINT=$(head -1 "$QUINCE_DATA_DIR/fake-hub.url")
echo "e2e: fake hub at $HF_ENDPOINT"
xvfb-run -a -s "-screen 0 1280x900x24" bash -c '
  trap "kill \$(jobs -p) 2>/dev/null; pkill -P \$\$ 2>/dev/null" EXIT
  "$0" --port "$1" --native-port $(( $1 + 1 )) > "$QUINCE_DATA_DIR/tauri-driver.log" 2>&1 &
  for _ in $(seq 100); do curl -sf "$E2E_DRIVER/status" >/dev/null 2>&1 && break; sleep 0.1; done
  node tests/e2e/app.e2e.mjs 2>&1 | tee "$QUINCE_DATA_DIR/e2e.log"; status=${PIPESTATUS[0]}
  # On failure the logs come first and the failure last, where a log tail shows it.
  [ $status = 0 ] || { echo "--- tauri-driver log"; tail -40 "$QUINCE_DATA_DIR/tauri-driver.log";
    echo "--- app log"; tail -40 "$QUINCE_DATA_DIR"/logs/quince*.log 2>/dev/null;
    echo "--- e2e (the failure)"; sed -n "/e2e: FAILED/,\$p" "$QUINCE_DATA_DIR/e2e.log" | head -80; }
  exit $status' "$DRIVER" "$PORT"
