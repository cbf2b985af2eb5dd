#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, for `make test-slurm`.
#
#   bash tests/slurm/cluster.sh install  # install slurm-wlm + munge if missing, start nothing
#   bash tests/slurm/cluster.sh start    # install slurm-wlm + munge if missing, start, wait for the node
#   bash tests/slurm/cluster.sh status   # what is running; exit 0 only when the node answers
#   bash tests/slurm/cluster.sh stop     # cancel its jobs, stop only what `start` started
#
# Everything lives in $NEPS_BCAST_SLURM_DIR (default /tmp/neps_bcast_slurm): slurm.conf,
# state, spool, logs and pid files. Nothing is written to /etc/slurm: clients find the
# cluster through SLURM_CONF=$NEPS_BCAST_SLURM_DIR/slurm.conf (the Makefile exports it).
# Its own ports (16817, 16818), so a cluster already on this machine is left alone.
# munged is shared (its default socket): reused when running, and stopped by `stop` only
# when `start` started it. Needs root (apt-get, SlurmUser=root).
set -euo pipefail

DIR=${NEPS_BCAST_SLURM_DIR:-/tmp/neps_bcast_slurm}
CONF=$DIR/slurm.conf
export SLURM_CONF=$CONF
NODE=$(hostname -s)
CPUS=$(nproc)
CTLD_PORT=16817
SLURMD_PORT=16818
WAIT_S=${NEPS_BCAST_SLURM_WAIT_S:-60}
MUNGE_PID=/run/munge/munged.pid
MUNGE_MINE=$DIR/munged.started-by-us

log() { echo "[cluster.sh] $*" >&2; }
die() {
    log "ERROR: $*"
    exit 1
}

# alive PIDFILE NAME: the pid in PIDFILE is a running NAME process.
alive() {
    local pid
    [ -s "$1" ] || return 1
    pid=$(cat "$1")
    [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "$2" ]
}

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null &&
        command -v sbatch >/dev/null && command -v munged >/dev/null; then
        return
    fi
    [ "$(id -u)" -eq 0 ] || die "slurm-wlm and munge are missing and installing them needs root"
    log "installing slurm-wlm and munge (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y --no-install-recommends slurm-wlm munge >"$DIR/apt.log" 2>&1; then
        apt-get update >>"$DIR/apt.log" 2>&1
        apt-get install -y --no-install-recommends slurm-wlm munge >>"$DIR/apt.log" 2>&1 ||
            die "apt-get install slurm-wlm munge failed; see $DIR/apt.log"
    fi
}

start_munge() {
    if alive "$MUNGE_PID" munged; then
        return
    fi
    if [ ! -s /etc/munge/munge.key ]; then
        log "creating /etc/munge/munge.key"
        mkdir -p /etc/munge
        if command -v mungekey >/dev/null; then
            mungekey --create --keyfile /etc/munge/munge.key
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
        fi
    fi
    chown munge:munge /etc/munge /etc/munge/munge.key
    chmod 0700 /etc/munge
    chmod 0400 /etc/munge/munge.key
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /run/munge /var/lib/munge /var/log/munge
    chmod 0755 /run/munge
    runuser -u munge -- /usr/sbin/munged
    touch "$MUNGE_MINE"
    local deadline=$((SECONDS + 10))
    until munge -n </dev/null | unmunge >/dev/null 2>&1; do
        [ $SECONDS -lt $deadline ] || die "munged does not answer; see /var/log/munge/munged.log"
        sleep 0.2 # bounded poll for the daemon's socket
    done
}

