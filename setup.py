"""Packaging for mindspeed_te: FP8/HiF8 training for Megatron-LM on Ascend NPUs (and anywhere else)."""
from setuptools import find_packages, setup

setup(
    name="mindspeed_te",
    version="0.1.0",
    description="TransformerEngine-compatible FP8/HiF8 modules for Megatron-LM on Ascend NPUs, with CPU emulation",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["mindspeed_te", "mindspeed_te.*", "patches", "patches.*"]),
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout", "en-dtypes>=0.0.4", "ml-dtypes>=0.5", "megatron-core==0.16.1"],
        "megatron": ["megatron-core>=0.16.1"],
        "npu": ["torch-npu>=2.14.0"],
    },
)
