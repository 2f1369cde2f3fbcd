"""The global state survives failed steps and follows TransformerEngine's semantics in the corner cases
(issue 12 item 3), and exposes TransformerEngine's state API (issue 10 item 4)."""
import pytest
import torch

from mindspeed_te import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    FP8GlobalStateManager,
    MXFP8BlockScaling,
    fp8_autocast,
)
from mindspeed_te.modules import Linear
from mindspeed_te.recipe_state import (
    DelayedScalingRecipeState,
    Float8BlockScalingRecipeState,
    Float8CurrentScalingRecipeState,
    MXFP8BlockScalingRecipeState,
    RecipeState,
)
from mindspeed_te.state import FP8GlobalState


def _step(layer, x, recipe, scale=1.0):
    with fp8_autocast(fp8_recipe=recipe):
        y = layer(x * scale)
    y.sum().backward()
    return y


# State integrity ------------------------------------------------------------------------------------------
def test_reset_is_one_fresh_instance():
    FP8GlobalStateManager.quantization_state.autocast_depth = 3
    FP8GlobalStateManager.reset()
    assert FP8GlobalStateManager.quantization_state == FP8GlobalState()


def test_recipe_changed_after_construction_is_refused_when_used_and_leaves_no_state():
    recipe = DelayedScaling(amax_history_len=4)
    recipe.amax_history_len = 0
    with pytest.raises(ValueError, match="amax_history_len"):
        with fp8_autocast(fp8_recipe=recipe):
            pass
    qstate = FP8GlobalStateManager.quantization_state
    assert qstate.autocast_depth == 0 and not qstate.registered and not qstate.fp8_enabled


def test_failed_forward_leaves_no_stale_backward_registration():
    torch.manual_seed(0)
    bad = Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)

    def explode(*_):
        raise RuntimeError("boom")

    hook = bad.register_forward_hook(explode)
    with pytest.raises(RuntimeError, match="boom"):
        with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=2)):
            bad(x)
    hook.remove()
    assert not FP8GlobalStateManager.quantization_state.registered
    # A later step with another recipe, and one with the same recipe, run and update their scales.
    good = Linear(16, 16)
    _step(good, x, DelayedScaling(fp8_format=Format.HIF8))
    assert good.fp8_states[1].scale.ne(1.0).any()
    _step(bad, x, DelayedScaling(amax_history_len=2))
    assert bad.fp8_states[1].scale.ne(1.0).any()


def test_no_grad_evaluation_keeps_training_scales():
    layer = Linear(16, 16)
    x = torch.randn(8, 16)
    recipe = DelayedScaling(amax_history_len=1)
    _step(layer, x.requires_grad_(), recipe)
    before = layer.fp8_states[0].scale.clone()
    with torch.no_grad(), fp8_autocast(fp8_recipe=recipe):
        layer(x * 1000)
    assert torch.equal(layer.fp8_states[0].scale, before)


def test_zero_new_amax_keeps_old_scale_with_max_algo():
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo="max")
    state = RecipeState.create(recipe, mode="forward", num_quantizers=1)
    q = state.make_quantizers()[0]
    for value in (8.0, 2.0):
        with fp8_autocast(fp8_recipe=recipe):
            FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(state)
            q(torch.full((4,), value))
    scale = state.scale.clone()
    history = state.amax_history.clone()
    state.scale.fill_(3.0)  # a scale the window would not give: it must survive an update without data
    with fp8_autocast(fp8_recipe=recipe):
        FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(state)  # the tensor is not seen this step
    assert state.scale.item() == 3.0 and torch.equal(state.amax_history, history)
    assert scale.item() == 448.0 / 8.0


def test_disabled_outer_region_still_reduces_backward_amaxes():
    layer = Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)
    recipe = DelayedScaling(amax_history_len=1)
    with fp8_autocast(enabled=False):
        with fp8_autocast(fp8_recipe=recipe):
            y = layer(x)
    y.sum().backward()
    fwd, bwd = layer.fp8_states
    assert fwd.scale[:2].ne(1.0).all() and bwd.scale[0].item() == 57344.0  # grad of sum() is 1
    assert not FP8GlobalStateManager.quantization_state.registered


def test_nested_first_module_reduces_after_its_own_gradient():
    """outer{inner{A}; B}: A is the first module and its backward runs last; A's gradient amax belongs to
    this step's update, not the next one."""
    a, b = Linear(16, 16), Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)
    recipe = DelayedScaling(amax_history_len=1)
    with fp8_autocast(fp8_recipe=recipe):
        with fp8_autocast(fp8_recipe=recipe):
            h = a(x)
        y = b(h)
    (y.sum() * 4.0).backward()
    # A's grad_output amax entered this step's update (scale moved) and nothing is left for the next step
    assert a.fp8_states[1].scale[0].item() != 1.0
    assert a.fp8_states[1].amax_history.eq(0).all()


