"""The public API: TransformerEngine's names at top level, and importing the package has no side effects
(no Megatron, no torch_npu, no patches)."""
import importlib.util
import os
import re
import subprocess
import sys

import mindspeed_te

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_top_level_names():
    for name in ("Linear", "LayerNormLinear", "LayerNorm", "RMSNorm", "GroupedLinear", "DotProductAttention",
                 "fp8_autocast", "autocast", "fp8_model_init", "quantized_model_init", "FP8GlobalStateManager",
                 "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling", "Format",
                 "convert_linears"):
        assert hasattr(mindspeed_te, name), name
    assert set(mindspeed_te.__all__) <= set(dir(mindspeed_te))


def test_import_has_no_side_effects():
    code = ("import sys, mindspeed_te; "
            "print(any(m.startswith(('megatron', 'torch_npu', 'mindspeed_te.patches')) for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_megatron_integration_installs_as_mindspeed_te_patches(tmp_path):
    """The integration folder patches/ imports as mindspeed_te.patches from anywhere, never as a top-level
    `patches` (which other distributions may also install)."""
    code = ("import importlib.util, mindspeed_te.patches.registry as r; "
            "print(r.__name__, importlib.util.find_spec('patches') is None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert out.stdout.split() == ["mindspeed_te.patches.registry", "True"]


def test_every_public_module_class_documents_its_arguments():
    """As in TransformerEngine, each constructor argument of a public module class is described in the class
    docstring (an argument added without a description fails here)."""
    import inspect

    import mindspeed_te.modules as modules

    packages = [modules]
    if importlib.util.find_spec("megatron.core") is not None:
        import mindspeed_te.megatron as megatron

        packages.append(megatron)
    missing = {}
    for package in packages:
        for name in package.__all__:
            cls = getattr(package, name)
            if not inspect.isclass(cls) or "__init__" not in vars(cls):
                continue
            args = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
            undocumented = [a for a in args if f"{a}:" not in cls.__doc__ and f"{a}," not in cls.__doc__]
            if undocumented:
                missing[f"{package.__name__}.{name}"] = undocumented
    assert not missing, missing


def test_readme_support_table_lists_the_tested_releases():
    """The README's table of Megatron releases is the matrix the tests run: the registry releases (CI), the
    source-tree releases, and together exactly the release lines the patches accept."""
    from mindspeed_te.patches.registry import SUPPORTED_MEGATRON_CORE
    from tests.megatron_matrix import REGISTRY_RELEASES, SOURCE_RELEASES

    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    rows = {cells[0]: cells for cells in (
        [cell.strip() for cell in line.strip("|").split("|")] for line in readme.splitlines()
        if re.match(r"\| 0\.\d+\.\d+ \|", line))}
    assert list(rows) == [*REGISTRY_RELEASES, *SOURCE_RELEASES]
    assert all(rows[release][2] == "package registry" for release in REGISTRY_RELEASES)
    assert all(rows[release][2] == "Megatron-LM tree" for release in SOURCE_RELEASES)
    assert sorted({release.rsplit(".", 1)[0] for release in rows}) == sorted(SUPPORTED_MEGATRON_CORE)
