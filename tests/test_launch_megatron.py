"""Megatron-LM's own pretrain_gpt.py through `python -m mindspeed_te.launch`, on CPU (needs a Megatron-LM
checkout at MEGATRON_LM_PATH, tag core_v0.16.1, and its Python requirements; skipped without it)."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.megatron_matrix import build_dataset_helpers, helpers_env, python_path

MEGATRON = os.environ.get("MEGATRON_LM_PATH")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not MEGATRON, reason="needs MEGATRON_LM_PATH (Megatron-LM checkout)")]

# A launch as users write it: Megatron's defaults (NCCL backend, gradient-accumulation fusion, the bias-gelu /
# bias-dropout / masked-softmax fusions), which the CPU device adaptor serves; no CPU-only flags.
TINY_GPT = ("--transformer-impl transformer_engine --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
            "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 "
            "--train-iters 3 --lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
            "--log-interval 1 --eval-iters 1 --eval-interval 100 --seed 7").split()
# Llama-style choices, whose defaults turn on RoPE fusion and SwiGLU fusion.
LLAMA = ("--position-embedding-type", "rope", "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", autouse=True)
def dataset_helpers() -> None:
    build_dataset_helpers(pathlib.Path(MEGATRON))


def _launch(*extra: str, nproc: int = 1, port: int = 29571, env_extra: dict | None = None,
            launcher: tuple[str, ...] = ("-m", "mindspeed_te.launch")) -> subprocess.CompletedProcess:
    env = dict(os.environ, **helpers_env(), PYTHONPATH=os.pathsep.join([ROOT, python_path(pathlib.Path(MEGATRON))]),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **(env_extra or {}))
    script = os.path.join(MEGATRON, "pretrain_gpt.py")
    if nproc == 1:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        cmd = [sys.executable, *launcher, script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={port}",
               *launcher, script]
    return subprocess.run([*cmd, *TINY_GPT, *extra], env=env, capture_output=True, text=True, timeout=600)


def _losses(run: subprocess.CompletedProcess) -> list[float]:
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return [float(x) for x in re.findall(r"iteration\s+\d+/\s*3 \|.*?lm loss: ([0-9.E+-]+)", run.stdout)]


@pytest.fixture(scope="module")
def fp32_losses() -> list[float]:
    return _losses(_launch())


@pytest.mark.parametrize("extra", [
    ("--fp8-format", "hif8", "--fp8-recipe", "delayed"),
    ("--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"),
    ("--fp8-format", "hybrid", "--fp8-recipe", "blockwise", "--bf16"),
], ids=lambda e: "-".join(e[1:4:2]))
def test_pretrain_gpt_trains_in_fp8(fp32_losses, extra):
    losses = _losses(_launch(*extra))
    assert len(losses) == 3 == len(fp32_losses)
    assert losses != fp32_losses  # quantized GEMMs ran
    assert all(abs(a - b) < 0.05 * b for a, b in zip(losses, fp32_losses))


def test_pretrain_gpt_tensor_and_sequence_parallel_moe():
    run = _launch("--tensor-model-parallel-size", "2", "--sequence-parallel", "--num-experts", "4",
                  "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall", "--moe-router-topk", "2",
                  "--disable-bias-linear",
                  "--fp8-format", "hif8", "--fp8-recipe", "tensorwise", nproc=2, port=29581)
    losses = _losses(run)
    assert len(losses) == 3 and all(5.0 < x < 6.0 for x in losses)


def test_standard_launch_with_only_the_fp8_flags_added_under_torchrun_tp2_sequence_parallel():
    """torchrun, TP=2 + sequence parallel, Llama-style model, Megatron's default fusions and backend: adding
    the three TE/FP8 flags is all it takes, and it trains like the same model on one process in fp32."""
    fp8 = ("--fp8-format", "hif8", "--fp8-recipe", "delayed")
    single = _losses(_launch(*LLAMA, port=29601))
    parallel = _losses(_launch(*LLAMA, "--tensor-model-parallel-size", "2", "--sequence-parallel", *fp8,
                               nproc=2, port=29603))
    assert len(parallel) == 3 == len(single)
    assert all(abs(a - b) < 0.05 * b for a, b in zip(parallel, single))


def test_gradient_accumulation_fusion_on_cpu_matches_the_unfused_path(fp32_losses):
    """Megatron's default --gradient-accumulation-fusion (weight gradients accumulated straight into
    main_grad by the adaptor's CPU kernel) trains as --no-gradient-accumulation-fusion does."""
    unfused = _losses(_launch("--no-gradient-accumulation-fusion", port=29605))
    assert len(unfused) == 3 and all(abs(a - b) <= 1e-5 * b for a, b in zip(unfused, fp32_losses))


