"""The public API: TransformerEngine's names at top level, and importing the package has no side effects
(no Megatron, no torch_npu, no patches)."""
import subprocess
import sys

import mindspeed_te


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
