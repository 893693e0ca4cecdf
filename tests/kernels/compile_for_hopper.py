"""Compiles omniwalk's Triton kernels for sm_90 (no GPU needed): run by test_compile.py in
a fresh process, because the test session runs Triton in its interpreter, which accepts
programs the compiler rejects (a loop-carried value changing type, for one)."""

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from omniwalk.kernels import (
    causal_conv, cross_attention, fp8, fused_moe, gated_delta_rule, gemv, norm_rotary, paged_attention, rms_norm, sampling,
    silu_mul, snac,
)

QUANTIZE_ARGS = {"fp8_max": "fp32", "inverse_fp8_max": "fp32", "min_scale": "fp32"}


def norm_signature(quantize: bool) -> dict:
    return {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*fp8e4nv" if quantize else "*bf16",
            "residual_out_ptr": "*bf16", "scale_ptr": "*fp32" if quantize else "*bf16", "stride_x": "i32",
            "stride_part": "i32", "stride_residual": "i32", "eps": "fp32", "width": "i32", **QUANTIZE_ARGS,
            "HAS_RESIDUAL": "constexpr", "ZERO_CENTERED": "constexpr", "QUANTIZE": "constexpr", "PARTS": "constexpr",
            "BLOCK": "constexpr"}



NORM_ROTARY = {"x_ptr": "*bf16", "weight_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": "*bf16",
               "stride_token": "i32", "stride_head": "i32", "stride_cos": "i32", "eps": "fp32",
               "HAS_NORM": "constexpr", "ZERO_CENTERED": "constexpr", "HEAD_DIM": "constexpr", "BLOCK_D": "constexpr",
               "HALF": "constexpr", "BLOCK_HALF": "constexpr"}