write_conf() {
    mkdir -p "$DIR/state" "$DIR/spool"
    cat >"$CONF" <<EOF
# Written by tests/slurm/cluster.sh: a one-node test cluster.
ClusterName=nepsbcast
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job is held back cred_expire + 1 s (default 120 s): until then slurmd still
# refuses its revoked credential ("Killing non-startable batch job: Job credential revoked").
AuthInfo=cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
# Requeue allowed; finished jobs stay visible to "scontrol show job" for an hour (no sacct).
JobRequeue=1
MinJobAge=3600
# SIGTERM, then SIGKILL this many seconds later (scancel, scontrol requeue, a time limit).
KillWait=30
ReturnToService=2
SlurmdParameters=config_overrides
SlurmctldTimeout=60
SlurmdTimeout=60
InactiveLimit=0
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=test Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

node_state() {
    sinfo -h -N -n "$NODE" -o '%T' 2>/dev/null | head -n 1
}

start() {
    mkdir -p "$DIR"
    if alive "$DIR/slurmctld.pid" slurmctld && alive "$DIR/slurmd.pid" slurmd; then
        log "already running ($DIR)"
        return
    fi
    install_packages
    start_munge
    # A half-started cluster (one daemon left) is stopped first, then started afresh.
    stop_daemons
    rm -rf "$DIR/state" "$DIR/spool"
    write_conf
    # -c: a fresh cluster, no job from an earlier start is recovered.
    slurmctld -c -f "$CONF"
    slurmd -f "$CONF"
    local deadline=$((SECONDS + WAIT_S)) state=""
    while [ $SECONDS -lt $deadline ]; do
        state=$(node_state)
        case $state in
        idle | mixed | allocated) break ;;
        esac
        sleep 0.5 # bounded poll for the node to register
    done
    case $state in
    idle | mixed | allocated) ;;
    *)
        log "node $NODE is '${state:-not listed}' after ${WAIT_S} s; logs:"
        tail -n 20 "$DIR/slurmctld.log" "$DIR/slurmd.log" >&2 || true
        die "the test cluster did not come up"
        ;;
    esac
    log "up: node $NODE ($CPUS CPUs) $state; SLURM_CONF=$CONF"
}

# stop_pid PIDFILE NAME: SIGTERM, a bounded wait, then SIGKILL.
stop_pid() {
    alive "$1" "$2" || return 0
    local pid deadline
    pid=$(cat "$1")
    kill "$pid" 2>/dev/null || true
    deadline=$((SECONDS + 15))
    while [ -d "/proc/$pid" ] && [ $SECONDS -lt $deadline ]; do
        sleep 0.2 # bounded wait for the daemon to exit
    done
    if [ -d "/proc/$pid" ]; then
        log "$2 (pid $pid) ignored SIGTERM for 15 s: SIGKILL"
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$1"
}

stop_daemons() {
    stop_pid "$DIR/slurmd.pid" slurmd
    stop_pid "$DIR/slurmctld.pid" slurmctld
}

cancel_jobs() {
    alive "$DIR/slurmctld.pid" slurmctld || return 0
    local jobs deadline
    jobs=$(squeue -h -o '%i' 2>/dev/null || true)
    [ -n "$jobs" ] || return 0
    log "cancelling jobs left on the test cluster: $(echo $jobs)"
    # shellcheck disable=SC2086
    scancel $jobs 2>/dev/null || true
    deadline=$((SECONDS + 60))
    while [ -n "$(squeue -h -o '%i' 2>/dev/null)" ] && [ $SECONDS -lt $deadline ]; do
        sleep 0.5 # bounded wait for the jobs to end
    done
}

stop() {
    [ -d "$DIR" ] || return 0
    cancel_jobs
    stop_daemons
    if [ -e "$MUNGE_MINE" ]; then
        stop_pid "$MUNGE_PID" munged
        rm -f "$MUNGE_MINE"
    fi
    # A job step whose slurmd is gone would be orphaned: report, never ignore, one.
    local left
    left=$(pgrep -x slurmstepd || true)
    [ -z "$left" ] || log "WARNING: slurmstepd still running: $(echo $left)"
    log "stopped"
}

status() {
    local ok=0 name
    for name in slurmctld slurmd; do
        if alive "$DIR/$name.pid" $name; then
            log "$name running (pid $(cat "$DIR/$name.pid"))"
        else
            log "$name not running"
            ok=1
        fi
    done
    if alive "$MUNGE_PID" munged; then log "munged running"; else log "munged not running"; fi
    [ $ok -eq 0 ] || return 1
    sinfo -N
}

case ${1:-} in
install)
    mkdir -p "$DIR"
    install_packages
    ;;
start) start ;;
stop) stop ;;
status) status ;;
*)
    echo "usage: $0 install|start|stop|status" >&2
    exit 2
    ;;
esac
