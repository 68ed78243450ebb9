#!/usr/bin/env bash
# Sets up ferry on a fresh machine: finds a Python >= 3.12 (jax 0.12 needs it; pyenv installs are
# looked for too), makes .venv beside this file and installs ferry with its test, planner and docs extras.
# Re-running it updates the same .venv.
set -euo pipefail
cd "$(dirname "$0")"

is_312() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }

find_python() {
  local candidates=("${FERRY_PYTHON:-}" python3.12 python3.13 python3)
  local root="${PYENV_ROOT:-$(pyenv root 2>/dev/null || echo "${HOME:-/root}/.pyenv")}"
  for dir in "$root"/versions/3.1[2-9]*; do candidates+=("$dir/bin/python3"); done
  for candidate in "${candidates[@]}"; do
    [ -n "$candidate" ] && is_312 "$candidate" && { command -v "$candidate"; return 0; }
  done
  return 1
}

if [ ! -x .venv/bin/python ] || ! is_312 .venv/bin/python; then
  python=$(find_python) || {
    echo "setup.sh: no Python 3.12 or newer found (jax 0.12 needs one). Install it (e.g. 'pyenv install 3.12')" \
         "or name it with FERRY_PYTHON=/path/to/python3.12." >&2
    exit 1
  }
  echo "setup.sh: making .venv with $python ($("$python" --version))"
  rm -rf .venv
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
.venv/bin/python -m pip install --quiet -e ".[test,plan,docs]" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
echo "setup.sh: ready. Run '.venv/bin/python launch/run.py' to train, '.venv/bin/pytest' to test."
