"""The sampler's exponential race as one Triton kernel (CUDA), with the torch reference beside it.

The race picks argmax_t(scaled[r, t] - log(-log(u[r, t]))) with u from a counter-based
hash of (row key, token id) (`_uniform`). In torch (`race_reference`, the CPU path) that is
~25 elementwise int64 kernels over the whole [rows, vocab] matrix (or, when filtering left
few candidates, a sparse version that needs two host syncs to size its buffers). The
kernel (`race_argmax`) runs one program per row that walks the vocabulary in blocks,
hashing, scoring and keeping the running best: one launch, the logits read once, no sync,
so a look-ahead step can sample without waiting for the GPU.

The arithmetic is the torch version's (uint32 MurmurHash3 finalizers, float64 scores, ties
to the lowest id, a row without a finite entry picks 0), so the ids are the same; the
tests compare both (in Triton's interpreter on CPU). The row keys and the sampler that
races: `omniwalk.engine.sampler`.
"""

from __future__ import annotations

import math

import torch

from omniwalk.kernels.triton_support import pdl_launch, triton

if triton is not None:
    import triton.language as tl

    from omniwalk.kernels.triton_support import await_predecessor

BLOCK = 1024

_MASK32 = 0xFFFFFFFF
_INV_2_32 = 1.0 / 4294967296.0


# ----------------------------------------------------------------------------- torch reference

def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32) and a constant c < 2**32, without overflow."""
    hi, lo = c >> 16, c & 0xFFFF
    return ((((x * hi) & 0xFFFF) << 16) + x * lo) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finalizer on int64 values in [0, 2**32) (a bijection of that range)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _uniform(tokens: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in (0, 1) of (key, token) pairs; the arguments broadcast together."""
    h = _fmix32(tokens ^ low)
    h = _fmix32((h + high) & _MASK32)
    return (h.to(torch.float64) + 0.5) * _INV_2_32


def race_reference(scaled: torch.Tensor, low: torch.Tensor, high: torch.Tensor,
                   token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """`race_argmax` in torch.

    Only finite entries can win, and each entry's noise depends on (key, token id)
    alone, so when filtering (top-p, top-k, a logits mask) left few candidates this
    version races those only: the same winner, without hashing the whole [rows, vocab]
    matrix (40 million entries at 256 rows of a 157k vocabulary)."""
    rows_count, vocab = scaled.shape
    finite = torch.isfinite(scaled)
    if int(finite.sum()) * 4 > rows_count * vocab:   # dense: most entries are candidates
        tokens = token_ids if token_ids is not None else torch.arange(vocab, device=scaled.device).unsqueeze(0)
        u = _uniform(tokens, low.unsqueeze(1), high.unsqueeze(1))
        return (scaled.to(torch.float64) - torch.log(-torch.log(u))).argmax(dim=-1)
    rows, cols = finite.nonzero(as_tuple=True)
    u = _uniform(cols if token_ids is None else token_ids[rows, cols], low[rows], high[rows])
    score = scaled[rows, cols].to(torch.float64) - torch.log(-torch.log(u))
    best = torch.full((rows_count,), -math.inf, dtype=torch.float64, device=scaled.device)
    best = best.scatter_reduce(0, rows, score, "amax")
    is_best = score == best[rows]
    # ties go to the lowest token id, as argmax does; a row with no finite entry gets 0
    winner = torch.full((rows_count,), vocab, dtype=torch.int64, device=scaled.device)
    winner = winner.scatter_reduce(0, rows[is_best], cols[is_best], "amin")
    return torch.where(winner == vocab, torch.zeros_like(winner), winner)


# ----------------------------------------------------------------------------- kernel

def race_argmax(scaled: torch.Tensor, low: torch.Tensor, high: torch.Tensor,
                token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """scaled: [rows, columns] float; low, high: [rows] int64 halves of each row's 64-bit key;
    token_ids: [rows, columns] the id each column stands for (default: its index), which is
    what is hashed. Returns [rows] int64 winning columns."""
    rows, columns = scaled.shape
    out = torch.empty(rows, dtype=torch.int64, device=scaled.device)
    if rows:
        ids = token_ids if token_ids is not None else scaled   # unread without HAS_IDS
        _race_kernel[(rows,)](scaled, low, high, ids, out, columns, scaled.stride(0), ids.stride(0),
                              HAS_IDS=token_ids is not None, BLOCK=BLOCK, **pdl_launch(scaled))
    return out


if triton is not None:

    @triton.jit
    def _fmix32_uint32(h):
        h ^= h >> 16
        h *= 0x85EBCA6B
        h ^= h >> 13
        h *= 0xC2B2AE35
        h ^= h >> 16
        return h

    # Columns and strides vary with the batch (a prefill's eager rows, the candidate
    # table's width): left unspecialized, they do not make Triton compile another variant
    # (~0.25-0.4 s, in a step) when they stop being multiples of 16.
    @triton.jit(do_not_specialize=["vocab", "stride_row", "stride_ids_row"])
    def _race_kernel(scaled_ptr, low_ptr, high_ptr, ids_ptr, out_ptr, vocab, stride_row, stride_ids_row,
                     HAS_IDS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        await_predecessor(PDL)
        row = tl.program_id(0)
        low = tl.load(low_ptr + row).to(tl.uint32)
        high = tl.load(high_ptr + row).to(tl.uint32)
        # typed: loop-carried values must keep their type across iterations
        best_score = tl.full((), -float("inf"), tl.float64)
        best_index = tl.full((), 0, tl.int32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < vocab
            x = tl.load(scaled_ptr + row * stride_row + cols, mask=mask, other=-float("inf")).to(tl.float64)
            if HAS_IDS:
                tokens = tl.load(ids_ptr + row * stride_ids_row + cols, mask=mask, other=0)
            else:
                tokens = cols
            h = _fmix32_uint32(tokens.to(tl.uint32) ^ low)
            h = _fmix32_uint32(h + high)                # wraps mod 2**32, as the torch version masks
            u = (h.to(tl.float64) + 0.5) * (1.0 / 4294967296.0)
            score = tl.where(mask, x - tl.log(-tl.log(u)), -float("inf"))
            block_best = tl.max(score, axis=0)
            block_index = start + tl.argmax(score, axis=0, tie_break_left=True)
            better = block_best > best_score           # strict: an earlier block wins a tie
            best_index = tl.where(better, block_index, best_index)
            best_score = tl.where(better, block_best, best_score)
        tl.store(out_ptr + row, best_index.to(tl.int64))
