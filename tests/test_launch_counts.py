"""Device launches counted the way an NPU runs them: every aten op that is not a view or an allocation, plus
every torch_npu kernel (the simulator's own torch ops inside a kernel are not launches)."""
from collections import Counter

import pytest
import torch

from mindspeed_te.diagnostics import LaunchCounter
from mindspeed_te.testing.npu_sim import make_simulator


def test_counter_counts_compute_ops_not_views_or_allocations():
    x = torch.randn(4, 6)
    with LaunchCounter() as counter:
        y = x + 1  # one kernel
        y.view(-1), y.t(), y[1:], y.reshape(6, 4)  # views: no kernel
        torch.empty(3)  # allocation: no kernel
        y.abs().amax()  # two kernels
        y.t().reshape(24)  # a copy (clone), then _unsafe_view of it: one kernel
    assert counter.counts == {"aten.add": 1, "aten.abs": 1, "aten.amax": 1, "aten.clone": 1}
    assert counter.total == 4 and counter.npu_kernels == 0


def test_counter_counts_a_torch_npu_kernel_once_and_restores_the_module():
    sim = make_simulator()
    x = torch.randn(64, 128).bfloat16()
    with LaunchCounter(sim) as counter:
        sim.npu_dynamic_quant(x, dst_type=torch.float8_e4m3fn, quant_mode="pertensor")
    assert counter.counts == {"torch_npu.npu_dynamic_quant": 1}
    assert counter.npu_kernels == 1
    assert "npu_dynamic_quant" not in vars(sim)  # the class's kernel shows through again
    with LaunchCounter(sim) as counter:
        pass
    assert counter.total == 0


def test_counter_counts_multi_tensor_ops_as_torch_npu_launches_them():
    """A foreach op is one NPU launch per kernel call only on torch_npu's fast route (op-plugin's Foreach*.cpp
    and PyTorch's can_use_fast_route): one dtype and device, dense tensors, matching shapes; lists are split
    into calls of 24 (in-place add, maximum, norm), 16 (out-of-place add) or 48 (copy, zero) tensors; off the
    route, and for ops torch_npu has no kernel for, one launch per tensor; an out= form is PyTorch's generated
    one (the op, then a copy per output); a norm to another dtype casts every input first."""
    ones = [torch.ones(1) for _ in range(30)]

    def launches(op, *args, **kwargs) -> int:
        with LaunchCounter() as counter:
            op(*args, **kwargs)
        return counter.total

    assert launches(torch._foreach_add_, ones, ones, alpha=0.0) == 2  # 24 + 6
    assert launches(torch._foreach_add, ones, ones, alpha=0.0) == 2  # 16 + 14
    assert launches(torch._foreach_add_, ones[:3], [torch.ones(1, dtype=torch.float64)] * 3) == 3  # two dtypes
    assert launches(torch._foreach_maximum_, ones[:3], [torch.ones(2)[:1]] * 3) == 1  # 1-element views are dense
    history = torch.zeros(4, 6)
    columns = list(history.split(2, dim=1))  # [4, 2] column blocks: not dense
    assert launches(torch._foreach_copy_, columns, [torch.ones(4, 2)] * 3) == 3
    assert launches(torch._foreach_copy_, [torch.ones(2)] * 60, [torch.zeros(2)] * 60) == 2  # 48 + 12
    bytes_ = [torch.zeros(2, dtype=torch.uint8) for _ in range(3)]
    assert launches(torch._foreach_maximum_, bytes_, bytes_) == 3  # uint8: no fused maximum
    assert launches(torch._foreach_zero_, bytes_) == 3
    assert launches(torch._foreach_max, ones[:5]) == 5  # no torch_npu kernel
    halves = [torch.ones(4, dtype=torch.bfloat16) for _ in range(3)]
    assert launches(torch._foreach_norm, halves, float("inf")) == 1
    assert launches(torch._foreach_norm, halves, float("inf"), dtype=torch.float32) == 3 + 1  # casts, then the norm
    assert launches(torch._foreach_norm, halves, 3) == 3  # ord 3: not the fused kernel's
    out = list(torch.empty(3, dtype=torch.bfloat16).unbind(0))
    assert launches(torch.ops.aten._foreach_norm.Scalar_out, halves, float("inf"), None, out=out) == 1 + 3


def test_counter_counts_adam_multi_tensor_ops_as_torch_npu_launches_them():
    """The ops of torch's foreach Adam/AdamW (op-plugin's Foreach*.cpp): mul_/add_ by a Scalar and sqrt_ 48 tensors a
    call (out of place 24), lerp_ 24 (16), addcmul_ 16 (12), div_ by a Scalar[] 50 (24); addcdiv_ by a Scalar[]
    has no torch_npu kernel (its binding always takes the slow path): one per tensor. Integer tensors take the slow
    path of sqrt, addcmul and div; a scalar that changes the tensors' dtype takes it for every op."""
    def launches(op, *args) -> int:
        with LaunchCounter() as counter:
            op(*args)
        return counter.total

    t = [torch.ones(2, dtype=torch.bfloat16) for _ in range(60)]
    assert launches(torch._foreach_mul_, t, 0.5) == 2  # 48 + 12
    assert launches(torch._foreach_mul, t, 0.5) == 3  # 24 + 24 + 12
    assert launches(torch._foreach_add_, t, 1e-8) == 2
    assert launches(torch._foreach_sqrt, t) == 3
    assert launches(torch._foreach_sqrt_, t) == 2
    assert launches(torch._foreach_lerp_, t, t, 0.1) == 3  # 24 + 24 + 12
    assert launches(torch._foreach_addcmul_, t, t, t, 0.1) == 4  # 16 x 3 + 12
    assert launches(torch._foreach_addcmul, t[:24], t[:24], t[:24], 0.1) == 2  # 12 + 12
    assert launches(torch._foreach_div_, t, [2.0] * 60) == 2  # 50 + 10
    assert launches(torch._foreach_div, t, [2.0] * 60) == 3
    assert launches(torch._foreach_addcdiv_, t, t, t, [0.1] * 60) == 60
    ints = [torch.ones(2, dtype=torch.int32) for _ in range(3)]
    assert launches(torch._foreach_mul_, ints, 2) == 1 and launches(torch._foreach_div, ints, [2.0] * 3) == 3
    assert launches(torch._foreach_mul, ints, 0.5) == 3  # int32 * float is float: off the fast route


def test_foreach_adamw_step_is_its_fused_kernels_and_one_addcdiv_per_tensor():
    """torch's foreach AdamW (as Megatron builds it without TE or Apex, and as torch picks it on an NPU) over n
    bf16 parameters: 7 multi-tensor ops each one kernel call for up to 16 tensors (weight decay, lerp, mul,
    addcmul, sqrt, div, add), and the addcdiv by the per-tensor step sizes, one launch per tensor. Its step
    counters stay on the host (not capturable): the bench's counter leaves their ops out, as on an NPU."""
    from mindspeed_te.bench.layer import DeviceLaunchCounter

    for n in (12, 24):
        params = [torch.nn.Parameter(torch.randn(4, 4).bfloat16()) for _ in range(n)]
        optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)
        for p in params:
            p.grad = torch.randn(4, 4).bfloat16()
        optimizer.step()
        host = frozenset(s["step"].untyped_storage().data_ptr() for s in optimizer.state.values())
        with DeviceLaunchCounter(None, host) as counter:
            optimizer.step()
        chunks = {12: 0, 24: 1}[n]  # addcmul_ splits at 16 tensors
        assert counter.total == 7 + chunks + n, dict(counter.counts)
        assert counter.counts["aten._foreach_addcdiv_"] == n