def test_overlapped_and_bf16_gradient_reduction_with_fused_accumulation():
    """Megatron's FP8 example scripts add --overlap-grad-reduce (whose hook requires a .grad: the fused path hands
    TransformerEngine's placeholder) and --grad-reduce-in-bf16 (bfloat16 main_grads, accumulated into in their
    own dtype). Both train as the unfused path does, within the bf16 rounding the unfused path adds (its weight
    gradients reach main_grad as bf16 .grads)."""
    fp8 = ("--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--bf16", "--use-distributed-optimizer",
           "--overlap-grad-reduce")
    fused = _losses(_launch(*fp8, port=29611))
    unfused = _losses(_launch(*fp8, "--no-gradient-accumulation-fusion", port=29613))
    assert len(fused) == 3 and all(abs(a - b) < 1e-4 * b for a, b in zip(fused, unfused))
    bf16_grads = _losses(_launch(*fp8, "--grad-reduce-in-bf16", port=29615))
    assert len(bf16_grads) == 3 and all(abs(a - b) < 1e-3 * b for a, b in zip(bf16_grads, unfused))


def test_te_cross_entropy_fusion_trains_as_the_native_one():
    """--cross-entropy-loss-fusion --cross-entropy-fusion-impl te (TE's parallel_cross_entropy, which Megatron
    finds through the patched extension) gives the losses of Megatron's native fused cross entropy, bit for bit:
    both take megatron-core's steps. Both run eager (TORCHDYNAMO_DISABLE), because the native steps are
    torch.compile'd (jit_fuser), and inductor's kernels round otherwise than eager ops by an amount that depends
    on the CPU (on an AVX-512 machine the third loss differed by 1.2e-5 of itself)."""
    flags = ("--cross-entropy-loss-fusion", "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--bf16")
    eager = {"TORCHDYNAMO_DISABLE": "1"}
    te = _losses(_launch(*flags, "--cross-entropy-fusion-impl", "te", port=29621, env_extra=eager))
    native = _losses(_launch(*flags, "--cross-entropy-fusion-impl", "native", port=29623, env_extra=eager))
    assert len(te) == 3 and te == native


def test_moe_shared_experts_and_moe_act_recompute_in_fp8():
    """A DeepSeek-style MoE: Megatron sets save_original_input on the shared experts' fc1 for non-delayed FP8 and
    on the experts' fc2 for --recompute-modules moe_act, whose output-discarding checkpoint runs under
    TransformerEngine's activation_recompute_forward. It trains, and the recompute changes no loss."""
    moe = ("--num-experts", "4", "--moe-shared-expert-intermediate-size", "64", "--moe-grouped-gemm",
           "--moe-router-topk", "2", "--disable-bias-linear", "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8",
           "--bf16")
    plain = _losses(_launch(*moe, port=29617))
    recompute = _losses(_launch(*moe, "--recompute-granularity", "selective", "--recompute-modules", "moe_act",
                                port=29619))
    assert len(plain) == 3 and recompute == plain


@pytest.mark.parametrize("layout", [("--pipeline-model-parallel-size", "2"), ("--use-distributed-optimizer",)],
                         ids=["pipeline-parallel", "data-parallel-distributed-optimizer"])
def test_pretrain_gpt_other_parallel_layouts(fp32_losses, layout):
    losses = _losses(_launch(*layout, "--fp8-format", "hif8", "--fp8-recipe", "delayed", nproc=2, port=29589))
    assert len(losses) == 3 and all(abs(a - b) < 0.05 * b for a, b in zip(losses, fp32_losses))


def test_pretrain_gpt_through_the_npu_kernels_matches_the_reference_backend():
    """The whole training run with torch_npu's kernels (the simulator checks every call against their
    contract) gives the reference backend's losses exactly (attention dropout off: the fused attention kernel
    draws its own dropout mask, which no other backend reproduces)."""
    flags = ("--fp8-format", "hif8", "--fp8-recipe", "blockwise", "--bf16", "--attention-dropout", "0")
    npu = _losses(_launch(*flags, port=29591, env_extra={"MINDSPEED_TE_BACKEND": "npu",
                                                           "MINDSPEED_TE_NPU_SIMULATOR": "1"}))
    reference = _losses(_launch(*flags, port=29593, env_extra={"MINDSPEED_TE_BACKEND": "reference"}))
    assert len(npu) == 3 and npu == reference


@pytest.mark.parametrize("recipe, optimizer, simulator, port", [
    ("blockwise", ("--use-distributed-optimizer",), "1", 29625),
    ("mxfp8", ("--moe-token-dispatcher-type", "alltoall", "--moe-router-fusion", "--moe-permute-fusion"),
     "Ascend950PR@26.1", 29629)],
    ids=["blockwise-distributed-optimizer", "mxfp8-alltoall-fused-router-and-permute"])
