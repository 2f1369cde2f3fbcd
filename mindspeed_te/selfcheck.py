"""Self-check for a machine with an Ascend 950: are the torch_npu kernels the plugin calls there, and do they
compute what the plugin expects?

    python -m mindspeed_te.selfcheck [--chip Ascend950DT] [--release 26.1] [--no-gpt]

Every module path the plugin runs (Linear, LayerNormLinear with RMSNorm and LayerNorm, LayerNormMLP with
SwiGLU, GroupedLinear in FP8 and bf16, DotProductAttention; Linear and GroupedLinear with their wgrads added into
main_grad too) runs a training step per recipe on the NPU backend and on the reference backend, from the same
weights and inputs. Each torch_npu kernel a case calls is judged by the case's
largest relative error over outputs and gradients; one line per kernel says ok, mismatch (with the error) or
missing in the installed torch_npu. Then a short Megatron GPT step runs per recipe on both backends. The exit
status is 1 on any mismatch, missing kernel or failed step.

The NPU path was built against a simulator of the documented kernels, not on hardware: this program is how a
user with a chip checks that the documents and the chip agree. Without an NPU it runs on the simulator, with
the kernels of the torch_npu release `--release` names.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch

from mindspeed_te.bench.launches import backend_environment, launch_recipes
from mindspeed_te.diagnostics import LaunchCounter
from mindspeed_te.kernels import SIMULATOR_ENV
from mindspeed_te.modules import DotProductAttention, GroupedLinear, LayerNormLinear, LayerNormMLP, Linear
from mindspeed_te.recipe import MXFP4BlockScaling, Recipe
from mindspeed_te.state import FP8GlobalStateManager, fp8_autocast
from mindspeed_te.testing.npu_sim.releases import RELEASES

# Largest relative error (max |npu - reference| / max |reference|) taken as agreement: bf16 outputs whose float32
# GEMM sums are added in another order differ by a bf16 rounding or two (2^-8 relative each).
TOLERANCE = 2.0**-6
RECIPES = ("delayed E4M3", "delayed HIF8", "tensorwise E4M3", "tensorwise HIF8", "blockwise E4M3",
           "blockwise HIF8", "mxfp8 E4M3", "mxfp4", "mxfp4, MXFP8 activations")
# the FP4 recipes the NPU path runs on its MX kernels (FP4 x FP4, and E4M3 x FP4)
FP4_RECIPES: dict[str, Recipe] = {"mxfp4": MXFP4BlockScaling(), "mxfp4, MXFP8 activations":
                                  MXFP4BlockScaling(fp8_activations=True)}
# Megatron's flags for the GPT steps: (--fp8-format, --fp8-recipe), or ("e2m1", --fp4-recipe) for FP4
GPT_RECIPES = {"delayed HiF8": ("hif8", "delayed"), "tensorwise E4M3": ("e4m3", "tensorwise"),
               "blockwise E4M3": ("e4m3", "blockwise"), "mxfp8 E4M3": ("e4m3", "mxfp8"), "mxfp4": ("e2m1", "mxfp4")}

Case = Callable[[Recipe, str], list[torch.Tensor]]


def real_npu() -> bool:
    """An installed torch_npu, and the simulator not asked for."""
    return os.environ.get(SIMULATOR_ENV, "0") == "0" and importlib.util.find_spec("torch_npu") is not None


@contextmanager
def backend(name: str, chip: str) -> Iterator[Any]:
    """The kernel backend `name` ("npu" or "reference") for the duration; yields the torch_npu module (real or
    simulated) for "npu". The CPU-only fused cast is off on the simulator, which takes the NPU's torch ops."""
    simulator = chip if name == "npu" and not real_npu() else None
    FP8GlobalStateManager.reset()  # first: its reset makes the backend be chosen again, a new one
    with backend_environment(name, simulator, fused=name != "npu") as chosen:
        try:
            yield chosen.npu if name == "npu" else None
        finally:
            FP8GlobalStateManager.reset()


def _train(module: torch.nn.Module, recipe: Recipe, device: str, inputs: list[torch.Tensor], *args: Any
           ) -> list[torch.Tensor]:
    """Two training steps (the second with delayed scaling's real scales); the second's output and gradients."""
    module = module.to(device)
    leaves = [x.to(device).requires_grad_() for x in inputs]
    for _ in range(2):
        module.zero_grad(set_to_none=True)
        for x in leaves:
            x.grad = None
        with fp8_autocast(fp8_recipe=recipe):
            out = module(*leaves, *args)
        out.backward(torch.ones_like(out))
    grads = [x.grad for x in leaves] + [p.grad for p in module.parameters() if p.grad is not None]
    return [t.detach().float().cpu() for t in [out, *grads]]


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=torch.bfloat16)


