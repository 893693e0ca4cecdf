"""omniwalk's Triton kernels, one job per module, each with its torch reference beside it
(the path CPU runs, and what the tests hold the kernel to).

    triton_support.py   the one `triton` import (None without Triton) and `use_triton(x)`
    fp8.py              FP8 row quantization (`Fp8Rows`)
"""
