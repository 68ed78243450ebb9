#!/usr/bin/env bash
# Sets up ferry on a fresh machine: finds a Python >= 3.12 (jax 0.12 needs it; pyenv installs are
# looked for too), makes .venv beside this file and installs ferry for the CPU with its test, docs and
# tensorboard extras (no CUDA or TPU wheels). Each argument adds an extra of pyproject.toml:
#   bash setup.sh plan   # the planner's deviceless GPU and TPU compiles (the CUDA plugin and libtpu, ~1 GB)
#   bash setup.sh hf     # torch (its CPU build) and transformers, for the Hugging Face parity tests
#   bash setup.sh gpu    # jax with CUDA 12, on a GPU machine;  bash setup.sh tpu: jax with libtpu, on a TPU VM
# Re-running it updates the same .venv (it removes nothing).
set -euo pipefail
cd "$(dirname "$0")"

extras_known=$(sed -n '/^\[project.optional-dependencies\]/,/^\[[a-z]/ s/^\([a-z0-9_-]*\) = \[.*/\1/p' pyproject.toml)
for extra in "$@"; do  # refused before anything is installed
  grep -qx -- "$extra" <<<"$extras_known" || {
    echo "setup.sh: '$extra' is not an extra of pyproject.toml; name any of:" $extras_known >&2
    exit 2
  }
done

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
quiet_pip() {  # pip without the warning pip.conf's missing local index folders give on some machines
  .venv/bin/python -m pip install --quiet "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

extras=(test docs tensorboard "$@")
quiet_pip --upgrade pip
if [[ " $* " == *" hf "* ]]; then
  # torch alone from the CPU build's index: torch==2.13.0 from PyPI is a CUDA build of several GB
  quiet_pip --no-deps --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" || {
    echo "setup.sh: no CPU build of torch 2.13.0 for $(.venv/bin/python --version) could be installed" \
         "(https://download.pytorch.org/whl/cpu); the hf extra needs one" >&2
    exit 1
  }
fi
quiet_pip -e ".[$(IFS=,; echo "${extras[*]}")]"
if [[ " $* " == *" hf "* ]] && ! .venv/bin/python -c 'import sys, torch; sys.exit(torch.version.cuda is not None)'; then
  echo "setup.sh: .venv holds a CUDA build of torch; the parity tests need its CPU build:" \
       ".venv/bin/pip uninstall torch, then bash setup.sh hf again" >&2
  exit 1
fi
echo "setup.sh: ready (extras: ${extras[*]}). Run '.venv/bin/python launch/run.py' to train, '.venv/bin/pytest' to test."
