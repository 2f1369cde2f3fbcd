"""npu_rotary_mul and its backward kernel npu_rotary_mul_backward (aclnnRotaryPositionEmbedding / ...Grad).

torch_npu gives npu_rotary_mul its backward through op-plugin's derivatives.yaml ("self, r1, r2:
npu_rotary_mul_backward(grad, self, r1, r2, rotary_mode)"): one kernel; op-plugin passes x to it only when r1 or r2
needs a gradient ("x = (r1.requires_grad() || r2.requires_grad()) ? self : at::Tensor()"; aclnnRotaryPosition-
EmbeddingGrad: "xOptional ... 空指针时不计算 dcosOut 和 dsinOut").

Numerics: the Ascend 950 kernel (ops-transformer rotary_position_embedding op_kernel/arch35) loads x, cos and sin
into float32 registers ("MicroAPI::RegTensor<float>"), multiplies and adds there and stores once in x's dtype; the
simulator does the same (float32 products and sum, one rounding). The grad kernel likewise, by its document's
formulas.

Modes: op-plugin maps rotary_mode "half" 0, "interleave" 1, "quarter" 2, "interleave-half" 3
(OpUtils.cpp get_rotary_mode) and takes only "half" and "interleave" below the Ascend 950 ("The rotary_mode of
npu_rotary_mul should be half or interleave", checked unless "GetSocVersion() >= SocVersion::Ascend950").
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from mindspeed_te.testing.npu_sim.checks import check_choice, check_dims, check_none, check_tensor, kernel
from mindspeed_te.testing.npu_sim.dtypes import FLOATS
from mindspeed_te.testing.npu_sim.errors import NpuSimNotImplemented, NpuSocError, NpuValueError

MODES_950 = ("half", "interleave", "quarter", "interleave-half")
MODES_A2_A3 = ("half", "interleave")


def _parts(x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the term cos multiplies, the term sin multiplies) of aclnnRotaryPositionEmbedding's formulas."""
    if mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return x, torch.cat((-x2, x1), dim=-1)
    if mode == "interleave":
        x1, x2 = x[..., ::2], x[..., 1::2]
        return x, torch.stack((-x2, x1), dim=-1).reshape(x.shape)
    if mode == "quarter":
        x1, x2, x3, x4 = x.chunk(4, dim=-1)
        return x, torch.cat((-x2, x1, -x4, x3), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]  # interleave-half: "x_part1 = cat(x1, x2), x_part2 = cat(-x2, x1)"
    return torch.cat((x1, x2), dim=-1), torch.cat((-x2, x1), dim=-1)


def _grad_x(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str) -> torch.Tensor:
    """dx of aclnnRotaryPositionEmbeddingGrad's formulas, in float32."""
    if mode == "quarter":
        dys, coss, sins = (t.chunk(4, dim=-1) for t in (dy, cos, sin))
        return torch.cat([piece for i in (0, 2) for piece in (
            coss[i] * dys[i] + sins[i + 1] * dys[i + 1], coss[i + 1] * dys[i + 1] - sins[i] * dys[i])], dim=-1)
    if mode == "interleave":
        (dy1, dy2), (cos1, cos2), (sin1, sin2) = ((t[..., ::2], t[..., 1::2]) for t in (dy, cos, sin))
    else:
        (dy1, dy2), (cos1, cos2), (sin1, sin2) = (t.chunk(2, dim=-1) for t in (dy, cos, sin))
    first, second = cos1 * dy1 + sin2 * dy2, cos2 * dy2 - sin1 * dy1
    if mode == "half":
        return torch.cat((first, second), dim=-1)
    return torch.stack((first, second), dim=-1).reshape(dy.shape)  # interleave, interleave-half


