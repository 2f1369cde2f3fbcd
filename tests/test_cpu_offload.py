"""Activation offload (TE's get_cpu_offload_context, Megatron's --cpu-offloading): the offloaded run computes
the same bits as the run without it, the offloaded layers' saved tensors leave device memory (FP8 activations
as their 1-byte codes), and TE's rule picks which tensors go."""
from __future__ import annotations

import importlib.util

import pytest
import torch

import mindspeed_te as te
from mindspeed_te.bench.memory import LiveStorages
from mindspeed_te.ops import cpu_offload
from mindspeed_te.recipe import DelayedScaling, Float8CurrentScaling, Format, MXFP8BlockScaling

TOKENS, HIDDEN = 1024, 512  # a [tokens, hidden] activation has 512 Ki elements: above TE's 256 Ki threshold
RECIPES = {"bf16": None, "hif8-delayed": DelayedScaling(fp8_format=Format.HIF8),
           "e4m3-current": Float8CurrentScaling(), "mxfp8": MXFP8BlockScaling()}
# on CUDA the accelerator path runs: side stream, pinned host buffers, non-blocking copies, record_stream
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture
def offloads(monkeypatch):
    """(layer, dtype, numel) of every storage copied to host memory."""
    made: list[tuple[int, torch.dtype, int]] = []
    offload = cpu_offload.OffloadSchedule._offload

    def recorded(self, t, storage):
        copy = offload(self, t, storage)
        made.append((self.layer, copy.host.dtype, copy.host.numel()))
        return copy

    monkeypatch.setattr(cpu_offload.OffloadSchedule, "_offload", recorded)
    return made


def _layers(n: int = 4, device: str = "cpu") -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [te.LayerNormLinear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16, device=device) for _ in range(n)]


def _run(layers, recipe, offload_layers: int, x0: torch.Tensor) -> list[torch.Tensor]:
    """Forward (each layer: LayerNormLinear then GeLU, as TE's usage wraps a layer) and backward; the output,
    the input's and every weight's gradient."""
    context, sync = te.get_cpu_offload_context(offload_layers > 0, offload_layers, len(layers))
    x = x0.detach().requires_grad_()
    h = x
    with te.fp8_autocast(recipe is not None, fp8_recipe=recipe):
        for layer in layers:
            with context:
                h = torch.nn.functional.gelu(layer(h))
            h = sync(h)
    h.float().square().sum().backward()
    grads = [h.detach(), x.grad, *(layer.weight.grad for layer in layers)]
    for layer in layers:
        layer.weight.grad = None
    return grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", RECIPES)
def test_offloaded_run_gives_the_same_bits(name, device, offloads):
    recipe = RECIPES[name]
    x0 = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16, device=device)
    # fresh layers alike for each (delayed scaling's state moves on with every step); two micro-batches each:
    # the schedule starts again at the first layer
    layers = _layers(device=device)
    plain = [_run(layers, recipe, 0, x0) for _ in range(2)]
    layers = _layers(device=device)
    offloaded = [_run(layers, recipe, 2, x0) for _ in range(2)]
    for a, b in zip(plain, offloaded):
        for u, v in zip(a, b):
            assert torch.equal(u, v)
    assert offloads and {layer for layer, _, _ in offloads} == {0, 1}  # the first 2 of 4 layers, each micro-batch
    codes = [n for _, dtype, n in offloads if dtype.itemsize == 1]  # uint8 (HiF8) or float8_e4m3fn
    if recipe is None:
        assert not codes
    else:  # the linear's input for its FP8 wgrad, as codes: one byte an element
        assert codes and all(n >= TOKENS * HIDDEN for n in codes)


