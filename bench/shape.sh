#!/usr/bin/env bash
# The daemon's shape against the pure machines (issue 41), counted in the source of the checkout
# (or of the commit given): lines of psls-node and of the pure crates, `Mutex` fields in the
# daemon, `pub` fields of `Node`, `OpError::new` sites, `Result<_, String>` signatures, and
# assertions outside tests. Lines: code lines (no blank or comment line) of the crates' src/
# folders, without their tests.
# Usage: bench/shape.sh [COMMIT]
set -euo pipefail
cd "$(dirname "$0")/.."
rev="${1:-}"
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
if [ -n "$rev" ]; then
  git archive "$rev" | tar -x -C "$src"
else
  git ls-files -z | xargs -0 -I{} cp --parents {} "$src" 2>/dev/null || true
fi
cd "$src"
# Code outside tests: no blank or comment line, no `tests.rs` file, nothing after a file's
# `#[cfg(test)]`.
code() { for f in $(find "$@" -name '*.rs' -not -name tests.rs 2>/dev/null); do
  awk '/^#\[cfg\(test\)\]/{exit} !/^\s*(\/\/|$)/' "$f"; done; }
lines() { code "$@" | wc -l; }
node=$(lines psls-node/src)
pure=$(lines psls-svm/src psls-cluster/src psls-ckpt/src psls-jobs/src)
all=$(lines $(ls -d psls-*/src bench/src tests/src 2>/dev/null))
mutex=$(grep -rhoE '^\s*(pub(\([a-z]+\))? )?[a-z_0-9]+: (std::sync::)?Mutex<' psls-node/src | wc -l)
node_pub=$(awk '/^pub struct Node \{/{f=1;next} f&&/^\}/{f=0} f' psls-node/src/node.rs | grep -cE '^\s*pub(\([a-z]+\))? [a-z_0-9]+:')
node_fields=$(awk '/^pub struct Node \{/{f=1;next} f&&/^\}/{f=0} f' psls-node/src/node.rs | grep -cE '^\s*(pub(\([a-z]+\))? )?[a-z_0-9]+:')
operr=$(grep -rho 'OpError::new' psls-node/src | wc -l)
strerr=$(grep -rhoE 'Result<[^;{]*, String>' --include=*.rs psls-*/src | wc -l)
asserts=$(code $(ls -d psls-*/src) | grep -oE '\b(debug_)?assert(_eq|_ne)?!' | wc -l)
printf '{"psls_node_lines":%d,"pure_crates_lines":%d,"node_to_pure":%.2f,"workspace_lines":%d,' "$node" "$pure" "$(echo "$node/$pure" | bc -l)" "$all"
printf '"daemon_mutex_fields":%d,"node_fields":%d,"node_pub_fields":%d,"operror_new_sites":%d,' "$mutex" "$node_fields" "$node_pub" "$operr"
printf '"result_string_signatures":%d,"assertions_outside_tests":%d}\n' "$strerr" "$asserts"
