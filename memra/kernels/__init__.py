"""GPU kernels (Triton, sm_90), one module per op family, each with a plain torch reference.

- :mod:`memra.kernels.gemv`: weight-resident decode linear layers ``y = x @ W^T`` for
  1..16 columns with ``W`` kept in bf16, FP8 block 128x128, NVFP4 or Q8_0.

Triton is imported lazily inside each module's kernel builders, so importing this package
(and the torch references) works without Triton installed.
"""
