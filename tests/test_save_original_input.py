"""save_original_input under delayed scaling (issue 29 b), which TransformerEngine refuses: the forward keeps the
high-precision input instead of its codes, and the backward quantizes it with the scale the forward used, even
when the delayed scale was updated in between (the autocast region's end, another micro-batch's forward), so the
wgrad reads exactly the codes the forward's GEMM read: outputs, gradients and the scaling state are those of
save_original_input=False, bit for bit, on the reference and the NPU kernels."""
from __future__ import annotations

from typing import Callable

import pytest
import torch

from mindspeed_te import DelayedScaling, Format, HIF8DelayedScaling, fp8_autocast
from mindspeed_te.modules import GroupedLinear, Linear
from mindspeed_te.tensor import QuantizedTensorStorage

# Each recipe's scales move at every autocast exit: a history of 1 follows each micro-batch's amax at once. HiF8
# delayed starts with one warm-up step (current scaling), so its first micro-batch's backward runs after the
# switch to delayed scales.
RECIPES: dict[str, Callable[[], DelayedScaling]] = {
    "delayed/e4m3": lambda: DelayedScaling(fp8_format=Format.E4M3, amax_history_len=1),
    "delayed/hybrid": lambda: DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=1),
    "hif8_delayed": lambda: HIF8DelayedScaling(amax_collect_interval=1, scale_update_interval=1, amax_history_len=1),
}
SPLITS = [32, 0, 48, 16]
MAGNITUDES = (1.0, 8.0, 0.25)  # of the micro-batches' inputs: each forward leaves another scale


def _train(make_recipe: Callable[[], DelayedScaling], save: bool, grouped: bool, dtype: torch.dtype):
    """Two steps of three micro-batches whose forwards (each its own autocast region, so each updates the forward
    scales) all run before their backwards (last first, as a pipeline schedule may): (per micro-batch: output,
    input grad, weight grads; the forward scale seen by each forward; the final scaling state; the tensors the
    first forward kept for backward, with that forward's input)."""
    torch.manual_seed(0)
    layer = (GroupedLinear(len(SPLITS), 64, 64, bias=False, params_dtype=dtype, save_original_input=save) if grouped
             else Linear(64, 64, params_dtype=dtype, save_original_input=save))
    recipe = make_recipe()
    gen = torch.Generator().manual_seed(1)
    rows = sum(SPLITS)
    results, scales, kept = [], [], None
    for _ in range(2):
        xs = [(torch.randn(rows, 64, generator=gen) * m).to(dtype).requires_grad_() for m in MAGNITUDES]
        dys = [torch.randn(rows, 64, generator=gen).to(dtype) for _ in MAGNITUDES]
        ys = []
        for x in xs:
            with fp8_autocast(fp8_recipe=recipe):
                ys.append(layer(x, SPLITS) if grouped else layer(x))
            scales.append(layer.fp8_states[0].scale.clone())
        if kept is None:
            kept = (_node(ys[0]).saved[0], xs[0])
        for y, dy in reversed(list(zip(ys, dys))):
            y.backward(dy)
        for x, y in zip(xs, ys):
            results.append([y.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()])
        for p in layer.parameters():
            p.grad = None
    state = [t.clone() for s in layer.fp8_states for t in (s.scale, s.amax_history)]
    return results, scales, state, kept


def _node(y: torch.Tensor):
    """The autograd node of the FP8 linear function that made `y` (under a reshape of the grouped output)."""
    node = y.grad_fn
    while not hasattr(node, "saved"):
        node = node.next_functions[0][0]
    return node


@pytest.mark.parametrize("grouped", [False, True], ids=["Linear", "GroupedLinear"])
@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("backend", ["reference", "npu"])
def test_same_results_as_saving_the_codes_across_scale_updates(backend, name, grouped, use_backend):
    use_backend(backend)
    runs = {save: _train(RECIPES[name], save, grouped, torch.bfloat16) for save in (False, True)}
    (ref, scales, state, _), (got, _, got_state, _) = runs[False], runs[True]
    # The scale each forward used differs from the next forward's: a backward quantizing with the state's
    # current scale would not give the forward's codes.
    assert all(not torch.equal(a, b) for a, b in zip(scales, scales[1:]))
    for a, b in zip(ref, got):
        for u, v in zip(a, b):
            assert torch.equal(u, v)
    # The backward recorded no amax: the histories and scales are the same too.
    for u, v in zip(state, got_state):
        assert torch.equal(u, v)


@pytest.mark.parametrize("grouped", [False, True], ids=["Linear", "GroupedLinear"])
def test_float32_inputs_divide_by_the_forwards_float32_scale_inverse(grouped):
    """Float32 inputs divide by the float32 1/scale, not the bfloat16-rounded one."""
    ref, _, state, _ = _train(RECIPES["delayed/e4m3"], False, grouped, torch.float32)
    got, _, got_state, _ = _train(RECIPES["delayed/e4m3"], True, grouped, torch.float32)
    for a, b in zip(ref + [state], got + [got_state]):
        for u, v in zip(a, b):
            assert torch.equal(u, v)


@pytest.mark.parametrize("grouped", [False, True], ids=["Linear", "GroupedLinear"])
@pytest.mark.parametrize("name", ["delayed/e4m3", "hif8_delayed"])
def test_backward_keeps_the_input_itself_not_its_codes(name, grouped):
    """What the autograd node keeps for the wgrad: the input's own memory with save_original_input (nothing
    quantized is held), its columnwise codes without."""
    for save in (False, True):
        *_, (held, x) = _train(RECIPES[name], save, grouped, torch.bfloat16)
        pieces = held if grouped else [held]
        if save:
            assert all(isinstance(p, torch.Tensor) and p.dtype == x.dtype for p in pieces)
            assert all(p.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for p in pieces)
            assert torch.equal(torch.cat(pieces) if grouped else held, x.detach())
        else:
            assert all(isinstance(p, QuantizedTensorStorage) for p in pieces)
