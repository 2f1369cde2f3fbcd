"""Issue 12 item 1: a NaN or Inf entering a quantized GEMM makes the GEMM's output non-finite, as in high
precision, under every recipe, format and backend; scales and histories stay finite and the next clean step
is exactly the step a run without the fault would take."""
import math
import warnings

import pytest
import torch

from mindspeed_te import (
    FP8GlobalStateManager,
    fp8_autocast,
)
from mindspeed_te.modules import Linear
from tests.recipes import recipe_factories

RECIPES = recipe_factories("delayed/hybrid", "delayed/e4m3", "delayed/hif8", "tensorwise/hybrid", "tensorwise/hif8",
                           "blockwise/e4m3", "blockwise/hif8", "mxfp8/hybrid", amax_history_len=4)
BACKENDS = ["reference", "torch", "npu"]


@pytest.fixture(params=BACKENDS)
def backend(request, use_backend):
    use_backend(request.param)
    return request.param


def _run(recipe, steps, dtype=torch.bfloat16):
    """Train-free steps of one layer: returns per step (output, input grad, weight grad) and the layer."""
    torch.manual_seed(0)
    layer = Linear(64, 64, params_dtype=dtype)
    results = []
    for x, dy in steps:
        x = x.to(dtype).requires_grad_()
        with fp8_autocast(fp8_recipe=recipe):
            y = layer(x)
        y.backward(dy.to(dtype))
        states = [(st.scale.clone(), st.amax_history.clone()) for st in layer.fp8_states if hasattr(st, "scale")]
        results.append((y.detach(), x.grad, layer.weight.grad, states))
        layer.weight.grad = None
        if layer.bias is not None:
            layer.bias.grad = None
    return results, layer


def _clean(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)


def _finite_state(layer):
    for state in layer.fp8_states:
        for name in ("scale", "amax_history"):
            if hasattr(state, name):
                assert torch.isfinite(getattr(state, name)).all(), name


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", ["activation", "gradient"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_nonfinite_value_stays_visible_and_state_recovers(backend, name, where, bad):
    x0, dy0 = _clean(0)
    x1, dy1 = _clean(1)
    x2, dy2 = _clean(2)
    if where == "activation":
        x1[5, 7] = bad
    else:
        dy1[9, 3] = bad
    faulty, layer = _run(RECIPES[name](), [(x0, dy0), (x1, dy1), (x2, dy2)])
    y, dx, dw, states = faulty[1]
    if where == "activation":  # high precision: row 5 of y is non-finite, and so is the weight gradient
        assert not torch.isfinite(y).all()
    else:  # high precision: dx row 9 and dw column... of the bad gradient are non-finite
        assert not torch.isfinite(dx).all()
    assert not torch.isfinite(dw).all()
    _finite_state(layer)
    # The faulted tensor's slot (forward input, or backward grad_output) kept its scale and window.
    if states:
        direction = 0 if where == "activation" else 1
        before, after = faulty[0][3][direction], states[direction]
        assert torch.equal(before[0][0], after[0][0]) and torch.equal(before[1][:, 0], after[1][:, 0])
    # The next clean step is finite; without delayed state it is exactly the step of a run without the fault.
    assert all(torch.isfinite(t).all() for t in faulty[2][:3])
    if not states:
        reference, _ = _run(RECIPES[name](), [(x0, dy0), (x2, dy2)])
        for got, want in zip(faulty[2][:3], reference[1][:3]):
            assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["delayed/hif8", "tensorwise/hybrid", "blockwise/e4m3", "mxfp8/hybrid"])
def test_each_faulty_step_is_warned_naming_module_and_tensor_and_counted(name):
    recipe = RECIPES[name]()
    layer = Linear(64, 64, name="fc1")
    for step in range(4):
        x, dy = _clean(step)
        if step == 1:
            x[0, 0] = math.inf
        if step == 3:  # the last step: reported all the same
            dy[3, 3] = math.nan
        x.requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # nothing is read, so nothing reported, inside a step
            with fp8_autocast(fp8_recipe=recipe):
                y = layer(x)
            y.backward(dy)
        if step in (1, 3):  # reported at the faulty step's boundary (Megatron: when its train_step returns)
            with pytest.warns(RuntimeWarning, match=r"fc1 input" if step == 1 else r"fc1 grad_output"):
                assert FP8GlobalStateManager.harvest_nonfinite() == ["fc1 input" if step == 1 else "fc1 grad_output"]
        else:
            assert FP8GlobalStateManager.harvest_nonfinite() == []
    assert FP8GlobalStateManager.check_nonfinite() == []  # everything was reported already
    assert FP8GlobalStateManager.get_nonfinite_counts() == {"steps": 2, "fc1 input": 1, "fc1 grad_output": 1}


