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
# The simulator's figure: the busiest node's idle messages per second at 16, 128 and 1,024
# simulated nodes (psls-cluster/tests/watch_sim.rs, the same machines the daemon runs).
cargo test -p psls-cluster --release --quiet --test watch_sim the_busiest_nodes_idle_messages -- --nocapture 2>&1 |
    grep "busiest node's idle messages per second"
# And the metadata log's (psls-cluster/tests/log_sim.rs: five voters, the followers in a tree):
# the busiest idle node's messages a tick at 16, 128 and 1,024 nodes.
cargo test -p psls-cluster --release --quiet --test log_sim the_log_at_16_128_and_1024_nodes -- --nocapture 2>&1 |
    grep "busiest idle node handles"
