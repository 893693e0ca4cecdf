"""Rotary embeddings with the optional per-head QK-norm before them, as one Triton kernel on
CUDA, with the torch reference beside it.

Unfused, one rotary is ten kernels (and a QK-norm six more). Both paths round where
transformers rounds in bf16 (normalize in fp32, cast, then scale; rotate in the
activation dtype), so the GPU path stays bit-close to the reference and the CPU path is
the reference (`rms_norm_reference`, then `rotary_reference`).

`norm_rotary_into_cache` also writes the keys and values into the paged KV cache, in the
same kernel on CUDA (`PagedAttention.forward(..., rotary=QKRotary)`).

CI runs the kernels in Triton's interpreter against the torch versions
(tests/kernels/test_norm_rotary.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniwalk.kernels.rms_norm import rms_norm_reference
from omniwalk.kernels.triton_support import pdl_launch, triton, use_triton

if triton is not None:
    import triton.language as tl

    from omniwalk.kernels.triton_support import await_predecessor

    from omniwalk.kernels.rms_norm import scale_normed


# ----------------------------------------------------------------------------- reference

def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, rotary_dim] fp32
    rotary_dim = cos.shape[-1]
    cos = cos[:, None, :].to(x.dtype)   # like transformers: rotate in the activation dtype
    sin = sin[:, None, :].to(x.dtype)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    first, second = x_rot.chunk(2, dim=-1)
    rotated = x_rot * cos + torch.cat((-second, first), dim=-1) * sin
    return rotated if rotary_dim == x.shape[-1] else torch.cat((rotated, x_pass), dim=-1)


# ----------------------------------------------------------------------------- public ops

def norm_rotary(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                cos: torch.Tensor, sin: torch.Tensor, zero_centered: bool = False) -> torch.Tensor:
    """Optional per-head RMSNorm (Qwen3's QK-norm; Qwen3.5's zero-centered one) then rotary
    of the first cos.shape[-1] dims, one kernel on CUDA.

    x: [num_tokens, num_heads, head_dim] (rows may be strided views of a fused projection)
    """
    if not use_triton(x):
        if weight is not None:
            x = rms_norm_reference(x, weight, eps, zero_centered)
        return rotary_reference(x, cos, sin)
    num_tokens, num_heads, head_dim = x.shape
    rotary_dim = cos.shape[-1]
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    _norm_rotary_kernel[(num_tokens, num_heads)](
        x, weight if weight is not None else x, cos, sin, out,
        x.stride(0), x.stride(1), cos.stride(0), eps,
        HAS_NORM=weight is not None, ZERO_CENTERED=zero_centered, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        HALF=rotary_dim // 2, BLOCK_HALF=triton.next_power_of_2(rotary_dim // 2), **pdl_launch(x),
    )
    return out


@dataclass(frozen=True)
class QKRotary:
    """What a layer's queries and keys get before attention: `norm_rotary` with these
    (the per-head norms are both set or both None)."""

    cos: torch.Tensor                 # [num_tokens, rotary_dim]
    sin: torch.Tensor
    q_weight: torch.Tensor | None     # [head_dim]
    k_weight: torch.Tensor | None
    eps: float = 0.0                  # both norms' (one config value)
    zero_centered: bool = False


def norm_rotary_into_cache(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rotary: QKRotary,
                           key_pool: torch.Tensor, value_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`norm_rotary` of query and key, then key and value written into the cache pools
    at `slots` (`index_copy_`, cast to the pool's dtype); returns the rotated query. On
    CUDA one kernel does all of it (four kernels fewer per layer than the unfused ops),
    with the same arithmetic, so the same bits.

    query: [num_tokens, num_heads, head_dim]; key, value: [num_tokens, num_kv_heads,
    head_dim] (strided views of a fused projection are fine); pools: [slots, num_kv_heads,
    head_dim]; slots: [num_tokens] int64.
    """
    fused = (use_triton(query) and (rotary.q_weight is None) == (rotary.k_weight is None)
             and key_pool.stride() == value_pool.stride()   # the kernel indexes both pools alike
             and all(t.stride(-1) == 1 for t in (query, key, value, key_pool)))
    if not fused:
        query = norm_rotary(query, rotary.q_weight, rotary.eps, rotary.cos, rotary.sin, rotary.zero_centered)
        key = norm_rotary(key, rotary.k_weight, rotary.eps, rotary.cos, rotary.sin, rotary.zero_centered)
        key_pool.index_copy_(0, slots, key.to(key_pool.dtype))
        value_pool.index_copy_(0, slots, value.to(value_pool.dtype))
        return query
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    rotary_dim = rotary.cos.shape[-1]
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    has_norm = rotary.q_weight is not None
    _norm_rotary_into_cache_kernel[(num_tokens, num_heads + 2 * num_kv_heads)](
        query, key, value, rotary.q_weight if has_norm else query, rotary.k_weight if has_norm else key,
        rotary.cos, rotary.sin, out, key_pool, value_pool, slots,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_pool.stride(0), key_pool.stride(1), rotary.cos.stride(0), rotary.eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        HAS_NORM=has_norm, ZERO_CENTERED=rotary.zero_centered, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        HALF=rotary_dim // 2, BLOCK_HALF=triton.next_power_of_2(rotary_dim // 2), **pdl_launch(query),
    )
    return out


# ----------------------------------------------------------------------------- kernels

