#!/usr/bin/env bash
# The main demo, in the project's pinned environment (created on first use): a GPT built from megatron-core
# learns the Python standard library's bytes in bf16, in every FP8/HiF8 recipe, with 8-bit Adam moments and in
# NVFP4 / MXFP4 with and without their stabilisers;
# tables in the terminal, figures in demo_out/ (`python -m mindspeed_te.demo --help` for the options, passed
# through from here).
# With MEGATRON_LM_PATH set (a Megatron-LM checkout), Megatron's own pretrain_gpt.py follows on the same corpus.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
python -m mindspeed_te.demo "$@"
if [ -n "${MEGATRON_LM_PATH:-}" ]; then
    echo
    bash "$ROOT/scripts/megatron_demo.sh"
else
    echo "(set MEGATRON_LM_PATH to a Megatron-LM checkout, tag core_v0.16.1, to also train with Megatron's" \
         "pretrain_gpt.py on the same corpus)"
fi
