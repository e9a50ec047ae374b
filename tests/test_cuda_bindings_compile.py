"""The CUDA registrations (csrc/bindings_cuda.cpp) compile against torch's headers on a machine without a GPU.

On a CPU build of torch the extension leaves the file out, and `scripts/nvcc_check.sh` compiles only the torch-free
kernels, so an error in the binding would first show on a GPU machine. This test gives the file to the C++
compiler (syntax and types, no object code) with torch's headers and the CUDA toolkit's. What a CPU build of
torch and a toolkit without its math libraries lack is stubbed in a directory searched after every real one
(``-idirafter``), so a real header always wins: torch's generated ``c10/cuda/impl/cuda_cmake_macros.h``, and
the handle and status types of cuBLAS, cuSPARSE and cuSOLVER that torch's CUDA context headers name (the
binding uses none of them)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch
from torch.utils.cpp_extension import include_paths

ROOT = Path(__file__).resolve().parent.parent
BINDING = ROOT / "csrc" / "bindings_cuda.cpp"

STUBS = {
    "c10/cuda/impl/cuda_cmake_macros.h": "",
    "cublas_v2.h": "typedef struct cublasContext* cublasHandle_t;\ntypedef int cublasStatus_t;\n",
    "cublasLt.h": "typedef struct cublasLtContext* cublasLtHandle_t;\n",
    "cusparse.h": "typedef struct cusparseContext* cusparseHandle_t;\ntypedef int cusparseStatus_t;\n",
    "cusolverDn.h": "typedef struct cusolverDnContext* cusolverDnHandle_t;\n",
    "cusolver_common.h": "typedef int cusolverStatus_t;\n",
}


def cuda_include() -> Path | None:
    """The CUDA toolkit's include directory: $CUDA_HOME's, that of the nvcc on PATH (through a wrapper script
    that execs it, as on these machines), or /usr/local/cuda's; None without cuda_runtime.h in any of them."""
    homes = [os.environ.get("CUDA_HOME")]
    nvcc = shutil.which("nvcc")
    if nvcc is not None:
        real = Path(nvcc).resolve()
        homes.append(str(real.parent.parent))
        try:  # a wrapper script: `exec /path/to/cuda/bin/nvcc "$@"` (the real nvcc is a binary: not read)
            with open(real, "rb") as f:
                head = f.read(4096)
        except OSError:
            head = b""
        if head.startswith(b"#!"):
            words = head.decode(errors="ignore").split()
            homes += [str(Path(w).parent.parent) for w in words if w.endswith("/bin/nvcc")]
    homes.append("/usr/local/cuda")
    for home in homes:
        if home and (Path(home) / "include" / "cuda_runtime.h").is_file():
            return Path(home) / "include"
    return None


def test_cuda_bindings_compile_against_torch_headers(tmp_path):
    cxx, cuda = shutil.which("g++"), cuda_include()
    if cxx is None or cuda is None:
        pytest.skip("needs g++ and the CUDA toolkit's headers")
    for name, text in STUBS.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"#pragma once\n// a stub for this syntax check (tests/{Path(__file__).name})\n{text}")
    cmd = ([cxx, "-std=c++20", "-fsyntax-only", "-Wall", "-Werror=return-type", f"-I{ROOT / 'csrc'}"]
           + [f"-I{p}" for p in include_paths()]
           + [f"-I{cuda}", f"-I{sysconfig.get_paths()['include']}", "-idirafter", str(tmp_path)]
           + [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", str(BINDING)])
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    errors = [line for line in run.stderr.splitlines() if ": error:" in line]
    assert run.returncode == 0, "\n".join(errors[:20]) or run.stderr[-4000:]


def test_cuda_include_is_found_through_a_wrapper_script(tmp_path, monkeypatch):
    """cuda_include() follows an nvcc that is a shell script exec'ing the real one (the one check above skips
    without it, so a wrong lookup would skip the check where it should run)."""
    home = tmp_path / "cuda-x"
    (home / "include").mkdir(parents=True)
    (home / "include" / "cuda_runtime.h").write_text("")
    (home / "bin").mkdir()
    wrapper = tmp_path / "bin" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {home}/bin/nvcc "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", str(wrapper.parent))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    assert cuda_include() == home / "include"