if triton is not None:

    @triton.jit
    def _norm_rotate_head(src, dst, weight_ptr, cos_row, sin_row, eps,
                          HAS_NORM: tl.constexpr, ZERO_CENTERED: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
        """One head: optional RMSNorm, then rotary of its first 2 * HALF dims, from `src`
        to `dst` (stored in dst's dtype; the arithmetic in the source's)."""
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < HEAD_DIM
        x = tl.load(src + dims, mask=dim_mask, other=0.0)
        dtype = x.dtype
        if HAS_NORM:
            xf = x.to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / HEAD_DIM + eps)
            w = tl.load(weight_ptr + dims, mask=dim_mask, other=0.0).to(tl.float32)
            x = scale_normed(xf * inv, w, dtype, ZERO_CENTERED)
        tl.store(dst + dims, x, mask=dim_mask & (dims >= 2 * HALF))   # the part left unrotated
        half = tl.arange(0, BLOCK_HALF)
        half_mask = half < HALF
        xa = tl.load(src + half, mask=half_mask, other=0.0)
        xb = tl.load(src + HALF + half, mask=half_mask, other=0.0)
        if HAS_NORM:   # the same normalization, on the two rotated halves
            wa = tl.load(weight_ptr + half, mask=half_mask, other=0.0).to(tl.float32)
            wb = tl.load(weight_ptr + HALF + half, mask=half_mask, other=0.0).to(tl.float32)
            xa = scale_normed(xa.to(tl.float32) * inv, wa, dtype, ZERO_CENTERED)
            xb = scale_normed(xb.to(tl.float32) * inv, wb, dtype, ZERO_CENTERED)
        c = tl.load(cos_row + half, mask=half_mask, other=0.0).to(dtype).to(tl.float32)
        s = tl.load(sin_row + half, mask=half_mask, other=0.0).to(dtype).to(tl.float32)
        xa = xa.to(tl.float32)
        xb = xb.to(tl.float32)
        # out = x * cos + rotate_half(x) * sin, each product rounded to the activation dtype
        first = ((xa * c).to(dtype).to(tl.float32) + (-xb * s).to(dtype).to(tl.float32)).to(dtype)
        second = ((xb * c).to(dtype).to(tl.float32) + (xa * s).to(dtype).to(tl.float32)).to(dtype)
        tl.store(dst + half, first, mask=half_mask)
        tl.store(dst + HALF + half, second, mask=half_mask)

    @triton.jit
    def _norm_rotary_kernel(x_ptr, weight_ptr, cos_ptr, sin_ptr, out_ptr,
                            stride_token, stride_head, stride_cos, eps,
                            HAS_NORM: tl.constexpr, ZERO_CENTERED: tl.constexpr, HEAD_DIM: tl.constexpr,
                            BLOCK_D: tl.constexpr,
                            HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr):
        await_predecessor(PDL)
        token = tl.program_id(0)
        head = tl.program_id(1)
        _norm_rotate_head(x_ptr + token * stride_token + head * stride_head,
                          out_ptr + (token * tl.num_programs(1) + head) * HEAD_DIM,
                          weight_ptr, cos_ptr + token * stride_cos, sin_ptr + token * stride_cos, eps,
                          HAS_NORM, ZERO_CENTERED, HEAD_DIM, BLOCK_D, HALF, BLOCK_HALF)

    @triton.jit
    def _norm_rotary_into_cache_kernel(q_ptr, k_ptr, v_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr,
                                       q_out_ptr, key_pool_ptr, value_pool_ptr, slots_ptr,
                                       stride_q_token, stride_q_head, stride_k_token, stride_k_head,
                                       stride_v_token, stride_v_head, stride_pool_slot, stride_pool_head,
                                       stride_cos, eps,
                                       NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                                       HAS_NORM: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                                       HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr):
        await_predecessor(PDL)
        # programs (token, h): h < NUM_HEADS a query head, then the key heads, then the values
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        cos_row, sin_row = cos_ptr + token * stride_cos, sin_ptr + token * stride_cos
        if head < NUM_HEADS:
            _norm_rotate_head(q_ptr + token * stride_q_token + head * stride_q_head,
                              q_out_ptr + (token * NUM_HEADS + head) * HEAD_DIM,
                              q_weight_ptr, cos_row, sin_row, eps,
                              HAS_NORM, ZERO_CENTERED, HEAD_DIM, BLOCK_D, HALF, BLOCK_HALF)
        else:
            slot = tl.load(slots_ptr + token)
            if head < NUM_HEADS + NUM_KV_HEADS:
                kv_head = head - NUM_HEADS
                _norm_rotate_head(k_ptr + token * stride_k_token + kv_head * stride_k_head,
                                  key_pool_ptr + slot * stride_pool_slot + kv_head * stride_pool_head,
                                  k_weight_ptr, cos_row, sin_row, eps,
                                  HAS_NORM, ZERO_CENTERED, HEAD_DIM, BLOCK_D, HALF, BLOCK_HALF)
            else:
                kv_head = head - NUM_HEADS - NUM_KV_HEADS
                dims = tl.arange(0, BLOCK_D)
                mask = dims < HEAD_DIM
                x = tl.load(v_ptr + token * stride_v_token + kv_head * stride_v_head + dims, mask=mask)
                tl.store(value_pool_ptr + slot * stride_pool_slot + kv_head * stride_pool_head + dims, x, mask=mask)
