#!/bin/bash
# Submits a chain of LINKS Slurm jobs that run PSLS job NAME to its end, each link after the
# one before it ended (afterany), and prints their Slurm job ids.
#
#   submit-chain.sh NAME LINKS [SBATCH OPTIONS...] -- PROGRAM [ARGS...]
#
# Example: submit-chain.sh mgs1 4 --time=2:00:00 --ntasks=8 -- ./mgs --n 8192
# PSLS_HALT_BEFORE (default 5m) is how long before each allocation's end the job halts.
set -euo pipefail
if [[ $# -lt 4 ]]; then
    echo "usage: $0 NAME LINKS [SBATCH OPTIONS...] -- PROGRAM [ARGS...]" >&2
    exit 2
fi
name=$1 links=$2
shift 2
if ! [[ $links =~ ^[1-9][0-9]*$ ]]; then
    echo "$0: LINKS must be a positive number, not '$links'" >&2
    exit 2
fi
opts=()
while [[ $# -gt 0 && $1 != "--" ]]; do
    opts+=("$1")
    shift
done
if [[ $# -lt 2 ]]; then
    echo "$0: give the program after --" >&2
    exit 2
fi
shift
here=$(cd "$(dirname "$0")" && pwd)
export PSLS_JOB=$name
prev=""
for ((i = 1; i <= links; i++)); do
    dep=()
    [[ -n $prev ]] && dep=(--dependency="afterany:$prev")
    prev=$(sbatch --parsable "${dep[@]}" "${opts[@]}" "$here/psls-job.sbatch" "$@")
    prev=${prev%%;*}
    echo "$prev"
done
