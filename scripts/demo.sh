#!/usr/bin/env bash
# The main job: a local 4-node cluster, import a 64 MiB file, kill a node, export it intact,
# show status, then MGS as a 4-rank job. The cluster folder is $PSLS_HOME (default ./.psls).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release --workspace --bins --quiet
exec ./target/release/psls demo "$@"
