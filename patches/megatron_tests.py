"""A pytest plugin that runs Megatron-LM's own unit tests on mindspeed_te and the CPU:

    cd $MEGATRON_LM_PATH && python -m pytest -p mindspeed_te.patches.megatron_tests -o addopts="" -p no:cacheprovider \\
        tests/unit_tests/transformer ...

Loaded before Megatron's conftest files, it applies every patch (TE modules, and without an accelerator the
CPU device adaptor, which serves the harness's `torch.cuda.set_device` and `init_process_group("nccl")`)
and keeps the harness from fetching its data sets over the network (`ensure_test_data`): tests that need
them fail on the missing files instead. While test modules are collected, `torch.cuda.is_available()` is
true, so that their `skipif(not torch.cuda.is_available())` gates see the adaptor as the device they need;
at run time it answers truthfully again (torch itself must not take CUDA paths).
"""
from __future__ import annotations

import importlib
from typing import Iterator

import pytest
import torch

import mindspeed_te.megatron_adaptor  # noqa: F401  (applies the patches)

DOWNLOADER = "tests.test_utils.python_scripts.download_unit_tests_dataset"


def _no_download(assets_dir: object) -> bool:
    raise RuntimeError("mindspeed_te's test plugin does not download Megatron's unit-test data sets")


try:
    importlib.import_module(DOWNLOADER).download_and_extract_asset = _no_download
except ImportError:  # not run from a Megatron-LM checkout: nothing would be downloaded anyway
    pass


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
