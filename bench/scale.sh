#!/usr/bin/env bash
# The control plane's cost against the cluster's size (issue 40), in one run: local clusters of
# 4, 8, 16, 32 and 64 daemons one after the other — time to healthy, idle CPU and memory per
# daemon, `psls create` p50, time to a verdict after a kill -9, `psls run -n N -- /bin/true` —
# each figure also as a ratio to the smallest cluster's (compare within one run: this machine
# is shared). Not a timed test; run it on an otherwise idle machine.
# Usage: bench/scale.sh [SIZES] (default 4,8,16,32,64)
set -euo pipefail
cd "$(dirname "$0")/.."
sizes="${1:-4,8,16,32,64}"
bash scripts/setup.sh
cargo build --release --workspace --bins --quiet
bin="${CARGO_TARGET_DIR:-target}/release"
"$bin/scale-bench" --sizes "$sizes"
