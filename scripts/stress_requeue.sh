#!/usr/bin/env bash
# Run tests/test_slurm.py's requeue test (a dp2_tp2 job on the localhost SLURM cluster gets USR2 mid-run,
# checkpoints, is requeued and resumes bitwise) N times in a row, 5 by default, and count the passes.
# Not part of the suite: each run takes minutes of the whole machine. Needs the localhost cluster's tools
# (scripts/setup.sh --with-slurm); the test's fixture starts the cluster itself.
#   scripts/stress_requeue.sh [N]
set -uo pipefail
cd "$(dirname "$0")/.."
N=${1:-5}
PY=${PYTHON:-.venv/bin/python}
TEST=tests/test_slurm.py::test_signalled_job_checkpoints_requeues_and_resumes_bitwise
passed=0
for i in $(seq 1 "$N"); do
  if "$PY" -m pytest -q -p no:cacheprovider "$TEST"; then
    passed=$((passed + 1))
    echo "stress_requeue: run $i of $N passed"
  else
    echo "stress_requeue: run $i of $N FAILED (its rank logs: the failed test's sweep folder, printed above)"
  fi
done
echo "stress_requeue: $passed of $N runs passed"
[ "$passed" = "$N" ]
