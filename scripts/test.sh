#!/usr/bin/env bash
# The whole test suite: unit, property, simulation and multi-process integration tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# A clean CI build gains nothing from incremental state (1.6 GB of it): disk is not always plenty.
if [ "${CI:-}" = true ]; then export CARGO_INCREMENTAL=0; fi
# Habits first: the formatting, and every lint as an error (`undocumented_unsafe_blocks`
# among them: a `// SAFETY:` on every `unsafe`).
cargo fmt --all --check
cargo clippy --workspace --all-targets --quiet -- -D warnings
# Libraries too: the C ABI test links libpsls_client.a.
cargo build --workspace --lib --bins --quiet
cargo test --workspace --no-run --quiet
# The Slurm test mostly waits on Slurm's clock (a job longer than its 1-minute limit): it runs
# beside the rest, which skip it.
slurm_test=a_job_longer_than_its_allocation_is_halted_before_the_limit
slurm_log=$(mktemp)
cargo test -p psls-tests --test slurm -- "$slurm_test" >"$slurm_log" 2>&1 &
slurm_pid=$!
# Integration tests start several 4-node clusters; two at a time fit this machine's 2 cores.
set +e
cargo test --workspace -- --test-threads=2 --skip "$slurm_test"
main=$?
wait "$slurm_pid"
slurm=$?
set -e
echo "---- tests/tests/slurm.rs (run beside the rest)"
cat "$slurm_log"
rm -f "$slurm_log"
[ "$main" -eq 0 ] && [ "$slurm" -eq 0 ]