def test_checkpoint_phase_api_restores_and_checks():
    stash = []
    state = RecipeState.create(DelayedScaling(), mode="forward", num_quantizers=3)
    with FP8GlobalStateManager.checkpoint_phase("forward", stash):
        assert FP8GlobalStateManager.get_checkpoint_phase() == "forward"
        FP8GlobalStateManager.stash_forward_state_for_recompute(state)
    assert FP8GlobalStateManager.get_checkpoint_phase() is None and len(stash) == 1
    for _ in range(2):  # a recompute may run more than once; each consumes its own copy
        with FP8GlobalStateManager.checkpoint_phase("recompute", stash):
            frozen = FP8GlobalStateManager.pop_forward_state_for_recompute(state)
            assert frozen is not state and torch.equal(frozen.scale, state.scale)
            with pytest.raises(RuntimeError, match="more FP8 modules"):
                FP8GlobalStateManager.pop_forward_state_for_recompute(state)
    with pytest.raises(ValueError, match="phase"):
        with FP8GlobalStateManager.checkpoint_phase("backward", stash):
            pass


def test_activation_recompute_forward_gives_each_module_its_first_pass_scales():
    """TransformerEngine's activation_recompute_forward (Megatron's output-discarding checkpoint, e.g.
    --recompute-modules moe_act): the first pass keeps each module's delayed-scaling state without a stash of
    its own; after a scale update, the recompute (in the restored autocast) quantizes with the first pass's
    scales, each module its own, oldest micro-batch first, and gives the first pass's outputs bit for bit."""
    torch.manual_seed(0)
    a, b = Linear(32, 32), Linear(32, 32)
    recipe = DelayedScaling()
    xs = [torch.randn(8, 32) * scale for scale in (1.0, 30.0)]  # two micro-batches, far apart in amax
    with fp8_autocast(fp8_recipe=recipe):  # a first step: scales from the data
        b(a(xs[0])).sum().backward()
    firsts = []
    with fp8_autocast(fp8_recipe=recipe):
        for x in xs:
            with torch.no_grad(), FP8GlobalStateManager.activation_recompute_forward(True, recompute_phase=False):
                firsts.append(b(a(x)))
    FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=True)  # what the step's end would do
    for x, first in zip(xs, firsts):
        with fp8_autocast(fp8_recipe=recipe), FP8GlobalStateManager.activation_recompute_forward(
                True, recompute_phase=True):
            assert torch.equal(b(a(x)), first)
    with fp8_autocast(fp8_recipe=recipe):  # without the context: today's scales, another result
        assert not torch.equal(b(a(xs[0])), firsts[0])
    assert not any(FP8GlobalStateManager.quantization_state.recompute_queues.values())  # every copy used


def test_a_failed_region_leaves_no_recompute_stash_and_the_next_recompute_gets_its_own_scales():
    """A region that fails after its first pass under activation_recompute_forward never runs that pass's
    recompute: its stash goes with it. Left queued, the next step's recompute of the same module would take the
    failed region's stale scales (its oldest copy) and give another result than its own first pass."""
    torch.manual_seed(0)
    layer, recipe = Linear(32, 32), DelayedScaling()
    x = torch.randn(8, 32)
    with fp8_autocast(fp8_recipe=recipe):  # a first step: scales from the data
        layer(x).sum().backward()
    with pytest.raises(RuntimeError, match="boom"):
        with fp8_autocast(fp8_recipe=recipe):
            with torch.no_grad(), FP8GlobalStateManager.activation_recompute_forward(True, recompute_phase=False):
                layer(x)
                raise RuntimeError("boom")
    queues = FP8GlobalStateManager.quantization_state.recompute_queues
    assert not any(queues.values())
    with fp8_autocast(fp8_recipe=recipe):  # a step far from the first's amax: other scales
        layer(x * 30.0).sum().backward()
    with fp8_autocast(fp8_recipe=recipe):
        with torch.no_grad(), FP8GlobalStateManager.activation_recompute_forward(True, recompute_phase=False):
            first = layer(x)
    with fp8_autocast(fp8_recipe=recipe), FP8GlobalStateManager.activation_recompute_forward(
            True, recompute_phase=True):
        assert torch.equal(layer(x), first)
    assert not any(queues.values())


