"""NPU backend: the torch_npu 2.14 quantization and GEMM kernels, called as their schemas define them.

This package module assembles `NpuBackend` from one mixin per job, each in its own module (as the
simulator is split): quantize.py (quantize, quantize_many and their kernels; fused_quantize.py, its base, the norm /
activation + quantize kernels), gemm.py (gemm and its
npu_quant_matmul modes), grouped_gemm.py, norm.py, attention.py, mc2.py (the fused communication
GEMMs), moe_rope.py (MoE token permutation, RoPE); common.py holds the few helpers several of them use.

torch_npu is imported here and only here, lazily: importing it needs the CANN libraries. Without an NPU,
`MINDSPEED_TE_NPU_SIMULATOR=1` puts the simulator (mindspeed_te.testing.npu_sim) in its place, which enforces the
kernels' contract on CPU tensors and computes their reference results.

What goes to a kernel and what stays on torch ops (which run on the NPU too):
  delayed      npu_quantize(x, 1/scale, div_mode=True)     1/scale prepared at the update (bfloat16-rounded for
                                                            bfloat16 x); one multi-tensor amax, history max and
                                                            NaN mark for a linear's input and weight together.
                                                            Not npu_quant_max (cast + amax in one launch): it
                                                            multiplies by scale, which rounds the format's ties
                                                            otherwise, and its amax (x's dtype, a new tensor)
                                                            would still take a launch into the history slot
  tensorwise   npu_dynamic_quant(pertensor, dst_type_max)   bfloat16/float16 x; float32 x (not a dtype that
               or amax + 2 small ops + npu_quantize         kernel takes): see _quantize_current. Power-of-2
                                                            scales, amax_epsilon, an amax reduction group or a
                                                            non-kernel target use torch ops
  blockwise    power-of-2 scales (TE's default): npu_dynamic_mx_quant(scale_alg=1) (E4M3/E5M2; partial
               float32 / 128x128 tiles use torch ops; float32 1x128 rows cast by one npu_quantize); columnwise
               1x128 tiles quantized along the tokens as x lies (axis -2), codes and E8M0 bytes kept as the
               kernel made them, which the MX-mode wgrad GEMM takes; HiF8 (whole tiles, bf16/fp32):
               tile amaxes of all the pass's layouts into one buffer, its scales in one chain of torch ops, the
               cast one npu_quantize per layout; other scales (HiF8's default): npu_dynamic_block_quant
               (fp16/bf16/fp32, not with amax_epsilon; HiF8 dst_type_max 15, 56, 224, 32768)
  mxfp8        npu_dynamic_mx_quant(scale_alg 1=ceil, 0=floor); both layouts of a bf16/fp16 tensor: one
               npu_dynamic_mx_quant_with_dual_axis (Ascend 950PR/950DT; its columnwise scales kept as it lays
               them out, which the GEMM takes)
  mxfp4        the same kernels' FP4 output (scale_alg 0, the "floor" rule) and npu_quant_matmul's MX mode with
               float4_e2m1fn_x2 operands (E4M3 x FP4 for fp8_activations); nvfp4 refused: npu/fp4.py
  flags        a quantize pass only notes its non-finite flag updates (quantizers.record_nonfinite_many); the
               state manager folds the whole step's once (FP8GlobalStateManager.fold_nonfinite)
  GEMMs        npu_quant_matmul (per-tensor, [1,128,128] blockwise, [1,1,32] MX, and the 1x128 x 1x128
               blockwise wgrad in the MX mode when its scales are powers of 2; a k past the kernel's 65535,
               a wgrad over more tokens, summed over parts); shapes the kernels cannot
               take (high-precision operands, other 1x128 x 1x128) use
               dequantize + matmul (HiF8 tiles decoded by one npu_dtype_cast, scaled by one broadcast
               multiply). The power-of-2 fprop and dgrad stay in [1,128,128] (an MX-mode fprop
               measured 2 more forward launches for bf16, 1 for float32): MX wants each operand's bytes
               repeated per 32-block (one op each), a float32 bias (one cast of a bf16 bias, as the late add
               is one op), and the float32 scales are made anyway (the non-finite flags read them, the dgrad
               takes the weight's).
  wgrad into   MXFP8 and power-of-2 blockwise E4M3/E5M2 into a float32 main_grad: npu_add_quant_matmul_ (op-plugin
  main_grad    26.0.0+, where torch_npu has it; the float32 sum added once, as GEMM + add); bf16/fp16 (no FP8,
               --no-fp8-wgrad) into float32: npu_grouped_matmul_add_ with one group where it runs (as the
               experts'); others: GEMM, then add
  experts      fprop/dgrad one npu_grouped_matmul (per-tensor, MX, G-B M-split); wgrad one K-split
               npu_grouped_matmul for per-tensor, MXFP8 and power-of-2 blockwise (MX scales laid out by one cat
               per operand, or as npu_grouped_dynamic_mx_quant (26.0.0+) made the experts' columnwise forms: one
               call for all; 128-tile bytes joined and repeated per 32-block by one gather); into main_grads:
               npu_add_quant_gmm_ (MX mode, 26.0.0+, main_grads one buffer in expert order), else one
               _foreach_add_. bf16/fp16 experts
               (no FP8): its non-quantized M-split and K-split modes, except a fprop with biases (the float32
               sum, which the mode does not write: one GEMM per expert); their wgrad into float32 main_grads:
               npu_grouped_matmul_add_ (Atlas A2/A3; the 950 from op-plugin 26.0.0), else the joined rows cast
               once, a float32 GEMM per expert, one _foreach_add_
  fused        npu_rms_norm_dynamic_mx_quant (RMSNorm into MXFP8 rowwise: a linear without wgrad) and
               npu_swiglu_mx_quant_with_dual_axis (SwiGLU into both MXFP8 layouts), where torch_npu has them
               (op-plugin 26.0.0 / 26.1.0 on); no other norm / activation + quantize kernel's rule is a recipe's:
               docs/npu.md, "Fused norm and activation quantize"
  MoE, RoPE    npu_moe_token_permute / npu_moe_token_unpermute (dropless routing, bfloat16) and npu_rotary_mul, each
               with torch_npu's one backward kernel: npu/moe_rope.py
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys
from typing import Any, ClassVar, Optional

import torch

from mindspeed_te import fused_cast
from mindspeed_te.kernels import SIMULATOR_ENV
from mindspeed_te.kernels.base import Capabilities, KernelBackend
from mindspeed_te.kernels.npu.attention import NpuAttention
from mindspeed_te.kernels.npu.fp4 import NpuFP4
from mindspeed_te.kernels.npu.gemm import NpuGemm
from mindspeed_te.kernels.npu.grouped_gemm import NpuGroupedGemm
from mindspeed_te.kernels.npu.mc2 import NpuMc2
from mindspeed_te.kernels.npu.moe_rope import MoeRopeKernels
from mindspeed_te.kernels.npu.norm import NpuNorm
from mindspeed_te.kernels.npu.quantize import NpuQuantize
from mindspeed_te.kernels.reference import ReferenceBackend


def _installed_torch_npu() -> Optional[Any]:
    """The real torch_npu, imported, when it is installed; None when it is not. An installed torch_npu that
    fails to import raises its error."""
    if sys.modules.get("torch_npu") is None and importlib.util.find_spec("torch_npu") is None:
        return None
    import torch_npu  # the one place the real module is imported

    return torch_npu


def npu_device_available() -> bool:
    """Whether torch_npu sees an NPU. torch.npu exists only once torch_npu is imported, which torch's backend
    autoload may not have done (turned off, or a torch_npu older than it): an installed torch_npu is imported
    here first, so an Ascend host is not taken for one without an accelerator. One that fails to import raises,
    naming the cause, rather than leaving the run on the CPU."""
    npu = getattr(torch, "npu", None)
    if npu is None:
        try:
            if _installed_torch_npu() is None:
                return False
        except Exception as err:  # a missing CANN library: ImportError or OSError; torch_npu's own checks: others
            raise RuntimeError(
                f"torch_npu is installed but cannot be imported ({type(err).__name__}: {err}); set up the CANN "
                "environment (source its set_env.sh) to run on the NPU, or uninstall torch_npu to run on the CPU"
            ) from err
        npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def _refuse_simulator_on_an_npu(simulator: str) -> None:
    """The simulator stands in for torch_npu where there is no NPU; left set where there is one, it would
    replace the chip's kernels by CPU emulation without a word. A torch_npu that cannot be imported drives no
    NPU, so the simulator may stand in for it."""
    try:
        present = npu_device_available()
    except RuntimeError:
        present = False
    if present:
        raise RuntimeError(
            f"{SIMULATOR_ENV}={simulator} asks for the torch_npu simulator, but torch_npu is installed and sees an "
            f"NPU ({torch.npu.get_device_name()}): unset {SIMULATOR_ENV} (or set it to 0) to run on the NPU"
        )


def load_torch_npu() -> Any:
    """torch_npu, or the simulator when MINDSPEED_TE_NPU_SIMULATOR is 1 (an Ascend 950PR) or a chip name
    starting with "Ascend" (that chip, e.g. Ascend950DT), which is refused on a host with an NPU. A chip name may
    end in @release: the kernels of that torch_npu release (Ascend950PR@26.1; 2.14 without one)."""
    simulator = os.environ.get(SIMULATOR_ENV, "0")
    if simulator == "1" or simulator.startswith("Ascend"):
        _refuse_simulator_on_an_npu(simulator)
        from mindspeed_te.testing.npu_sim import RELEASES, make_release_simulator

        chip, _, release = ("Ascend950PR" if simulator == "1" else simulator).partition("@")
        return make_release_simulator(chip, release or RELEASES[0])
    try:
        torch_npu = _installed_torch_npu()
        if torch_npu is None:
            raise ModuleNotFoundError("No module named 'torch_npu'", name="torch_npu")
    except ImportError as err:
        raise RuntimeError(
            f"MINDSPEED_TE_BACKEND=npu needs torch_npu (pip install 'mindspeed_te[npu]', with the CANN "
            f"libraries), or {SIMULATOR_ENV}=1 to run the NPU path on the torch_npu simulator: {err}"
        ) from err
    return torch_npu


@functools.lru_cache(maxsize=2)
def _npu_backend(simulator: str) -> NpuBackend:
    return NpuBackend(load_torch_npu())


def get_npu_backend() -> NpuBackend:
    """The NPU backend, one per value of MINDSPEED_TE_NPU_SIMULATOR (the real torch_npu or a simulated chip)."""
    return _npu_backend(os.environ.get(SIMULATOR_ENV, "0"))


get_npu_backend.cache_clear = _npu_backend.cache_clear  # type: ignore[attr-defined]


# The kernel contract's methods (kernels/base.py), each of which a device backend implements or takes from the
# reference emulation.
CONTRACT_METHODS = tuple(name for name, value in vars(KernelBackend).items()
                         if callable(value) and not name.startswith("_"))


def check_emulations(cls: type) -> None:
    """Raise TypeError unless every contract method that `cls` takes from the reference emulation (found in
    ReferenceBackend or KernelBackend along its MRO) is declared in `cls.reference_emulations`, and every
    declared one is such a method: emulation on a device is then a decision, never a missing override."""
    declared = getattr(cls, "reference_emulations", {})
    emulated = {name for name in CONTRACT_METHODS
                if next(owner for owner in cls.__mro__ if name in vars(owner)) in ReferenceBackend.__mro__}
    problems = []
    if undeclared := sorted(emulated - set(declared)):
        problems.append(f"emulated by the reference without a declaration: {', '.join(undeclared)} (implement "
                        "them in an NPU mixin or declare them in reference_emulations, name -> reason)")
    if stale := sorted(set(declared) - emulated):
        problems.append(f"declared but not taken from the reference: {', '.join(stale)} (reference_emulations "
                        f"takes only contract methods that the reference implements: {', '.join(CONTRACT_METHODS)})")
    if problems:
        raise TypeError(f"{cls.__name__}: " + "; ".join(problems))


class DeclaredEmulations:
    """Checks each class made from it (`check_emulations`) as it is created, so that a contract method left to
    the reference emulation fails at import, not as a silently emulated kernel on the device."""

    reference_emulations: ClassVar[dict[str, str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_emulations(cls)


class NpuBackend(DeclaredEmulations, NpuMc2, NpuQuantize, NpuNorm, NpuAttention, NpuFP4, NpuGemm, NpuGroupedGemm,
                 MoeRopeKernels, ReferenceBackend):
    """Dispatches quantize, GEMM, norm, attention, MoE permutation and RoPE to torch_npu kernels where they apply;
    the contract methods in `reference_emulations` are the reference's, for the reasons given there."""

    name = "npu"
    reference_emulations = {
        "read_twice": "a cache, not a kernel: npu_quant_matmul takes per-tensor codes undecoded; the reference keeps "
                      "one decode per block for its dequantize + matmul fallback",
    }
    # aclnnAllGatherMatmulV2 / aclnnMatmulReduceScatterV2 (Ascend 950): "k轴取值范围为[256, 65535)"; the bindings of
    # the base (high-precision) kernels: "world_size should be in [2, 4, 8, 16, 32]" (the quant ones add 64)
    # aclnnGroupedMatmulV4: "实现分组矩阵乘计算，每组矩阵乘的维度大小可以不同" (each group's sizes may differ); the
    # per-tensor modes (T-T) add no alignment of their own. Nor do blockwise experts: each one's wgrad (1x128 tiles
    # on both operands, which no blockwise mode takes) runs in the MX mode, whose last block along k (the tokens)
    # may be short ("kLoops=ceil(K_i / gsK)，支持最后的切片长度不足gsK"), as an expert's last tile is.
    capabilities = Capabilities(fused_communication_gemm=True, fused_communication_k_range=(256, 65535),
                                fused_communication_world_sizes=(2, 4, 8, 16, 32), native_mx_gemm=True,
                                unaligned_per_tensor_groups=True, blockwise_expert_rows=1)
    bf16_output_gemm = False  # the dequantize fallback runs as the device would run it

    def __init__(self, torch_npu: Any) -> None:
        super().__init__()
        self.npu = torch_npu
        device_name = torch_npu.npu.get_device_name()
        self.device_name = device_name
        self.supports_fp8 = str(device_name).startswith("Ascend950")
        if getattr(torch_npu, "is_simulator", False):  # its cube sums as the reference backend's GEMM does
            torch_npu.set_bf16_matmul(fused_cast.gemm_bf16)
        # MX experts at any rows where torch_npu's grouped MX quantize lays out each expert's pairs by itself, its
        # last block short (aclnnGroupedDynamicMxQuant; the K-split MX GEMM: "支持最后的切片长度不足gsK"); else at
        # whole 64-row pairs of their columnwise scales (aclnnDynamicMxQuant mxscaleOut: "并对其进行偶数pad"): one
        # quantize call then makes every expert's forms, which lie joined.
        grouped_mx = hasattr(torch_npu, "npu_grouped_dynamic_mx_quant")
        self.capabilities = dataclasses.replace(self.capabilities, mx_expert_rows=1 if grouped_mx else 64)

    def available(self) -> tuple[bool, str]:
        """FP8, HiF8 and MX kernels exist on the Ascend 950 series only."""
        if self.supports_fp8:
            return True, ""
        return False, (f"the NPU is {self.device_name}; FP8/HiF8/MXFP8 matmuls need an Ascend 950 series chip "
                       "(A2/A3 chips have int8/int4 quantized matmuls only)")
