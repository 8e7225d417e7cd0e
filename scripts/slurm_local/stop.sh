#!/usr/bin/env bash
# Stop the cluster scripts/slurm_local/start.sh started in STATE_DIR, by the PIDs it recorded
# (never by name): cancel its jobs, then the slurmd's, slurmctld, munged.
set -uo pipefail

[ $# -eq 1 ] || { echo "usage: $0 STATE_DIR" >&2; exit 2; }
RUN="$1"
PIDS="$RUN/pids"
[ -s "$PIDS" ] || { echo "stop.sh: nothing recorded in $PIDS"; exit 0; }
export SLURM_CONF="$RUN/slurm.conf"

pid_of() { awk -v n="$1" '$1 == n {print $2}' "$PIDS"; }
# running and not a zombie
alive() { local s; s=$(ps -o stat= -p "$1" 2>/dev/null) && [ -n "$s" ] && [ "${s#Z}" = "$s" ]; }

# stop_pids TIMEOUT_S PID...: SIGTERM, wait, then SIGKILL
stop_pids() {
  local t=$1 p any; shift
  for p in "$@"; do alive "$p" && kill -TERM "$p" 2>/dev/null; done
  for _ in $(seq $((t * 10))); do
    any=0
    for p in "$@"; do alive "$p" && any=1; done
    [ $any = 0 ] && return 0
    sleep 0.1
  done
  for p in "$@"; do alive "$p" && { echo "stop.sh: SIGKILL $p" >&2; kill -KILL "$p" 2>/dev/null; }; done
  sleep 0.2
}

ctld=$(pid_of slurmctld)
if [ -n "$ctld" ] && alive "$ctld"; then
  jobs=$(squeue -h -o '%A' 2>/dev/null | sort -u | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    # shellcheck disable=SC2086
    scancel $jobs 2>/dev/null
    for _ in $(seq 100); do
      [ -z "$(squeue -h -t running,completing,configuring,suspended -o '%A' 2>/dev/null)" ] && break
      sleep 0.1
    done
  fi
fi
# shellcheck disable=SC2046
stop_pids 10 $(awk '$1 ~ /^slurmd-/ {print $2}' "$PIDS")
[ -n "$ctld" ] && stop_pids 10 "$ctld"
m=$(pid_of munged); [ -n "$m" ] && stop_pids 5 "$m"

left=""
while read -r name pid; do alive "$pid" && left="$left $name:$pid"; done < "$PIDS"
[ -z "$left" ] || { echo "stop.sh: still alive:$left" >&2; exit 1; }
mv "$PIDS" "$PIDS.stopped"
echo "SLURM cluster in $RUN stopped."
