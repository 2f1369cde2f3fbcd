"""The CPU device adaptor: torch.cuda calls Megatron makes get their CPU meaning, and come back on revert."""
from __future__ import annotations

import time

import torch

from patches.device_cpu import Event, Stream, TORCH_CUDA, accelerator_present, register_device_cpu
from patches.registry import PatchRegistry


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
