#!/usr/bin/env bash
# Run the main demo in the project's pinned environment (created on first use).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec python -m mindspeed_te.demo "$@"
