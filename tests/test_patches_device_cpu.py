"""The CPU device adaptor: torch.cuda calls Megatron makes get their CPU meaning, and come back on revert."""
from __future__ import annotations

import time

import torch

from mindspeed_te.patches.device_cpu import TORCH_CUDA, Event, Stream, accelerator_present, register_device_cpu
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


def test_nccl_requests_get_gloo_and_device_properties_answer(tmp_path):
    registry = PatchRegistry()
    register_device_cpu(registry)
    registry.apply()
    try:
        props = torch.cuda.get_device_properties(0)
        assert (props.major, props.minor) == torch.cuda.get_device_capability() and props.multi_processor_count >= 1
        torch.distributed.init_process_group(backend="nccl", init_method=f"file://{tmp_path}/init", rank=0,
                                             world_size=1)
        try:
            assert torch.distributed.get_backend() == "gloo"
            group = torch.distributed.new_group([0], backend="nccl")
            x = torch.ones(3)
            torch.distributed.all_reduce(x, group=group)
            assert torch.distributed.get_backend(group) == "gloo" and torch.equal(x, torch.ones(3))
        finally:
            torch.distributed.destroy_process_group()
    finally:
        registry.revert()


def test_destroy_model_parallel_frees_every_group_megatron_created(tmp_path):
    """Megatron forgets its NCCL groups on destroy; served by gloo they would keep their sockets and threads."""
    from megatron.core import parallel_state

    registry = PatchRegistry()
    register_device_cpu(registry)
    registry.apply()
    try:
        torch.distributed.init_process_group(backend="nccl", init_method=f"file://{tmp_path}/init", rank=0,
                                             world_size=1)
        try:
            live = torch.distributed.distributed_c10d._world.pg_map
            for _ in range(2):  # re-initialising after a destroy works
                parallel_state.initialize_model_parallel(1, 1)
                created = [g for g in parallel_state._global_process_group_list if g is not None]
                x = torch.ones(2)
                torch.distributed.all_reduce(x, group=parallel_state.get_tensor_model_parallel_group())
                assert len(created) > 5 and all(g in live for g in created) and torch.equal(x, torch.ones(2))
                parallel_state.destroy_model_parallel()
                assert not any(g in live for g in created)
                assert list(live) == [torch.distributed.group.WORLD]
        finally:
            torch.distributed.destroy_process_group()
    finally:
        registry.revert()


def test_checkpoint_exchange_buffers_asked_on_cuda_land_on_the_cpu():
    """ShardedTensor.init_data's default init_fn is the torch.empty bound at Megatron's import."""
    from megatron.core.dist_checkpointing import ShardedTensor

    registry = PatchRegistry()
    register_device_cpu(registry)
    registry.apply()
    try:
        sharded = ShardedTensor.from_rank_offsets("w", torch.ones(2, 3, dtype=torch.bfloat16))
        sharded.data = None
        sharded.init_data("cuda")
        assert sharded.data.device.type == "cpu" and sharded.data.shape == (2, 3)
        assert sharded.data.dtype == torch.bfloat16
    finally:
        registry.revert()


def test_host_copy_of_a_quantized_tensor_is_its_dequantized_values():
    """On a device the D2H copy goes through the tensor's dispatch and gives plain values; Megatron's
    checkpoint writer relies on it (its files load with weights_only=True)."""
    from mindspeed_te import Float8Quantizer, FP8Dtype, QuantizedTensor

    quantizer = Float8Quantizer(torch.ones(1), torch.zeros(1), FP8Dtype.E4M3)
    x = torch.tensor([0.5, -3.0, 448.0, 1000.0])
    quantized = QuantizedTensor.from_storage(quantizer.quantize(x), quantizer)
    registry = PatchRegistry()
    register_device_cpu(registry)
    registry.apply()
    try:
        host = quantized.to("cpu", non_blocking=True)
        assert type(host) is torch.Tensor and torch.equal(host, torch.tensor([0.5, -3.0, 448.0, 448.0]))
        assert quantized.to("cuda") is quantized  # a device tensor stays where it is
    finally:
        registry.revert()


def _uneven_gather_worker(rank: int, world: int) -> list:
    registry = PatchRegistry()
    register_device_cpu(registry)
    registry.apply()
    try:
        mine = torch.full((2 * rank,), float(rank + 1))  # rank 0 sends an empty tensor, as NCCL allows
        out = [torch.empty(2 * r) for r in range(world)]
        torch.distributed.all_gather(out, mine)
        return out
    finally:
        registry.revert()


def test_all_gather_into_tensors_of_different_sizes_as_nccl_allows():
    from tests.dist_utils import run_distributed

    for result in run_distributed(_uneven_gather_worker, 3):
        assert [t.tolist() for t in result] == [[], [2.0, 2.0], [3.0, 3.0, 3.0, 3.0]]
