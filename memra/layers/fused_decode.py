"""The fused CPU decode step as the models see it: memra/kernels/cpu_native.py ``DecoderLayers``
(every Llama-family decoder layer of a <= NATIVE_MAX_ROWS-row decode step in one native call,
bit-identical to the layer-by-layer path), re-exported here so that models depend on layers only."""

from __future__ import annotations

from ..kernels.cpu_native import DecoderLayer, DecoderLayers
from ..kernels.cpu_native import enabled as native_enabled

__all__ = ["DecoderLayer", "DecoderLayers", "native_enabled"]
