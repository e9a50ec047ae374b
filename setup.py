"""Builds the one extension, specdec_ext._C.

* Default: a CppExtension with the CPU kernels (csrc/ops.cpp, csrc/cpu/*.cpp).
* With a CUDA build of torch and nvcc on PATH (or SPECDEC_CUDA=1): a CUDAExtension that adds
  csrc/cuda/*.cu and csrc/bindings_cuda.cpp. Architectures come from TORCH_CUDA_ARCH_LIST,
  default "8.0;9.0". SPECDEC_CUDA=0 forces the CPU-only build.
* The library is Python-free (py_limited_api: not linked to libtorch_python, no Python symbols), so
  C++ programs link it beside libtorch; Python loads it with torch.ops.load_library.
* CPU flags: -O3 -fopenmp-simd (vectorised reductions without -ffast-math); on x86-64 also
  AVX2/FMA/F16C. Override with SPECDEC_CPU_FLAGS (e.g. "-march=native" or "" for baseline x86-64).
* -g0: no debug information (Python's own CFLAGS carry -g, which doubled the build's compile time, most of it in
  the op registrations' templates); SPECDEC_CPU_FLAGS="-g ..." puts it back, as those flags come after.
* When torch's intra-op backend is OpenMP (its CPU wheels), -fopenmp, compiled and linked: at::parallel_for is a
  header template that runs serially in code compiled without it, so the kernels' row loops would use one
  thread whatever torch.get_num_threads() says. The extension then shares torch's OpenMP runtime (libgomp,
  loaded by torch first) and its thread count.
"""
import glob
import os
import platform
import shutil

from setuptools import setup

import torch
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def want_cuda() -> bool:
    env = os.environ.get("SPECDEC_CUDA")
    if env is not None:
        return env == "1"
    return torch.version.cuda is not None and shutil.which("nvcc") is not None


def cpu_flags() -> list:
    env = os.environ.get("SPECDEC_CPU_FLAGS")
    if env is not None:
        return env.split()
    return ["-mavx2", "-mfma", "-mf16c"] if platform.machine() in ("x86_64", "AMD64") else []


def openmp_flags() -> list:
    """["-fopenmp"] when torch parallelises with OpenMP (at::parallel_for needs it at compile time)."""
    info = torch.__config__.parallel_info()
    return ["-fopenmp"] if "OpenMP" in info and "OpenMP not found" not in info and platform.system() == "Linux" else []


def extension():
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    link = openmp_flags()
    cxx = ["-O3", "-g0", "-fopenmp-simd", "-fno-trapping-math", "-fno-math-errno"] + link + cpu_flags()
    include_dirs = [os.path.join(ROOT, "csrc")]
    if not want_cuda():
        sources = [s for s in sources if not s.endswith("bindings_cuda.cpp")]
        return CppExtension("specdec_ext._C", sources, include_dirs=include_dirs, extra_compile_args={"cxx": cxx},
                            extra_link_args=link, py_limited_api=True)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    nvcc = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]
    return CUDAExtension(
        "specdec_ext._C", sources, include_dirs=include_dirs, extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        extra_link_args=link, py_limited_api=True,
    )


setup(ext_modules=[extension()], cmdclass={"build_ext": BuildExtension.with_options(no_python_abi_suffix=True)})