def test_a_failed_region_keeps_the_stash_of_earlier_micro_batches():
    """Only the failed region's copies go: a micro-batch whose backward (and recompute) is still to come keeps its
    own, and its recompute gives its first pass's result."""
    torch.manual_seed(0)
    layer, recipe = Linear(32, 32), DelayedScaling()
    x = torch.randn(8, 32)
    with fp8_autocast(fp8_recipe=recipe):
        layer(x).sum().backward()
    with fp8_autocast(fp8_recipe=recipe):
        with torch.no_grad(), FP8GlobalStateManager.activation_recompute_forward(True, recompute_phase=False):
            first = layer(x)
    with pytest.raises(RuntimeError, match="boom"):
        with fp8_autocast(fp8_recipe=recipe):
            with torch.no_grad(), FP8GlobalStateManager.activation_recompute_forward(True, recompute_phase=False):
                layer(x * 30.0)
                raise RuntimeError("boom")
    assert [len(queue) for queue in FP8GlobalStateManager.quantization_state.recompute_queues.values()] == [1]
    with fp8_autocast(fp8_recipe=recipe), FP8GlobalStateManager.activation_recompute_forward(
            True, recompute_phase=True):
        assert torch.equal(layer(x), first)


def _object_at(address: int, make):
    """A new object from make() that CPython placed at `address` (a freed object's id), or None."""
    kept = []
    for _ in range(5000):
        candidate = make()
        if id(candidate) == address:
            return candidate
        kept.append(candidate)
    return None


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "stateless"])
def test_a_recompute_stash_goes_with_its_state_and_is_not_given_to_a_new_one_at_its_address(recipe):
    """The stash of activation_recompute_forward holds its module's state weakly: a state that is collected
    leaves nothing queued (a stateless recipe's frozen copy is the state itself, which the queue must not keep
    alive), and a new state that CPython puts at the dead one's address is not handed the dead one's copy."""
    import gc
    import weakref

    qstate = FP8GlobalStateManager.quantization_state
    state = RecipeState.create(recipe, mode="forward", num_quantizers=3)
    with FP8GlobalStateManager.checkpoint_phase("forward", qstate.recompute_queues):
        FP8GlobalStateManager.stash_forward_state_for_recompute(state)
    assert len(list(qstate.recompute_queues.values())) == 1
    ref, address, cls = weakref.ref(state), id(state), type(state)
    del state
    gc.collect()
    assert ref() is None, "the stash keeps the module's state alive"
    assert not list(qstate.recompute_queues.values())
    newcomer = _object_at(address, lambda: cls.__new__(cls))  # only its identity is asked for
    if newcomer is None:
        pytest.skip("CPython put no new state at the freed address")
    with FP8GlobalStateManager.checkpoint_phase("recompute", qstate.recompute_queues):
        with pytest.raises(RuntimeError, match="more FP8 modules"):
            FP8GlobalStateManager.pop_forward_state_for_recompute(newcomer)


# TransformerEngine's state API -----------------------------------------------------------------------------
def test_autocast_state_getters_and_setters_of_both_te_generations():
    recipe = Float8CurrentScaling()
    saved = FP8GlobalStateManager.get_fp8_autocast_state()
    FP8GlobalStateManager.autocast_enter(enabled=True, calibrating=False, fp8_recipe=recipe, fp8_group=None)
    assert FP8GlobalStateManager.is_fp8_enabled() and FP8GlobalStateManager.get_fp8_recipe() is recipe
    assert FP8GlobalStateManager.get_autocast_state() == FP8GlobalStateManager.get_fp8_autocast_state()
    FP8GlobalStateManager.set_fp8_autocast_state(saved)
    FP8GlobalStateManager.autocast_exit(enabled=True, _graph=False)
    assert not FP8GlobalStateManager.is_fp8_enabled()
    assert FP8GlobalStateManager.quantization_state.autocast_depth == 0
    FP8GlobalStateManager.fp8_autocast_enter(True, False, recipe, None, False)
    FP8GlobalStateManager.set_autocast_state(saved)
    FP8GlobalStateManager.fp8_autocast_exit(True, False)
    assert FP8GlobalStateManager.quantization_state.autocast_depth == 0


def test_autocast_arguments_and_unique_key():
    r1, r2 = DelayedScaling(), DelayedScaling(margin=1)
    with fp8_autocast(fp8_recipe=r1):
        pass
    with fp8_autocast(fp8_recipe=r2):
        pass
    args = FP8GlobalStateManager.quantization_state.autocast_arguments
    k1 = FP8GlobalStateManager.get_unique_autocast_key(r1, None)
    k2 = FP8GlobalStateManager.get_unique_autocast_key(r2, None)
    assert k1 != k2 and args[k1] == (r1, None) and args[k2] == (r2, None)
    # equal configurations share a key (their amaxes are reduced together)
    assert FP8GlobalStateManager.get_unique_autocast_key(DelayedScaling(), None) == k1


