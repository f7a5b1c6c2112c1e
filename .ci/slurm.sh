#!/usr/bin/env bash
# Starts a real SLURM cluster on this machine, so tests of the slurm launcher submit real jobs:
#   - partition `debug` (the default): this machine as one node, named by its hostname;
#   - partition `two`: two more nodes, forge-node1 and forge-node2, each a network namespace
#     with its own hostname and address on a bridge (10.213.0.0/24) and half the cores, so
#     what goes from one to the other crosses a network stack. Where network namespaces are
#     not allowed, the cluster is `debug` alone, and this says why.
# Idempotent: installs, configures and starts only what is missing, then waits until every node
# is idle and `srun hostname` runs in each partition. Needs root (apt-get, namespaces, daemons
# as root). `.ci/slurm.sh stop` stops every daemon it started and removes the namespaces, the
# bridge and the nodes' /etc/hosts lines.
#
#   FORGE_SLURM_DIR      state, spool, logs and pid files (default /tmp/forge-slurm)
#   FORGE_SLURM_TIMEOUT  seconds to wait for the nodes to become idle (default 60)
set -euo pipefail

ROOT=${FORGE_SLURM_DIR:-/tmp/forge-slurm}
TIMEOUT=${FORGE_SLURM_TIMEOUT:-60}
HOST=$(hostname -s)
CONF=/etc/slurm/slurm.conf
KEY=/etc/munge/munge.key
# The two-node partition: the bridge has address .1 (slurmctld's, seen from the nodes), node i
# has .1i; /etc/hosts names them, so every process (a Monarch worker too) finds them by name.
NET=10.213.0
BRIDGE=forge-br0
NODES=(forge-node1 forge-node2)
HOSTS_TAG="# forge .ci/slurm.sh"

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

# Whether the two-node partition can exist here; if not, says why on stdout.
namespaces_refused() {
    local err
    err=$(unshare --net --uts true 2>&1) && return 1
    echo "network namespaces are not allowed here (unshare: ${err:-failed})"
}

# Headroom keeps RealMemory under what slurmd measures, else it drains the node as INVALID.
real_memory_mb() {
    local total
    total=$(free -m | awk '/^Mem:/ {print $2}')
    echo $((total - total / 10))
}

# Each namespace node's cores: half of the machine's, at least one.
node_cpus() {
    local half=$(($(nproc) / 2))
    echo $((half > 0 ? half : 1))
}

render_conf() {
    local two=$1 ctl=$HOST i
    [[ $two == yes ]] && ctl="$HOST($NET.1)"
    cat <<EOF
# Written by forge/.ci/slurm.sh: a test cluster on one machine.
ClusterName=forge
SlurmctldHost=$ctl
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
# Short waits so a cancelled job frees the node at once, and a requeued one starts again
# soon (a requeued job waits out its credential's lifetime).
KillWait=5
MinJobAge=30
AuthInfo=cred_expire=10
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation=$ROOT/state
SlurmdSpoolDir=$ROOT/spool/%n
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd-%n.log
SlurmctldPidFile=$ROOT/run/slurmctld.pid
SlurmdPidFile=$ROOT/run/slurmd-%n.pid
NodeName=$HOST CPUs=$(nproc) RealMemory=$(real_memory_mb) State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
    [[ $two == yes ]] || return 0
    for i in 1 2; do
        echo "NodeName=${NODES[i - 1]} NodeAddr=$NET.1$i CPUs=$(node_cpus)" \
            "RealMemory=$(($(real_memory_mb) / 2)) State=UNKNOWN"
    done
    echo "PartitionName=two Nodes=${NODES[0]},${NODES[1]} MaxTime=INFINITE State=UP"
}

# Leaves a marker when the config was (re)written, so running daemons get restarted.
write_conf() {
    mkdir -p "$ROOT"/{state,spool,log,run} /etc/slurm
    local new
    new=$(render_conf "$1")
    if [[ -f $CONF && $(cat $CONF) == "$new" ]]; then
        step "config: $CONF up to date"
        return
    fi
    step "config: writing $CONF (node $HOST, $(nproc) CPUs, $(real_memory_mb) MB; partition two: $1)"
    echo "$new" >$CONF
    echo changed >"$ROOT/run/conf-changed"
}

# The bridge, and per node a namespace with its end of a veth pair, its address, a default
# route to this machine's own addresses, and a line in /etc/hosts.
start_network() {
    if ! ip link show $BRIDGE >/dev/null 2>&1; then
        ip link add $BRIDGE type bridge
        ip addr add $NET.1/24 dev $BRIDGE
    fi
    ip link set $BRIDGE up
    local i node veth
    for i in 1 2; do
        node=${NODES[i - 1]} veth=forge-veth$i
        if ! ip netns exec "$node" true 2>/dev/null; then
            ip link del $veth 2>/dev/null || true # left by a namespace removed by hand
            ip netns add "$node"
            ip link add $veth type veth peer name eth0 netns "$node"
            ip link set $veth master $BRIDGE
            ip link set $veth up
            ip netns exec "$node" ip addr add $NET.1$i/24 dev eth0
            ip netns exec "$node" ip link set eth0 up
            ip netns exec "$node" ip link set lo up
            ip netns exec "$node" ip route add default via $NET.1
        fi
        grep -q "^$NET.1$i $node " /etc/hosts || echo "$NET.1$i $node $HOSTS_TAG" >>/etc/hosts
    done
    step "network: ${NODES[*]} at $NET.11, $NET.12 on bridge $BRIDGE"
}

