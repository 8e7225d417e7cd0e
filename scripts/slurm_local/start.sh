#!/usr/bin/env bash
# A throw-away SLURM cluster on this machine: one private munged, one slurmctld and N slurmd
# ("n1".."nN", one `slurmd -N nX` each on its own port, spool, pid and log file). Every node is
# localhost, so a job's node identity comes from SLURMD_NODENAME (submitit's JobEnvironment).
#
#   scripts/slurm_local/start.sh STATE_DIR      then: source STATE_DIR/slurm.env
#   scripts/slurm_local/stop.sh STATE_DIR
#
# Needs root (slurmd switches to the job's user) and Debian's slurm-wlm and munge
# (scripts/setup.sh --with-slurm installs them). Nothing outside STATE_DIR is touched: the
# cluster has its own munge key and socket, and SLURM_CONF in slurm.env points at its config.
# Environment: SLURM_LOCAL_NODES (2), SLURM_LOCAL_CPUS (CPUs per node, 2), SLURM_LOCAL_CTLD_PORT
# (16817), SLURM_LOCAL_NODE_PORT0 (17000: node i listens on PORT0+i), SLURM_LOCAL_TIMEOUT_S (60).
# Writes STATE_DIR/pids ("name pid" per daemon; stop.sh stops exactly these), STATE_DIR/slurm.env,
# logs in STATE_DIR/log.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[ $# -eq 1 ] || { echo "usage: $0 STATE_DIR" >&2; exit 2; }
mkdir -p "$1"
RUN="$(cd "$1" && pwd)"
NNODES="${SLURM_LOCAL_NODES:-2}"
CPUS="${SLURM_LOCAL_CPUS:-2}"
MEM_MB="$(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo)"
CTLD_PORT="${SLURM_LOCAL_CTLD_PORT:-16817}"
PORT0="${SLURM_LOCAL_NODE_PORT0:-17000}"
TIMEOUT="${SLURM_LOCAL_TIMEOUT_S:-60}"
PIDS="$RUN/pids"
T0=$(date +%s.%N)

[ "$(id -u)" = 0 ] || { echo "start.sh: must run as root (slurmd switches to the job's user)" >&2; exit 1; }
for b in munged munge slurmctld slurmd sinfo sbatch; do
  command -v "$b" >/dev/null || { echo "start.sh: '$b' not found. Fix: scripts/setup.sh --with-slurm" >&2; exit 1; }
done
if [ -s "$PIDS" ]; then
  while read -r _name pid; do
    if kill -0 "$pid" 2>/dev/null; then echo "start.sh: a cluster is running from $RUN (pid $pid); stop.sh $RUN first" >&2; exit 1; fi
  done < "$PIDS"
fi

rm -rf "$RUN/munge" "$RUN/state" "$RUN/log" "$RUN/spool"
mkdir -p "$RUN/munge" "$RUN/state" "$RUN/log"
chmod 755 "$RUN"; chmod 711 "$RUN/munge"  # job users must reach the socket
: > "$PIDS"

failed() {
  echo "start.sh: start-up failed; last log lines:" >&2
  for f in "$RUN"/log/*; do [ -f "$f" ] && { echo "== $f" >&2; tail -n 15 "$f" >&2; }; done
  "$HERE/stop.sh" "$RUN" >&2 || true
}
trap failed ERR

# start NAME CMD...: a daemon in its own session, recorded as "NAME PID"
start() {
  local name=$1; shift
  setsid "$@" </dev/null >"$RUN/log/$name.out" 2>&1 &
  echo "$name $!" >> "$PIDS"
}

# munge: a private key and socket, independent of any munged the machine runs
dd if=/dev/urandom of="$RUN/munge/munge.key" bs=1 count=1024 status=none
chmod 400 "$RUN/munge/munge.key"
SOCK="$RUN/munge/munge.socket"
start munged munged --foreground --force --socket="$SOCK" --key-file="$RUN/munge/munge.key" \
  --pid-file="$RUN/munge/munged.pid" --log-file="$RUN/log/munged.log" --seed-file="$RUN/munge/munged.seed"
for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.05; done
munge -S "$SOCK" -n | unmunge -S "$SOCK" >/dev/null

CONF="$RUN/slurm.conf"
NODELIST=""
{
  cat <<CONF
ClusterName=local
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCK
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$RUN/state
SlurmdSpoolDir=$RUN/spool/%n
SlurmctldPidFile=$RUN/log/slurmctld.pid
SlurmdPidFile=$RUN/log/slurmd-%n.pid
SlurmctldLogFile=$RUN/log/slurmctld.log
SlurmdLogFile=$RUN/log/slurmd-%n.log
# several slurmd on one host, each declaring its own CPUs
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
SchedulerParameters=batch_sched_delay=0
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
# finished jobs stay visible to squeue (and so to the sacct stand-in) for 5 minutes
MinJobAge=300
# a requeued job may start again at once
JobRequeue=1
CONF
  for i in $(seq 1 "$NNODES"); do
    echo "NodeName=n$i NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((PORT0 + i)) CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN"
    NODELIST="$NODELIST${NODELIST:+,}n$i"
  done
  echo "PartitionName=debug Nodes=$NODELIST Default=YES MaxTime=INFINITE State=UP"
} > "$CONF"
export SLURM_CONF="$CONF"

start slurmctld slurmctld -D -c -f "$CONF"
for i in $(seq 1 "$NNODES"); do
  mkdir -p "$RUN/spool/n$i"
  start "slurmd-n$i" slurmd -D -N "n$i" -f "$CONF"
done

# every node "idle" (not "idle*", which is not responding yet)
deadline=$(( $(date +%s) + TIMEOUT ))
while :; do
  idle=$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 == "idle"' | sort -u | wc -l || true)
  [ "$idle" -ge "$NNODES" ] && break
  while read -r name pid; do
    kill -0 "$pid" 2>/dev/null || { echo "start.sh: $name (pid $pid) died" >&2; false; }
  done < "$PIDS"
  [ "$(date +%s)" -lt "$deadline" ] || { echo "start.sh: nodes not idle after ${TIMEOUT}s" >&2; false; }
  sleep 0.2
done
trap - ERR

cat > "$RUN/slurm.env" <<ENV
export SLURM_CONF=$CONF
export PATH=$HERE/bin:\$PATH
ENV
echo "SLURM cluster up in $(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s: $NNODES nodes x $CPUS CPUs, state in $RUN"
