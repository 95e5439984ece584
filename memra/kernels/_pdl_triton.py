"""Triton side of programmatic dependent launch (see :mod:`memra.kernels.pdl`)."""

import triton
import triton.language as tl


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    # first statement of every kernel that memra.kernels.pdl may launch with launch_pdl=True: wait
    # until the predecessor grid has finished and its writes are visible (griddepcontrol.wait), then
    # let the successor grid be scheduled (griddepcontrol.launch_dependents); no global memory is
    # touched before the wait.
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
