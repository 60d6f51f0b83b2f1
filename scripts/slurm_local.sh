#!/usr/bin/env bash
# A one-host Slurm cluster (munged + slurmctld + slurmd) for shardtune's SLURM tests and for trying the sbatch
# scripts that `shardtune slurm` writes. Needs root; installs Debian's slurm-wlm and munge when missing.
#
#   scripts/slurm_local.sh start    install if needed, write the config, start the daemons, wait for the node
#   scripts/slurm_local.sh status   exit 0 when the node takes jobs
#   scripts/slurm_local.sh stop     stop the daemons this script started (munged too, when it started it)
#
# Clients need SLURM_CONF (printed by `start`): the config lives in $SHARDTUNE_SLURM_DIR, never in /etc/slurm,
# so a host's own Slurm setup is left alone. No systemd and no cgroups: the daemons are started directly,
# processes are tracked by parent id (proctrack/linuxproc). The node has 2 CPUs (CPUS to change it).
set -euo pipefail

DIR=${SHARDTUNE_SLURM_DIR:-/tmp/shardtune-slurm}
CPUS=${CPUS:-2}
HOST=$(hostname -s)
CONF=$DIR/slurm.conf

install_if_missing() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
        return 0
    fi
    if [ "$(id -u)" != 0 ]; then
        echo "slurm_local.sh: slurm-wlm and munge are not installed and this is not root" >&2
        return 3
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null || {
        echo "slurm_local.sh: apt-get install slurm-wlm munge failed" >&2
        return 3
    }
}

write_config() {
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log" "$DIR/run"
    cat >"$CONF" <<EOF
# Written by scripts/slurm_local.sh: one host, $CPUS CPUs, daemons run as root.
ClusterName=shardtune-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# No cgroups in containers: track a job's processes by their parent id, no task confinement.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldPort=${SLURMCTLD_PORT:-6817}
SlurmdPort=${SLURMD_PORT:-6818}
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
    if munge -n >/dev/null 2>&1 </dev/null; then
        return 0
    fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    [ -s /etc/munge/munge.key ] || { mungekey --create 2>/dev/null || create-munge-key -f; }
    chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
    # munged drops to its own user when started as root by the package's init script; --force allows root.
    if id munge >/dev/null 2>&1; then
        su -s /bin/sh munge -c munged || munged --force
    else
        munged --force
    fi
    touch "$DIR/run/munged.ours"  # stop ends munged only when this script started it
    for _ in $(seq 50); do munge -n >/dev/null 2>&1 </dev/null && return 0; sleep 0.1; done
    echo "slurm_local.sh: munged did not start" >&2
    return 1
}

node_ready() {
    SLURM_CONF=$CONF sinfo -h -n "$HOST" -o %t 2>/dev/null | grep -Eq '^(idle|mix|alloc)'
}

start() {
    install_if_missing
    write_config
    start_munge
    export SLURM_CONF=$CONF
    pgrep -F "$DIR/run/slurmctld.pid" >/dev/null 2>&1 || slurmctld -c -f "$CONF"
    pgrep -F "$DIR/run/slurmd.pid" >/dev/null 2>&1 || slurmd -f "$CONF"
    for _ in $(seq 150); do
        if node_ready; then
            echo "export SLURM_CONF=$CONF"
            return 0
        fi
        SLURM_CONF=$CONF scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true
        sleep 0.2
    done
    echo "slurm_local.sh: node $HOST did not become idle; logs in $DIR/log" >&2
    tail -5 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 || true
    return 1
}

stop() {
    for name in slurmd slurmctld; do
        if [ -f "$DIR/run/$name.pid" ]; then
            kill "$(cat "$DIR/run/$name.pid")" 2>/dev/null || true
            rm -f "$DIR/run/$name.pid"
        fi
    done
    if [ -f "$DIR/run/munged.ours" ] && [ -f /run/munge/munged.pid ]; then
        kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true
        rm -f "$DIR/run/munged.ours"
    fi
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) node_ready ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
