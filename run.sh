#!/usr/bin/env bash
# One entry point for a fresh machine: finds Python >= 3.12, makes .venv, installs lingjax, runs.
#   ./run.sh generate [ARGS]   python -m lingjax.generate on the embedded default model
#   ./run.sh test [PYTEST ARGS] the test suite (what CI runs; LINGJAX_TEST_WORKERS processes, default 2;
#                               LINGJAX_TEST_ALL=1 adds the extended tier CI leaves out)
#   ./run.sh python [ARGS]      the venv's python (e.g. ./run.sh python -m bench.batch1 --help)
set -euo pipefail
cd "$(dirname "$0")"

find_python() {
  for cand in "${LINGJAX_PYTHON:-}" python3.12 python3.13 python3; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$cand"; return 0
    fi
  done
  # pyenv keeps 3.12 installed but inactive on our CPU machines
  for v in 3.12 3.13; do
    if command -v pyenv >/dev/null 2>&1; then
      full=$(pyenv versions --bare 2>/dev/null | grep -E "^${v}(\.|$)" | tail -n1 || true)
      if [ -n "$full" ]; then echo "env PYENV_VERSION=$full python$v"; return 0; fi
    fi
    for p in "$HOME"/.pyenv/versions/${v}*/bin/python$v /root/.pyenv/versions/${v}*/bin/python$v; do
      [ -x "$p" ] && { echo "$p"; return 0; }
    done
  done
  echo "error: lingjax needs Python >= 3.12 (jax >= 0.11); none found. Set LINGJAX_PYTHON=/path/to/python3.12" >&2
  return 1
}

venv=.venv
if [ ! -x "$venv/bin/python" ]; then
  py=$(find_python)
  echo "creating $venv with $($py --version 2>&1)" >&2
  $py -m venv "$venv"
fi
stamp="$venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install -q -e ".[test,serve,train]" >&2
  rm -f "$venv"/.installed-*; touch "$stamp"
fi

cmd=${1:-generate}; shift || true
case "$cmd" in
  generate) exec "$venv/bin/python" -m lingjax.generate "$@" ;;
  test)
    # test files spread over LINGJAX_TEST_WORKERS processes (default 2, the CI machine's cores); a
    # file stays in one process, so its cached models and module fixtures are built once
    set +e
    # -m "not extended" leaves out the tests CI has no time for (tests/conftest.py EXTENDED);
    # LINGJAX_TEST_ALL=1 runs them too, and a -m of your own replaces it
    tier=(-m "not extended"); [ "${LINGJAX_TEST_ALL:-0}" = 1 ] && tier=()
    "$venv/bin/python" -m pytest -q -n "${LINGJAX_TEST_WORKERS:-2}" --dist loadfile "${tier[@]}" "$@"
    rc=$?
    [ $rc -eq 5 ] && { echo "error: pytest collected no tests" >&2; exit 1; }
    exit $rc ;;
  python) exec "$venv/bin/python" "$@" ;;
  *) echo "usage: ./run.sh {generate|test|python} [ARGS]" >&2; exit 2 ;;
esac
