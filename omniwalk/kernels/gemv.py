"""The product of a few rows with a large weight (`x @ weight.T + bias`): a decode step's
dense projections at batch 1-4, as one Triton kernel on CUDA.

A decode step at batch 1 reads each projection's weights once and does almost no
arithmetic. For narrow outputs cuBLAS's M = 1 GEMMs launch few programs or add a split-K
reduce: Qwen3-0.6B's o_proj took 12.5 us there, 3.1 us here; the Thinker's router
4.9 against 2.4. A program per BLOCK_N output columns walks K with wide loads, all ROWS
rows' partial sums at once. Sums in fp32, one rounding to the output dtype (as cuBLAS).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omniwalk.kernels.triton_support import pdl_launch, triton, use_triton

if triton is not None:
    import triton.language as tl

    from omniwalk.kernels.triton_support import await_predecessor

GEMV_MAX_ROWS = 4
#: (BLOCK_N, BLOCK_K, num_warps, num_stages) for one row and for 2-4, from an H200 sweep
GEMV_TILES = {1: (2, 1024, 4, 3), 4: (4, 1024, 4, 4)}
#: the widest output the GEMV takes for one row and for 2-4 (docs/benchmarks.md, "GEMV";
#: one row to 8,192 since PDL: the Thinker's qkv, 5,120 wide, then beat cuBLAS)
GEMV_MAX_OUTPUTS = {1: 8192, 4: 1024}
#: with PDL, a program whose weights fit this many elements reads them all before it waits
#: for the previous kernel (no kernel writes weights): a one-row decode step's projections
GEMV_PRELOAD_ELEMENTS = 8192


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemv` takes this product: a few half-precision rows on CUDA, where it beat
    cuBLAS on the H200 (docs/benchmarks.md, "GEMV"): one row into at most 8,192 outputs,
    2-4 rows into at most 1,024. Wider outputs give cuBLAS's tiles enough programs."""
    rows = x.shape[0] if x.dim() == 2 else GEMV_MAX_ROWS + 1
    return (use_triton(x) and 0 < rows <= GEMV_MAX_ROWS
            and weight.shape[0] <= GEMV_MAX_OUTPUTS[1 if rows == 1 else GEMV_MAX_ROWS]
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and weight.stride(1) == 1)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         tiles: tuple[int, int, int, int] | None = None, preload: bool | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias [N]) -> [M, N], M <= GEMV_MAX_ROWS. `preload`: read
    each program's weights in one block before waiting for the previous kernel (default: one
    row under PDL, when they fit GEMV_PRELOAD_ELEMENTS)."""
    if not (triton is not None and x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS):
        return F.linear(x, weight, bias)
    rows, k = x.shape
    n = weight.shape[0]
    x = x.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_n, block_k, num_warps, num_stages = tiles or GEMV_TILES[1 if rows == 1 else GEMV_MAX_ROWS]
    launch = pdl_launch(x)
    if preload is None:
        preload = launch["PDL"] and rows == 1 and block_n * triton.next_power_of_2(k) <= GEMV_PRELOAD_ELEMENTS
    block_k = triton.next_power_of_2(k) if preload else min(block_k, triton.next_power_of_2(k))
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, ROWS=max(1, triton.next_power_of_2(rows)), BLOCK_N=block_n, BLOCK_K=block_k,
        PRELOAD=preload, num_warps=num_warps, num_stages=num_stages, **launch)
    return out


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, rows, N, K, stride_x, stride_w, stride_out,
                     HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PRELOAD: tl.constexpr, PDL: tl.constexpr):
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        row = tl.arange(0, ROWS)
        row_ok = row < rows
        ks = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
        if PRELOAD:   # all of K in one block, its weights read while the previous kernel ends
            w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)
            await_predecessor(PDL)
            x = tl.load(x_ptr + row[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :],
                        other=0.0).to(tl.float32)
            result = tl.sum(w[None, :, :] * x[:, None, :], axis=2)   # [ROWS, BLOCK_N]
        else:
            await_predecessor(PDL)
            acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k_ok = ks < K - k0
                w = tl.load(w_rows + (k0 + ks)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                x = tl.load(x_ptr + row[:, None] * stride_x + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                            other=0.0).to(tl.float32)
                acc += w[None, :, :] * x[:, None, :]
            result = tl.sum(acc, axis=2)   # [ROWS, BLOCK_N]
        if HAS_BIAS:
            result += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + row[:, None] * stride_out + cols[None, :], result.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])
