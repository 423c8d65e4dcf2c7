"""Optional ahead-of-time build of the CUDA kernels (the metadata lives in pyproject.toml).

    WOQ_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST="7.5;8.0;8.6;8.9;9.0a" pip install --no-build-isolation .

builds kernels/_C*.so for T4, A100, A10/3090, L4/4090 and H100 (the Docker image does
this; 9.0a, not 9.0: the mixed GEMM's wgmma configurations need the sm_90a target);
kernels/build.py loads it when present and otherwise JIT-compiles for the GPU at hand.
Without WOQ_BUILD_CUDA the package is pure Python (CPU machines, CI).
"""
import glob
import os

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("WOQ_BUILD_CUDA") == "1":
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "7.5;8.0;8.6;8.9;9.0a")
    sm90a = ["-DWOQ_BUILT_SM90A"] if "9.0a" in os.environ["TORCH_CUDA_ARCH_LIST"].replace(" ", ";").split(";") else []
    csrc = "kernels/csrc"
    sources = sorted(glob.glob(f"{csrc}/*.cu")) + [f"{csrc}/torch_binding.cpp"]  # = kernels/build.py
    ext_modules = [CUDAExtension("woq.kernels._C", sources,
                                 extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", *sm90a]})]
    cmdclass = {"build_ext": BuildExtension}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
