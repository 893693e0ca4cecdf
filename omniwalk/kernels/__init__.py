"""omniwalk's Triton kernels, one job per module. Every kernel has a torch reference beside it,
in the same module: the path CPU runs, and what the tests hold the kernel to (in Triton's
CPU interpreter; tests/kernels).

    triton_support.py   the one `triton` import (None without Triton) and `use_triton(x)`
    rms_norm.py         RMSNorm, add + RMSNorm, zero-centered and gated RMSNorm
    silu_mul.py         the gated MLP's silu(gate) * up
    fused_moe.py        MoE routing and experts: grouped GEMMs per expert (Triton, grouped_mm)
    norm_rotary.py      QK-norm + rotary, and with the KV-cache write (`QKRotary`)
    fp8.py              FP8 row quantization (`Fp8Rows`), shared by the norm and SiLU kernels
    paged_attention.py  causal attention of a ragged batch over the paged KV cache
    cross_attention.py  cross-attention decode over a slot of the encoder-output pool
    sampling.py         the sampler's exponential race (argmax over hashed noise)
    causal_conv.py      short causal depthwise conv with a carried state (decode step)
    gated_delta_rule.py the gated delta rule's recurrence over state-pool rows
    state_rows.py       `StateRows`: the pool rows a recurrent kernel reads and writes
    snac.py             SNAC's Snake, depthwise conv and fused 1x1 conv

Kernels depend on torch and Triton only: nothing here imports `omniwalk.engine`,
`omniwalk.layers` or `omniwalk.models` (tests/test_layering.py).
"""