def _table_grad(terms: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """dcos / dsin: "sum(dy * ..., dims)" over the dims the table broadcast along."""
    dims = tuple(i for i in range(terms.dim()) if table.shape[i] == 1 and terms.shape[i] != 1)
    return terms.sum(dim=dims, keepdim=True) if dims else terms


class _RotaryMul(torch.autograd.Function):
    """The forward kernel's values; the backward is the simulator's npu_rotary_mul_backward."""

    @staticmethod
    def forward(ctx: Any, sim: Any, x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, mode: str) -> torch.Tensor:
        part1, part2 = _parts(x.float(), mode)
        ctx.sim, ctx.mode = sim, mode
        ctx.save_for_backward(x, r1, r2)
        ctx.set_materialize_grads(False)
        return (part1 * r1.float() + part2 * r2.float()).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: Optional[torch.Tensor]) -> tuple:
        if dy is None:
            return None, None, None, None, None
        x, r1, r2 = ctx.saved_tensors
        dx, dr1, dr2 = ctx.sim.npu_rotary_mul_backward(dy, x, r1, r2, rotary_mode=ctx.mode)
        return None, dx, dr1, dr2, None


class RopeKernels:
    """npu_rotary_mul (differentiable) and npu_rotary_mul_backward."""

    def _check_rotary(self, x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, mode: str, x_name: str,
                      tables_need_grad: bool) -> None:
        """The shared contract of npu_rotary_mul and its backward on this chip."""
        # torch_npu doc: input, r1, r2 "数据类型支持float16，bfloat16，float32"; aclnnRotaryPositionEmbedding: cos, sin
        # "与x数据类型一致" (op-plugin casts mixed tables with extra kernels, which the library never asks for).
        check_tensor(x_name, x, FLOATS)
        check_tensor("r1", r1, (x.dtype,))
        check_tensor("r2", r2, (x.dtype,))
        # 950: "输入张量x共有四维"; the older torch_npu document: input, r1, r2 "4维Tensor" (TND's 3 dims not modeled).
        for name, t in ((x_name, x), ("r1", r1), ("r2", r2)):
            check_dims(name, t, 4, 4)
        # "输入张量cos和sin的shape必须完全相同"
        if r1.shape != r2.shape:
            raise NpuValueError(f"r1 {tuple(r1.shape)} and r2 {tuple(r2.shape)} must have one shape")
        d = x.shape[-1]
        if r1.shape[-1] != d:
            raise NpuValueError(f"r1's last dim {r1.shape[-1]} must be {x_name}'s ({d})")
        family = self.soc_family
        if family == "950":
            check_choice("rotary_mode", mode, MODES_950)
            # "最后一维大小必须相同，且小于等于1024。对于half、interleave和interleave-half模式，
            # 最后一维必须能被2整除，对于quarter模式，最后一维必须能被4整除";
            # "cos和sin的shape需要与x满足broadcast关系，且广播后的shape必须等于x的shape"
            if d > 1024 or d % (4 if mode == "quarter" else 2):
                raise NpuValueError(f"{x_name}'s last dim {d} must be at most 1024 and divisible by "
                                    f"{4 if mode == 'quarter' else 2}")
            if any(c not in (1, s) for c, s in zip(r1.shape[:3], x.shape[:3])):
                raise NpuValueError(f"r1 {tuple(r1.shape)} must broadcast to {x_name} {tuple(x.shape)}")
            return
        if family != "A2/A3":
            raise NpuSimNotImplemented(f"npu_rotary_mul on {self.soc_name} (the jit_compile=True path) is not "
                                       "simulated")
        check_choice("rotary_mode", mode, MODES_A2_A3)
        # jit_compile=False (Atlas A2/A3): "D < 896，且为2的倍数"; r1, r2 "数据范围：[-1, 1]".
        if d >= 896 or d % 2:
            raise NpuValueError(f"{x_name}'s last dim {d} must be even and below 896")
        for name, t in (("r1", r1), ("r2", r2)):
            if not torch.equal(t.detach().clamp(-1, 1), t.detach()):
                raise NpuValueError(f"{name} must lie in [-1, 1] (the kernel's data range on {self.soc_name})")
        self._check_layout(x, r1, mode, tables_need_grad)

    @staticmethod
    def _check_layout(x: torch.Tensor, r1: torch.Tensor, mode: str, tables_need_grad: bool) -> None:
        """Atlas A2/A3: "layout支持：BNSD、BSND、SBND"; the r1 layouts per input layout, half: "x为BSND: 1S1D、BS1D、
        BSND ... x为SBND: S11D、SB1D、SBND", B, N < 1000; interleave: "x为BSND: 1S1D ... x为SBND: S11D", B * N <
        1000; "当需要计算cos/sin的反向梯度时，B*N <= 1024". BNSD (with its further S bounds) is not modeled."""
        a, b, c = x.shape[:3]
        layouts = {  # name: (r1 shapes the mode takes, B, N)
            "SBND": ({(a, 1, 1)} | ({(a, b, 1), (a, b, c)} if mode == "half" else set()), b, c),
            "BSND": ({(1, b, 1)} | ({(a, b, 1), (a, b, c)} if mode == "half" else set()), a, c),
        }
        shape = tuple(r1.shape[:3])
        for shapes, batch, heads in layouts.values():
            fits = batch < 1000 and heads < 1000 if mode == "half" else batch * heads < 1000
            if shape in shapes and fits and (not tables_need_grad or batch * heads <= 1024):
                return
        if mode == "half" and shape in {(1, 1, c), (a, 1, c)}:
            raise NpuSimNotImplemented("the BNSD layout of npu_rotary_mul is not simulated")
        raise NpuValueError(f"r1 {tuple(r1.shape)} fits no layout the kernel takes for x {tuple(x.shape)} in mode "
                            f"{mode!r} (SBND: S11D, SB1D, SBND; BSND: 1S1D, BS1D, BSND; B, N < 1000)")

    @kernel(differentiable=True)
    def npu_rotary_mul(self, input: torch.Tensor, /, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half",
                       rotate: Optional[torch.Tensor] = None) -> torch.Tensor:
        """output = r1 * input + r2 * rotate(input) (torch_npu's document), in float32, input's dtype and shape."""
        if self.soc_family not in ("950", "A2/A3"):
            raise NpuSocError(f"npu_rotary_mul's aclnn kernel needs an Ascend 950 or Atlas A2/A3, not {self.soc_name}")
        check_none("rotate", rotate, "(the rotation-matrix form is not simulated)")
        self._check_rotary(input, r1, r2, rotary_mode, "input", r1.requires_grad or r2.requires_grad)
        return _RotaryMul.apply(self, input, r1, r2, rotary_mode)

    @kernel
    def npu_rotary_mul_backward(self, grad: torch.Tensor, input: torch.Tensor, /, r1: torch.Tensor,
                                r2: torch.Tensor, rotary_mode: str = "half"
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dx, dr1, dr2) by aclnnRotaryPositionEmbeddingGrad's formulas in float32, in input's dtype (op-plugin's
        meta: "dx = torch.empty_like(embedding ...)", "dr1 = torch.empty_like(cosine, dtype=embedding.dtype)");
        dr1 and dr2 are computed only when r1 or r2 needs a gradient (zeros otherwise: op-plugin passes no x)."""
        if self.soc_family not in ("950", "A2/A3"):
            raise NpuSocError(f"npu_rotary_mul_backward needs an Ascend 950 or Atlas A2/A3, not {self.soc_name}")
        need_tables = r1.requires_grad or r2.requires_grad
        self._check_rotary(input, r1, r2, rotary_mode, "input", need_tables)
        # "输入张量dy、xOptional和输出张量dxOut的shape必须完全相同"; dy "与 dy 数据类型一致" for the rest
        check_tensor("grad", grad, (input.dtype,))
        if grad.shape != input.shape:
            raise NpuValueError(f"grad {tuple(grad.shape)} must have input's shape {tuple(input.shape)}")
        dy, cos, sin = grad.float(), r1.float(), r2.float()
        dx = _grad_x(dy, cos, sin, rotary_mode).to(input.dtype)
        if not need_tables:
            return dx, torch.zeros_like(r1, dtype=input.dtype), torch.zeros_like(r2, dtype=input.dtype)
        part1, part2 = _parts(input.float(), rotary_mode)
        return (dx, _table_grad(dy * part1, r1).to(input.dtype), _table_grad(dy * part2, r2).to(input.dtype))