@pytest.mark.parametrize("backend_name", ["reference", "npu"])
def test_faults_are_named_in_a_step_mixing_mx_and_float_flags(backend_name, use_backend):
    """MXFP8 scales are E8M0 bytes (NaN: 0xFF), the others float32: one step's fold reads both kinds and the
    check names the right module and tensor. Three layers in a chain, each under its own recipe (MXFP8,
    tensorwise, MXFP8); an Inf put into the middle layer's input makes its output, and so the last layer's
    input, non-finite, and nothing before it."""
    use_backend(backend_name)
    layers = [Linear(64, 64, name=f"fc{i}") for i in range(3)]
    recipes = [RECIPES["mxfp8/hybrid"](), RECIPES["tensorwise/hybrid"](), RECIPES["mxfp8/hybrid"]()]
    h, dy = _clean(0)
    for i, (layer, recipe) in enumerate(zip(layers, recipes)):
        h = h.detach().clone()
        if i == 1:
            h[2, 5] = math.inf
        with fp8_autocast(fp8_recipe=recipe):
            h = layer(h)
    h.backward(dy)  # the last region's backward ends the step: one check, for all three regions
    with pytest.warns(RuntimeWarning):
        FP8GlobalStateManager.harvest_nonfinite()
    counts = FP8GlobalStateManager.get_nonfinite_counts()
    assert {k: v for k, v in counts.items() if k != "steps"} == {"fc1 input": 1, "fc2 input": 1}, counts


@pytest.mark.parametrize("name", ["delayed/hif8", "delayed/e4m3"])
def test_fault_in_an_evaluation_pass_is_checked_at_its_exit_and_reported_once(name):
    """The exit of a pass without gradients checks it (its amaxes folded into the flags); the report is read
    at the next boundary, here only after a clean training step: that step neither reports the evaluation's
    NaN amax again nor updates from it (its exit cleared it, whatever the check was to find)."""
    layer = Linear(64, 64, name="fc1")
    x, _ = _clean(0)
    x[1, 1] = math.nan
    recipe = RECIPES[name]()
    x1, dy = _clean(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with torch.no_grad(), fp8_autocast(fp8_recipe=recipe):
            layer(x)
        assert len(FP8GlobalStateManager.quantization_state.nonfinite_reports) == 1  # checked at the exit
        with fp8_autocast(fp8_recipe=recipe):
            y = layer(x1.requires_grad_())
        y.backward(dy)
    with pytest.warns(RuntimeWarning, match="fc1 input") as caught:
        assert FP8GlobalStateManager.harvest_nonfinite() == ["fc1 input"]  # the clean step's check: nothing
    assert len(caught) == 1
    assert FP8GlobalStateManager.get_nonfinite_counts() == {"steps": 1, "fc1 input": 1}
    assert all(bool(state.scale.isfinite().all()) for state in layer.fp8_states if hasattr(state, "scale"))


def test_fault_counts_reach_the_numerics_report(tmp_path):
    import json

    from mindspeed_te.debug import NumericsReport, reset_counters

    reset_counters()
    layer = Linear(64, 64, name="fc1")
    for step in range(3):
        x, dy = _clean(step)
        if step == 1:
            dy[0, 0] = math.inf
        with fp8_autocast(fp8_recipe=RECIPES["tensorwise/hif8"]()):
            y = layer(x.requires_grad_())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            y.backward(dy)
            FP8GlobalStateManager.harvest_nonfinite()  # the listeners hear of a check when it is harvested
    NumericsReport(str(tmp_path)).write(plots=False)
    counters = json.loads((tmp_path / "numerics.json").read_text())["counters"]
    assert counters == {"nonfinite_steps": 1, "nonfinite fc1 grad_output": 1}
    reset_counters()


def test_fault_with_one_region_per_layer_is_reported_once_at_the_end_of_its_step():
    """Megatron's per-layer regions (every recipe but delayed): the check runs once, after the last backward
    the step's regions owe, with no host read; its one read, at the step boundary, reports a gradient fault in
    the first layer in its own step."""
    from mindspeed_te.diagnostics import HostSyncCounter

    a, b = Linear(64, 64, name="a"), Linear(64, 64, name="b")
    recipe = RECIPES["tensorwise/hif8"]()
    reports = FP8GlobalStateManager.quantization_state.nonfinite_reports
    for step in range(2):
        x, dy = _clean(step)
        with HostSyncCounter(trap=True):
            with fp8_autocast(fp8_recipe=recipe):
                h = a(x.requires_grad_())
            with fp8_autocast(fp8_recipe=recipe):
                y = b(h)
            assert not reports  # the second region's entry did not end the step: a's backward is owed
            if step == 1:
                h.register_hook(lambda g: g.index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(math.nan)))
            y.backward(dy)
        assert len(reports) == 1
        with HostSyncCounter() as counter:
            if step == 1:
                with pytest.warns(RuntimeWarning, match=r"at a grad_output$|at a grad_output:"):
                    FP8GlobalStateManager.harvest_nonfinite()
            else:
                assert FP8GlobalStateManager.harvest_nonfinite() == []
        assert dict(counter.counts) == {"tolist": 1}


