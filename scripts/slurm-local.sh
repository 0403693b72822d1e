#!/usr/bin/env bash
# slurm-local.sh — bring up / tear down a throw-away single-machine Slurm
# (Debian's slurm-wlm 22.05 + munge) for automated tests.
#
#   scripts/slurm-local.sh start DIR   # install if needed, start munged,
#                                      # slurmctld, slurmd; wait for the node
#                                      # to be idle; print `export ...` lines
#                                      # as the last lines of stdout.
#   scripts/slurm-local.sh stop DIR    # stop what `start DIR` started
#                                      # (idempotent).
#
# Everything lives under DIR (config, munge key and socket, state, spool,
# logs, pid files); nothing is written to /etc.  Must run as root (the
# daemons run as root, SlurmUser=root).
#
# Exit codes of `start`: 0 ok; 3 Slurm could not be started (one line
# "slurm-local: cannot start Slurm: ..." on stderr; the caller should skip
# its test); 1 usage errors.
#
# Environment knobs:
#   SLURM_LOCAL_PORT_BASE   first port to try (slurmctld=BASE, slurmd=BASE+1),
#                           default 6817; if busy, BASE+10, BASE+20, ... are tried
#   SLURM_LOCAL_TIMEOUT     seconds to wait for the node to become idle (60)
#   SLURM_LOCAL_EXTRA_CONF  extra lines appended verbatim to slurm.conf
#
# Client side: eval the printed lines; SLURM_CONF points every Slurm command
# at DIR/slurm.conf, whose AuthInfo names the DIR-local munge socket.
set -Eeuo pipefail

PROG=slurm-local
# The daemons live in /usr/sbin, which a non-login PATH may lack.
PATH=$PATH:/usr/sbin:/sbin
TIMEOUT=${SLURM_LOCAL_TIMEOUT:-60}

usage() {
    echo "usage: $0 start|stop DIR" >&2
    exit 1
}

log() { echo "$PROG: $*" >&2; }

# die MSG : caller's mistake (not "Slurm unavailable"): exit 1.
die() {
    echo "$PROG: $*" >&2
    exit 1
}

# ---------------------------------------------------------------- helpers

# pid_alive PIDFILE NAME -> prints pid if the pid file names a live process
# whose comm is NAME.
pid_alive() {
    local file=$1 name=$2 pid comm
    [[ -s $file ]] || return 1
    pid=$(tr -dc '0-9' <"$file" 2>/dev/null || true)
    [[ -n $pid ]] || return 1
    any_alive "$pid" || return 1
    comm=$(cat "/proc/$pid/comm" 2>/dev/null || true)
    [[ $comm == "$name" ]] || return 1
    echo "$pid"
}

