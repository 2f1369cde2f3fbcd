"""A pytest plugin that runs Megatron-LM's own unit tests on mindspeed_te and the CPU:

    cd $MEGATRON_LM_PATH && python -m pytest -p mindspeed_te.patches.megatron_tests -o addopts="" -p no:cacheprovider \\
        tests/unit_tests/transformer ...

Loaded before Megatron's conftest files, it applies every patch (TE modules, and without an accelerator the
CPU device adaptor, which serves the harness's `torch.cuda.set_device` and `init_process_group("nccl")`)
and keeps the harness from fetching its data sets over the network (`ensure_test_data`): tests that need
them fail on the missing files instead. While test modules are collected, `torch.cuda.is_available()` is
true, so that their `skipif(not torch.cuda.is_available())` gates see the adaptor as the device they need;
at run time it answers truthfully again (torch itself must not take CUDA paths).

With `--te-import-facade`, the few TransformerEngine import paths that Megatron's FP8 test files import
themselves (dist_checkpointing/test_fp8.py, dist_checkpointing/models/test_moe_experts.py) are served by
mindspeed_te's own classes through modules put in `sys.modules` for this session only; nothing else is
behind them, so any other TE name such a test reaches is missing, as it would be without TE.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import Iterator

import pytest
import torch

import mindspeed_te.megatron_adaptor  # noqa: F401  (applies the patches)
from mindspeed_te import Float8Quantizer, QuantizedTensor

DOWNLOADER = "tests.test_utils.python_scripts.download_unit_tests_dataset"


def _no_download(assets_dir: object) -> bool:
    raise RuntimeError("mindspeed_te's test plugin does not download Megatron's unit-test data sets")


try:
    importlib.import_module(DOWNLOADER).download_and_extract_asset = _no_download
except ImportError:  # not run from a Megatron-LM checkout: nothing would be downloaded anyway
    pass


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--te-import-facade", action="store_true",
                     help="serve the TransformerEngine imports of Megatron's FP8 test files by mindspeed_te")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("te_import_facade"):
        for name, module in _te_import_facade().items():
            if name in sys.modules:
                raise pytest.UsageError(f"--te-import-facade: {name} is already importable (TransformerEngine "
                                        "installed?); run without the facade")
            sys.modules[name] = module


class TEFloat8Quantizer(Float8Quantizer):
    """TE's calling convention: quantizer(x) is a Float8Tensor (ours gives its storage). At module level so
    that tensors holding it pickle (checkpoint writers hand tensors to worker processes)."""

    def __call__(self, x: torch.Tensor) -> QuantizedTensor:
        return QuantizedTensor.from_storage(self.quantize(x), self)


def _te_import_facade() -> dict[str, types.ModuleType]:
    """Module name -> module: the TE names those test files use, bound to mindspeed_te's classes."""
    from mindspeed_te import Float8Tensor, FP8Dtype, fp8_autocast
    from mindspeed_te.patches.megatron_te import TE_API_VERSION
    from mindspeed_te.state import FP8GlobalStateManager

    def module(name: str, package: bool = False, **attributes: object) -> types.ModuleType:
        made = types.ModuleType(name, "mindspeed_te's stand-in for this TransformerEngine module (tests only)")
        if package:
            made.__path__ = []
        made.__dict__.update(attributes)
        return made

    float8 = module("transformer_engine.pytorch.tensor.float8_tensor", Float8Tensor=Float8Tensor,
                    Float8Quantizer=TEFloat8Quantizer)
    fp8 = module("transformer_engine.pytorch.fp8", fp8_autocast=fp8_autocast,
                 check_fp8_support=FP8GlobalStateManager.is_fp8_available, FP8GlobalStateManager=FP8GlobalStateManager)
    tensor = module("transformer_engine.pytorch.tensor", True, float8_tensor=float8)
    old_float8 = module("transformer_engine.pytorch.float8_tensor", Float8Tensor=Float8Tensor)
    torch_api = module("transformer_engine.pytorch", True, fp8=fp8, tensor=tensor, float8_tensor=old_float8,
                       fp8_autocast=fp8_autocast, Float8Tensor=Float8Tensor)
    return {
        "transformer_engine": module("transformer_engine", True, pytorch=torch_api, __version__=TE_API_VERSION),
        torch_api.__name__: torch_api, fp8.__name__: fp8, tensor.__name__: tensor, float8.__name__: float8,
        old_float8.__name__: old_float8,
        # TE's C++ extension: only its FP8 element types, as the quantizers take them
        "transformer_engine_torch": module("transformer_engine_torch", DType=types.SimpleNamespace(
            kFloat8E4M3=FP8Dtype.E4M3, kFloat8E5M2=FP8Dtype.E5M2)),
    }


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector) -> Iterator[None]:
    """Collect (import) each test module with torch.cuda.is_available() true, when the adaptor is on."""
    from mindspeed_te.patches.device_cpu import accelerator_present

    if accelerator_present():
        yield
        return
    original = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        yield
    finally:
        torch.cuda.is_available = original
