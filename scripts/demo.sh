#!/usr/bin/env bash
# Run the main demo in the project's pinned environment (created on first use): with MEGATRON_LM_PATH set
# (a Megatron-LM checkout), Megatron's own pretrain_gpt.py in fp32 and FP8/HiF8; otherwise a small model
# trained in fp32 and every recipe with the TE-style modules.
if [ -n "${MEGATRON_LM_PATH:-}" ]; then
    exec bash "$(dirname "${BASH_SOURCE[0]}")/megatron_demo.sh" "$@"
fi
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
echo "(set MEGATRON_LM_PATH to a Megatron-LM checkout, tag core_v0.16.1, to run Megatron's pretrain_gpt.py instead)"
exec python -m mindspeed_te.demo "$@"
