#!/usr/bin/env bash
# Starts a real one-node SLURM cluster on this machine, so tests of the slurm launcher submit
# real jobs. Idempotent: installs, configures and starts only what is missing, then waits
# until the node is idle and `srun hostname` runs. Needs root (apt-get, daemons as root).
#
#   FORGE_SLURM_DIR      state, spool, logs and pid files (default /tmp/forge-slurm)
#   FORGE_SLURM_TIMEOUT  seconds to wait for the node to become idle (default 60)
set -euo pipefail

ROOT=${FORGE_SLURM_DIR:-/tmp/forge-slurm}
TIMEOUT=${FORGE_SLURM_TIMEOUT:-60}
HOST=$(hostname -s)
CONF=/etc/slurm/slurm.conf
KEY=/etc/munge/munge.key

step() { echo "[slurm] $*"; }
die() {
    echo "[slurm] ERROR: $*" >&2
    exit 1
}

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v sinfo >/dev/null && command -v munged >/dev/null; then
        step "packages: slurm-wlm and munge already installed"
        return
    fi
    step "packages: installing slurm-wlm munge (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    local log=/tmp/forge-slurm-apt.log
    # A stale package index makes install fail with 404s on a fresh machine.
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge; } \
        >$log 2>&1 || die "apt-get failed: $(tail -5 $log)"
}

start_munge() {
    install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
    install -d -o munge -g munge -m 0755 /run/munge
    if [[ ! -s $KEY ]]; then
        step "munge: writing a key to $KEY"
        dd if=/dev/urandom of=$KEY bs=1024 count=1 status=none
    fi
    # munged refuses a key that others can read.
    chown munge:munge $KEY
    chmod 0400 $KEY
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        step "munge: munged already running"
        return
    fi
    step "munge: starting munged as user munge"
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return
        sleep 0.1
    done
    die "munged did not answer (see /var/log/munge/munged.log)"
}

# Headroom keeps RealMemory under what slurmd measures, else it drains the node as INVALID.
real_memory_mb() {
    local total
    total=$(free -m | awk '/^Mem:/ {print $2}')
    echo $((total - total / 10))
}

render_conf() {
    cat <<EOF
# Written by forge/.ci/slurm.sh: a one-node test cluster.
ClusterName=forge
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
# Short waits so a cancelled job frees the node in seconds, not minutes.
KillWait=5
MinJobAge=30
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation=$ROOT/state
SlurmdSpoolDir=$ROOT/spool
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd.log
SlurmctldPidFile=$ROOT/run/slurmctld.pid
SlurmdPidFile=$ROOT/run/slurmd.pid
NodeName=$HOST CPUs=$(nproc) RealMemory=$(real_memory_mb) State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
}

# Leaves a marker when the config was (re)written, so running daemons get restarted.
write_conf() {
    mkdir -p "$ROOT"/{state,spool,log,run} /etc/slurm
    local new
    new=$(render_conf)
    if [[ -f $CONF && $(cat $CONF) == "$new" ]]; then
        step "config: $CONF up to date"
        return
    fi
    step "config: writing $CONF (node $HOST, $(nproc) CPUs, $(real_memory_mb) MB)"
    echo "$new" >$CONF
    echo changed >"$ROOT/run/conf-changed"
}

running() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Stops a daemon this script started, by its pid file, so a new config takes effect.
stop_daemon() {
    local pidfile=$ROOT/run/$1.pid
    running "$pidfile" || return 0
    step "$1: stopping (config changed)"
    kill "$(cat "$pidfile")"
    for _ in $(seq 50); do
        running "$pidfile" || return 0
        sleep 0.1
    done
    die "$1 did not stop"
}

start_daemon() {
    local name=$1
    if running "$ROOT/run/$name.pid"; then
        step "$name: already running"
        return
    fi
    step "$name: starting"
    "/usr/sbin/$name" || die "$name failed to start (see $ROOT/log/$name.log)"
}

start_slurm() {
    if [[ -f $ROOT/run/conf-changed ]]; then
        stop_daemon slurmd
        stop_daemon slurmctld
        rm -f "$ROOT/run/conf-changed"
    fi
    start_daemon slurmctld
    start_daemon slurmd
}

wait_idle() {
    local state="" deadline=$((SECONDS + TIMEOUT))
    while ((SECONDS < deadline)); do
        state=$(sinfo -h -n "$HOST" -o %t 2>/dev/null || true)
        if [[ $state == idle ]]; then
            step "node: $HOST idle in partition debug"
            return
        fi
        sleep 0.5
    done
    die "node $HOST not idle after ${TIMEOUT}s (state '${state:-none}'); $(sinfo -R -h 2>&1)" \
        "; see $ROOT/log/"
}

check_srun() {
    local out
    out=$(timeout 30 srun -N1 -n1 hostname 2>&1) || die "srun hostname failed: $out"
    step "srun: hostname -> $out"
}

main() {
    [[ $(id -u) == 0 ]] || die "run as root: it installs packages and starts daemons as root"
    install_packages
    start_munge
    write_conf
    start_slurm
    wait_idle
    check_srun
}

main "$@"