def _linear(recipe: Recipe, device: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return _train(Linear(256, 256, bias=True, params_dtype=torch.bfloat16), recipe, device, [_randn(128, 256)])


def _linear_main_grad(recipe: Recipe, device: str) -> list[torch.Tensor]:
    """Linear with its wgrad added into a float32 main_grad (--gradient-accumulation-fusion)."""
    torch.manual_seed(0)
    layer = Linear(256, 256, bias=True, params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True).to(device)
    layer.weight.main_grad = torch.zeros(256, 256, device=device)
    return [*_train(layer, recipe, device, [_randn(128, 256)]), layer.weight.main_grad.cpu()]


def _norm_linear(normalization: str) -> Case:
    def case(recipe: Recipe, device: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        layer = LayerNormLinear(256, 256, bias=True, params_dtype=torch.bfloat16, normalization=normalization)
        return _train(layer, recipe, device, [_randn(128, 256)])
    return case


def _mlp(recipe: Recipe, device: str) -> list[torch.Tensor]:
    """RMSNorm + FC1 + SwiGLU + FC2: the norm and activation quantize kernels, where the chip has them."""
    torch.manual_seed(0)
    layer = LayerNormMLP(256, 512, bias=True, normalization="RMSNorm", activation="swiglu",
                         params_dtype=torch.bfloat16)
    return _train(layer, recipe, device, [_randn(128, 256)])


def _grouped(recipe: Recipe, device: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    layer = GroupedLinear(4, 256, 256, bias=False, params_dtype=torch.bfloat16)
    # FP8 experts of tokens not whole 32-blocks, as Fp8Padding leaves them on the NPU: MX and 1x128 blocks cut
    # short (FP4 needs whole blocks)
    splits = [64] * 4 if recipe.nvfp4() or recipe.mxfp4() else [37, 91, 64, 64]
    return _train(layer, recipe, device, [_randn(256, 256)], splits)


class _OutsideFp8(torch.nn.Module):
    """`inner` run outside the FP8 region: the bfloat16 path of a model trained without --fp8."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> torch.Tensor:
        with fp8_autocast(enabled=False):
            return self.inner(*args)


def _grouped_main_grads(fp8: bool) -> Case:
    """GroupedLinear with its wgrads added into float32 main_grads, slices of one buffer in expert order
    (--gradient-accumulation-fusion): the grouped GEMM + accumulate kernels."""
    def case(recipe: Recipe, device: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        layer = GroupedLinear(4, 256, 256, bias=False, params_dtype=torch.bfloat16,
                              fuse_wgrad_accumulation=True).to(device)
        buffer = torch.zeros(4, 256, 256, device=device)
        for i, w in enumerate(layer.weights):
            w.main_grad = buffer[i]
        module = layer if fp8 else _OutsideFp8(layer)
        # experts of 32 * odd tokens: MXFP8's columnwise forms take the grouped quantize where torch_npu has it
        return [*_train(module, recipe, device, [_randn(256, 256)], [32, 96, 64, 64]), buffer.cpu()]
    return case


def _attention(recipe: Recipe, device: str) -> list[torch.Tensor]:
    attention = DotProductAttention(8, 64, attn_mask_type="causal")
    return _train(attention, recipe, device, [_randn(256, 2, 8, 64), _randn(256, 2, 8, 65)[..., :64].contiguous(),
                                              _randn(256, 2, 8, 66)[..., :64].contiguous()])


CASES: dict[str, Case] = {"Linear": _linear, "Linear, wgrad into main_grad": _linear_main_grad,
                          "LayerNormLinear RMSNorm": _norm_linear("RMSNorm"),
                          "LayerNormLinear LayerNorm": _norm_linear("LayerNorm"), "LayerNormMLP SwiGLU": _mlp,
                          "GroupedLinear": _grouped, "GroupedLinear, wgrad into main_grad": _grouped_main_grads(True),
                          "GroupedLinear bf16, wgrad into main_grad": _grouped_main_grads(False),
                          "DotProductAttention": _attention}


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """max |got - want| / max |want| over all tensors; inf where NaN/Inf appears in one and not the other."""
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        if not torch.equal(a.isfinite(), b.isfinite()):
            return float("inf")
        finite = b.isfinite()
        scale = b[finite].abs().max().item() if finite.any() else 0.0
        diff = (a[finite] - b[finite]).abs().max().item() if finite.any() else 0.0
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def check_kernels(chip: str, recipes: tuple[str, ...] = RECIPES) -> tuple[dict[str, float], list[str]]:
    """Per torch_npu kernel, the largest relative error of the cases that called it; and the cases that failed
    to run on the NPU backend (with their error)."""
    device = "npu" if real_npu() else "cpu"
    errors: dict[str, float] = {}
    failed: list[str] = []
    for recipe_name in recipes:
        recipe = {**launch_recipes(), **FP4_RECIPES}[recipe_name]
        for case_name, case in CASES.items():
            label = f"{case_name}, {recipe_name}"
            with backend("reference", chip):
                want = case(recipe, "cpu")
            with backend("npu", chip) as npu:
                counter = LaunchCounter(npu)
                try:
                    with counter:
                        got = case(recipe, device)
                except Exception as err:  # reported, and the exit status says so
                    failed.append(f"{label}: {type(err).__name__}: {err}")
                    continue
            error = relative_error(got, want)
            for name in counter.counts:
                if name.startswith("torch_npu."):
                    kernel = name.removeprefix("torch_npu.")
                    errors[kernel] = max(errors.get(kernel, 0.0), error)
    return errors, failed


def missing_kernels(chip: str) -> list[str]:
    """The kernels the plugin may call (those the simulator models) that the installed torch_npu lacks."""
    if not real_npu():
        return []
    from mindspeed_te.testing.npu_sim import make_simulator

    simulated = make_simulator()
    with backend("npu", chip) as npu:
        return sorted(name for name in dir(type(simulated)) if name.startswith("npu_") and not hasattr(npu, name))


def gpt_steps(chip: str) -> dict[str, tuple[float, float]]:
    """Per recipe, the loss of one Megatron GPT step on the NPU backend and on the reference backend (FP4 where
    the installed megatron-core has it: 0.15 on)."""
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    from mindspeed_te.bench.gpt import gpt_step, megatron_world

    has_fp4 = "fp4" in {f.name for f in dataclasses.fields(TransformerConfig)}
    losses = {}
    with megatron_world():
        for label, flags in GPT_RECIPES.items():
            if flags[0] == "e2m1" and not has_fp4:
                continue
            pair = []
            for name in ("npu", "reference"):
                with backend(name, chip):
                    device = "npu" if name == "npu" and real_npu() else "cpu"
                    pair.append(gpt_step(flags, layers=2, hidden=128, seq=128, device=device)())
            losses[label] = (pair[0], pair[1])
    return losses


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mindspeed_te.selfcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chip", default="Ascend950PR", choices=["Ascend950PR", "Ascend950DT"],
                        help="the chip the simulator models when there is no NPU (default Ascend950PR)")
    parser.add_argument("--release", default=RELEASES[0], choices=RELEASES,
                        help="the torch_npu release whose kernels the simulator has when there is no NPU (default "
                             f"{RELEASES[0]})")
    parser.add_argument("--no-gpt", action="store_true", help="skip the Megatron GPT steps")
    args = parser.parse_args(argv)
    simulated = f"{args.chip}@{args.release}"
    where = "torch_npu on this NPU" if real_npu() else f"the torch_npu simulator ({simulated}): no NPU here"
    print(f"mindspeed_te self-check against {where}")
    errors, failed = check_kernels(simulated)
    bad = False
    for kernel, error in sorted(errors.items()):
        ok = error <= TOLERANCE
        bad |= not ok
        print(f"{kernel:48s} {'ok' if ok else 'MISMATCH'}  max relative error {error:.2e}")
    for kernel in missing_kernels(args.chip):
        bad = True
        print(f"{kernel:48s} MISSING in this torch_npu")
    for line in failed:
        bad = True
        print(f"FAILED {line}")
    if not args.no_gpt:
        for label, (npu_loss, reference_loss) in gpt_steps(simulated).items():
            ok = abs(npu_loss - reference_loss) <= TOLERANCE * abs(reference_loss)
            bad |= not ok
            print(f"GPT step {label:38s} {'ok' if ok else 'MISMATCH'}  loss {npu_loss:.5f} "
                  f"(reference {reference_loss:.5f})")
    print("self-check " + ("FAILED" if bad else "passed"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