def test_availability_queries():
    for query in (FP8GlobalStateManager.is_fp8_available, FP8GlobalStateManager.is_mxfp8_available,
                  FP8GlobalStateManager.is_fp8_block_scaling_available):
        assert query() == (True, "")
    import mindspeed_te as te

    assert te.is_fp8_available() is True and te.is_fp8_available(return_reason=True) == (True, "")
    assert te.is_mxfp8_available() is True and te.is_fp8_block_scaling_available() is True
    assert isinstance(te.get_default_recipe(), DelayedScaling)


def test_skip_fp8_weight_update_tensor():
    assert FP8GlobalStateManager.get_skip_fp8_weight_update_tensor() is None
    FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(True)
    flag = FP8GlobalStateManager.get_skip_fp8_weight_update_tensor()
    assert flag.tolist() == [1.0]
    FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(False)
    assert FP8GlobalStateManager.get_skip_fp8_weight_update_tensor() is flag and flag.tolist() == [0.0]


@pytest.mark.parametrize("recipe, state_type", [
    (DelayedScaling(), DelayedScalingRecipeState),
    (Float8CurrentScaling(), Float8CurrentScalingRecipeState),
    (Float8BlockScaling(), Float8BlockScalingRecipeState),
    (MXFP8BlockScaling(), MXFP8BlockScalingRecipeState),
], ids=lambda v: type(v).__name__)
def test_recipe_state_create_follows_te_layout(recipe, state_type):
    fwd = RecipeState.create(recipe, mode="forward", num_quantizers=6)
    bwd = RecipeState.create(recipe, mode="backward", num_quantizers=4)
    assert type(fwd) is state_type and type(bwd) is state_type
    assert fwd.mode == "forward" and bwd.mode == "backward"
    qf, qb = fwd.make_quantizers(), bwd.make_quantizers()
    assert len(qf) == 6 and len(qb) == 4
    # TE: forward tensors use the format's forward dtype, gradients the backward one (HYBRID: E4M3 / E5M2)
    assert {q.fp8_dtype for q in qf} == {recipe.fp8_format.fwd_dtype}
    assert {q.fp8_dtype for q in qb} == {recipe.fp8_format.bwd_dtype}
    if isinstance(recipe, Float8BlockScaling):  # weight slots (1, 4) use 128x128 tiles, the rest 1x128
        assert [q.block_scaling_dim for q in qf] == [1, 2, 1, 1, 2, 1]
        assert [q.block_scaling_dim for q in qb] == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="mode"):
        RecipeState.create(recipe, mode="sideways")


def test_block_scaling_refuses_2d_weight_and_gradient_blocks():
    with pytest.raises(ValueError, match="w_block_scaling_dim=2 with grad_block_scaling_dim=2"):
        Float8BlockScaling(w_block_scaling_dim=2, grad_block_scaling_dim=2)


@pytest.mark.parametrize("recipe", [DelayedScaling(fp8_format=Format.HIF8),
                                    Float8CurrentScaling(fp8_format=Format.HIF8), Float8CurrentScaling(),
                                    Float8BlockScaling(), MXFP8BlockScaling()],
                         ids=lambda r: f"{type(r).__name__}-{r.fp8_format.name}")
