"""Where a layer computes: torch on the CPU, or memra's kernels on a GPU.

Every layer with a kernel path derives from :class:`KernelLayer`. It is built for the CPU
(plain torch: the reference math, exact in fp32) and switched in place by :meth:`KernelLayer.to_gpu`,
which moves its weights into the formats the kernels read and sets ``kernels``; its forward
then calls the fused Triton kernels (memra/kernels) behind the same signature. Models never
branch on the device: they build layers and call them, and :func:`modules_to_gpu` switches
every layer of a model at once.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.gemv import interpret_mode

__all__ = ["KernelLayer", "check_gpu_device", "modules_to_gpu", "on_device"]


class KernelLayer(nn.Module):
    """A layer with a torch path (``kernels`` False) and a GPU kernel path (``kernels`` True).

    Subclasses that hold weights override :meth:`to_gpu` to repack them (and set ``kernels``);
    layers whose weights are plain fp32 buffers (norms, routers) only flip the flag, their
    buffers moving with the enclosing ``Module.to``.
    """

    kernels: bool = False

    def to_gpu(self, device: torch.device | str | None, dtype: torch.dtype = torch.bfloat16) -> None:
        """Take the kernel path from now on (``device``, ``dtype``: see subclasses)."""
        self.kernels = True


def check_gpu_device(device: torch.device | str) -> torch.device:
    """``device`` as a torch.device the kernels can run on.

    Raises: ValueError if it is not a CUDA device (the CPU is accepted under the Triton
    interpreter, ``TRITON_INTERPRET=1``, so that tests can run the kernel path there)."""
    device = torch.device(device)
    if device.type != "cuda" and not interpret_mode():
        raise ValueError(f"to_gpu: expected a CUDA device, got {device} (the CPU takes it only under "
                         f"TRITON_INTERPRET=1, for tests)")
    return device


def modules_to_gpu(root: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Switch every :class:`KernelLayer` under ``root`` (``root`` included) to its kernel path on
    ``device`` in place: linear layers, embeddings and routed experts into their packed GPU forms,
    then the remaining buffers (norms, routers, biases) moved. Layers already switched (loaded
    with ``device=``, or built in GPU memory) are skipped, so a model can be moved layer by layer
    while it loads (the host never holds more than one layer's dequantized weights)."""
    for m in list(root.modules()):
        if isinstance(m, KernelLayer) and not m.kernels:
            m.to_gpu(device, dtype)
    root.to(device)


def on_device(module: nn.Module, device: torch.device | str | None, dtype: torch.dtype) -> nn.Module:
    """``module`` switched with :func:`modules_to_gpu` when ``device`` is given, else as it is."""
    if device is not None:
        modules_to_gpu(module, torch.device(device), dtype)
    return module
