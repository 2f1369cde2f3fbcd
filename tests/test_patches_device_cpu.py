"""The CPU device adaptor: torch.cuda calls Megatron makes get their CPU meaning, and come back on revert."""
from __future__ import annotations

import time

import torch

from mindspeed_te.patches.device_cpu import Event, Stream, TORCH_CUDA, accelerator_present, register_device_cpu
from mindspeed_te.patches.registry import PatchRegistry


def test_streams_and_events_behave_like_synchronous_cuda_ones():
    stream = Stream(device="cpu", priority=-1)
    assert stream.query() and stream.wait_stream(Stream()) is None
    event = stream.record_event()
    assert isinstance(event, Event)
    event.synchronize()
    start, end = Event(enable_timing=True), Event(enable_timing=True)
    start.record()
    time.sleep(0.01)
    end.record()
    assert 5 <= start.elapsed_time(end) < 1000


def test_adaptor_routes_torch_cuda_to_the_cpu_and_reverts():
    assert not accelerator_present()  # this machine has neither CUDA nor an NPU
    original = torch.cuda.current_device
    registry = PatchRegistry()
    register_device_cpu(registry)
    registry.apply()
    try:
        assert torch.cuda.current_device() == torch.device("cpu")
        assert torch.zeros(2, device=torch.cuda.current_device()).device.type == "cpu"
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda.synchronize()
        torch.cuda.manual_seed(7)
        state = torch.cuda.get_rng_state()
        first = torch.rand(3)
        torch.cuda.set_rng_state(state)
        assert torch.equal(torch.rand(3), first)  # Megatron's RNG tracker round-trips the CPU generator
        assert torch.cuda.memory_allocated() == 0 and torch.cuda.memory_stats() == {}
    finally:
        registry.revert()
    assert torch.cuda.current_device is original
    assert set(TORCH_CUDA) <= set(dir(torch.cuda))  # every target is a real torch.cuda name


def test_literal_cuda_devices_land_on_the_cpu_and_type_names_read_as_cuda():
    originals = (torch.zeros, torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.type)
    registry = PatchRegistry()
    register_device_cpu(registry)
    registry.apply()
    try:
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.tensor([1.0], device="cuda:0").device.type == "cpu"
        assert torch.full((1,), 3.0, device=torch.device("cuda")).device.type == "cpu"
        x = torch.ones(2, dtype=torch.bfloat16)
        assert x.cuda() is x and x.to("cuda").device.type == "cpu" and x.to(device=0).device.type == "cpu"
        assert x.to(torch.float32).dtype == torch.float32  # other uses of .to are untouched
        assert x.type() == "torch.cuda.BFloat16Tensor" and torch.ones(1).type() == "torch.cuda.FloatTensor"
        assert x.type("torch.cuda.FloatTensor").dtype == torch.float32
    finally:
        registry.revert()
    assert torch.ones(1).type() == "torch.FloatTensor"
    assert (torch.zeros, torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.type) == originals
