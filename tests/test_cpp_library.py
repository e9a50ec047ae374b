"""The ops library without Python: it has no Python symbols, and a libtorch-only C++ program
(tests/cpp/call_ops.cpp) links it normally, loads it with dlopen(RTLD_NOW), calls chain_verify,
chain_verify_logits, chain_verify_greedy and acceptance_head_step through the dispatcher, and gets what the
pure-PyTorch reference gives on the same inputs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch.utils.cpp_extension import include_paths, library_paths

from specdec_ext import ops, reference

pytestmark = pytest.mark.skipif(not ops.HAS_EXTENSION, reason="no compiled ops library")
SOURCE = Path(__file__).parent / "cpp" / "call_ops.cpp"


def compile_line(program: Path) -> list[str]:
    """The documented compiler line (README, "The ops from C++"): libtorch's headers and libraries, and the
    ops library linked as any shared library (--no-as-needed: it is used through its registrations)."""
    lib = ops.library_path()
    torch_lib = library_paths()[0]
    # a library built with its CUDA kernels also needs torch's CUDA libraries, linked into the program: the rpath
    # below is a RUNPATH, which the loader does not apply to the ops library's own dependencies
    cuda = ["-ltorch_cuda", "-lc10_cuda"] if torch._C._dispatch_has_kernel_for_dispatch_key(
        "specdec_ext::chain_verify", "CUDA") else []
    return (["g++", "-std=c++20", "-O1", str(SOURCE), "-o", str(program)]
            + [f"-I{p}" for p in include_paths()]
            + [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
            + [f"-L{torch_lib}", "-Wl,--no-as-needed", str(lib), "-ltorch", "-ltorch_cpu", "-lc10", *cuda,
               f"-Wl,-rpath,{torch_lib}", f"-Wl,-rpath,{lib.parent}", "-ldl"])


def test_library_has_no_python_symbols():
    if shutil.which("nm") is None:
        pytest.skip("no nm")
    out = subprocess.run(["nm", "-D", "--undefined-only", str(ops.library_path())], capture_output=True, text=True,
                         check=True).stdout
    assert "PyInit" not in out
    python = [line.split()[-1] for line in out.splitlines() if line.split()[-1].startswith(("Py", "_Py"))]
    assert python == [], f"the ops library needs Python symbols: {python[:5]}"
    needed = subprocess.run(["ldd", str(ops.library_path())], capture_output=True, text=True).stdout
    assert "torch_python" not in needed and "libpython" not in needed


def write_tensors(path: Path, tensors: dict) -> None:
    with path.open("w") as f:
        for name, t in tensors.items():
            dtype = "i64" if t.dtype == torch.int64 else "f32"
            vals = " ".join(repr(float(x)) for x in t.reshape(-1).tolist())
            f.write(f"{name} {dtype} {t.dim()} {' '.join(map(str, t.shape))} {vals}\n")


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_cpp_program_calls_the_ops_and_matches_the_reference(tmp_path):
    program = tmp_path / "call_ops"
    build = subprocess.run(compile_line(program), capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]

    g = torch.Generator().manual_seed(0)
    B, K, V, H, L = 3, 4, 11, 8, 2
    draft_logits, target_logits = torch.randn(B, K, V, generator=g), torch.randn(B, K + 1, V, generator=g)
    draft_logits[1] = target_logits[1, :K]  # a row that accepts everything: the bonus token is used
    t = {"ids": torch.stack([torch.multinomial(draft_logits[b].softmax(-1), 1, generator=g).squeeze(-1)
                             for b in range(B)]),
         "draft_logits": draft_logits, "target_logits": target_logits,
         "draft_probs": draft_logits.softmax(-1), "target_probs": target_logits.softmax(-1),
         "temperature": torch.tensor([1.0, 0.7, 0.0]), "uniforms": torch.rand(B, K + 1, generator=g),
         "hidden": torch.randn(B, H, generator=g), "block_weight": torch.randn(L, H, H, generator=g) * 0.3,
         "block_bias": torch.randn(L, H, generator=g) * 0.1, "out_weight": torch.randn(H, generator=g) * 0.3,
         "out_bias": torch.tensor([0.5]), "cum_accept": torch.tensor([1.0, 0.6, 0.3]),
         "stop_below": torch.tensor([0.0, 0.5, 0.2])}
    # the text format carries values rounded to float64 reprs; the oracle sees the same float32 values
    inputs = tmp_path / "inputs.txt"
    write_tensors(inputs, t)
    run = subprocess.run([str(program), str(ops.library_path()), str(inputs)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    got = {line.split()[0]: torch.tensor([float(x) for x in line.split()[1:]], dtype=torch.float64)
           for line in run.stdout.splitlines()}

    def same(name, expected, exact=True):
        e = expected.to(torch.float64).reshape(-1)
        assert got[name].shape == e.shape, name
        if exact:
            assert torch.equal(got[name], e), f"{name}: C++ {got[name].tolist()} vs reference {e.tolist()}"
        else:
            torch.testing.assert_close(got[name], e, rtol=1e-4, atol=1e-5, msg=name)

    out, num = reference.chain_verify(t["ids"], t["draft_probs"], t["target_probs"], uniforms=t["uniforms"])
    same("chain_verify.out", out), same("chain_verify.num", num)
    assert num.max() == K and num.min() < K, "the case must cover a full acceptance and a rejection"
    out, num = reference.chain_verify_logits(t["ids"], t["draft_logits"], t["target_logits"], t["temperature"],
                                             uniforms=t["uniforms"])
    same("chain_verify_logits.out", out), same("chain_verify_logits.num", num)
    out, num = reference.chain_verify_greedy(t["ids"], t["target_logits"])
    same("chain_verify_greedy.out", out), same("chain_verify_greedy.num", num)
    cum = t["cum_accept"].clone()
    p, stop = reference.acceptance_head_step(t["hidden"], None, None, None, t["block_weight"], t["block_bias"],
                                             t["out_weight"], t["out_bias"], cum, 2, 1, 20, 0.9, t["stop_below"])
    same("acceptance_head_step.p", p, exact=False)
    same("acceptance_head_step.stop", stop)
    same("acceptance_head_step.cum", cum, exact=False)