def _simulated(chip: str = "1"):
    from mindspeed_te.bench.launches import npu_simulated

    return npu_simulated(chip)


def test_per_step_delayed_update_is_a_fixed_handful_of_launches():
    """Issue 9: one batched update per (recipe, group) key, not a loop of small ops per module, on the key's
    contiguous buffers (the states' tensors are views into them, so nothing is gathered or written back per
    state; a multi-tensor op over per-state tensors would be one NPU launch per 16 to 48 of them): fold
    NaN/Inf amaxes into the non-finite flags (1), the update itself (9: clean the newest amax, window max,
    fp8_max / amax, FLT_MAX clamp, seen mask, keep-or-new scale, roll, keep-or-rolled window, clear slot 0),
    one multi-tensor write of window and scale (1), 1/scale, rounded to bfloat16, and its float32 value (3)."""
    from mindspeed_te.bench.launches import update_launches
    from mindspeed_te.recipe import DelayedScaling

    with _simulated() as npu:
        totals = {layers: [c.total for c in update_launches(DelayedScaling(), layers, npu)] for layers in (2, 32)}
    assert totals[2] == totals[32] == [14, 14]


@pytest.mark.slow
def test_hif8_delayed_update_is_batched_too():
    """HIF8DelayedScaling: the same 14 launches at a scale-update step (its per-slot targets are the fp8_max
    of the one division), and at the steps between (amaxes keep accumulating) the flag fold and clearing
    NaN/Inf from the newest amaxes: 2, for 2 layers as for 32."""
    from mindspeed_te.bench.launches import HIF8_UPDATE_RECIPE, HIF8_UPDATE_STEPS, update_launches
    from mindspeed_te.recipe import HIF8DelayedScaling

    with _simulated() as npu:
        recipe = HIF8DelayedScaling(**HIF8_UPDATE_RECIPE)
        totals = {(layers, kind): [c.total for c in update_launches(recipe, layers, npu, steps=step)]
                  for layers in (2, 32) for kind, step in HIF8_UPDATE_STEPS.items()}
    for layers in (2, 32):
        assert totals[layers, "scale update"] == [14, 14]
        assert totals[layers, "accumulating"] == [2, 2]


@pytest.mark.parametrize("recipe_name", ["tensorwise", "blockwise", "mxfp8"])
def test_nonfinite_fold_is_a_fixed_handful_of_launches_per_step(recipe_name):
    """The non-finite flag updates every quantize of a step noted (forward and backward, all layers) are
    folded once, at the step's end, into the flags' shared buffer: per-tensor scales are one concatenation
    and one indexed add (tensorwise: 2); block scales are concatenated in their flags' order (MX: E8M0 bytes
    cast to their values, one op), each element given its flag's position by one repeat of the per-flag
    lengths, and added, times 0, by one indexed add (blockwise 3, MXFP8 4), for 2 layers as for 32."""
    from mindspeed_te.bench.launches import fold_launches
    from mindspeed_te.recipe import Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

    recipe = {"tensorwise": Float8CurrentScaling(), "blockwise": Float8BlockScaling(),
              "mxfp8": MXFP8BlockScaling()}[recipe_name]
    with _simulated() as npu:
        counts = {layers: dict(fold_launches(recipe, layers, npu).counts) for layers in (2, 32)}
    expected = {"aten.cat": 1, "aten.index_add_": 1}
    if recipe_name != "tensorwise":
        expected["aten.repeat_interleave"] = 1
    if recipe_name == "mxfp8":
        expected["aten._to_copy"] = 1
    assert counts[2] == counts[32] == expected


