"""Native linear kernels (cpu_backend.ops.linear) against a float64 reference.

Every ISA library this CPU can run (amx, avx512, avx_vnni, avx2, portable) is
tested in its own subprocess with VLLM_CPU_BACKEND_ISA set,
since a process holds one kernel library. The subprocess is this file run as a
script (`--worker ISA`); it prints one JSON line with its findings.

Grid: M in {1, 2, 3, 5, 8, 17, 64, 130} x (N, K) in {(1, 16), (17, 33),
(64, 576), (1536, 576), (576, 1536), (100, 7), (33, 80)} x weight dtype {bf16, fp16,
fp32} x x dtype {bf16, fp32} x {no bias, bias}, bf16 x also with float32 output
(out_dtype, what the LM head asks for), plus edge cases (3-D and
row-strided and column-major x, fp16 x, M = 0, K = 0, NaN, bad arguments, fake tensors and
torch.library.opcheck); every grid case also through `linear_out` (the form writing into a
given tensor), which must give the very same values. On the amx library bf16 x with at least 16 rows and an
even K runs on AMX tiles: the grid's M >= 17 rows, K = 80 (a partial last k
tile), M = 16 (the threshold) and M = 700 at K = 1536 (several row groups)
cover its paths.

Reference: float64 matmul of the very values the kernel sees (x, W and bias
already rounded to their dtypes), so only the kernel's own rounding is measured.
With scale = |x| @ |W|^T + |bias| (float32 suffices for a tolerance), an output
element must satisfy
    fp32 out:  |y - ref| <= 2e-5 * scale
    bf16 out:  |y - ref| <= 2^-8 * |ref| + 3e-5 * scale   (half a bf16 ulp + fp32 sums)
    fp16 out:  |y - ref| <= 2^-11 * |ref| + 3e-5 * scale  (half an fp16 ulp + fp32 sums)
2e-5 * scale allows fp32 accumulation over K <= 1536 (typical error
~sqrt(K) * 6e-8 * scale) yet catches a dropped or doubled term (>= scale / K).
The packed layout is checked exactly (through unpack_linear_weight, which
knows the pair-interleaved bf16 panels of the avx512 build).
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpu_backend import isa

WORKER_TIMEOUT_S = 240
MS = (1, 2, 3, 5, 8, 17, 64, 130)
NKS = ((1, 16), (17, 33), (64, 576), (1536, 576), (576, 1536), (100, 7), (33, 80))
EXPECTED_LIBRARY = {path: path for path in isa.ISA_PATHS}  # cpu_backend.isa: one library per path


# ------------------------------------------------------------- the worker ---


def _tolerance(torch, out_dtype, ref, scale):
    if out_dtype == torch.float32:
        return 2e-5 * scale
    ulp_half = 2.0**-8 if out_dtype == torch.bfloat16 else 2.0**-11
    return ulp_half * ref.abs() + 3e-5 * scale


def _reference(torch, x, w, bias, w64=None):
    """(ref, scale) as float64; w64 = (W^T float64, |W|^T float32) may be precomputed."""
    wt, wt_abs = w64 if w64 is not None else (w.double().T, w.float().abs().T)
    x64 = x.double()
    # scale only sets tolerances: float32 is plenty (and much faster)
    ref, scale = x64 @ wt, (x.float().abs() @ wt_abs.float()).double()
    if bias is not None:
        b64 = bias.double()
        ref, scale = ref + b64, scale + b64.abs()
    return ref, scale


def _check(torch, y, ref, scale, want_dtype, label, failures, worst):
    if y.dtype != want_dtype or tuple(y.shape) != tuple(ref.shape):
        failures.append(f"{label}: got {y.dtype} {tuple(y.shape)}, want {want_dtype} {tuple(ref.shape)}")
        return
    err = (y.double() - ref).abs()
    tol = _tolerance(torch, y.dtype, ref, scale)
    if err.numel():
        ratio = float((err / tol.clamp_min(1e-300)).max())
        worst[str(y.dtype)] = max(worst.get(str(y.dtype), 0.0), ratio)
        if not ratio <= 1.0:  # also catches NaN
            failures.append(f"{label}: max err {float(err.max()):.3g}, worst err/tol {ratio:.3g}")


def _worker_grid(torch, L, nr, failures, worst):
    gen = torch.Generator().manual_seed(1234)
    cases = 0
    for n, k in NKS:
        w32 = torch.randn(n, k, generator=gen) / k**0.5
        b32 = torch.randn(n, generator=gen)
        for wdtype in (torch.bfloat16, torch.float16, torch.float32):
            w = w32.to(wdtype)
            packed = L.pack_linear_weight(w)
            # exact layout: [ceil(N/NR), K, NR], panel p column j = row p*NR+j, zero padded
            p = -(-n // nr)
            if tuple(packed.shape) != (p, k, nr) or packed.dtype != wdtype:
                failures.append(f"pack {n}x{k} {wdtype}: shape {tuple(packed.shape)} {packed.dtype}")
                continue
            if not torch.equal(L.unpack_linear_weight(packed, n), w):
                failures.append(f"pack {n}x{k} {wdtype}: layout differs")
            if bool(L.unpack_linear_weight(packed, p * nr)[n:].ne(0).any()):
                failures.append(f"pack {n}x{k} {wdtype}: padding is not zero")
            bias = b32.to(wdtype)
            b64 = bias.double()
            w64 = w.double()
            wt, wt_abs = w64.T.contiguous(), w.float().abs().T.contiguous()
            for xdtype in (torch.bfloat16, torch.float32):
                # one reference product for all M (rows of every M stacked)
                xs = torch.randn(sum(MS), k, generator=gen).to(xdtype)
                refs, scales = _reference(torch, xs, w, None, (wt, wt_abs))
                row = 0
                for m in MS:
                    x, ref, scale = xs[row : row + m], refs[row : row + m], scales[row : row + m]
                    row += m
                    out_dtypes = (None, torch.float32) if xdtype == torch.bfloat16 else (None,)
                    for b in (None, bias):
                        for out_dtype in out_dtypes:
                            y = L.linear(x, packed, n, b, out_dtype)
                            label = (f"M={m} N={n} K={k} w={wdtype} x={xdtype} bias={b is not None} "
                                     f"out={out_dtype}")
                            # the form writing into a given tensor (step graphs' buffers)
                            into = torch.full_like(y, float("nan"))
                            torch.ops.cpu_backend.linear_out(into, x, packed, n, b)
                            if not torch.equal(into, y):
                                failures.append(f"{label}: linear_out differs from linear")
                            want = out_dtype or xdtype
                            if b is None:
                                _check(torch, y, ref, scale, want, label, failures, worst)
                            else:
                                _check(torch, y, ref + b64, scale + b64.abs(), want, label, failures, worst)
                            cases += 1
    return cases


def _worker_edges(torch, L, nr, failures, worst):
    gen = torch.Generator().manual_seed(99)
    n, k = 45, 70
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)
    packed = L.pack_linear_weight(w)
    b32 = torch.randn(n, generator=gen)
    cases = 0

    def check(x, bias, label):
        nonlocal cases
        y = L.linear(x, packed, n, bias)
        x2, y2 = x.reshape(-1, k), y.reshape(-1, n)
        if tuple(y.shape) != (*x.shape[:-1], n):
            failures.append(f"{label}: shape {tuple(y.shape)}")
        ref, scale = _reference(torch, x2, w, bias)
        _check(torch, y2, ref, scale, x.dtype, label, failures, worst)
        cases += 1

    check(torch.randn(2, 3, k, generator=gen), b32, "3-D x fp32")
    check(torch.randn(4, 1, k, generator=gen).to(torch.bfloat16), None, "3-D x bf16")
    wide = torch.randn(9, k + 13, generator=gen)
    check(wide[:, 5 : 5 + k], b32.to(torch.float16), "row-strided x, fp16 bias")
    check(torch.randn(k, 6, generator=gen).to(torch.bfloat16).t(), b32, "column-major x bf16")
    check(torch.randn(7, k, generator=gen).to(torch.float16), b32.to(torch.bfloat16), "fp16 x")
    check(torch.randn(1, k, generator=gen).to(torch.float16), None, "fp16 x M=1")
    check(torch.randn(k, generator=gen), b32, "1-D x")

    # bf16 GEMMs at the AMX threshold and past one row group (amx library)
    for m, kk in ((16, 70), (700, 1536)):
        wk = (torch.randn(n, kk, generator=gen) / kk**0.5).to(torch.bfloat16)
        xk = torch.randn(m, kk, generator=gen).to(torch.bfloat16)
        ref, scale = _reference(torch, xk, wk, b32)
        pk = L.pack_linear_weight(wk)
        for out_dtype in (torch.bfloat16, torch.float32, torch.float16):
            y = L.linear(xk, pk, n, b32, out_dtype)
            _check(torch, y, ref, scale, out_dtype, f"bf16 GEMM M={m} K={kk} out={out_dtype}", failures, worst)
            cases += 1

    x = torch.randn(3, k, generator=gen)
    if not torch.equal(L.linear_reference(x, w, b32), _reference(torch, x, w, b32)[0]):
        failures.append("linear_reference differs from x.double() @ w.double().T + b")

    y = L.linear(torch.randn(0, k), packed, n)
    if tuple(y.shape) != (0, n):
        failures.append(f"M=0: shape {tuple(y.shape)}")
    # K = 0: y = bias (or 0)
    packed0 = L.pack_linear_weight(torch.zeros(n, 0))
    y = L.linear(torch.randn(3, 0), packed0, n, b32)
    if not torch.equal(y, b32.expand(3, n)):
        failures.append("K=0: y != bias")
    # inf/nan propagate
    x = torch.randn(2, k, generator=gen)
    x[1, 3] = float("nan")
    y = L.linear(x, packed, n)
    if not (bool(torch.isnan(y[1]).all()) and bool(torch.isfinite(y[0]).all())):
        failures.append("NaN in x row 1 must make row 1 NaN and only it")
    cases += 3

    # bad arguments raise
    bad = {
        "wrong n": lambda: L.linear(torch.randn(2, k), packed, n + nr),
        "wrong K": lambda: L.linear(torch.randn(2, k + 1), packed, n),
        "wrong bias": lambda: L.linear(torch.randn(2, k), packed, n, torch.randn(n + 1)),
        "int x": lambda: L.linear(torch.ones(2, k, dtype=torch.int32), packed, n),
        "int out_dtype": lambda: L.linear(torch.randn(2, k), packed, n, None, torch.int32),
        "3-D weight": lambda: L.pack_linear_weight(torch.randn(2, 3, 4)),
        "not packed": lambda: L.linear(torch.randn(2, k), w, n),
        "linear_out: wrong out shape": lambda: torch.ops.cpu_backend.linear_out(
            torch.empty(2, n + 1), torch.randn(2, k), packed, n),
        "linear_out: strided out": lambda: torch.ops.cpu_backend.linear_out(
            torch.empty(n, 2).t(), torch.randn(2, k), packed, n),
        "linear_out: int out": lambda: torch.ops.cpu_backend.linear_out(
            torch.empty(2, n, dtype=torch.int32), torch.randn(2, k), packed, n),
    }
    for label, call in bad.items():
        try:
            call()
            failures.append(f"{label}: no error")
        except RuntimeError:
            pass
        cases += 1

    # fake tensors (torch.compile tracing): shapes without running the kernel
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx = mode.from_tensor(torch.randn(5, 3, k))
        fw = mode.from_tensor(torch.randn(n, k))
        fp = torch.ops.cpu_backend.pack_linear_weight(fw)
        fy = torch.ops.cpu_backend.linear(fx, fp, n, None)
        if tuple(fp.shape) != (-(-n // nr), k, nr) or tuple(fy.shape) != (5, 3, n):
            failures.append(f"fake: {tuple(fp.shape)} {tuple(fy.shape)}")
        fy = torch.ops.cpu_backend.linear(fx.bfloat16(), fp, n, None, torch.float32)
        if fy.dtype != torch.float32:
            failures.append(f"fake out_dtype: {fy.dtype}")
    # schema, fake and AOT-dispatch checks of torch.library
    for op, op_args in (
        (torch.ops.cpu_backend.linear.default, (torch.randn(3, k).to(torch.bfloat16), packed, n, b32)),
        (torch.ops.cpu_backend.linear.default,
         (torch.randn(3, k).to(torch.bfloat16), packed, n, None, torch.float32)),
        (torch.ops.cpu_backend.pack_linear_weight.default, (w,)),
        (torch.ops.cpu_backend.linear_out.default,
         (torch.empty(3, n, dtype=torch.bfloat16), torch.randn(3, k).to(torch.bfloat16), packed, n, b32)),
    ):
        for check_name, outcome in torch.library.opcheck(op, op_args).items():
            if outcome != "SUCCESS":
                failures.append(f"opcheck {op}: {check_name}: {outcome}")
    cases += 1
    return cases


def _worker(expected_isa: str) -> dict:
    import torch

    from cpu_backend import ops
    from cpu_backend.ops import linear as L

    loaded = ops.load()
    failures: list[str] = []
    worst: dict[str, float] = {}
    nr = L.pack_nr()
    cases = _worker_grid(torch, L, nr, failures, worst)
    cases += _worker_edges(torch, L, nr, failures, worst)
    return {
        "selected": expected_isa,
        "loaded": loaded,
        "op_isa": str(torch.ops.cpu_backend.isa()),
        "nr": nr,
        "cases": cases,
        "worst_err_over_tol": worst,
        "failures": failures[:50],
        "n_failures": len(failures),
    }


# -------------------------------------------------------------- the tests ---


def _supported_paths() -> list[str]:
    from cpu_backend import isa

    return isa.supported_paths()


_workers: dict[str, subprocess.Popen] = {}


@atexit.register
def _reap_workers() -> None:  # workers of deselected tests
    for proc in _workers.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _start_worker(isa_path: str) -> subprocess.Popen:
    import cpu_backend

    env = dict(os.environ)
    env["VLLM_CPU_BACKEND_ISA"] = isa_path
    # the worker imports the same cpu_backend copy as this process
    package_parent = str(Path(cpu_backend.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [sys.executable, __file__, "--worker", isa_path],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run_worker(isa_path: str) -> dict:
    """The worker's findings; all ISA workers start together on first use."""
    if not _workers:
        for path in EXPECTED_LIBRARY:
            if path in _supported_paths():
                _workers[path] = _start_worker(path)
    proc = _workers[isa_path]
    try:
        stdout, stderr = proc.communicate(timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"{isa_path} worker timed out after {WORKER_TIMEOUT_S}s:\n{stderr}")
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{stdout}\n{stderr}"
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("isa_path", list(EXPECTED_LIBRARY))
def test_linear_kernels_match_reference(isa_path):
    if isa_path not in _supported_paths():
        pytest.skip(f"this CPU has no {isa_path}")
    result = _run_worker(isa_path)
    assert result["loaded"] == EXPECTED_LIBRARY[isa_path] == result["op_isa"], result
    assert result["cases"] > 500
    assert result["n_failures"] == 0, "\n".join(result["failures"])


def test_import_is_cheap():
    """`import cpu_backend.ops` must not import torch (the kernels load lazily)."""
    code = "import sys, cpu_backend, cpu_backend.ops; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_missing_library_error():
    """No library for the selected ISA: a clear error naming the fix."""
    code = (
        "import cpu_backend.ops as o\n"
        "o.library_file = lambda lib: None\n"
        "try:\n    o.load()\nexcept o.KernelsNotBuilt as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install --no-build-isolation" in out.stdout


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    print(json.dumps(_worker(sys.argv[2])))