KERNELS = [
    ("fp8 row quantization", fp8._quantize_rows_kernel,
     {"x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "stride_x": "i32", "width": "i32",
      "fp8_max": "fp32", "inverse_fp8_max": "fp32", "min_scale": "fp32", "BLOCK": "constexpr"}, {"BLOCK": 8192}),
] + [
    (f"race{' over candidate ids' * ids}", sampling._race_kernel,
     {"scaled_ptr": "*fp32", "low_ptr": "*i64", "high_ptr": "*i64", "ids_ptr": "*i64", "out_ptr": "*i64",
      "vocab": "i32", "stride_row": "i32", "stride_ids_row": "i32", "HAS_IDS": "constexpr", "BLOCK": "constexpr"},
     {"HAS_IDS": ids, "BLOCK": 1024}) for ids in (False, True)
] + [
    ("conv decode step", causal_conv._conv_decode_kernel,
     {"x_ptr": "*bf16", "weight_ptr": "*bf16", "pool_ptr": "*bf16", "read_ptr": "*i64", "write_ptr": "*i64",
      "out_ptr": "*bf16", "stride_x": "i32", "stride_weight": "i32", "stride_row": "i32",
      "channels": "i32", "batch": "i32", "end_first": "i32", "end_second": "i32",
      "TAPS": "constexpr", "BLOCK": "constexpr"}, {"TAPS": 4, "BLOCK": 256}),
] + [
    (f"gated delta rule{' (ragged)' * varlen}", gated_delta_rule._gated_delta_rule_kernel,
     {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "A_log_ptr": "*bf16",
      "dt_bias_ptr": "*bf16", "out_ptr": "*bf16", "pool_ptr": "*fp32", "read_ptr": "*i64", "write_ptr": "*i64",
      "cu_seqlens_ptr": "*i64", "stride_q": "i32", "stride_k": "i32", "stride_v": "i32", "stride_a": "i32",
      "stride_b": "i32", "stride_row": "i32", "scale": "fp32", "KEY_HEADS": "constexpr", "VALUE_HEADS": "constexpr",
      "KEY_DIM": "constexpr", "VALUE_DIM": "constexpr", "BLOCK_V": "constexpr", "VARLEN": "constexpr"},
     {"KEY_HEADS": 16, "VALUE_HEADS": 16, "KEY_DIM": 128, "VALUE_DIM": 128, "BLOCK_V": 8, "VARLEN": varlen})
    for varlen in (False, True)
] + [
    ("gated rms norm", rms_norm._gated_rms_norm_kernel,
     {"x_ptr": "*bf16", "gate_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*bf16", "heads": "i32",
      "stride_gate_token": "i32", "stride_gate_head": "i32", "eps": "fp32", "width": "i32", "BLOCK": "constexpr"},
     {"BLOCK": 128}),
] + [
    (f"cross-attention decode (split {splits})", cross_attention._cross_decode_kernel,
     {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "slot_ptr": "*i64", "out_ptr": "*bf16",
      "partial_acc_ptr": "*fp32", "partial_stats_ptr": "*fp32", "scale": "fp32",
      "stride_q_row": "i32", "stride_q_head": "i32", "stride_slot": "i64", "stride_pos": "i32", "stride_head": "i32",
      "stride_o_row": "i32", "stride_o_head": "i32", "source_len": "i32",
      "HEAD_DIM": "constexpr", "BLOCK_D": "constexpr", "BLOCK_N": "constexpr", "SPLITS": "constexpr"},
     {"HEAD_DIM": 64, "BLOCK_D": 64, "BLOCK_N": block_n, "SPLITS": splits}) for splits, block_n in ((1, 64), (16, 32))
] + [
    ("snake", snac._snake_kernel,
     {"x_ptr": "*fp32", "alpha_ptr": "*fp32", "beta_ptr": "*fp32", "out_ptr": "*fp32", "channels": "i32",
      "length": "i32", "stride_row": "i32", "BLOCK": "constexpr"}, {"BLOCK": 1024}),
] + [
    (f"depthwise conv{' + snake' * with_snake}", snac._depthwise_conv_kernel,
     {"x_ptr": "*fp32", "weight_ptr": "*fp32", "bias_ptr": "*fp32", "alpha_ptr": "*fp32", "out_ptr": "*fp32",
      "channels": "i32", "length": "i32", "dilation": "i32", "padding": "i32", "TAPS": "constexpr",
      "HAS_BIAS": "constexpr", "SNAKE": "constexpr", "BLOCK": "constexpr"},
     {"TAPS": 7, "HAS_BIAS": True, "SNAKE": with_snake, "BLOCK": 1024}) for with_snake in (False, True)
] + [
    (f"pointwise conv{' (noise)' * noise}{' tf32' * tf32}{' + residual' * residual}", snac._pointwise_conv_kernel,
     {"y_ptr": "*fp32", "weight_ptr": "*fp32", "bias_ptr": "*fp32", "residual_ptr": "*fp32", "scale_ptr": "*fp32",
      "out_ptr": "*fp32", "channels_in": "i32", "channels_out": "i32", "length": "i32", "stride_scale": "i32",
      "HAS_BIAS": "constexpr", "HAS_SCALE": "constexpr", "HAS_RESIDUAL": "constexpr", "TF32": "constexpr",
      "BLOCK_O": "constexpr", "BLOCK_T": "constexpr", "BLOCK_I": "constexpr"},
     {"HAS_BIAS": not noise, "HAS_SCALE": noise, "HAS_RESIDUAL": residual, "TF32": tf32, "BLOCK_O": 32,
      "BLOCK_T": 128, "BLOCK_I": 32})
    for noise in (False, True) for tf32 in (False, True) for residual in (False, True)
] + [
    (f"silu and mul{' (fp8 out)' * quantize}", silu_mul._silu_mul_kernel,
     {"gate_ptr": "*bf16", "up_ptr": "*bf16", "out_ptr": "*fp8e4nv" if quantize else "*bf16", "stride_gate": "i32",
      "stride_up": "i32", "width": "i32", "scale_ptr": "*fp32" if quantize else "*bf16", **QUANTIZE_ARGS,
      "BLOCK": "constexpr", "QUANTIZE": "constexpr"}, {"BLOCK": 8192 if quantize else 1024, "QUANTIZE": quantize})
    for quantize in (False, True)
] + [
    (f"add+rms norm{' (zero-centered)' * zc}{' (fp8 out)' * quantize}", rms_norm._add_rms_norm_kernel,
     norm_signature(quantize), {"HAS_RESIDUAL": True, "ZERO_CENTERED": zc, "QUANTIZE": quantize, "PARTS": 8 if zc else 1,
                                "BLOCK": 1024})
    for zc in (False, True) for quantize in (False, True)
] + [
    (f"norm+rotary{' (zero-centered)' * zc}", norm_rotary._norm_rotary_kernel, NORM_ROTARY,
     {"HAS_NORM": True, "ZERO_CENTERED": zc, "HEAD_DIM": 256, "BLOCK_D": 256, "HALF": 32, "BLOCK_HALF": 32})
    for zc in (False, True)
]