# any_alive PID... : true if one of them is still running (zombies, which a
# slow-reaping init may keep around, count as gone).
any_alive() {
    local p stat
    for p in "$@"; do
        stat=$(cat "/proc/$p/stat" 2>/dev/null) || continue
        stat=${stat##*) }
        [[ ${stat:0:1} == Z ]] || return 0
    done
    return 1
}

# stop_daemons DIR NAME... : SIGTERM every DIR/run/NAME.pid daemon that is
# alive, wait up to 15 s, SIGKILL survivors, wait 5 s more; remove the pid
# files. Fails if something is still alive.
stop_daemons() {
    local dir=$1 name pid i pids=()
    shift
    for name in "$@"; do
        if pid=$(pid_alive "$dir/run/$name.pid" "$name"); then
            kill -TERM "$pid" 2>/dev/null || true
            pids+=("$pid")
        fi
    done
    if ((${#pids[@]})); then
        for ((i = 0; i < 150; i++)); do any_alive "${pids[@]}" || break; sleep 0.1; done
        if any_alive "${pids[@]}"; then
            log "sending SIGKILL to $* (ignored SIGTERM)"
            kill -KILL "${pids[@]}" 2>/dev/null || true
            for ((i = 0; i < 50; i++)); do any_alive "${pids[@]}" || break; sleep 0.1; done
        fi
        if any_alive "${pids[@]}"; then
            log "$* did not exit"
            return 1
        fi
    fi
    for name in "$@"; do rm -f "$dir/run/$name.pid"; done
}

# Kill leftovers of jobs run by this instance: slurmstepd processes and job
# processes whose environment holds SLURM_CONF=<this conf> (job processes
# also carry SLURM_JOB_ID; the caller's own shell does not).
sweep_jobs() {
    local conf=$1 p env victims=() keep=" " q=$$
    # Never touch this script or its ancestors.
    while [[ -n $q && $q != 0 ]]; do
        keep+="$q "
        q=$(awk '/^PPid:/ { print $2 }' "/proc/$q/status" 2>/dev/null || true)
    done
    for p in /proc/[0-9]*; do
        p=${p#/proc/}
        [[ $keep == *" $p "* ]] && continue
        env=$( { tr '\0' '\n' <"/proc/$p/environ"; } 2>/dev/null) || continue
        grep -qxF "SLURM_CONF=$conf" <<<"$env" || continue
        if [[ $(cat "/proc/$p/comm" 2>/dev/null) == slurmstepd ]] ||
            grep -q '^SLURM_JOB_ID=' <<<"$env"; then
            victims+=("$p")
        fi
    done
    if ((${#victims[@]})); then
        kill -KILL "${victims[@]}" 2>/dev/null || true
    fi
}

do_stop() {
    local dir=$1 rc=0
    [[ -d $dir ]] || return 0
    dir=$(cd "$dir" && pwd -P)
    stop_daemons "$dir" slurmd slurmctld || rc=1
    sweep_jobs "$dir/slurm.conf"
    stop_daemons "$dir" munged || rc=1
    return $rc
}

# Listening TCP ports (decimal), from /proc (no ss/netstat dependency).
listening_ports() {
    local f
    for f in /proc/net/tcp /proc/net/tcp6; do
        [[ -r $f ]] || continue
        awk 'NR > 1 && $4 == "0A" { split($2, a, ":"); print a[2] }' "$f"
    done | while read -r hex; do echo $((16#$hex)); done | sort -u
}

# ---------------------------------------------------------------- start

# last_error FILE... : the last two error/fatal lines of the daemons' logs,
# joined, for the one-line failure message.
last_error() {
    local line
    line=$(grep -hE 'error|fatal|Error' "$@" 2>/dev/null |
        grep -v 'Cannot create context for mpi/' | tail -n2 | paste -sd';' - || true)
    echo "${line:-no error logged}"
}

START_DIR=
fail() {
    trap - ERR
    # Inside a command substitution: leave the message to the main shell.
    [[ $BASHPID == "$$" ]] || exit 3
    echo "$PROG: cannot start Slurm: $*" >&2
    if [[ -n $START_DIR ]]; then
        do_stop "$START_DIR" >/dev/null 2>&1 || true
    fi
    exit 3
}

ensure_installed() {
    local missing=0 b
    for b in slurmctld slurmd munged sinfo scontrol munge unmunge; do
        command -v "$b" >/dev/null 2>&1 || missing=1
    done
    ((missing)) || return 0
    command -v apt-get >/dev/null 2>&1 || fail "slurm-wlm/munge not installed and no apt-get"
    local apt_log=$1/log/apt.log
    log "installing slurm-wlm and munge (log: $apt_log)"
    local pkgs=(slurm-wlm munge)
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        "${pkgs[@]}" >"$apt_log" 2>&1; then
        log "apt-get install failed; running apt-get update and retrying"
        DEBIAN_FRONTEND=noninteractive apt-get update >>"$apt_log" 2>&1 ||
            fail "apt-get update failed (see $apt_log)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            "${pkgs[@]}" >>"$apt_log" 2>&1 ||
            fail "apt-get install slurm-wlm munge failed (see $apt_log)"
    fi
    for b in slurmctld slurmd munged sinfo scontrol munge unmunge; do
        command -v "$b" >/dev/null 2>&1 || fail "$b still missing after install"
    done
}

do_start() {
    local dir=$1
    [[ $(id -u) == 0 ]] || fail "must run as root (daemons run as SlurmUser=root)"
    [[ $dir != *[[:space:]#]* ]] || die "DIR must not contain whitespace or '#': $dir"
    [[ ${SLURM_LOCAL_PORT_BASE:-6817} =~ ^[0-9]+$ ]] ||
        die "SLURM_LOCAL_PORT_BASE is not a number: $SLURM_LOCAL_PORT_BASE"
    [[ $TIMEOUT =~ ^[0-9]+$ ]] || die "SLURM_LOCAL_TIMEOUT is not a number: $TIMEOUT"
    mkdir -p "$dir" || fail "cannot create $dir"
    dir=$(cd "$dir" && pwd -P)
    START_DIR=$dir
    trap 'fail "unexpected error at line $LINENO (command: $BASH_COMMAND)"' ERR

    # A previous instance in this DIR (alive, or killed -9 with stale pid
    # files): stop it and start afresh.
    do_stop "$dir" || fail "could not stop a previous instance in $dir"

    mkdir -p "$dir"/{log,run,munge,state,spool}
    local f
    for f in munged slurmctld slurmd; do
        : >"$dir/log/$f.log"
        : >"$dir/log/$f.out"
    done
    chmod 0700 "$dir"/munge
    ensure_installed "$dir"

    # ---- munge
    local sock=$dir/munge/munge.socket key=$dir/munge/munge.key
    if [[ ! -s $key ]]; then
        (umask 077 && head -c 1024 /dev/urandom >"$key") || fail "cannot create munge key"
    fi
    chmod 0400 "$key"
    rm -f "$sock" "$sock.lock"
    munged --force --key-file="$key" --socket="$sock" \
        --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" \
        --seed-file="$dir/munge/munged.seed" </dev/null >>"$dir/log/munged.out" 2>&1 ||
        fail "munged did not start: $(last_error "$dir/log/munged.out" "$dir/log/munged.log")"
    local i ok=0
    for ((i = 0; i < 100; i++)); do
        if munge -n -S "$sock" 2>/dev/null | unmunge -S "$sock" >/dev/null 2>&1; then
            ok=1
            break
        fi
        sleep 0.1
    done
    ((ok)) || fail "munged not answering on $sock (see $dir/log/munged.log)"

    # ---- ports
    local base=${SLURM_LOCAL_PORT_BASE:-6817} busy ctld_port slurmd_port
    busy=$(listening_ports)
    ctld_port=
    for ((i = 0; i < 20; i++)); do
        local p=$((base + 10 * i))
        ((p + 1 < 65536)) || break
        if ! grep -qxE "$p|$((p + 1))" <<<"$busy"; then
            ctld_port=$p
            slurmd_port=$((p + 1))
            break
        fi
    done
    [[ -n $ctld_port ]] || fail "no free port pair found from $base"

    # ---- slurm.conf
    local host short cpus mem_mb real_mem
    short=$(hostname -s 2>/dev/null || hostname)
    host=$(hostname)
    [[ -n $short ]] || short=localhost
    cpus=$(nproc)
    mem_mb=$(awk '/^MemTotal:/ { print int($2 / 1024) }' /proc/meminfo)
    real_mem=1024
    if ((mem_mb / 2 < real_mem)); then real_mem=$((mem_mb / 2)); fi
    if ((real_mem < 1)); then real_mem=1; fi

    cat >"$dir/slurm.conf" <<EOF
# Generated by slurm-local.sh — single-machine test cluster.
ClusterName=slurmlocal
SlurmctldHost=$short(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$sock
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig=$dir/plugstack.conf
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1,batch_sched_delay=0
ReturnToService=2
MinJobAge=60
KillWait=5
OverTimeLimit=0
CompleteWait=0
InactiveLimit=0
MessageTimeout=10
SlurmctldTimeout=30
SlurmdTimeout=30
WaitTime=0
MaxJobCount=10000
NodeName=$short NodeHostname=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$real_mem State=UNKNOWN
PartitionName=debug Nodes=$short Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
    if [[ -n ${SLURM_LOCAL_EXTRA_CONF:-} ]]; then
        printf '%s\n' "$SLURM_LOCAL_EXTRA_CONF" >>"$dir/slurm.conf"
    fi
    : >"$dir/plugstack.conf"
    mkdir -p "$dir/spool/$short"

    export SLURM_CONF=$dir/slurm.conf

    # ---- slurmctld (fresh state: -c), slurmd
    slurmctld -c -f "$SLURM_CONF" </dev/null >>"$dir/log/slurmctld.out" 2>&1 ||
        fail "slurmctld failed to start: $(last_error "$dir/log/slurmctld.out" "$dir/log/slurmctld.log")"
    slurmd -N "$short" -f "$SLURM_CONF" </dev/null >>"$dir/log/slurmd.out" 2>&1 ||
        fail "slurmd failed to start: $(last_error "$dir/log/slurmd.out" "$dir/log/slurmd.log")"

    # ---- wait for the node to be idle
    local t0=$SECONDS deadline=$((SECONDS + TIMEOUT)) state=
    while ((SECONDS < deadline)); do
        for f in slurmctld slurmd; do
            # The pid file may appear a little after the daemon forked.
            if ! pid_alive "$dir/run/$f.pid" "$f" >/dev/null &&
                { [[ -s $dir/run/$f.pid ]] || ((SECONDS - t0 > 10)); }; then
                fail "$f exited: $(last_error "$dir/log/$f.out" "$dir/log/$f.log")"
            fi
        done
        state=$(sinfo -h -N -n "$short" -o %t 2>/dev/null || true)
        if [[ $state == idle ]]; then
            break
        fi
        case $state in
        down* | drain* | inval* | fail*)
            # ReturnToService=2 should clear this once slurmd registers;
            # nudge it anyway.
            scontrol update NodeName="$short" State=RESUME >/dev/null 2>&1 || true
            ;;
        esac
        sleep 0.5
    done
    if [[ $state != idle ]]; then
        fail "node $short not idle after ${TIMEOUT}s (state '${state:-none}'; $(last_error "$dir/log/slurmd.log" "$dir/log/slurmctld.log"); logs in $dir/log)"
    fi
    trap - ERR

    log "Slurm up: node $short, ports $ctld_port/$slurmd_port, dir $dir"
    printf 'export SLURM_CONF=%q\n' "$dir/slurm.conf"
    printf 'export SLURM_LOCAL_MUNGE_SOCKET=%q\n' "$sock"
}

# ---------------------------------------------------------------- main

[[ $# -eq 2 ]] || usage
case $1 in
start) do_start "$2" ;;
stop)
    if ! do_stop "$2"; then
        log "stop: some daemon did not exit"
        exit 1
    fi
    ;;
*) usage ;;
esac
