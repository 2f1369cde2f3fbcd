"""Issue 30, deliverables 3 and 4: the GPT layer launch bench (mindspeed_te.bench.layer) and the NPU path's host
time with no-op kernels (mindspeed_te.bench.host)."""
import warnings

import pytest
import torch

from tests.dist_utils import run_distributed


def _layer_bench(rank: int, world: int) -> dict:
    """One recipe's split (tensorwise E4M3, dense, simulated 950PR) and the bench's rows for it and bf16."""
    warnings.filterwarnings("ignore")
    from mindspeed_te.bench import layer
    from mindspeed_te.bench.launches import npu_simulated

    with layer.megatron_world(), npu_simulated("Ascend950PR"):
        split, measured = layer.layer_split(layer.RECIPES["tensorwise E4M3"], moe=False)
    rows = layer.bench_layer_launches(kinds=("dense",), chips=("Ascend950PR",), recipes=("bf16", "tensorwise E4M3"))
    parts = {n: {k: getattr(m, k).total for k in ("zero", "first", "later", "optimizer", "end")}
             for n, m in measured.items()}
    return {"split": split, "parts": parts, "whole": {n: m.whole.total for n, m in measured.items()},
            "kernels": {n: m.later.npu_kernels for n, m in measured.items()}, "rows": rows}


@pytest.mark.slow
def test_layer_bench_split_adds_up_to_the_measured_step():
    """A training step's launches are its parts' (nothing runs between them uncounted), and the split per layer
    (micro-batch, step) and constant gives back the measured total of a 1-layer and a 2-layer block's step; the
    rows carry the split's ratio to the floor and the difference to bf16."""
    from mindspeed_te.bench.layer import MICRO_BATCHES, floor

    out = run_distributed(_layer_bench, 1)[0]
    split, parts, whole = out["split"], out["parts"], out["whole"]
    for layers in (1, 2):
        assert sum(parts[layers].values()) == whole[layers], parts[layers]
        assert split.total(layers) == whole[layers] == split.totals[layers]
        # the two micro-batches, the step's own work and the constant
        assert split.total(layers) == layers * (MICRO_BATCHES * split.micro_batch + split.step) + split.constant
        assert out["kernels"][layers] > 0  # the simulator's kernels were counted, as kernels
    assert split.micro_batch > 0 and split.step >= split.optimizer > 0 and split.constant >= 0
    assert parts[2]["first"] > parts[2]["later"]  # the weights' quantizes
    rows = {name: (value, detail) for name, value, detail in out["rows"]}
    fl = floor("tensorwise E4M3", "dense")
    value, detail = rows["NPU launches per GPT layer, dense, tensorwise E4M3, 950PR"]
    assert value == pytest.approx(split.per_layer / fl.per_layer)
    assert detail.startswith(f"micro-batch {split.micro_batch} / step {split.step} / constant {split.constant}")
    base = rows["NPU launches per GPT layer, dense, bf16, 950PR"]
    diff = rows["NPU launches per GPT layer FP8 - bf16, dense, tensorwise E4M3, 950PR"][0]
    assert diff == split.per_layer - round(base[0] * floor("bf16", "dense").per_layer)


def test_floor_table_jobs_each_take_a_launch_and_give_the_ratio():
    """Every job of the floor table (every kind and recipe) is done at least once and costs at least one launch,
    with a reason; the floor per layer is MICRO_BATCHES times its micro-batch jobs plus its step jobs; FP8 adds
    jobs to bf16's (the quantizes); AdamW is one launch per parameter."""
    from mindspeed_te.bench.layer import KINDS, MB, MICRO_BATCHES, RECIPES, STEP, floor, floor_jobs

    for kind in KINDS:
        base = floor("bf16", kind)
        for recipe in RECIPES:
            jobs = floor_jobs(recipe, kind)
            assert jobs and all(j.count >= 1 and j.launches >= 1 and j.reason for j in jobs), recipe
            assert {j.per for j in jobs} == {MB, STEP}
            fl = floor(recipe, kind)
            per_layer = sum(j.count * j.launches * (MICRO_BATCHES if j.per == MB else 1) for j in jobs)
            assert fl.per_layer == per_layer
            if recipe != "bf16":
                assert fl.micro_batch > base.micro_batch and fl.step > base.step, recipe
        # one update and one gradient accumulation per parameter
        counts = {j.name: j.total for j in floor_jobs("bf16", kind)}
        assert counts["AdamW"] == counts["gradient accumulation"] == {"dense": 12, "moe": 15}[kind]


_NOOP_CASES = [("Ascend950PR", "tensorwise E4M3"), ("Ascend950PR", "delayed HIF8"), ("Ascend950PR", "blockwise E4M3"),
               ("Ascend950PR", "blockwise HIF8"), ("Ascend950PR", "mxfp8 E4M3"), ("Ascend950DT", "mxfp8 E4M3")]


@pytest.mark.parametrize("chip, name", _NOOP_CASES)
def test_noop_kernels_return_the_real_kernels_shapes_and_dtypes(chip, name):
    """The no-op kernels return what the real simulated kernels return for the same input signature (shapes,
    strides, dtypes; checked on a second pass that runs both), and a third pass runs on no-ops alone."""
    from mindspeed_te.bench.host import NoOpKernels
    from mindspeed_te.bench.launches import launch_recipes, npu_simulated
    from mindspeed_te.bench.linear import _linear_case

    with npu_simulated(chip) as npu:
        step, x, w, _ = _linear_case(launch_recipes()[name], 128, 256, 128, torch.bfloat16)
        step()  # (a first step makes what later ones keep)
        with NoOpKernels(npu) as kernels:
            step()  # the real kernels (where a signature repeats, a no-op): their outputs' metadata cached
            real, noop = kernels.real_calls, kernels.calls
            kernels.verify = True
            step()  # real kernels again, each output checked against the cached metadata
            assert kernels.real_calls == 2 * real + noop and kernels.calls == noop
            kernels.verify = False
            x.grad = w.grad = None
            step()
            assert kernels.calls == 2 * noop + real and kernels.real_calls == 2 * real + noop  # all no-ops
            assert x.grad.shape == x.shape and w.grad.shape == w.shape
        assert "npu_quant_matmul" not in vars(npu)  # the class's kernels show through again


def test_noop_kernel_metadata_matches_a_direct_call():
    """The cached metadata is the kernel's: a tuple of outputs keeps its shapes, strides and dtypes."""
    from mindspeed_te.bench.host import NoOpKernels, metadata
    from mindspeed_te.testing.npu_sim import make_simulator

    sim = make_simulator("Ascend950DT")
    x = torch.randn(64, 128).bfloat16()
    real = sim.npu_dynamic_mx_quant_with_dual_axis(x, dst_type=torch.float8_e4m3fn)
    with NoOpKernels(sim) as kernels:
        sim.npu_dynamic_mx_quant_with_dual_axis(x, dst_type=torch.float8_e4m3fn)
        fake = sim.npu_dynamic_mx_quant_with_dual_axis(torch.empty_like(x), dst_type=torch.float8_e4m3fn)
        assert kernels.calls == 1
    assert metadata(fake) == metadata(real) and isinstance(fake, tuple)


def test_noop_host_time_runs_the_npu_path_on_no_ops():
    """The host-time case: the FP8 linear's kernel calls are no-ops after the first step, and both times are
    measured."""
    from mindspeed_te.bench.host import noop_host_time

    ours, base, calls = noop_host_time(3)
    assert ours > 0 and base > 0 and calls >= 6  # 3 quantizes and 3 GEMMs per forward + backward
