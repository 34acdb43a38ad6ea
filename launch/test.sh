#!/usr/bin/env bash
# The test suite (README's second command): sets up the environment if needed, then runs pytest.
# Extra arguments go to pytest, e.g. `bash launch/test.sh -m slow` for the soak tests.
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$SHARDOPT_ROOT"
python integrations/data.py >/dev/null   # the example data set (fetched once into .cache/), which a test checks
exec python -m pytest "$@"
