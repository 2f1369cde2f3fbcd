#!/usr/bin/env bash
# Lint and run the test suite in the project's pinned environment (created on first use), then the megatron-core
# release matrix: the plugin's megatron-core tests against every other supported release, each installed from the
# package registry into .venv/megatron-core/<release> (tests/megatron_matrix.py).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow"` to skip the slow multi-process cases and the
# matrix locally; MEGATRON_MATRIX=0 skips the matrix, MEGATRON_MATRIX="0.12.1 0.14.0" runs only those releases.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ruff check .  # lint first (configured in ruff.toml): CI fails on a lint error
status=0
matrix="${MEGATRON_MATRIX-all}"
if [[ " $* " == *"not slow"* && -z "${MEGATRON_MATRIX+set}" ]]; then
    matrix=0  # the matrix is slow: a "not slow" run skips it unless MEGATRON_MATRIX asks for it
fi
if [ "$matrix" != 0 ]; then
    [ "$matrix" = all ] && matrix=""
    # shellcheck disable=SC2086  # the release list splits on spaces
    python -m tests.megatron_matrix $matrix -- "$@" || status=1
fi
python -m pytest "$@" || status=1  # last, so that its summary closes the output
exit $status