stop_network() {
    local i node
    for i in 1 2; do
        node=${NODES[i - 1]}
        if ip netns exec "$node" true 2>/dev/null; then
            ip netns pids "$node" | xargs -r kill -9 # every process left in the node
            ip netns del "$node"
        fi
        ip link del forge-veth$i 2>/dev/null || true
    done
    ip link del $BRIDGE 2>/dev/null || true
    # Rewritten in place: in a container /etc/hosts is often a mount of its own.
    local kept
    kept=$(grep -vF "$HOSTS_TAG" /etc/hosts || true)
    echo "$kept" >/etc/hosts
}

running() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Stops a daemon this script started, by its pid file.
stop_daemon() {
    local pidfile=$1
    running "$pidfile" || return 0
    step "$(basename "$pidfile" .pid): stopping"
    kill "$(cat "$pidfile")"
    for _ in $(seq 50); do
        running "$pidfile" || return 0
        sleep 0.1
    done
    die "$(basename "$pidfile" .pid) did not stop"
}

# Every slurmd (this script's earlier versions named one slurmd.pid), then slurmctld.
stop_slurm() {
    local pidfile
    for pidfile in "$ROOT"/run/slurmd*.pid; do
        [[ -e $pidfile ]] && stop_daemon "$pidfile"
    done
    stop_daemon "$ROOT/run/slurmctld.pid"
}

# Starts daemon `name` (a pid file of that name) with `command...` unless it runs.
start_daemon() {
    local name=$1
    shift
    if running "$ROOT/run/$name.pid"; then
        step "$name: already running"
        return
    fi
    step "$name: starting"
    "$@" || die "$name failed to start (see $ROOT/log/$name.log)"
}

start_slurm() {
    local two=$1 node
    if [[ -f $ROOT/run/conf-changed ]]; then
        stop_slurm
        rm -f "$ROOT/run/conf-changed"
    fi
    # -c: no jobs from an earlier slurmctld. A machine image taken while a test's job ran
    # (or a killed slurmctld) would otherwise bring that job back, its node 'alloc' for good.
    start_daemon slurmctld /usr/sbin/slurmctld -c
    start_daemon "slurmd-$HOST" /usr/sbin/slurmd
    [[ $two == yes ]] || return 0
    for node in "${NODES[@]}"; do
        mkdir -p "$ROOT/spool/$node"
        # Its own hostname too: slurmd finds its NodeName by hostname, and everything it
        # starts (the jobs) inherits both namespaces. nsenter, not `ip netns exec`, which
        # would mount a /sys without the cgroup file system slurmd reads.
        start_daemon "slurmd-$node" nsenter --net="/run/netns/$node" \
            unshare --uts sh -c "hostname $node && exec /usr/sbin/slurmd"
    done
}

wait_idle() {
    local node=$1 state="" deadline=$((SECONDS + TIMEOUT))
    while ((SECONDS < deadline)); do
        state=$(sinfo -h -n "$node" -o %t 2>/dev/null || true)
        if [[ $state == idle ]]; then
            step "node: $node idle"
            return
        fi
        sleep 0.5
    done
    die "node $node not idle after ${TIMEOUT}s (state '${state:-none}'); $(sinfo -R -h 2>&1)" \
        "; see $ROOT/log/"
}

check_srun() {
    local partition=$1 nodes=$2 out
    out=$(timeout 30 srun -p "$partition" -N"$nodes" -n"$nodes" hostname 2>&1) \
        || die "srun hostname in partition $partition failed: $out"
    step "srun: partition $partition: hostname -> $(echo "$out" | sort | tr '\n' ' ')"
}

start() {
    local two=yes why node started=$SECONDS
    if why=$(namespaces_refused); then
        two=no
        step "partition two: left out: $why; the cluster is one node"
    fi
    install_packages
    start_munge
    write_conf $two
    [[ $two == yes ]] && start_network
    start_slurm $two
    wait_idle "$HOST"
    check_srun debug 1
    if [[ $two == yes ]]; then
        for node in "${NODES[@]}"; do wait_idle "$node"; done
        check_srun two 2
    fi
    step "up in $((SECONDS - started)) s"
}

stop() {
    stop_slurm
    stop_network
    pkill -x munged || true
    step "stopped: daemons, namespaces, bridge and /etc/hosts lines"
}

main() {
    [[ $(id -u) == 0 ]] || die "run as root: it installs packages and starts daemons as root"
    case ${1:-start} in
        start) start ;;
        stop) stop ;;
        *) die "usage: .ci/slurm.sh [start|stop]" ;;
    esac
}

main "$@"
