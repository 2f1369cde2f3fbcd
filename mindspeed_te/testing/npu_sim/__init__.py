"""A CPU stand-in for `torch_npu` (2.14.0): the quantization, GEMM, mc2, attention, norm, MoE permutation and RoPE
kernels the NPU backend calls. It is a test double, independent of the library it tests (it never imports
mindspeed_te's formats, quantizers, scaling or kernels).

`make_simulator()` returns a fresh module object that can be put where `torch_npu` would be
(`sys.modules["torch_npu"] = sim`). Each kernel

* checks its arguments the way the real kernel's contract does (the op-plugin meta registrations and docs of
  torch_npu 2.14.0, and the CANN docs of the Ascend 950 series; the document line is quoted beside each
  check) and raises on any violation. The errors are `RuntimeError`s, as torch_npu's are, and also
  `TypeError` (dtypes) or `ValueError` (shapes, values); the message starts with the kernel's name and names
  the offending argument;
* computes the result on CPU with the simulator's own format codecs (`codecs.py`);
* counts itself in `sim.launch_counts` once its arguments passed the checks (a rejected call launches nothing).

Keyword names follow torch_npu 2.14. The first tensor of the single-input kernels is positional-only here: the
real ops are `torch.ops.npu` overloads whose schema calls it `self` or `x` while the docs say `input`, so the
library must pass it positionally.

Calls the real kernel accepts but that the library never makes (int8/int4 data, FP4 other than E2M1 in the MX
modes, pseudo-quantization other than MX E4M3 x FP4, activations fused into grouped GEMMs, ...) raise
`NpuSimNotImplemented` instead of being guessed at.

Layout: dtypes.py (dtype numbers), errors.py, checks.py (argument checks, the `kernel` wrapper), codecs.py
(encode/decode), fp4.py (E2M1 codec, the packed layout, the MX quantize kernels' FP4 arguments), blocks.py (tiles),
quantize.py, gemm.py, grouped_gemm.py, mc2.py, attention.py, norm.py, moe.py,
rope.py, simulator.py; quant_max.py: npu_quant_max, which the backend does not call (its rule multiplies by the
scale), on a simulator of its own (`make_simulator_with_quant_max`), so that the default one lacks it;
fused_quant.py: npu_rms_norm_dynamic_mx_quant and npu_swiglu_mx_quant_with_dual_axis (op-plugin 26.0.0 / 26.1.0 and
later), which the backend calls where torch_npu has them, on a simulator of their own
(`make_simulator_with_fused_quant`); fused_wgrad.py: npu_grouped_dynamic_mx_quant, npu_add_quant_matmul_ and
npu_add_quant_gmm_ (op-plugin 26.0.0 and later), likewise (`make_simulator_with_fused_wgrad`); releases.py: a
simulated torch_npu 26.1 with all of them (`make_release_simulator`).
"""
from mindspeed_te.testing.npu_sim.dtypes import FLOAT4_E2M1FN_X2, FLOAT8_E4M3FN, FLOAT8_E5M2, FLOAT8_E8M0FNU, HIFLOAT8
from mindspeed_te.testing.npu_sim.errors import (
                                                 NpuContractError,
                                                 NpuSimNotImplemented,
                                                 NpuSocError,
                                                 NpuTypeError,
                                                 NpuValueError,
)
from mindspeed_te.testing.npu_sim.fused_quant import (
                                                 NpuSimulatorWithFusedQuant,
                                                 make_simulator_with_fused_quant,
)
from mindspeed_te.testing.npu_sim.fused_wgrad import (
                                                 NpuSimulatorWithFusedWgrad,
                                                 make_simulator_with_fused_wgrad,
)
from mindspeed_te.testing.npu_sim.quant_max import (
                                                 NpuSimulatorWithQuantMax,
                                                 make_simulator_with_quant_max,
)
from mindspeed_te.testing.npu_sim.releases import RELEASES, NpuSimulator26, make_release_simulator
from mindspeed_te.testing.npu_sim.simulator import NpuSimulator, make_simulator

__all__ = [
    "NpuSimulator",
    "make_simulator",
    "NpuSimulatorWithQuantMax",
    "make_simulator_with_quant_max",
    "NpuSimulatorWithFusedQuant",
    "make_simulator_with_fused_quant",
    "NpuSimulatorWithFusedWgrad",
    "make_simulator_with_fused_wgrad",
    "RELEASES",
    "NpuSimulator26",
    "make_release_simulator",
    "NpuContractError",
    "NpuTypeError",
    "NpuValueError",
    "NpuSocError",
    "NpuSimNotImplemented",
    "HIFLOAT8",
    "FLOAT8_E5M2",
    "FLOAT8_E4M3FN",
    "FLOAT8_E8M0FNU",
    "FLOAT4_E2M1FN_X2",
]
