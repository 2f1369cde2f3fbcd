#!/usr/bin/env bash
# Lint and run the test suite in the project's pinned environment (created on first use).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow"` to skip the slow cases locally.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ruff check .  # lint first (configured in ruff.toml): CI fails on a lint error
exec python -m pytest "$@"
