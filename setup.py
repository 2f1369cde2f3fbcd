"""Packaging for mindspeed_te: FP8/HiF8 training for Megatron-LM on Ascend NPUs (and anywhere else)."""
from setuptools import Extension, find_packages, setup

# The fused CPU quantize kernels (mindspeed_te/fused_cast.py). Optional: without a C compiler the package
# installs without them and quantizes with torch ops (same results, slower). -fno-trapping-math lets the
# compiler vectorize the branch-free rounding; it changes no result (the code reads no FP exception flags).
fused_cast = Extension(
    "mindspeed_te._fused_cast",
    sources=["mindspeed_te/csrc/fused_cast.c"],
    extra_compile_args=["-O3", "-fno-trapping-math", "-pthread"],
    extra_link_args=["-pthread"],
    optional=True,
)

setup(
    name="mindspeed_te",
    version="0.1.0",
    description="TransformerEngine-compatible FP8/HiF8 modules for Megatron-LM on Ascend NPUs, with CPU emulation",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # The Megatron integration lives in the top-level folder patches/ and installs as mindspeed_te.patches
    # (never as a top-level `patches`, a name other distributions may also claim).
    packages=find_packages(include=["mindspeed_te", "mindspeed_te.*"]) + ["mindspeed_te.patches"],
    package_dir={"mindspeed_te.patches": "patches"},
    ext_modules=[fused_cast],
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout", "en-dtypes>=0.0.4", "ml-dtypes>=0.5", "megatron-core==0.16.1"],
        "megatron": ["megatron-core>=0.16.1"],
        "npu": ["torch-npu>=2.14.0"],
    },
)
