#!/usr/bin/env bash
# PSLS against MPI in one run, on a local 4-node cluster (issue 24's figures): the step
# micro-benchmark (a barrier; rank 0 writes 2 pages, a barrier, the other rank reads them)
# against MPI_Barrier and an 8 KiB MPI_Bcast, barriers during memory checkpoints against
# barriers without, and MGS 1024x1024 at 2 ranks against the same
# kernel in MPI (bench/mpi/) and on plain threads; every figure a ratio to its baseline, run
# after run, the rounds alternated. MPI is MPICH from the distribution's packages (installed
# when mpicc is missing), forced onto TCP (UCX_TLS=tcp,self MPIR_CVAR_NOLOCAL=1) as PSLS's
# daemons talk over the network.
# Usage: bench/mpi.sh [ROUNDS] [VECTORS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
vectors="${2:-1024}"
bash scripts/setup.sh
if ! command -v mpicc >/dev/null 2>&1; then
    echo "mpi.sh: mpicc is missing: installing MPICH (mpich, libmpich-dev) from the distribution's packages"
    export DEBIAN_FRONTEND=noninteractive
    if ! { apt-get install -y -q mpich libmpich-dev >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q mpich libmpich-dev >/dev/null 2>&1; }; }; then
        echo "mpi.sh: skipped: MPICH could not be installed from the distribution's packages"
        exit 0
    fi
fi
cargo build --release --workspace --bins --quiet
bin="$(pwd)/${CARGO_TARGET_DIR:-target}/release"
mpicc -O2 -o "$bin/mgs_mpi" bench/mpi/mgs_mpi.c -lm
mpicc -O2 -o "$bin/step_mpi" bench/mpi/step_mpi.c
export UCX_TLS=tcp,self MPIR_CVAR_NOLOCAL=1
dir="$(mktemp -d)"
cleanup() {
    "$bin/psls" cluster down --dir "$dir" >/dev/null 2>&1 || true
    rm -rf "$dir"
}
trap cleanup EXIT
port=$((20000 + RANDOM % 12000))
"$bin/psls" cluster init --dir "$dir" --nodes 4 --spares 0 --memory-mb 1024 --base-port "$port" >/dev/null
"$bin/psls" cluster up --dir "$dir" >/dev/null
# A number from a JSON line: field NAME.
field() { grep -o "\"$2\":[^,}]*" <<<"$1" | head -1 | cut -d: -f2 | tr -d '"'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }'; }
echo "round,what,psls,baseline,ratio"
for r in $(seq 1 "$rounds"); do
    m=$(mpirun -n 2 "$bin/step_mpi" --iters 2000)
    p=$("$bin/psls" --dir "$dir" run -n 2 --level memory -- "$bin/step-bench" --iters 2000 --ckpt-pages 256 --ckpt-every 50 | grep '"bench":"step"' | sed 's/^\[[0-9]*\] //')
    for w in barrier_p50_us barrier_p90_us step_p50_us step_p90_us; do
        a=$(field "$p" "$w")
        b=$(field "$m" "$w")
        echo "$r,$w (MPI),$a,$b,$(ratio "$a" "$b")"
    done
    # Barriers while each rank's 256 pages are copied by a memory checkpoint every 50
    # barriers, against the barriers of the same run without checkpoints.
    for q in p50 p90; do
        a=$(field "$p" "ckpt_barrier_${q}_us")
        b=$(field "$p" "barrier_${q}_us")
        echo "$r,barrier_${q}_us during memory checkpoints (without),$a,$b,$(ratio "$a" "$b")"
    done
    m=$(mpirun -n 2 "$bin/mgs_mpi" --vectors "$vectors" --dim "$vectors")
    p=$("$bin/psls" --dir "$dir" run -n 2 -- "$bin/mgs" --vectors "$vectors" --dim "$vectors" | grep '"bench":"mgs"' | sed 's/^\[[0-9]*\] //')
    a=$(field "$p" time_s)
    b=$(field "$m" run_s)
    t=$(field "$p" baseline_s)
    echo "$r,mgs_s (MPI),$a,$b,$(ratio "$a" "$b")"
    echo "$r,mgs_s (threads),$a,$t,$(ratio "$a" "$t")"
    echo "$r,mgs messages_per_step,$(field "$p" messages_per_step),3,"
done
