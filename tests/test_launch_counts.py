"""Device launches counted the way an NPU runs them: every aten op that is not a view or an allocation, plus
every torch_npu kernel (the simulator's own torch ops inside a kernel are not launches)."""
import torch

from mindspeed_te.diagnostics import LaunchCounter
from mindspeed_te.kernels.npu_sim import make_simulator


def test_counter_counts_compute_ops_not_views_or_allocations():
    x = torch.randn(4, 6)
    with LaunchCounter() as counter:
        y = x + 1  # one kernel
        y.view(-1), y.t(), y[1:], y.reshape(6, 4)  # views: no kernel
        torch.empty(3)  # allocation: no kernel
        y.abs().amax()  # two kernels
    assert counter.counts == {"aten.add": 1, "aten.abs": 1, "aten.amax": 1}
    assert counter.total == 3 and counter.npu_kernels == 0


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