def test_moe_through_the_npu_kernels_matches_the_reference_backend(recipe, optimizer, simulator, port):
    """Grouped-GEMM experts on torch_npu's kernels (blockwise and MXFP8: fprop, dgrad and wgrad of all experts as
    one grouped GEMM each; the experts' weights, which GroupedLinear, and the distributed optimizer in reverse, lay
    out in one buffer, quantized in one pass; the fused router's top-k probs placed by the permute kernel's rows as
    they are) give the reference backend's losses exactly (attention dropout off, as above). The NPU's experts are
    not padded (MXFP8 with torch_npu 26.1's grouped MX quantize), the reference's are, as TE's."""
    flags = ("--hidden-size", "128", "--num-experts", "4", "--moe-grouped-gemm", "--moe-router-topk", "2",
             "--disable-bias-linear", *optimizer, "--fp8-format", "e4m3", "--fp8-recipe", recipe, "--bf16",
             "--attention-dropout", "0")
    npu = _losses(_launch(*flags, port=port, env_extra={"MINDSPEED_TE_BACKEND": "npu",
                                                         "MINDSPEED_TE_NPU_SIMULATOR": simulator}))
    reference = _losses(_launch(*flags, port=port + 2, env_extra={"MINDSPEED_TE_BACKEND": "reference"}))
    assert len(npu) == 3 and npu == reference


def test_pretrain_gpt_with_ascend_mc2_on_the_npu_kernels():
    """--use-ascend-mc2 with MXFP8 and sequence parallelism: the fused all-gather+matmul and
    matmul+reduce-scatter kernels (simulated over the gloo group) train like separate collectives."""
    flags = ("--hidden-size", "128", "--tensor-model-parallel-size", "2", "--sequence-parallel",
             "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--bf16")
    env = {"MINDSPEED_TE_BACKEND": "npu", "MINDSPEED_TE_NPU_SIMULATOR": "1"}
    fused = _losses(_launch(*flags, "--use-ascend-mc2", nproc=2, port=29595, env_extra=env))
    separate = _losses(_launch(*flags, nproc=2, port=29597, env_extra=env))
    assert len(fused) == 3 and all(abs(a - b) < 1e-3 * b for a, b in zip(fused, separate))


def test_fp8_with_the_local_implementation_is_refused():
    run = _launch("--transformer-impl", "local", "--fp8-format", "hif8")
    assert run.returncode != 0
    assert "--fp8-format hif8 needs --transformer-impl transformer_engine" in run.stderr + run.stdout


def test_checkpoint_resume_restores_fp8_scales(tmp_path):
    """Save at iteration 3 through Megatron's distributed checkpointing, resume: the first resumed step has
    the loss of the uninterrupted run, which needs the delayed-scaling history and scales back from the
    modules' _extra_state (starting them fresh changes that loss)."""
    six = ["--train-iters", "6", "--hidden-dropout", "0", "--attention-dropout", "0",  # later --train-iters wins
           "--fp8-format", "e4m3", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "4"]
    straight = _losses_of_6(_launch(*six, port=29583))
    _launch(*six, "--save", str(tmp_path), "--save-interval", "3", "--exit-interval", "3", port=29585)
    resumed = _losses_of_6(_launch(*six, "--load", str(tmp_path), port=29587))
    assert sorted(resumed) == [4, 5, 6]
    assert resumed[4] == straight[4]


def _losses_of_6(run: subprocess.CompletedProcess) -> dict[int, float]:
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    found = re.findall(r"iteration\s+(\d+)/\s*6 \|.*?lm loss: ([0-9.E+-]+)", run.stdout)
    return {int(i): float(x) for i, x in found}


def test_pretrain_gpt_step_recovery_retries_a_fault_on_one_rank():
    """--fp8-step-recovery: a NaN in one layer's output on rank 1 at iteration 2 makes both ranks skip that
    attempt and retry the batch; the losses are those of the run without the fault (dropout off, so the
    retry computes what the first attempt would have), and the warning names the layer by its model path."""
    flags = ("--fp8-format", "hif8", "--fp8-recipe", "tensorwise", "--fp8-step-recovery",
             "--no-check-for-nan-in-loss-and-grad", "--hidden-dropout", "0", "--attention-dropout", "0")
    reference = _losses(_launch(*flags, nproc=2, port=29591))
    faulty = _launch(*flags, nproc=2, port=29593, env_extra={"MINDSPEED_TE_TEST_FAULT": "1,1"},
                     launcher=(os.path.join(ROOT, "tests", "megatron_fault_launch.py"),))
    assert _losses(faulty) == reference and len(reference) == 3
    assert re.search(r"NaN/Inf entered quantized GEMMs at .*\bdecoder\.layers\.0\.self_attention\.linear_proj input",
                     faulty.stderr), faulty.stderr[-3000:]
    skipped = re.findall(r"number of skipped iterations:\s+(\d+)", faulty.stdout)
    assert len(skipped) == 3 and set(skipped) == {"0"}  # the retry succeeded: no iteration was given up
