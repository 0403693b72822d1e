#!/usr/bin/env bash
# Issue 24's scaling and checkpoint figures, in one run on local clusters started fresh for
# each run (2 cores here: every daemon and rank shares them):
# - MGS VECTORS² with N ranks on N nodes (N = 2, 4, 8) against plain threads in the same run,
#   and the link messages per step;
# - MGS VECTORS² at 4 ranks on 4 nodes with a memory checkpoint every 50 and every 250
#   vectors against no checkpoint (`psls run --level memory`), the runs alternated, with the
#   write-protect faults of the node that took most and the recovery copies sent to other
#   nodes per page checkpointed.
# Usage: bench/scaling.sh [ROUNDS] [VECTORS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-2}"
vectors="${2:-1024}"
bash scripts/setup.sh
cargo build --release --workspace --bins --quiet
bin="$(pwd)/${CARGO_TARGET_DIR:-target}/release"
dir=""
cleanup() {
    if [ -n "$dir" ]; then
        "$bin/psls" cluster down --dir "$dir" >/dev/null 2>&1 || true
        rm -rf "$dir"
    fi
}
trap cleanup EXIT
# One MGS run on a fresh cluster of NODES nodes: run NODES RANKS [psls run options] -- [mgs options]
run() {
    local nodes=$1 ranks=$2
    shift 2
    dir="$(mktemp -d)"
    local port=$((20000 + RANDOM % 12000))
    "$bin/psls" cluster init --dir "$dir" --nodes "$nodes" --spares 0 --memory-mb 1024 --base-port "$port" >/dev/null
    "$bin/psls" cluster up --dir "$dir" >/dev/null
    "$bin/psls" --dir "$dir" run -n "$ranks" "$@" | grep '"bench":"mgs"' | sed 's/^\[[0-9]*\] //'
    cleanup
    dir=""
}
# The largest per-node write-protect fault count of an MGS line.
wp_max() { grep -o '"wp_faults":[0-9]*' <<<"$1" | cut -d: -f2 | sort -n | tail -1; }
field() { grep -o "\"$2\":[^,}]*" <<<"$1" | head -1 | cut -d: -f2 | tr -d '"'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }'; }
echo "round,what,psls,baseline,ratio"
for r in $(seq 1 "$rounds"); do
    for n in 2 4 8; do
        o=$(run "$n" "$n" -- "$bin/mgs" --vectors "$vectors" --dim "$vectors")
        a=$(field "$o" time_s)
        t=$(field "$o" baseline_s)
        echo "$r,mgs_s $n ranks on $n nodes (threads),$a,$t,$(ratio "$a" "$t")"
        echo "$r,messages_per_step $n nodes,$(field "$o" messages_per_step),,"
    done
    o=$(run 4 4 --level memory -- "$bin/mgs" --vectors "$vectors" --dim "$vectors" --no-baseline)
    base=$(field "$o" time_s)
    echo "$r,wp_faults per node at most without checkpoints,$(wp_max "$o"),,"
    for k in 50 250; do
        o=$(run 4 4 --level memory -- "$bin/mgs" --vectors "$vectors" --dim "$vectors" --no-baseline --checkpoint-every "$k")
        a=$(field "$o" time_s)
        echo "$r,mgs_s memory checkpoint every $k (none),$a,$base,$(ratio "$a" "$base")"
        echo "$r,checkpoint_bytes every $k ($(field "$o" checkpoints) checkpoints),$(field "$o" checkpoint_bytes),,"
        echo "$r,wp_faults per node at most every $k,$(wp_max "$o"),,"
        echo "$r,recovery copies sent per checkpointed page every $k,$(field "$o" ckpt_transfers_per_page),,"
    done
done