def test_float64_runs_like_its_float32_rounding(recipe):
    """float64 works: inputs are quantized from their float32 rounding, so a float64 layer gives the float32
    layer's result (up to the final high-precision accumulation)."""
    results = []
    for dtype in (torch.float64, torch.float32):
        FP8GlobalStateManager.reset()
        layer = Linear(64, 32, params_dtype=dtype)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
        with fp8_autocast(fp8_recipe=recipe):
            y = layer(x)
        y.sum().backward()
        assert y.dtype == dtype and x.grad.dtype == dtype and layer.weight.grad.dtype == dtype
        results.append((y.detach(), x.grad, layer.weight.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b.double(), rtol=1e-5, atol=1e-5)


def test_format_values_carry_te_maxima():
    assert Format.E4M3.value.max_fwd == 448 and Format.E4M3.value.max_bwd == 448
    assert Format.E5M2.value.max_fwd == 57344
    assert Format.HYBRID.value.max_fwd == 448 and Format.HYBRID.value.max_bwd == 57344
    assert Format.HIF8.value.max_fwd == 15 and Format.HIF8.value.max_bwd == 224


def test_quantizer_calibrate_updates_state_as_quantize_would_without_quantizing():
    recipe = DelayedScaling(amax_history_len=2)
    calibrated = RecipeState.create(recipe, mode="forward", num_quantizers=1)
    quantized = RecipeState.create(recipe, mode="forward", num_quantizers=1)
    for x in (torch.tensor([1.0, -6.0]), torch.tensor([3.0])):
        calibrated.make_quantizers()[0].calibrate(x)
        quantized.make_quantizers()[0].quantize(x)
    assert calibrated.amax_history[0].item() == 6.0
    assert torch.equal(calibrated.amax_history, quantized.amax_history)
    for recipe in (Float8CurrentScaling(), Float8BlockScaling(), MXFP8BlockScaling()):  # stateless: no-ops
        RecipeState.create(recipe, mode="forward", num_quantizers=1).make_quantizers()[0].calibrate(torch.ones(4))


def test_top_level_te_names():
    import mindspeed_te as te
    from mindspeed_te.megatron.misc import Fp8Padding, Fp8Unpadding

    assert te.Fp8Padding is Fp8Padding and te.Fp8Unpadding is Fp8Unpadding
    import copy

    layer = Linear(16, 16)
    plain = copy.deepcopy(layer)
    x = torch.randn(8, 16, requires_grad=True)
    recipe = DelayedScaling(amax_history_len=2)
    with fp8_autocast(fp8_recipe=recipe):  # TE's call form: tensors positional, the rest by keyword
        y = te.checkpoint(layer, x, use_reentrant=False, distribute_saved_activations=False)
    y.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    with fp8_autocast(fp8_recipe=recipe):
        y_plain = plain(x)
    y_plain.sum().backward()
    assert torch.equal(y, y_plain) and torch.equal(x.grad, grad)
    assert torch.equal(layer.weight.grad, plain.weight.grad)


def _two_layer_steps(fail_backward: bool, recipe_after=None):
    """Step 1 runs forward; its backward raises after B's backward and before A's (the first module), or is
    never run. Steps 2 and 3 are clean. Returns their outputs, gradients and backward scales."""
    torch.manual_seed(0)
    a, b = Linear(16, 16), Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)
    recipe = DelayedScaling(amax_history_len=2)
    with fp8_autocast(fp8_recipe=recipe):
        h = a(x)
        y = b(h)
    if fail_backward:
        def explode(_):
            raise RuntimeError("boom")

        h.register_hook(explode)
        with pytest.raises(RuntimeError, match="boom"):
            (y.sum() * 1000.0).backward()  # B's gradient amax is 1000x the clean steps'
    del h, y  # the failed step's graph is gone; a training loop zeroes its gradients
    x.grad = a.weight.grad = b.weight.grad = a.bias.grad = b.bias.grad = None
    results = []
    for _ in range(2):
        with fp8_autocast(fp8_recipe=recipe_after or recipe):
            out = b(a(x))
        out.sum().backward()
        results.append((out.detach(), x.grad.clone(), a.weight.grad.clone(), b.weight.grad.clone(),
                        b.fp8_states[1].scale.clone(), b.fp8_states[1].amax_history.clone()))
        x.grad = a.weight.grad = b.weight.grad = None
        a.bias.grad = b.bias.grad = None
        assert not FP8GlobalStateManager.quantization_state.registered
    return results


@pytest.mark.parametrize("recipe_after", [None, DelayedScaling(fp8_format=Format.HIF8)], ids=["same", "other"])
def test_failed_backward_leaves_no_stale_registration(recipe_after):
    """A raising backward leaves nothing behind: the clean steps after it are those of a run whose first step
    never ran its backward (B's partial gradient amax is discarded, no registration is reduced later)."""
    failed = _two_layer_steps(True, recipe_after)
    reference = _two_layer_steps(False, recipe_after)
    for got, want in zip(failed, reference):
        for g, w in zip(got, want):
            assert torch.equal(g, w)


def test_pending_backward_of_earlier_regions_is_kept():
    """Several outermost regions before one backward (Megatron's per-layer regions, pipeline warm-up): their
    backward registrations stay until the backward reduces them."""
    a, b = Linear(16, 16), Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)
    recipe = DelayedScaling(amax_history_len=1)
    with fp8_autocast(fp8_recipe=recipe):
        h = a(x)
    with fp8_autocast(fp8_recipe=recipe):
        y = b(h)
    registered = FP8GlobalStateManager.quantization_state.registered
    assert {id(a.fp8_states[1]), id(b.fp8_states[1])} <= set(next(v for k, v in registered.items() if not k[1]))
    y.sum().backward()
    assert not registered and b.fp8_states[1].scale[0].item() != 1.0
