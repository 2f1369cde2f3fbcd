#!/usr/bin/env bash
# Train a tiny GPT with Megatron-LM's own pretrain_gpt.py through mindspeed_te on this machine (CPU is
# fine): fp32 first, then FP8/HiF8 recipes, and print the losses side by side.
# Needs a Megatron-LM checkout (tag core_v0.16.1) at MEGATRON_LM_PATH; nothing is downloaded from it here.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
: "${MEGATRON_LM_PATH:?set MEGATRON_LM_PATH to a Megatron-LM checkout (git tag core_v0.16.1)}"
# Megatron-LM's training code needs these beyond megatron-core.
python -m pip install --quiet six regex pyyaml pydantic pybind11 triton 2>/dev/null
# Its C++ dataset helpers, built for this interpreter.
make -s -C "$MEGATRON_LM_PATH/megatron/core/datasets" \
    LIBEXT="$(python -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"

export MASTER_ADDR=127.0.0.1 MASTER_PORT=29591 RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 PYTHONPATH="$ROOT"
TINY_GPT=(--transformer-impl transformer_engine --num-layers 2 --hidden-size 64 --num-attention-heads 4
          --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4
          --train-iters 20 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 128
          --distributed-backend gloo --use-cpu-initialization --no-gradient-accumulation-fusion
          --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion
          --log-interval 5 --eval-iters 1 --eval-interval 1000 --seed 7)
run() {
    local name="$1"; shift
    local losses
    losses=$(python -m mindspeed_te.launch "$MEGATRON_LM_PATH/pretrain_gpt.py" "${TINY_GPT[@]}" "$@" 2>&1 \
        | sed -n 's/.*iteration .*lm loss: \([0-9.E+-]*\).*/\1/p' | tr '\n' ' ')
    printf '%-34s %s\n' "$name" "${losses:-FAILED}"
}
echo "training lm loss at iterations 5, 10, 15, 20"
run "fp32"
run "hif8 delayed" --fp8-format hif8 --fp8-recipe delayed
run "hif8 tensorwise" --fp8-format hif8 --fp8-recipe tensorwise
run "e4m3 blockwise" --fp8-format e4m3 --fp8-recipe blockwise
run "hybrid mxfp8, bf16" --fp8-format hybrid --fp8-recipe mxfp8 --bf16
run "hif8 tensorwise, MoE (4 experts)" --fp8-format hif8 --fp8-recipe tensorwise --num-experts 4 \
    --moe-grouped-gemm --moe-token-dispatcher-type alltoall --moe-router-topk 2
