#!/usr/bin/env bash
# bash scripts/run_tests.sh [pytest args...]
#
# Sets up the environment if needed (scripts/setup_env.sh), then runs the test suite on CPU:
# unit tests and the integration tests that start real vLLM / megatron-core / Ray on the tiny model.
#   bash scripts/run_tests.sh -m "not integration"   # the fast tier only
#   bash scripts/run_tests.sh -m faults              # the fault-injection suite (docs/failure_and_security.md)
#   CHATGEN_RUN_SLOW=1 bash scripts/run_tests.sh     # also the slow tests (whole learning curves)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup_env.sh"
venv="${CHATGEN_VENV:-$repo/.venv}"
cd "$repo"
exec "$venv/bin/python" -m pytest "$@"
