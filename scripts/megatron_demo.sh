#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py, launched as users launch it (torchrun, Megatron's default backend and
# fusions, no CPU-only flags: the plugin's CPU device adaptor serves them), on the demo's corpus (the Python
# standard library's source as byte tokens), written with Megatron's indexed-dataset builder: bf16, then
# FP8/HiF8 recipes, losses side by side.
#     MEGATRON_LM_PATH=/path/to/Megatron-LM scripts/megatron_demo.sh [DATA_DIR]   (default demo_out/megatron)
# Needs a Megatron-LM checkout (tag core_v0.16.1) at MEGATRON_LM_PATH; nothing is downloaded from it here.
# Fails loudly: a failed install, build or training run stops it (after the table, for the runs) with an error.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
: "${MEGATRON_LM_PATH:?set MEGATRON_LM_PATH to a Megatron-LM checkout (git tag core_v0.16.1)}"
DATA_DIR="$(mkdir -p "${1:-demo_out/megatron}" && cd "${1:-demo_out/megatron}" && pwd)"
# Megatron-LM's training code needs these beyond megatron-core, at the versions pinned there.
python -m pip install --quiet -r "$ROOT/requirements-megatron-lm.txt"
# Its C++ dataset helpers, built for this interpreter.
make -s -C "$MEGATRON_LM_PATH/megatron/core/datasets" \
    LIBEXT="$(python -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"

# The corpus as DATA_DIR/stdlib.bin/.idx; SPLIT holds out the same files as `python -m mindspeed_te.demo`.
SPLIT="$(python -m mindspeed_te.demo.corpus "$DATA_DIR/stdlib")"
export PYTHONPATH="$ROOT" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
GPT=(--transformer-impl transformer_engine --num-layers 2 --hidden-size 128 --num-attention-heads 4
     --seq-length 128 --max-position-embeddings 128 --position-embedding-type rope --bf16
     --micro-batch-size 16 --global-batch-size 16 --train-iters 50 --lr 3e-3 --min-lr 3e-4
     --lr-decay-style cosine --lr-warmup-iters 5 --weight-decay 0.1 --clip-grad 1.0 --seed 1234
     --data-path "$DATA_DIR/stdlib" --split "$SPLIT" --tokenizer-type NullTokenizer --vocab-size 256
     --log-interval 10 --eval-interval 1000 --eval-iters 4)
FAILED=()
run() {  # run NAME [FLAGS...]: one pretrain_gpt.py launch, its losses on one line; a failed one is noted
    local name="$1"; shift
    local log="$DATA_DIR/${name// /_}.log"
    if ! python -m torch.distributed.run --standalone --nproc-per-node 1 \
        -m mindspeed_te.launch "$MEGATRON_LM_PATH/pretrain_gpt.py" "${GPT[@]}" "$@" >"$log" 2>&1; then
        FAILED+=("$name (see $log)")
    fi
    local losses val
    losses=$(sed -n 's/.*iteration .*lm loss: \([0-9.E+-]*\).*/\1/p' "$log" | xargs -r printf '%.3f ' 2>/dev/null)
    val=$(sed -n 's/.*on validation set | lm loss value: \([0-9.E+-]*\).*/\1/p' "$log" | xargs -r printf '%.3f' 2>/dev/null)
    printf '%-28s %-36s %s\n' "$name" "${losses:-FAILED (see $log)}" "$val"
}
echo "Megatron-LM pretrain_gpt.py on the standard library's bytes ($SPLIT train/validation/test files)"
printf "%-28s %-36s %s\n" "run" "lm loss at iterations 1,10,...,50" "validation"
run "bf16"
run "hif8 delayed" --fp8-format hif8 --fp8-recipe delayed
run "hif8 tensorwise" --fp8-format hif8 --fp8-recipe tensorwise
run "hybrid delayed" --fp8-format hybrid --fp8-recipe delayed
run "e4m3 blockwise" --fp8-format e4m3 --fp8-recipe blockwise
run "e4m3 mxfp8" --fp8-format e4m3 --fp8-recipe mxfp8
run "hif8 tensorwise, MoE (4 exp.)" --fp8-format hif8 --fp8-recipe tensorwise --num-experts 4 \
    --moe-grouped-gemm --moe-token-dispatcher-type alltoall --moe-router-topk 2 --disable-bias-linear
if [ "${#FAILED[@]}" -gt 0 ]; then
    printf 'failed: %s\n' "${FAILED[@]}" >&2
    exit 1
fi
