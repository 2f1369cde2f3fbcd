# Sourced by demo.sh and test.sh: create .venv on first use and install the pinned environment.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PYTHON_BIN="${PYTHON:-python3.11}"
command -v "$PYTHON_BIN" >/dev/null 2>&1 || PYTHON_BIN=python3
STAMP="$VENV/.mindspeed_te-installed"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON_BIN" -m venv "$VENV"
fi
# Reinstall when the pins, setup.py or the C sources (built in place by the editable install) change.
if [ ! -f "$STAMP" ] || [ "$ROOT/requirements-dev.txt" -nt "$STAMP" ] || [ "$ROOT/setup.py" -nt "$STAMP" ] \
        || [ -n "$(find "$ROOT/mindspeed_te/csrc" -newer "$STAMP" 2>/dev/null)" ]; then
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    # torch first and pinned, so nothing later pulls a multi-gigabyte CUDA build.
    "$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
    "$VENV/bin/python" -m pip install --quiet -r "$ROOT/requirements-dev.txt"
    "$VENV/bin/python" -m pip install --quiet --no-deps -e "$ROOT"
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