FUSED_MOE = {"a_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "topk_weights_ptr": "*bf16",
             "sorted_pairs_ptr": "*i32", "block_experts_ptr": "*i32", "num_pairs": "i32", "N": "i32", "K": "i32",
             "stride_a": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_out": "i32",
             "A_ROW_DIVISOR": "constexpr", "GATED": "constexpr", "WEIGHTED": "constexpr", "MASKED": "constexpr",
             "IEEE": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
KERNELS += [
    (f"fused moe {'gate_up' if gated else 'down'}{' (masked)' * masked}", fused_moe._fused_moe_kernel, FUSED_MOE,
     {"A_ROW_DIVISOR": 8 if gated else 1, "GATED": gated, "WEIGHTED": not gated, "MASKED": masked, "IEEE": False,
      "BLOCK_M": 16 if masked else 128, "BLOCK_N": 128, "BLOCK_K": 64})
    for gated in (False, True) for masked in (False, True)
]
KERNELS += [
    (f"moe gemv {'gate_up' if gated else 'down'}", fused_moe._moe_gemv_kernel,
     {"a_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "topk_weights_ptr": "*bf16", "topk_ids_ptr": "*i32",
      "N": "i32", "K": "i32", "stride_a": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_out": "i32",
      "A_ROW_DIVISOR": "constexpr", "GATED": "constexpr", "WEIGHTED": "constexpr", "BLOCK_N": "constexpr",
      "BLOCK_K": "constexpr"},
     {"A_ROW_DIVISOR": 8 if gated else 1, "GATED": gated, "WEIGHTED": not gated, "BLOCK_N": 8, "BLOCK_K": 256})
    for gated in (False, True)
] + [
    ("moe alignment", fused_moe._align_kernel,
     {"ids_ptr": "*i32", "sorted_pairs_ptr": "*i32", "block_experts_ptr": "*i32", "starts_ptr": "*i32",
      "num_pairs": "i32", "num_experts": "i32", "num_blocks": "i32", "BLOCK_M": "constexpr", "BLOCK_P": "constexpr",
      "BLOCK_E": "constexpr", "BLOCK_FILL": "constexpr"},
     {"BLOCK_M": 16, "BLOCK_P": 256, "BLOCK_E": 256, "BLOCK_FILL": 1024}),
] + [
    (f"gemv{' (weights preloaded)' * preload}", gemv._gemv_kernel,
     {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16", "rows": "i32", "N": "i32",
      "K": "i32", "stride_x": "i32", "stride_w": "i32", "stride_out": "i32", "HAS_BIAS": "constexpr",
      "ROWS": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "PRELOAD": "constexpr"},
     {"HAS_BIAS": preload, "ROWS": 1 if preload else 4, "BLOCK_N": 2 if preload else 8,
      "BLOCK_K": 4096 if preload else 512, "PRELOAD": preload})
    for preload in (False, True)
] + [
    (f"merge attention splits ({splits})", paged_attention._merge_splits_kernel,
     {"partial_acc_ptr": "*fp32", "partial_stats_ptr": "*fp32", "out_ptr": "*bf16", "stride_o_token": "i32",
      "stride_o_head": "i32", "SPLITS": "constexpr", "BLOCK_S": "constexpr", "HEAD_DIM": "constexpr",
      "BLOCK_D": "constexpr"},
     {"SPLITS": splits, "BLOCK_S": triton.next_power_of_2(splits), "HEAD_DIM": 128, "BLOCK_D": 128})
    for splits in (16, 3)
]

failed = 0
for name, kernel, signature, constexprs in KERNELS:
    if "PDL" in kernel.arg_names:   # compiled as launched on Hopper: waiting on its predecessor
        signature, constexprs = {**signature, "PDL": "constexpr"}, {**constexprs, "PDL": True}
    try:
        triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                       target=GPUTarget("cuda", 90, 32))
    except Exception as exc:   # report every kernel, then fail
        failed += 1
        print(f"{name}: {type(exc).__name__}: {exc}")
sys.exit(1 if failed else 0)
