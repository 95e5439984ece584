"""A stand-in for Triton's CUDA driver on a machine without a GPU, for the precompile tests: it
answers as an sm_90 device (target, device 0, stream 0) and can launch nothing. With it, and
``knobs.runtime.jit_cache_hook`` answering "skip" (precompile's record pass), memra's kernels can
be "launched" on CPU tensors: Triton binds the arguments, specializes and calls the hook, and
never reaches a launch. Install it in a fresh process (:func:`install`), never in the test
process: it replaces the driver for the whole interpreter."""

from __future__ import annotations


class FakeCudaDriver:
    """The parts of Triton 3.6's ``driver.active`` that specialization, the jit hook, the disk
    cache lookup and ``JITFunction.preload`` use; anything else raises AttributeError."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_device_interface(self):
        import torch

        return torch.cuda

    def __getattr__(self, name):
        raise AttributeError(f"fake CUDA driver: no {name}")


def install() -> None:
    """Make :class:`FakeCudaDriver` Triton's active driver (this process only)."""
    from triton.runtime.driver import driver

    driver.set_active(FakeCudaDriver())
