"""Megatron-LM's own pretrain_gpt.py in FP4 on CPU: `--fp4-format e2m1 --fp4-recipe nvfp4|mxfp4` added to a launch
is all it takes; the FP4 quantizers run (and no FP8 one), losses stay finite and near the bf16 run's, and
--fp4-param-gather keeps the TE linears' weights as FP4 parameters."""
from __future__ import annotations

import math
import pathlib

import pytest

from tests.megatron_matrix import build_dataset_helpers, tree_release
from tests.test_fp8_param_megatron import PROBE, _probe
from tests.test_launch_megatron import MEGATRON, _launch, _losses, _losses_of_6
from tests.test_megatron_releases import TREES as RELEASE_TREES
from tests.test_megatron_releases import _launch as release_launch

pytestmark = pytest.mark.slow
needs_tree = pytest.mark.skipif(not MEGATRON, reason="needs MEGATRON_LM_PATH (Megatron-LM checkout)")

QUANTIZER = {"nvfp4": "NVFP4Quantizer", "mxfp4": "MXFP4Quantizer"}
MOE = ("--num-experts", "4", "--moe-grouped-gemm", "--moe-router-topk", "2", "--disable-bias-linear",
       "--moe-token-dispatcher-type", "alltoall")


@pytest.fixture(scope="module", autouse=True)
def dataset_helpers() -> None:
    if MEGATRON:
        build_dataset_helpers(pathlib.Path(MEGATRON))


@pytest.fixture(scope="module")
def bf16_losses() -> list[float]:
    return _losses(_launch("--bf16", port=29631))


def _check_trains_in(recipe: str, run, reference: list[float]) -> dict:
    """Losses finite and within 5% of the reference run's, and only the recipe's FP4 quantizer ran."""
    losses, probe = _losses(run), _probe(run)
    assert len(losses) == 3 == len(reference) and all(math.isfinite(x) for x in losses)
    assert all(abs(a - b) < 0.05 * b for a, b in zip(losses, reference)), (losses, reference)
    assert set(probe["quantized_by"]) == {QUANTIZER[recipe]}, probe["quantized_by"]
    return probe


@needs_tree
@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_pretrain_gpt_trains_in_fp4(bf16_losses, recipe):
    run = _launch("--bf16", "--fp4-format", "e2m1", "--fp4-recipe", recipe, port=29633, launcher=PROBE)
    probe = _check_trains_in(recipe, run, bf16_losses)
    assert _losses(run) != bf16_losses  # the FP4 GEMMs changed the numbers
    assert probe["quantized_params"] == 0  # weights stay bf16 without --fp4-param-gather
    # every TE linear's GEMMs (qkv, proj, fc1, fc2 of 2 layers): input and weight per forward at least
    assert probe["quantized_by"][QUANTIZER[recipe]] >= 3 * 8 * 2


@needs_tree
def test_pretrain_gpt_takes_the_mxfp4_stabiliser_flags(bf16_losses):
    """--mxfp4-random-hadamard-transform --mxfp4-stochastic-rounding on a launch: still MXFP4 only, near bf16, and
    other losses than plain MXFP4's."""
    plain = _losses(_launch("--bf16", "--fp4-format", "e2m1", "--fp4-recipe", "mxfp4", port=29741))
    run = _launch("--bf16", "--fp4-format", "e2m1", "--fp4-recipe", "mxfp4", "--mxfp4-random-hadamard-transform",
                  "--mxfp4-stochastic-rounding", port=29743, launcher=PROBE)
    _check_trains_in("mxfp4", run, bf16_losses)
    assert _losses(run) != plain


@needs_tree
@pytest.mark.parametrize("recipe,tensor", [("nvfp4", "NVFP4Tensor"), ("mxfp4", "MXFP4Tensor")])
def test_fp4_param_gather_keeps_the_weights_in_fp4(bf16_losses, recipe, tensor):
    run = _launch("--bf16", "--fp4-format", "e2m1", "--fp4-recipe", recipe, "--fp4-param-gather", port=29635,
                  launcher=PROBE)
    probe = _check_trains_in(recipe, run, bf16_losses)
    assert _losses(run) != bf16_losses
    assert probe["param_types"] == [tensor] and probe["quantized_params"] == 8  # qkv, proj, fc1, fc2 x 2 layers


