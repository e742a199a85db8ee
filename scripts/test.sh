#!/usr/bin/env bash
# Set up a virtual environment (CPU torch 2.13.0, the package, its test extra) and run the
# test suite. Idempotent: a second run reuses .venv. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[test]'
# The P/D cross-host test joins two network namespaces with a veth pair (iproute2's `ip`).
if [ "$(id -u)" = 0 ] && ! command -v ip >/dev/null 2>&1; then
    (apt-get update -qq && apt-get install -y -qq iproute2) >/dev/null 2>&1 \
        || echo "iproute2 could not be installed: the network-namespace test will skip"
fi
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
# pytest exits 5 when it collects no tests: not a failure of the code under test.
if [ "$rc" -eq 5 ]; then rc=0; fi
exit "$rc"
