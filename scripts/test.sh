#!/usr/bin/env bash
# Set up a virtual environment (CPU torch 2.13.0, the package, its test extra) and run the
# test suite. Idempotent: a second run reuses .venv. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[test]'
# As root, from the distribution's packages: iproute2's `ip` (the P/D cross-host test joins
# two network namespaces with a veth pair) and chromium (the dashboard's browser tests).
need=()
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v chromium >/dev/null 2>&1 || need+=(chromium fonts-dejavu-core)
if [ "$(id -u)" = 0 ] && [ "${#need[@]}" -gt 0 ]; then
    echo "installing ${need[*]} with apt-get"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}") \
        >/dev/null 2>&1 || echo "apt-get could not install ${need[*]}: the tests that need them \
will skip (under CI the browser tests fail instead)"
fi
set +e
# A process per core, four at most, each taking whole files (a file's module fixtures, such
# as its server, start once). Pass -n 0 to run in this process (for -s or --pdb).
.venv/bin/python -m pytest -q -n auto --maxprocesses=4 --dist loadfile "$@"
rc=$?
set -e
# pytest exits 5 when it collects no tests: not a failure of the code under test.
if [ "$rc" -eq 5 ]; then rc=0; fi
exit "$rc"