def test_offloaded_layers_release_their_device_memory():
    """Bytes made in the first layer's forward that are still alive after the forward of all layers (what the
    layer keeps for backward), less what is in host memory: nearly nothing once offloaded."""
    layers, recipe = _layers(2), MXFP8BlockScaling()
    x0 = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16)

    def kept(offload: bool) -> int:
        context, sync = te.get_cpu_offload_context(offload, 1, 2)
        tracker = LiveStorages()
        x = x0.detach().requires_grad_()
        with te.fp8_autocast(True, fp8_recipe=recipe):
            with tracker:
                with context:
                    h = torch.nn.functional.gelu(layers[0](x))
                h = sync(h)
            with context:
                out = torch.nn.functional.gelu(layers[1](h))
            out = sync(out)
        held = tracker.live_bytes(leave_out=(h,)) - (context.host_bytes if offload else 0)
        out.float().sum().backward()
        return held

    kept(False)  # FP8 metadata and weights' first quantize
    without, with_offload = kept(False), kept(True)
    assert without > TOKENS * HIDDEN * 3  # the GeLU's bf16 input and the linear's input codes (x0 is older)
    # What stays: the weight's MX codes and scales, quantized in this forward (weights stay on the device: about
    # HIDDEN² bytes) and tensors below the threshold (the norm's statistics)
    assert with_offload < HIDDEN * HIDDEN * 1.1 + 65536


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_frees_cuda_memory_into_pinned_buffers(monkeypatch):
    """4 layers, the first 2 offloaded: after the forward the device holds less by about what went to host
    memory (each storage freed at its layer's end, once its side-stream copy has read it), all of it pinned."""
    pinned: list[bool] = []
    offload = cpu_offload.OffloadSchedule._offload

    def recorded(self, t, storage):
        copy = offload(self, t, storage)
        pinned.append(copy.host.is_pinned())
        return copy

    monkeypatch.setattr(cpu_offload.OffloadSchedule, "_offload", recorded)
    layers, recipe = _layers(device="cuda"), MXFP8BlockScaling()
    x0 = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16, device="cuda")

    def held(offload_layers: int) -> tuple[int, int]:
        context, sync = te.get_cpu_offload_context(offload_layers > 0, offload_layers, len(layers))
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        h = x0.detach().requires_grad_()
        with te.fp8_autocast(True, fp8_recipe=recipe):
            for layer in layers:
                with context:
                    h = torch.nn.functional.gelu(layer(h))
                h = sync(h)
        torch.cuda.synchronize()
        kept, host = torch.cuda.memory_allocated() - before, context.host_bytes if offload_layers else 0
        h.float().square().sum().backward()
        return kept, host

    held(0)  # FP8 metadata and the weights' first quantize
    without, _ = held(0)
    with_offload, host = held(2)
    assert pinned and all(pinned)
    assert host > 2 * TOKENS * HIDDEN and without - with_offload >= 0.8 * host, (without, with_offload, host)


def test_views_of_one_storage_travel_once(offloads):
    """q and k saved by a product are views of one projection output: its storage is copied once."""
    context, sync = te.get_cpu_offload_context(True, 1, 2)
    x = torch.randn(TOKENS, 2 * HIDDEN, requires_grad=True)
    with context:
        proj = x * 1.5
        q, k = proj.chunk(2, dim=-1)
        y = q * k
    y = sync(y)
    with context:
        z = y * 2.0
    z = sync(z)
    z.sum().backward()
    assert offloads == [(0, torch.float32, TOKENS * 2 * HIDDEN)]
    q_ref, k_ref = (x.detach() * 1.5).chunk(2, dim=-1)
    assert torch.equal(x.grad, 2.0 * 1.5 * torch.cat([k_ref, q_ref], dim=-1))


def test_small_parameters_and_marked_tensors_stay(offloads):
    context, sync = te.get_cpu_offload_context(True, 1, 2)
    weight = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN))  # saved by the matmul: a parameter
    small = torch.randn(16, HIDDEN, requires_grad=True)  # below the threshold
    marked = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    te.mark_not_offload(marked)
    with context:
        y = (small @ weight).sum() + (marked * marked).sum()
    y = sync(y)
    y.backward()
    assert offloads == []
    assert torch.equal(marked.grad, 2 * marked.detach())


@pytest.mark.parametrize("kwargs, flag", [
    (dict(num_layers=2, model_layers=2), "--cpu-offloading-num-layers"),
    (dict(num_layers=0, model_layers=2), "--cpu-offloading-num-layers"),
    (dict(num_layers=1, model_layers=2, offload_weights=True), "--cpu-offloading-weights"),
    (dict(num_layers=1, model_layers=2, offload_activations=False), "--no-cpu-offloading-activations"),
    (dict(num_layers=1, model_layers=2, manual_synchronization=True), "manual_synchronization"),
])
def test_bad_settings_are_refused_by_name(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        te.get_cpu_offload_context(True, **kwargs)


def test_disabled_context_does_nothing():
    context, sync = te.get_cpu_offload_context(False, 1, 2)
    x = torch.ones(3)
    with context:
        assert sync(x) is x


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
@pytest.mark.parametrize("fp8", [None, ("hif8", "delayed"), ("e4m3", "mxfp8")], ids=["bf16", "hif8", "mxfp8"])
def test_megatron_block_with_cpu_offloading_gives_the_same_bits(fp8):
    """Megatron's TransformerBlock with config.cpu_offloading (its --cpu-offloading) calls our context around each
    layer and our sync function on each output: same output and gradients as without, activations in host memory."""
    from mindspeed_te.bench.gpt import megatron_world
    from mindspeed_te.bench.layer import build_block

    def run(**offload) -> list[torch.Tensor]:
        block = build_block(2, fp8, moe=False, hidden=HIDDEN, **offload)
        x0 = torch.randn(TOKENS, 1, HIDDEN, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
        results = []
        for first in (True, False):  # a step's first micro-batch and a later one
            if first:
                block.set_is_first_microbatch()
            x = x0.clone().requires_grad_()
            out = block(x, attention_mask=None)
            out.float().square().sum().backward()
            results += [out.detach(), x.grad]
        return results + [p.grad for p in block.parameters()]

    with megatron_world():
        plain = run()
        offloaded = run(cpu_offloading=True, cpu_offloading_num_layers=1)
    assert len(plain) == len(offloaded)
    for a, b in zip(plain, offloaded):
        assert torch.equal(a, b)
