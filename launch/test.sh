#!/usr/bin/env bash
# The test suite (README's second command): sets up the environment if needed, then runs pytest.
# Extra arguments go to pytest, e.g. `bash launch/test.sh -m slow` for the soak tests.
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$SHARDOPT_ROOT"
exec python -m pytest "$@"