@needs_tree
def test_moe_in_mxfp4_with_router_padding():
    """Grouped experts in MXFP4, the router padding each expert's tokens to the recipe's 32 rows
    (--moe-router-padding-for-quantization, Megatron's fp4_utils.get_fp4_align_size)."""
    run = _launch("--bf16", *MOE, "--fp4-format", "e2m1", "--fp4-recipe", "mxfp4",
                  "--moe-router-padding-for-quantization", port=29637, launcher=PROBE)
    reference = _losses(_launch("--bf16", *MOE, port=29639))
    _check_trains_in("mxfp4", run, reference)


@needs_tree
def test_fp4_param_gather_with_the_distributed_optimizer():
    """DP=2 with Megatron's distributed optimizer: the NVFP4 weights' codes sit in its uint8 parameter buffer (one
    per byte up to megatron-core 0.16, packed two per byte from 0.17), each rank casts its shard of the fp32 main
    weights (fp8_utils.quantize_param_shard; fp4_utils.quantize_nvfp4_param_shard from 0.17), and every step's
    parameter all-gather moves them as bytes. The losses are exactly those of the same NVFP4 run with bf16
    weights: the shard casts give the one cast of the whole bf16 weight that run makes at each forward."""
    flags = ("--bf16", "--use-distributed-optimizer", "--fp4-format", "e2m1", "--fp4-recipe", "nvfp4")
    reference = _losses(_launch(*flags, nproc=2, port=29641))
    run = _launch(*flags, "--fp4-param-gather", nproc=2, port=29643, launcher=PROBE)
    probe = _check_trains_in("nvfp4", run, reference)
    assert _losses(run) == reference
    assert probe["param_types"] == ["NVFP4Tensor"] and probe["quantized_params"] == 8
    bytes_per_element = 0.5 if tuple(map(int, tree_release(pathlib.Path(MEGATRON)).split(".")[:2])) >= (0, 17) else 1
    assert probe["codes_in_uint8_buffer"] and probe["code_bytes_per_element"] == [bytes_per_element]
    elements, _ = probe["gather"]["torch.uint8"]
    assert elements >= 3 * bytes_per_element * probe["quantized_elements"]


@needs_tree
def test_checkpoint_resume_with_fp4_parameters(tmp_path):
    """FP4 weights saved through Megatron's distributed checkpoint at iteration 3 and loaded again: the resumed
    losses are the uninterrupted run's (dropout off)."""
    six = ["--bf16", "--train-iters", "6", "--hidden-dropout", "0", "--attention-dropout", "0",
           "--fp4-format", "e2m1", "--fp4-recipe", "nvfp4", "--fp4-param-gather"]
    straight = _losses_of_6(_launch(*six, port=29645))
    _launch(*six, "--save", str(tmp_path), "--save-interval", "3", "--exit-interval", "3", port=29647)
    resumed = _losses_of_6(_launch(*six, "--load", str(tmp_path), port=29649))
    assert sorted(resumed) == [4, 5, 6]
    assert all(math.isfinite(resumed[i]) for i in (4, 5, 6))
    assert resumed[4] == straight[4]


@pytest.mark.skipif(not RELEASE_TREES, reason="needs MEGATRON_LM_TREES (Megatron-LM trees)")
@pytest.mark.parametrize("tree", RELEASE_TREES, ids=lambda tree: tree_release(tree))
def test_each_release_with_fp4_flags_trains_in_mxfp4(tree):
    """Every release that has --fp4-format (0.15 on), its own script and argument checks, TP2 + sequence
    parallelism: MXFP4 trains to finite losses near the uniform start (ln 256 = 5.55)."""
    if not (tree / "megatron" / "core" / "fp4_utils.py").exists():
        pytest.skip(f"megatron-core {tree_release(tree)} has no --fp4-format")
    losses = release_launch(tree, 29661 + 10 * RELEASE_TREES.index(tree), "--bf16", "--fp4-format", "e2m1",
                            "--fp4-recipe", "mxfp4")
    assert len(losses) == 3 and all(math.isfinite(x) and 4.5 < x < 6.0 for x in losses), losses