@pytest.mark.parametrize("recipe_name", ["delayed", "tensorwise"])
def test_nonfinite_check_is_a_fixed_handful_of_launches_and_no_host_read(recipe_name):
    """Issue 30: the non-finite check at a step's end (after the fold) copies every watched flag to the host
    without waiting: one concatenation, one copy, then one indexed fill per flag buffer clears them (delayed
    scaling: a key's forward and backward buffers, 4 launches; tensorwise: the shared flag buffer, 3), for 2
    layers as for 32; reading the copy later launches nothing. Before, the check took 8 and 7 (the
    concatenation, isfinite's 4 ops, logical_not, the fills) and waited for the device with one .tolist()."""
    from mindspeed_te import FP8GlobalStateManager, fp8_autocast
    from mindspeed_te.diagnostics import HostSyncCounter
    from mindspeed_te.modules import Linear
    from mindspeed_te.recipe import DelayedScaling, Float8CurrentScaling

    recipe = {"delayed": DelayedScaling(), "tensorwise": Float8CurrentScaling()}[recipe_name]
    counts = {}
    with _simulated() as npu:
        for layers in (2, 32):
            FP8GlobalStateManager.reset()
            model = torch.nn.Sequential(*(Linear(128, 128, params_dtype=torch.bfloat16) for _ in range(layers)))
            for _ in range(2):  # the second step's states live in their key's buffers (delayed scaling)
                with fp8_autocast(fp8_recipe=recipe):
                    out = model(torch.randn(128, 128, dtype=torch.bfloat16, requires_grad=True))
                out.backward(torch.ones_like(out))
            FP8GlobalStateManager.harvest_nonfinite()
            with fp8_autocast(fp8_recipe=recipe):
                model(torch.randn(128, 128, dtype=torch.bfloat16))
            FP8GlobalStateManager.fold_nonfinite()
            with LaunchCounter(npu) as check, HostSyncCounter(trap=True):
                FP8GlobalStateManager._start_nonfinite_check()
            with LaunchCounter(npu) as read:
                assert FP8GlobalStateManager.harvest_nonfinite() == []
            counts[layers] = dict(check.counts), read.total
    FP8GlobalStateManager.reset()
    fills = 2 if recipe_name == "delayed" else 1
    assert counts[2] == counts[32] == ({"aten.cat": 1, "aten.copy_": 1, "aten.index_fill_": fills}, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delayed_linear_launches(dtype):
    """Forward: the amaxes of input and weight (float32: one multi-tensor norm, then one max into their
    history slots; bfloat16: one norm each, since the NPU's multi-tensor norm to float32 would cast each
    input first, written straight into the slots, still clear since the update), one NaN mark of their
    decode scales, two npu_quantize, the GEMM with its bias (6; bfloat16 7). Backward: grad_output's norm
    into its slot, the NaN mark, npu_quantize, dgrad, wgrad, the bias gradient (6). bfloat16 inputs need no
    upcast: they are divided by the bfloat16-rounded 1/scale prepared at the update. A bfloat16 bias is cast
    to float32 for the GEMM: aclnnQuantMatmulV5's FP8 tables take a float32 bias only."""
    from mindspeed_te.bench.launches import linear_launches
    from mindspeed_te.recipe import DelayedScaling, Format

    bf16 = dtype == torch.bfloat16
    with _simulated() as npu:
        for fmt in (Format.E4M3, Format.HYBRID, Format.HIF8):
            forward, backward = linear_launches(DelayedScaling(fp8_format=fmt), dtype, npu)
            assert forward.total == 6 + bf16, dict(forward.counts)
            assert backward.total == 6, dict(backward.counts)
            assert forward.counts.get("aten._foreach_maximum_", 0) == (not bf16)
            assert "aten._foreach_maximum_" not in backward.counts
            assert forward.counts["torch_npu.npu_quantize"] == 2 and backward.counts["torch_npu.npu_quant_matmul"] == 2
            assert forward.counts.get("aten._to_copy", 0) == (dtype == torch.bfloat16)  # the bias only
            assert "aten._to_copy" not in backward.counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensorwise_linear_launches(dtype):
    """bfloat16: npu_dynamic_quant per tensor, the bias cast to float32 (the kernel's only bias dtype), the GEMM
    (4); backward quantize, dgrad, wgrad, bias gradient (4). float32, which npu_dynamic_quant does not take: one
    multi-tensor amax (forward: and a stack of the two), scale_inv from it in 3 ops (amax == 0, addcdiv,
    clamp), npu_quantize per tensor (8 forward, 8 backward). The non-finite flag updates are folded once per
    step (test_nonfinite_fold_...)."""
    from mindspeed_te.bench.launches import linear_launches
    from mindspeed_te.recipe import Float8CurrentScaling, Format

    bf16 = dtype == torch.bfloat16
    with _simulated() as npu:
        for fmt in (Format.E4M3, Format.HYBRID, Format.HIF8):
            forward, backward = linear_launches(Float8CurrentScaling(fp8_format=fmt), dtype, npu)
            assert forward.total == (4 if bf16 else 8), dict(forward.counts)
            assert backward.total == (4 if bf16 else 8), dict(backward.counts)
            assert "aten._foreach_maximum_" not in forward.counts and "aten._foreach_maximum_" not in backward.counts
            kernel = "torch_npu.npu_dynamic_quant" if bf16 else "torch_npu.npu_quantize"
            assert forward.counts[kernel] == 2 and backward.counts[kernel] == 1


def test_only_kernels_know_the_backends():
    """Issue 8: above kernels/, code talks to the backend contract (kernels/base.py) and asks capabilities;
    it never imports a concrete backend, calls torch_npu through `backend.npu` or tests a backend's name."""
    import pathlib
    import re

    import mindspeed_te

    root = pathlib.Path(mindspeed_te.__file__).parent
    forbidden = re.compile(r"kernels\.(npu|reference|torch_native|npu_sim)\b|backend\.npu\b|\.hcom\(|"
                           r"\.name\s*[!=]=\s*[\"'](npu|reference|torch)[\"']")
    offenders = [f"{path.relative_to(root)}:{n}" for path in root.rglob("*.py")
                 if "kernels" not in path.parts and "testing" not in path.parts
                 for n, line in enumerate(path.read_text().splitlines(), 1) if forbidden.search(line)]
    assert offenders == []


def _per_recipe_counts(recipe, dtype, chip: str = "1"):
    from mindspeed_te.bench.launches import linear_launches

    with _simulated(chip) as npu:
        return linear_launches(recipe, dtype, npu)


@pytest.mark.parametrize("fmt", ["E4M3", "HYBRID"])
def test_blockwise_power_2_linear_launches(fmt):
    """TE's default blockwise (power-of-2 scales) through npu_dynamic_mx_quant, scale_alg=1. A rowwise 1x128
    layout, bf16: the kernel (128-blocks) + its E8M0 bytes decoded to the float32 scales the [1, 128, 128] GEMM
    takes (2); float32 input: the kernel takes 32-blocks only, so + the max over each tile's four exponents +
    decode + one npu_quantize of the (m * k / 128, 128) view along axis 0 (4). A columnwise 1x128 layout,
    quantized along the tokens, keeps the kernel's E8M0 bytes, which only the wgrad GEMM reads: bf16 the kernel
    alone (1); float32 kernel + max of four (its tile bytes kept one per row, not in pairs) + decode + division
    + cast (5). The 128x128 weight: the kernel + one max over the tile's 128 rows (and, float32, their four
    32-blocks) + decode + div + cast (5). The non-finite flags: none (folded once per step). Forward: fprop GEMM
    ([1, 128, 128], no bias) + one add of the bias into the output dtype. Backward: dgrad GEMM; the 1x128 x 1x128
    wgrad in the MX mode, each operand's tile bytes repeated for its 32-blocks (1 each); the bias gradient's sum."""
    from mindspeed_te.recipe import Float8BlockScaling, Format

    recipe = Float8BlockScaling(fp8_format=Format[fmt])
    rowwise = {torch.bfloat16: 2, torch.float32: 4}
    columnwise = {torch.bfloat16: 1, torch.float32: 5}
    weight = {torch.bfloat16: 5, torch.float32: 5}
    for dtype in (torch.bfloat16, torch.float32):
        forward, backward = _per_recipe_counts(recipe, dtype)
        assert forward.total == rowwise[dtype] + columnwise[dtype] + weight[dtype] + 1 + 1, dict(forward.counts)
        assert backward.total == rowwise[dtype] + columnwise[dtype] + 1 + 2 + 1 + 1, dict(backward.counts)
        assert forward.counts["torch_npu.npu_dynamic_mx_quant"] == 3
        assert backward.counts["torch_npu.npu_quant_matmul"] == 2 and "aten.mm" not in backward.counts
        assert "aten.bitwise_right_shift" not in backward.counts  # the wgrad takes the kernel's bytes


def test_blockwise_hif8_linear_launches():
    """HiF8's default blockwise rule is the block kernel's (scale_inv = amax / target): each layout is one
    npu_dynamic_block_quant, bf16 and float32 alike (the non-finite flags are folded once per step, outside
    these counts). Forward: input rowwise and columnwise, weight 128x128 (3), fprop GEMM ([1, 128, 128], no
    bias), bias add. Backward: the gradient's two layouts, dgrad GEMM, the 1x128 x 1x128 HiF8 wgrad
    (dequantized: 2 npu_dtype_cast, 2 broadcast multiplies, one matmul: 5, + the cast of a bf16 result), the
    bias gradient's sum."""
    from mindspeed_te.recipe import Float8BlockScaling, Format

    for dtype in (torch.bfloat16, torch.float32):
        bf16 = dtype == torch.bfloat16
        forward, backward = _per_recipe_counts(Float8BlockScaling(fp8_format=Format.HIF8), dtype)
        assert forward.total == 3 + 1 + 1, dict(forward.counts)
        assert backward.total == 2 + 1 + 5 + bf16 + 1, dict(backward.counts)
        assert forward.counts["torch_npu.npu_dynamic_block_quant"] == 3
        assert backward.counts["torch_npu.npu_dynamic_block_quant"] == 2


def test_blockwise_power_2_hif8_linear_launches():
    """HiF8 with power-of-2 tiles asked for (not its default), which no kernel makes. All layouts of a pass share the
    small ops: one vector norm per layout writes its tile amaxes into one buffer; the scales of the whole buffer
    in 7 ops (NaN/Inf to the target, 0 to the target, target / amax, FLT_MAX clamp, power-of-2 floor,
    reciprocal, NaN mark) + one cast of the divisors for a bf16 input; one npu_quantize per layout with a tile
    per row, + 1 for the columnwise layout's transposed copy and for the 128x128 weight's divisors repeated per
    row (the non-finite flags are folded once per step, outside these counts). Forward: input rowwise and
    columnwise, weight (3 layouts), fprop GEMM, bias add. Backward: the gradient's two layouts, dgrad GEMM, the
    1x128 x 1x128 HiF8 wgrad (no npu_quant_matmul mode takes it: each operand decoded by one npu_dtype_cast and
    multiplied by its tile scales broadcast, one matmul: 5, + the cast of a bf16 result), the bias gradient's
    sum."""
    from mindspeed_te.recipe import Float8BlockScaling, Format, QParams

    pow2 = QParams(power_2_scale=True)
    recipe = Float8BlockScaling(fp8_format=Format.HIF8, fp8_quant_fwd_inp=pow2, fp8_quant_fwd_weight=pow2,
                                fp8_quant_bwd_grad=pow2)
    for dtype in (torch.bfloat16, torch.float32):
        bf16 = dtype == torch.bfloat16
        forward, backward = _per_recipe_counts(recipe, dtype)
        scales = 7 + bf16
        assert forward.total == 3 + scales + 3 + 1 + 1 + 1 + 1, dict(forward.counts)
        assert backward.total == 2 + scales + 2 + 1 + 1 + 5 + bf16 + 1, dict(backward.counts)
        assert backward.counts["torch_npu.npu_dtype_cast"] == 2 and "aten.gather" not in backward.counts
        assert forward.counts["torch_npu.npu_quantize"] == 3 and backward.counts["torch_npu.npu_quantize"] == 2
        assert forward.counts["aten.linalg_vector_norm"] == 3 and forward.counts["aten.div"] == 1


@pytest.mark.parametrize("chip", ["Ascend950PR", "Ascend950DT"])
def test_mxfp8_linear_launches(chip):
    """MXFP8: two layouts per quantizer; with a bf16 input one npu_dynamic_mx_quant_with_dual_axis on both chips
    (aclnnDynamicMxQuantWithDualAxis: "Ascend 950PR/Ascend 950DT：支持"; 950PR before: 6 / 5), whose columnwise
    scales the GEMM takes in the kernel's layout (no copy); a float32 input (not the kernel's) one
    npu_dynamic_mx_quant per layout. The non-finite flags: none (folded once per step). The GEMM with its float32
    bias inside (a bf16 bias is cast: the MX mode takes float32 only). Backward: the gradient's two layouts,
    dgrad, wgrad, the bias gradient."""
    from mindspeed_te.recipe import MXFP8BlockScaling

    for dtype in (torch.bfloat16, torch.float32):
        forward, backward = _per_recipe_counts(MXFP8BlockScaling(), dtype, chip)
        dual = dtype == torch.bfloat16
        quantizes = 2 if dual else 4
        assert forward.total == quantizes + 1 + (dtype == torch.bfloat16), dict(forward.counts)
        assert backward.total == quantizes // 2 + 2 + 1, dict(backward.counts)
        assert forward.counts["torch_npu.npu_dynamic_mx_quant_with_dual_axis"] == 2 * dual
        assert backward.counts["torch_npu.npu_dynamic_mx_quant_with_dual_axis"] == dual
        assert forward.counts["torch_npu.npu_dynamic_mx_quant"] == 4 * (not dual)
        assert "aten.clone" not in forward.counts and "aten.clone" not in backward.counts


@pytest.mark.parametrize("recipe_name", ["delayed", "tensorwise", "mxfp8"])
def test_later_microbatch_reuses_the_weight_and_the_gemm_bias(recipe_name):
    """is_first_microbatch=False (TE's micro-batch cache): the weight's quantized form and the bias in the
    GEMM's float32 form are kept from the step's first micro-batch, so a later bf16 forward quantizes only the
    input and casts nothing -- delayed: amax, history max, NaN mark, npu_quantize, GEMM (5; in a region of its
    own, as Megatron runs each micro-batch, the amax goes straight into its slot, cleared at the last
    region's update: 4); tensorwise: npu_dynamic_quant, GEMM (2); MXFP8: both layouts in one dual-axis call,
    GEMM (2; 3 before the 950PR took the dual-axis kernel) -- and gives
    the same output as quantizing and casting again."""
    from mindspeed_te import Linear, fp8_autocast
    from mindspeed_te.bench.launches import microbatch_launches
    from mindspeed_te.diagnostics import LaunchCounter
    from mindspeed_te.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling

    recipe = {"delayed": DelayedScaling(), "tensorwise": Float8CurrentScaling(),
              "mxfp8": MXFP8BlockScaling()}[recipe_name]
    layer = Linear(256, 256, bias=True, params_dtype=torch.bfloat16)
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(128, 256, dtype=torch.bfloat16)
    with _simulated() as npu, fp8_autocast(fp8_recipe=recipe):
        layer(x, is_first_microbatch=True)
        with LaunchCounter(npu) as counter:
            cached = layer(x, is_first_microbatch=False)
        fresh = layer(x, is_first_microbatch=None)
    assert counter.total == {"delayed": 5, "tensorwise": 2, "mxfp8": 2}[recipe_name], dict(counter.counts)
    assert "aten._to_copy" not in counter.counts
    assert torch.equal(cached, fresh)
    with _simulated() as npu:
        own_region = microbatch_launches(recipe, torch.bfloat16, npu)
    assert own_region.total == {"delayed": 4, "tensorwise": 2, "mxfp8": 2}[recipe_name], dict(own_region.counts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_linear_quantizes_all_experts_with_one_set_of_small_ops(dtype):
    """A GroupedLinear forward quantizes every expert's input and weight in one batch: the amaxes (one
    multi-tensor norm; bfloat16 then one stack), one history max, one non-finite mark, the
    experts' inputs (row blocks of one tensor) in one npu_quantize with a divisor per row, and so their weights
    (row blocks of the buffer the module lays them out in): the same launches whatever the number of experts
    (delayed scaling). The grouped GEMM reads the input and weight codes where they lie and writes the output
    rows in place: no concatenation or stack of codes or outputs. The backward quantizes every expert's
    grad_output in one npu_quantize too."""
    from mindspeed_te import GroupedLinear, fp8_autocast
    from mindspeed_te.recipe import DelayedScaling

    def counts(experts: int) -> tuple[Counter, Counter]:
        layer = GroupedLinear(experts, 128, 128, bias=False, params_dtype=dtype)
        x = torch.randn(experts * 32, 128, dtype=dtype, requires_grad=True)
        for _ in range(2):  # the second step, with real scales
            with fp8_autocast(fp8_recipe=DelayedScaling()), LaunchCounter(npu) as forward:
                y = layer(x, [32] * experts)
            layer.zero_grad(set_to_none=True)  # accumulating into .grad is not the layer's work
            x.grad = None
            with LaunchCounter(npu) as backward:
                y.backward(torch.ones_like(y))
        return forward.counts, backward.counts

    with _simulated() as npu:
        (few, few_back), (many, many_back) = counts(4), counts(8)
    assert many == few and many["torch_npu.npu_quantize"] == 2, (few, many)
    # bfloat16: the norms stacked and max-ed into the slots (side by side) by one maximum, which promotes them
    maximum = "aten.maximum" if dtype == torch.bfloat16 else "aten._foreach_maximum_"
    assert many["aten._foreach_norm"] == many[maximum] == 1, many
    # the non-finite marks: one add of the stacked bfloat16 amaxes to the state's scale_inv slots (side by side:
    # every input's, then every weight's), so the marked scales are one vector; float32 amaxes come apart, so
    # one multi-tensor add, whose scales the inputs' and the weights' joins then concatenate once each
    bf16 = dtype == torch.bfloat16
    assert (many["aten.add"], many["aten._foreach_add"]) == ((1, 0) if bf16 else (0, 1)), many
    # the inputs' and the weights' per-row divisors (+ float32: the scales' joins); the GEMM takes x's scales one
    # per group, where they lie
    assert many["aten.cat"] == (2 if bf16 else 4) and many["aten.stack"] == bf16, many
    assert many_back["torch_npu.npu_quantize"] == 1 and many_back - few_back == {}, (few_back, many_back)


@pytest.mark.parametrize("chip, name", [("Ascend950PR", "blockwise E4M3"), ("Ascend950PR", "mxfp8 E4M3"),
                                        ("Ascend950DT", "mxfp8 E4M3"), ("Ascend950PR", "blockwise HIF8")])
def test_block_scaled_experts_launch_a_fixed_few_kernels_each(chip, name):
    """Block-scaled experts of 32 tokens each (one 32-block along the wgrad's k): the rowwise forms of all the
    experts' inputs, and of their grad_outputs, come from one quantize of the joined rows, and so do those of
    the weights, which the module lays out as row blocks of one buffer (128x128 tiles: the only form). MXFP8's
    dual-axis kernel makes both forms in one call where every block but the last is whole 64-row pairs of its
    columnwise scales (the weights here); otherwise each block's columnwise form is a call of its own (32 tokens
    each here). What each expert adds is its
    columnwise quantizes alone, with no dequantize + matmul fallback (the fprop and the dgrad of all experts are
    one npu_grouped_matmul each, its MX or G-B mode, whose stacked weights are a view of the joined codes where the
    experts' weights have one form for both; the wgrad too, its K-split MX mode, whose scales a few ops per
    operand lay out as that mode reads them: power-of-2 1x128 tiles as four 32-blocks each). Backward per expert:
    the grad_output's columnwise quantize. HiF8 tiles, which no wgrad mode takes, are decoded (one npu_dtype_cast
    each) and scaled (one multiply each: an expert's 32 tokens are one tile cut short) for one matmul, cast to
    the gradient's dtype."""
    from mindspeed_te.bench.launches import grouped_launches, launch_recipes, npu_simulated

    with npu_simulated(chip) as npu:
        few, many = (grouped_launches(launch_recipes()[name], torch.bfloat16, npu, experts=e) for e in (4, 8))
    per_expert = []
    for a, b in zip(few, many):
        added = b.counts - a.counts
        assert not a.counts - b.counts and all(n % 4 == 0 for n in added.values()), (a.counts, b.counts)
        per_expert.append({key: n // 4 for key, n in added.items()})
    forward, backward = per_expert
    hif8 = name.endswith("HIF8")
    assert ("aten.mm" in backward) == hif8, backward
    assert "torch_npu.npu_quant_matmul" not in forward
    assert "torch_npu.npu_quant_matmul" not in backward, backward
    want = {("Ascend950PR", "blockwise E4M3"): ({"torch_npu.npu_dynamic_mx_quant": 1}, 1),
            ("Ascend950PR", "mxfp8 E4M3"): ({"torch_npu.npu_dynamic_mx_quant": 1}, 1),
            ("Ascend950DT", "mxfp8 E4M3"): ({"torch_npu.npu_dynamic_mx_quant": 1}, 1),
            ("Ascend950PR", "blockwise HIF8"): ({"torch_npu.npu_dynamic_block_quant": 1}, 7)}[(chip, name)]
    assert forward == want[0], forward
    assert sum(backward.values()) == want[1], backward


@pytest.mark.parametrize("chip, name, kernel", [
    ("Ascend950PR", "mxfp8 E4M3", "npu_dynamic_mx_quant"), ("Ascend950DT", "mxfp8 E4M3", "npu_dynamic_mx_quant"),
    ("Ascend950PR", "blockwise E4M3", "npu_dynamic_mx_quant"),
    ("Ascend950PR", "blockwise HIF8", "npu_dynamic_block_quant"),
    ("Ascend950PR", "tensorwise E4M3", "npu_dynamic_quant")])
@pytest.mark.parametrize("grouped", [False, True], ids=["Linear", "GroupedLinear"])
def test_save_original_input_adds_only_the_inputs_quantize_to_backward(chip, name, kernel, grouped):
    """With `save_original_input` (Megatron sets it on shared experts and recomputed layers) the backward quantizes
    the saved input again, columnwise only: one kernel call more than without it, and nothing else. In
    particular the non-finite note reads the columnwise scales as the kernel made them (MX pairs, power-of-2
    E8M0 bytes), without decoding them. Experts of 64 tokens: their MX columnwise forms in one call."""
    from mindspeed_te.bench.launches import _second_layer_launches, launch_recipes, npu_simulated
    from mindspeed_te.modules import GroupedLinear, Linear

    backward = {}
    with npu_simulated(chip) as npu:
        for save in (False, True):
            if grouped:
                layer = GroupedLinear(4, 256, 256, bias=False, params_dtype=torch.bfloat16, save_original_input=save)
                args = (256, npu, [64] * 4)
            else:
                layer = Linear(256, 256, bias=True, params_dtype=torch.bfloat16, save_original_input=save)
                args = (128, npu)
            backward[save] = _second_layer_launches(launch_recipes()[name], layer, *args)[1].counts
    # per expert for grouped 1x128 tiles and per-tensor scales (each expert's own); per-tensor experts' codes and
    # scales then joined (two concatenations, which the wgrad would make otherwise: without save_original_input
    # the forward joined them)
    want = {f"torch_npu.{kernel}": 4 if grouped and not name.startswith("mxfp8") else 1}
    if grouped and name.startswith("tensorwise"):
        want["aten.cat"] = 2
    assert backward[True] - backward[False] == want and not backward[False] - backward[True], backward


# The weight-gradient kernels of op-plugin 26.0.0 and later (npu_sim.fused_wgrad), in the backend's simulator
@pytest.mark.parametrize("chip", ["Ascend950PR", "Ascend950DT"])
def test_mx_experts_add_no_launch_with_the_grouped_quantize(chip):
    """With npu_grouped_dynamic_mx_quant in torch_npu no MXFP8 expert adds a launch (GroupedLinear(e, 256, 256),
    32 tokens each, 4 or 8 experts: the same counts). Forward: the inputs' rowwise form (one
    npu_dynamic_mx_quant of the joined rows), their columnwise forms (one grouped quantize, in the K-split
    GEMM's scale layout), the weights' two forms (row blocks of one buffer, 256 rows each: one dual-axis call
    on both chips), the fprop npu_grouped_matmul (writing bfloat16 itself). Backward: the grad_outputs' rowwise
    form (one quantize of the joined rows), their columnwise forms (one grouped quantize), the dgrad and the wgrad
    npu_grouped_matmul (the K-split MX mode, reading both operands' codes and scales as the grouped quantizes laid
    them out: no concatenation). Before:
    one columnwise quantize per expert forward and backward, and one npu_quant_matmul per expert's wgrad
    (8 experts: 13 / 18 on the 950PR, 13 / 19 on the 950DT, before either took the dual-axis kernel)."""
    from mindspeed_te.bench.launches import grouped_launches, launch_recipes, npu_simulated

    with npu_simulated(chip, release="26.1") as npu:
        few, many = (grouped_launches(launch_recipes()["mxfp8 E4M3"], torch.bfloat16, npu, experts=e) for e in (4, 8))
    assert few[0].counts == many[0].counts and few[1].counts == many[1].counts, (few, many)
    weights = {"torch_npu.npu_dynamic_mx_quant_with_dual_axis": 1}
    want_forward = Counter({"torch_npu.npu_dynamic_mx_quant": 1, "torch_npu.npu_grouped_dynamic_mx_quant": 1,
                            "torch_npu.npu_grouped_matmul": 1}) + Counter(weights)
    assert many[0].counts == want_forward
    assert many[1].counts == {"torch_npu.npu_dynamic_mx_quant": 1, "torch_npu.npu_grouped_dynamic_mx_quant": 1,
                              "torch_npu.npu_grouped_matmul": 2}


def _accumulating_experts(experts, layout):
    """GroupedLinear(experts, 256, 256) in bfloat16 with fuse_wgrad_accumulation into float32 main_grads: each its
    own ("apart"), or slices of one buffer in expert order ("in order") or in reverse (Megatron's grad buffer)."""
    from mindspeed_te.modules import GroupedLinear

    layer = GroupedLinear(experts, 256, 256, bias=False, params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True)
    buffer = torch.zeros(experts, 256, 256)
    for i, w in enumerate(layer.weights):
        w.main_grad = {"apart": torch.zeros(256, 256), "in order": buffer[i], "reverse": buffer[-1 - i]}[layout]
    return layer


def _accumulating_launches(name, npu, experts=None, layout="apart"):
    """Backward launches of Linear(256, 256) (experts None) or `_accumulating_experts` (32 tokens each) with
    fuse_wgrad_accumulation into float32 main_grads."""
    from mindspeed_te.bench.launches import _second_layer_launches, launch_recipes
    from mindspeed_te.modules import Linear

    if experts is None:
        layer = Linear(256, 256, bias=True, params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True)
        layer.weight.main_grad = torch.zeros(256, 256)
        return _second_layer_launches(launch_recipes()[name], layer, 128, npu)[1]
    layer = _accumulating_experts(experts, layout)
    return _second_layer_launches(launch_recipes()[name], layer, 32 * experts, npu, [32] * experts)[1]


def test_mx_wgrad_accumulation_into_main_grad_is_the_gemm():
    """--gradient-accumulation-fusion: with npu_add_quant_matmul_ in torch_npu an MXFP8 Linear's wgrad is added
    into the float32 main_grad by the GEMM itself: backward 5 -> 4 launches (grad_output's two forms in one
    dual-axis call, the dgrad, the fused wgrad, the bias gradient's sum), in place of npu_quant_matmul + add_.
    Other recipes keep the add."""
    from mindspeed_te.bench.launches import npu_simulated

    with npu_simulated() as npu:
        before = {name: _accumulating_launches(name, npu).counts for name in ("mxfp8 E4M3", "delayed HIF8")}
    with npu_simulated(release="26.1") as npu:
        after = {name: _accumulating_launches(name, npu).counts for name in ("mxfp8 E4M3", "delayed HIF8")}
    dual = "torch_npu.npu_dynamic_mx_quant_with_dual_axis"
    assert before["mxfp8 E4M3"] == {dual: 1, "torch_npu.npu_quant_matmul": 2, "aten.add_": 1, "aten.sum": 1}
    assert after["mxfp8 E4M3"] == {dual: 1, "torch_npu.npu_quant_matmul": 1, "torch_npu.npu_add_quant_matmul_": 1,
                                   "aten.sum": 1}
    assert after["delayed HIF8"] == before["delayed HIF8"] and before["delayed HIF8"]["aten.add_"] == 1


def test_blockwise_wgrad_accumulation_into_main_grad_is_the_gemm():
    """--gradient-accumulation-fusion under power-of-2 blockwise: the 1x128 x 1x128 wgrad runs in the MX mode on
    tokens-major codes, so with torch_npu 26.1's kernels a Linear's wgrad is npu_add_quant_matmul_ (the
    npu_quant_matmul + add_ of 2.14 in one), and the experts' (main_grads in expert order) one npu_add_quant_gmm_
    for all of them: no GEMM per expert, and each expert more adds only its grad_output's columnwise quantize."""
    from mindspeed_te.bench.launches import npu_simulated

    name = "blockwise E4M3"
    with npu_simulated() as npu:
        before = _accumulating_launches(name, npu).counts
    with npu_simulated(release="26.1") as npu:
        after = _accumulating_launches(name, npu).counts
        experts = [_accumulating_launches(name, npu, e, "in order").counts for e in (4, 8)]
    assert before["torch_npu.npu_quant_matmul"] == 2 and before["aten.add_"] == 1
    assert after["torch_npu.npu_quant_matmul"] == 1 and after["torch_npu.npu_add_quant_matmul_"] == 1
    assert "aten.add_" not in after and after.total() == before.total() - 1
    for counts in experts:
        assert counts["torch_npu.npu_add_quant_gmm_"] == 1 and "torch_npu.npu_quant_matmul" not in counts, counts
    assert experts[1] - experts[0] == {"torch_npu.npu_dynamic_mx_quant": 4}, (experts[0], experts[1])


@pytest.mark.parametrize("name", ["delayed E4M3", "mxfp8 E4M3"])
def test_experts_wgrad_accumulation_is_one_launch_for_all(name):
    """The experts' wgrads (one grouped GEMM, float32) are added into their float32 main_grads by one
    multi-tensor add (torch_npu's fused _foreach_add_, 24 tensors a call) in place of one add per expert: 8
    experts' backward, delayed 21 -> 9 (its dgrad reads the grad_outputs' scales one per group, its amaxes
    stacked meet the history in one maximum), MXFP8 (950PR,
    its wgrad also one grouped GEMM now) 26 -> 16, whether the main_grads lie apart or in Megatron's grad buffer
    (the last expert's first). With npu_grouped_dynamic_mx_quant and npu_add_quant_gmm_ in torch_npu the MXFP8
    experts' backward is 5 launches, 4 where the main_grads are slices of one buffer in expert order (the GEMM
    adds into them)."""
    from mindspeed_te.bench.launches import npu_simulated

    with npu_simulated() as npu:
        counts = {(layout, e): _accumulating_launches(name, npu, e, layout).counts
                  for layout in ("apart", "reverse") for e in (4, 8)}
    for layout in ("apart", "reverse"):
        added = counts[(layout, 8)] - counts[(layout, 4)]
        assert added == ({} if name.startswith("delayed") else {"torch_npu.npu_dynamic_mx_quant": 4}), added
        assert counts[(layout, 8)]["aten._foreach_add_"] == 1 and "aten.add_" not in counts[(layout, 8)]
    assert sum(counts[("apart", 8)].values()) == (9 if name.startswith("delayed") else 16)
    assert counts[("reverse", 8)] == counts[("apart", 8)]
    if name.startswith("mxfp8"):
        with npu_simulated(release="26.1") as npu:
            apart, in_order = (_accumulating_launches(name, npu, 8, layout) for layout in ("apart", "in order"))
        assert apart.total == 5 and in_order.total == 4
        assert in_order.counts["torch_npu.npu_add_quant_gmm_"] == 1 and "aten._foreach_add_" not in in_order.counts


def _bf16_experts_accumulating(npu, experts, layout):
    """Backward launches of `_accumulating_experts` outside FP8, 32 tokens each (the second step's; the input needs
    no gradient, so the wgrad is all its GEMM work)."""
    layer = _accumulating_experts(experts, layout)
    x = torch.randn(32 * experts, 256, dtype=torch.bfloat16)
    for _ in range(2):
        y = layer(x, [32] * experts)
        dy = torch.ones_like(y)
        with LaunchCounter(npu) as backward:
            y.backward(dy)
    return backward


def test_bf16_experts_wgrad_accumulation_does_not_grow_with_the_experts():
    """bfloat16 experts' wgrads into float32 main_grads (--gradient-accumulation-fusion without FP8). torch_npu
    26.1 on the 950: one npu_grouped_matmul_add_ (y_i += dY_iᵀ X_i), in place where the main_grads lie in expert
    order, else into zeros and one multi-tensor add (Megatron's reverse order). 2.14, whose binding calls a kernel
    the 950 lacks: the joined rows cast once, a float32 GEMM per expert, one multi-tensor add. Before: two casts,
    a GEMM and an add per expert (8 experts: 32)."""
    from mindspeed_te.bench.launches import npu_simulated

    with npu_simulated(release="26.1") as npu:
        newer = {(layout, e): _bf16_experts_accumulating(npu, e, layout).counts
                 for layout in ("in order", "reverse") for e in (4, 8)}
    with npu_simulated() as npu:
        older = {e: _bf16_experts_accumulating(npu, e, "reverse").counts for e in (4, 8)}
    for e in (4, 8):
        assert newer[("in order", e)] == {"torch_npu.npu_grouped_matmul_add_": 1}
        assert newer[("reverse", e)] == {"aten.zeros": 1, "torch_npu.npu_grouped_matmul_add_": 1,
                                         "aten._foreach_add_": 1}
        assert older[e] == {"aten._to_copy": 2, "aten.mm": e, "aten._foreach_add_": 1}


def test_bf16_linear_wgrad_accumulation_is_the_grouped_kernel_with_one_group():
    """A bfloat16 Linear's wgrad into a float32 main_grad (--gradient-accumulation-fusion without FP8, or
    --no-fp8-wgrad) goes through the backend's GEMM. With torch_npu 26.1 on the 950 (and on Atlas A2/A3 with any
    release) it is npu_grouped_matmul_add_ with one group: the backward is the dgrad, it and the bias gradient's
    sum (before: two casts and an addmm for the wgrad, 5 in all). torch_npu 2.14 on the 950 takes the reference's
    float32 GEMM and its add (6: the product added once, as the grouped and quantized GEMMs add theirs)."""
    from mindspeed_te.bench.launches import npu_simulated
    from mindspeed_te.modules import Linear

    def backward_launches(npu):
        layer = Linear(256, 256, bias=True, params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True)
        layer.weight.main_grad = torch.zeros(256, 256)
        x = torch.randn(128, 256, dtype=torch.bfloat16, requires_grad=True)
        y = layer(x)
        dy = torch.ones_like(y)
        with LaunchCounter(npu) as backward:
            y.backward(dy)
        return backward.counts

    with npu_simulated(release="26.1") as npu:
        assert backward_launches(npu) == {"aten.mm": 1, "torch_npu.npu_grouped_matmul_add_": 1, "aten.sum": 1}
    with npu_simulated() as npu:
        assert backward_launches(npu) == {"aten.mm": 2, "aten._to_copy": 2, "aten._foreach_add_": 1, "aten.sum": 1}


# What a LayerNormLinear adds to a Linear on the norm's output, forward and backward: the norm's kernel on the bf16
# activation and parameters as they are (no casts of x, y or the parameters), and its one backward kernel
# (torch_npu's autograd: npu_rms_norm_backward for RMSNorm, whose float32 dgamma autograd then casts to the
# parameter's dtype; LayerNorm's backward returns its gradients in the parameters' dtype).
NORM_LAUNCHES = {
    "RMSNorm": ({"torch_npu.npu_rms_norm": 1},
                {"torch_npu.npu_rms_norm_backward": 1, "aten._to_copy": 1}),
    "LayerNorm": ({"aten.native_layer_norm": 1}, {"aten.native_layer_norm_backward": 1}),
}


@pytest.mark.parametrize("normalization", NORM_LAUNCHES)
@pytest.mark.parametrize("name", ["delayed HIF8", "tensorwise E4M3", "blockwise E4M3", "mxfp8 E4M3"])
def test_layernorm_linear_adds_the_norms_kernel_each_way(name, normalization):
    """A LayerNormLinear launches what a Linear on the norm's output does plus `NORM_LAUNCHES`, whichever the
    norm."""
    from mindspeed_te.bench.launches import launch_recipes, linear_launches, norm_linear_launches

    recipe = launch_recipes()[name]
    with _simulated("Ascend950DT") as npu:
        norm_forward, norm_backward = norm_linear_launches(recipe, npu, normalization)
        forward, backward = linear_launches(recipe, torch.bfloat16, npu)
    added_forward = Counter(norm_forward.counts)
    added_forward.subtract(forward.counts)
    added_backward = Counter(norm_backward.counts)
    added_backward.subtract(backward.counts)
    want_forward, want_backward = NORM_LAUNCHES[normalization]
    assert +added_forward == want_forward, dict(norm_forward.counts)
    assert +added_backward == want_backward, dict(norm_backward.counts)
    assert norm_forward.total == forward.total + sum(want_forward.values())
    assert norm_backward.total == backward.total + sum(want_backward.values())


def test_causal_attention_is_one_kernel_each_way():
    """npu_fusion_attention's causal mode on its fixed 2048x2048 mask: no mask of the sequence's size is built per
    call, and the backward is torch_npu's one grad kernel."""
    from mindspeed_te.bench.launches import attention_launches

    with _simulated() as npu:
        forward, backward = attention_launches(npu)
    assert forward.counts == {"torch_npu.npu_fusion_attention": 1}
    assert backward.counts == {"torch_npu.npu_fusion_attention_grad": 1}


def _moe_permutation_launches(npu=None, with_probs: bool = True, marked: str = "no"
                              ) -> tuple[Counter, Counter, Counter]:
    """(permute forward, unpermute forward, both backward) launches of a MoE layer's token permutation as Megatron's
    fused alltoall dispatcher runs it (TE's moe_permute_with_probs, then moe_unpermute of the experts' rows; dropless
    top-2 of 8 experts, 64 bfloat16 tokens, float32 router probs), on its second micro-batch; `marked`: "dropless",
    the routing map marked top-2, as the patched dispatcher marks its dropless maps; "top-k", and holding the top-k
    experts it was made from, as the fused router makes it."""
    from mindspeed_te.kernels.permutation import EXPERTS_PER_TOKEN, TOPK_EXPERTS
    from mindspeed_te.megatron import moe_fused

    gen = torch.Generator().manual_seed(0)
    scores = torch.softmax(torch.randn(64, 8, generator=gen), dim=-1)
    top = scores.topk(2, dim=1).indices
    routing_map = torch.zeros(64, 8, dtype=torch.bool).scatter(1, top, True)
    if marked != "no":
        setattr(routing_map, EXPERTS_PER_TOKEN, 2)
    if marked == "top-k":
        setattr(routing_map, TOPK_EXPERTS, top)
    probs = (scores * routing_map).requires_grad_(with_probs)
    x = torch.randn(64, 32, generator=gen).bfloat16().requires_grad_()
    for _ in range(2):
        x.grad = probs.grad = None  # (a micro-batch's own gradients, no accumulation into earlier ones)
        with LaunchCounter(npu) as permute:
            if with_probs:
                permuted, permuted_probs, row_map = moe_fused.fused_permute_with_probs(x, probs, routing_map, 128)
            else:
                permuted, row_map = moe_fused.fused_permute(x, routing_map, 128)
        rows = torch.randn(permuted.shape, generator=gen).bfloat16().requires_grad_()  # the experts' output
        with LaunchCounter(npu) as unpermute:
            out = moe_fused.fused_unpermute(rows, row_map, restore_shape=x.shape)
        seeds = [torch.ones_like(t) for t in (out, permuted, *([permuted_probs] if with_probs else []))]
        with LaunchCounter(npu) as backward:
            torch.autograd.backward([out, permuted, *([permuted_probs] if with_probs else [])], seeds)
    return permute.counts, unpermute.counts, backward.counts


@pytest.mark.parametrize("marked", ["no", "dropless", "top-k"])
@pytest.mark.parametrize("with_probs", [True, False])
def test_moe_permutation_is_one_kernel_each_way(with_probs, marked):
    """Issue 29: a MoE layer's permute + unpermute on an NPU is torch_npu's npu_moe_token_permute and
    npu_moe_token_unpermute, and torch_npu's one grad kernel each, instead of the torch index ops (before: 28 / 23
    launches for the permute with / without probs, 4 for the unpermute, 10 / 6 backward). Around the permute kernel:
    the routing map's experts per token (one stable sort; issue 30: none for a top-2 map that holds the router's
    top-k, whose two rows per token sum alike in either order), the check that every token has exactly k of them
    (2 ops and a 1-byte host read: the kernel's contract; issue 30: none for a map the dispatcher marks top-k, as
    Megatron's dropless routing makes it); with probs, their gather and placement at the rows (2: added onto kept
    zeros at the kernel's int32 rows; before, a cast of them and an index_copy), whose backward is an index_select
    and a scatter onto kept zeros (2; torch's gather backward makes zeros and adds: 3)."""
    reference = _moe_permutation_launches(with_probs=with_probs, marked=marked)
    assert [sum(c.values()) for c in reference] == ([28, 4, 10] if with_probs else [23, 4, 6])
    with _simulated() as npu:
        permute, unpermute, backward = _moe_permutation_launches(npu, with_probs, marked)
    check = {} if marked != "no" else {"aten.gt": 1, "aten.all": 1, "aten._local_scalar_dense": 1}
    kernel = {**({} if marked == "top-k" else {"aten.sort": 1}), **check, "torch_npu.npu_moe_token_permute": 1}
    probs = {"aten.gather": 1, "aten.index_add": 1}
    assert permute == {**kernel, **(probs if with_probs else {})}
    assert unpermute == {"torch_npu.npu_moe_token_unpermute": 1}  # its unit probs are made once per shape
    grads = {"torch_npu.npu_moe_token_unpermute_grad_v2": 1, "torch_npu.npu_moe_token_permute_grad_v2": 1}
    probs_grads = {"aten.index_select": 1, "aten.scatter": 1}
    assert backward == {**grads, **(probs_grads if with_probs else {})}


def _rope_launches(fn, x: torch.Tensor, npu=None) -> tuple[Counter, Counter]:
    x = x.clone().requires_grad_()
    with LaunchCounter(npu) as forward:
        y = fn(x)
    seed = torch.ones_like(y)
    with LaunchCounter(npu) as backward:
        y.backward(seed)
    return forward.counts, backward.counts


def test_rope_is_one_kernel_each_way():
    """Issue 29: one RoPE application on an NPU is npu_rotary_mul and its one backward kernel. TE's
    apply_rotary_pos_emb (sbhd, bfloat16): the rotation's 5 ops each way become 1 (the module's cos / sin of the
    angles and their casts stay: 4); MLA's fused q RoPE on the Ascend 950 ("interleave-half": de-interleave and
    rotate): 7 forward and 9 backward launches become the kernel and the cat with the unrotated channels, each way."""
    from mindspeed_te.megatron.mla_rope import fused_apply_mla_rope_for_q
    from mindspeed_te.modules.rope import apply_rotary_pos_emb

    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    angles = torch.outer(torch.arange(8).float(), inv)
    freqs = torch.cat((angles, angles), dim=-1).view(8, 1, 1, 16)
    t = torch.randn(8, 2, 4, 16).bfloat16()
    cos, sin = torch.cos(angles).bfloat16().view(8, 1, 1, 8), torch.sin(angles).bfloat16().view(8, 1, 1, 8)

    def te(x):
        return apply_rotary_pos_emb(x, freqs)

    def mla(x):
        return fused_apply_mla_rope_for_q(x, cos, sin, 8, 8)

    tables = {"aten.cos": 1, "aten.sin": 1, "aten._to_copy": 2}
    assert _rope_launches(te, t) == ({**tables, "aten.mul": 2, "aten.neg": 1, "aten.cat": 1, "aten.add": 1},
                                     {"aten.mul": 2, "aten.neg": 1, "aten.cat": 1, "aten.add": 1})
    assert [sum(c.values()) for c in _rope_launches(mla, t)] == [7, 9]
    with _simulated() as npu:
        assert _rope_launches(te, t, npu) == ({**tables, "torch_npu.npu_rotary_mul": 1},
                                              {"torch_npu.npu_rotary_mul_backward": 1})
        assert _rope_launches(mla, t, npu) == ({"torch_npu.npu_rotary_mul": 1, "aten.cat": 1},
                                               {"torch_npu.npu_rotary_mul_backward": 1, "aten.cat": 1})


# The fused norm / SwiGLU + MX quantize kernels (torch_npu with op-plugin 26.0.0 / 26.1.0 and later), measured on a
# simulated torch_npu that has them against the default simulator (which lacks them), MXFP8 E4M3, bf16, 128 tokens,
# LayerNormMLP(256, 256, RMSNorm, swiglu) and LayerNormLinear(256, 256, RMSNorm) with a bias.
#
# LayerNormMLP forward, unfused: the norm (npu_rms_norm) 1; FC1: its input's MX forms (one dual-axis call, on the
# 950PR as on the 950DT), the weight's likewise, the bias cast, the GEMM; the activation in float32: cast, silu, mul,
# cast back (4); FC2 as FC1: 13. Fused: npu_swiglu_mx_quant_with_dual_axis makes FC2's input's two forms from FC1's
# output in one launch, replacing the 4 activation ops and FC2's input quantize: 9.
# LayerNormMLP backward, unfused: per linear the grad_output's MX forms (1), the dgrad and wgrad GEMMs, the bias sum;
# the activation's autograd: grad cast to float32, two muls, silu_backward, cat, cast back (6); the norm's
# npu_rms_norm_backward and the dgamma cast: 16. Fused: the activation's backward first recomputes its float32
# graph from the saved bf16 input (cast, silu, mul: +3; the unfused graph instead keeps float32 copies of FC1's
# output and silu's, 12 bytes per FFN element against 4), then runs the same 6: 19.
# LayerNormLinear with a frozen weight (no wgrad, so no columnwise input): npu_rms_norm_dynamic_mx_quant makes the
# rowwise input in place of the norm and its rowwise quantize: forward 5 -> 4; backward unchanged (5: grad_output's
# rowwise MX, dgrad, bias sum, npu_rms_norm_backward with the kernel's rstd, the dgamma cast). In training (a weight
# gradient) nothing fuses: the pinned NORM_LAUNCHES above hold. (Before the 950PR took the dual-axis kernel its
# counts were 17 / 18 -> 12 / 21 and 6 / 5 -> 5 / 5.)
FUSED_LAUNCHES = {  # (kind, chip): ((forward, backward) unfused, (forward, backward) fused)
    ("mlp", "Ascend950DT"): ((13, 16), (9, 19)),
    ("mlp", "Ascend950PR"): ((13, 16), (9, 19)),
    ("frozen linear", "Ascend950DT"): ((5, 5), (4, 5)),
    ("frozen linear", "Ascend950PR"): ((5, 5), (4, 5)),
}


@pytest.mark.parametrize("kind,chip", list(FUSED_LAUNCHES))
def test_fused_norm_and_swiglu_quantize_launches(kind, chip, monkeypatch):
    from mindspeed_te.bench.launches import _second_layer_launches, launch_recipes
    from mindspeed_te.kernels.npu import NpuBackend
    from mindspeed_te.modules import LayerNormLinear, LayerNormMLP
    from mindspeed_te.testing.npu_sim import make_simulator_with_fused_quant

    def measure(fused: bool) -> tuple[int, int]:
        torch.manual_seed(0)
        if kind == "mlp":
            layer = LayerNormMLP(256, 256, normalization="RMSNorm", activation="swiglu", params_dtype=torch.bfloat16)
        else:
            layer = LayerNormLinear(256, 256, bias=True, params_dtype=torch.bfloat16, normalization="RMSNorm")
            layer.weight.requires_grad_(False)
        if fused:
            backend = NpuBackend(make_simulator_with_fused_quant(chip))
            monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend", lambda: backend)
        with _simulated(chip) as npu:
            forward, backward = _second_layer_launches(launch_recipes()["mxfp8 E4M3"], layer, 128, npu)
        monkeypatch.undo()
        kernels = {"torch_npu.npu_swiglu_mx_quant_with_dual_axis", "torch_npu.npu_rms_norm_dynamic_mx_quant"}
        assert bool(kernels & set(forward.counts)) == fused, dict(forward.counts)
        return forward.total, backward.total

    unfused, fused = FUSED_LAUNCHES[kind, chip]
    assert measure(False) == unfused
    assert measure(True) == fused
