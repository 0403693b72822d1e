#!/usr/bin/env bash
# The whole test suite: unit, property, simulation and multi-process integration tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Libraries too: the C ABI test links libpsls_client.a.
cargo build --workspace --lib --bins --quiet
# Integration tests start several 4-node clusters; two at a time fit this machine's 2 cores.
cargo test --workspace -- --test-threads=2
