#!/usr/bin/env bash
# The paper's Figures 5 and 6 on a local 4-node cluster, in one command: MGS 1024x1024 with
# memory and with persistent checkpoints for K = 50, 100, 250, 500 (fig5.csv), then with each
# cleaning policy in a small memory (fig6.csv), drawn as fig5.png and fig6.png in
# bench/figures/ (or the folder given).
# Usage: bench/figures.sh [OUT_DIR] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench/figures}"
rounds="${2:-3}"
bash scripts/setup.sh
cargo build --release --workspace --bins --quiet
mkdir -p "$out"
bin="${CARGO_TARGET_DIR:-target}/release"
"$bin/mem-bench" --rounds "$rounds" --ks 50,100,250,500 --csv "$out/fig5.csv"
"$bin/mem-bench" --rounds "$rounds" --ks 50,100,250,500 --policies none,total,p1,p2,p3,lru:1000 --csv "$out/fig6.csv"
"$bin/figures" --fig5 "$out/fig5.csv" --fig6 "$out/fig6.csv" --out "$out"