@pytest.mark.parametrize("save_original_input", [False, True])
@pytest.mark.parametrize("chip", ["Ascend950PR", "Ascend950DT"])
def test_mx_experts_joined_quantize_names_the_faulty_expert(chip, save_original_input, monkeypatch, use_backend):
    """MX experts whose rows one kernel call quantizes (rowwise over the joined rows, columnwise per part of
    whole 64-row pairs, in the kernel's padded pairs) still note each expert's own scales: an Inf in expert 1's
    rows is named as expert 1's input and no other, also when the backward quantizes the saved input again
    (columnwise only: the note reads the pairs as made)."""
    from mindspeed_te import Format, MXFP8BlockScaling
    from mindspeed_te.kernels.npu import NpuBackend
    from mindspeed_te.modules import GroupedLinear
    from mindspeed_te.testing.npu_sim import make_simulator

    use_backend("npu")
    monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend", lambda: NpuBackend(make_simulator(chip)))
    layer = GroupedLinear(3, 64, 64, bias=False, save_original_input=save_original_input)
    layer.name = "experts"
    x = torch.randn(160, 64)
    x[70, 3] = math.inf  # expert 1 has rows 64..127
    x.requires_grad_()
    with fp8_autocast(fp8_recipe=MXFP8BlockScaling(fp8_format=Format.HYBRID)):
        y = layer(x, [64, 64, 32])
    y.backward(torch.randn_like(y))
    with pytest.warns(RuntimeWarning, match=r"experts input\[1\]"):
        FP8GlobalStateManager.harvest_nonfinite()
    counts = FP8GlobalStateManager.get_nonfinite_counts()
    assert {k: v for k, v in counts.items() if k != "steps"} == {"experts input[1]": 1}, counts


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_per_tensor_experts_joined_scales_name_the_faulty_expert(recipe, monkeypatch, use_backend):
    """bfloat16 experts under per-tensor scaling on the NPU path: their scales come marked in one vector (delayed:
    one add of the stacked amaxes to the state's side-by-side slots) or are joined into one after their quantizes
    (tensorwise). Each expert's mark is still its own: an Inf in expert 1's rows is named as expert 1's input and
    no other, and only expert 1's output rows are non-finite."""
    from mindspeed_te import DelayedScaling, Float8CurrentScaling, Format
    from mindspeed_te.kernels.npu import NpuBackend
    from mindspeed_te.modules import GroupedLinear
    from mindspeed_te.testing.npu_sim import make_simulator

    use_backend("npu")
    monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend", lambda: NpuBackend(make_simulator("Ascend950PR")))
    layer = GroupedLinear(3, 64, 64, bias=False, params_dtype=torch.bfloat16)
    layer.name = "experts"
    make = DelayedScaling if recipe == "delayed" else Float8CurrentScaling
    x = torch.randn(160, 64).bfloat16()
    x[70, 3] = math.inf  # expert 1 has rows 64..127
    x.requires_grad_()
    with fp8_autocast(fp8_recipe=make(fp8_format=Format.HYBRID)):
        y = layer(x, [64, 64, 32])
    y.backward(torch.randn_like(y))
    finite = torch.isfinite(y.float()).all(dim=1)
    assert not finite[64:128].any() and finite[:64].all() and finite[128:].all()
    with pytest.warns(RuntimeWarning, match=r"experts input\[1\]"):
        FP8GlobalStateManager.harvest_nonfinite()
    counts = FP8GlobalStateManager.get_nonfinite_counts()
    assert {k: v for k, v in counts.items() if k != "steps"} == {"experts input[1]": 1}, counts
