#!/usr/bin/env bash
# bash scripts/run_tests_under_load.sh [pytest args...]
#
# The test suite with the machine loaded: two busy-loop processes (`stress --cpu 2`'s load, in
# Python so nothing needs installing) run beside scripts/run_tests.sh, and waits stretch by
# CHATGEN_TEST_TIMEOUT_SCALE (default 3 here; CI sets none, so 1). What a loaded machine must still
# pass: docs/testing.md. At the end it prints the time taken and the load average, for the note that
# reports the run.
#   bash scripts/run_tests_under_load.sh                         # the whole suite
#   BUSY_PROCESSES=4 bash scripts/run_tests_under_load.sh tests/integration/test_two_node.py
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${CHATGEN_VENV:-$repo/.venv}"
export CHATGEN_TEST_TIMEOUT_SCALE=${CHATGEN_TEST_TIMEOUT_SCALE:-3}
# Idle OpenMP threads sleep, as in every process chatgen's CLI and Ray workers start
# (chatgen/core/process_tuning.py): the tests that run engines in pytest's own process would otherwise spin
# against the busy loops (test_generation_engine.py under two busy loops: 51 s spinning, 35 s passive, 23 s
# on the quiet machine).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
busy=()
stop_busy() {  # only the processes this script started, by their ids
  for pid in "${busy[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap stop_busy EXIT
for _ in $(seq "${BUSY_PROCESSES:-2}"); do
  python3 -c 'while True: pass' &
  busy+=("$!")
done
load() { cut -d' ' -f1-3 /proc/loadavg; }
echo "run_tests_under_load: ${#busy[@]} busy processes (${busy[*]})," \
     "CHATGEN_TEST_TIMEOUT_SCALE=$CHATGEN_TEST_TIMEOUT_SCALE, OMP_WAIT_POLICY=$OMP_WAIT_POLICY, load $(load)" >&2
start=$SECONDS
status=0
bash "$repo/scripts/run_tests.sh" "$@" || status=$?
took=$((SECONDS - start))
echo "run_tests_under_load: exit $status after $((took / 60)) min $((took % 60)) s," \
     "load $(load) ($(nproc) cores)" >&2
exit $status
