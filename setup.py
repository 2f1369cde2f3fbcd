"""Packaging for mindspeed_te: FP8/HiF8 training for Megatron-LM on Ascend NPUs (and anywhere else)."""
from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError

# The fused CPU quantize kernels (mindspeed_te/fused_cast.py). Optional: without a C compiler the package
# installs without them and quantizes with torch ops (same results, slower). -fno-trapping-math lets the
# compiler vectorize the branch-free rounding; it changes no result (the code reads no FP exception flags).
# -ffp-contract=off: every multiply and add rounds on its own, as in the torch ops the kernels replace.
fused_cast = Extension(
    "mindspeed_te._fused_cast",
    sources=["mindspeed_te/csrc/module.c", "mindspeed_te/csrc/threads.c", "mindspeed_te/csrc/simd.c",
             "mindspeed_te/csrc/cast.c", "mindspeed_te/csrc/decode.c", "mindspeed_te/csrc/tiles.c",
             "mindspeed_te/csrc/tiles_avx512.c", "mindspeed_te/csrc/epilogue.c", "mindspeed_te/csrc/gemm_bf16.c",
             "mindspeed_te/csrc/nibbles.c", "mindspeed_te/csrc/nvfp4.c"],
    depends=["mindspeed_te/csrc/kernels.h", "mindspeed_te/csrc/codecs.h", "mindspeed_te/csrc/codecs_x86.h",
             "mindspeed_te/csrc/tiles.h"],
    extra_compile_args=["-O3", "-fno-trapping-math", "-ffp-contract=off", "-pthread"],
    extra_link_args=["-pthread"],
    optional=True,
)
# With OpenMP the kernels run on the OpenMP threads of torch's libgomp.so.1 (the loader binds the extension's
# libgomp.so.1 to the copy torch has already loaded); a compiler without it builds the pthread code instead.
OPENMP_FLAGS = ["-fopenmp"]
# A toolchain that cannot assemble AVX-512 BF16 still builds the quantize kernels; gemm_bf16 then reports itself
# unsupported and the GEMMs take torch's path.
NO_BF16_FLAGS = ["-DMINDSPEED_TE_NO_AVX512BF16"]


class BuildExt(build_ext):
    """Builds the extension with OpenMP and the AVX-512 BF16 GEMM, else without what the toolchain refuses."""

    def build_extension(self, ext: Extension) -> None:
        compile_args, link_args = list(ext.extra_compile_args), list(ext.extra_link_args)
        attempts = [("OpenMP, BF16 GEMM", OPENMP_FLAGS, []), ("OpenMP, no BF16 GEMM", OPENMP_FLAGS, NO_BF16_FLAGS),
                    ("no OpenMP, BF16 GEMM", [], []), ("no OpenMP, no BF16 GEMM", [], NO_BF16_FLAGS)]
        for number, (_, openmp, defines) in enumerate(attempts, 1):
            ext.extra_compile_args = compile_args + openmp + defines
            ext.extra_link_args = link_args + openmp
            try:
                super().build_extension(ext)
                return
            except CCompilerError as error:
                if number == len(attempts):
                    raise
                print(f"building {ext.name} again ({attempts[number][0]}): {error}")


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
    cmdclass={"build_ext": BuildExt},
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout", "en-dtypes>=0.0.4", "ml-dtypes>=0.5", "megatron-core==0.16.1"],
        # the release lines mindspeed_te.patches.registry.SUPPORTED_MEGATRON_CORE lists (0.12 to 0.19)
        "megatron": ["megatron-core>=0.12,<0.20"],
        "npu": ["torch-npu>=2.14.0"],
    },
)
