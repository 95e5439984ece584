"""Weight formats memra knows: ggml block types and their byte geometry.

Block sizes and byte counts follow ggml's ``ggml-common.h`` (see shared/FORMATS.md);
the ``gguf`` package's ``GGML_QUANT_SIZES`` is the same table and tests check the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

__all__ = ["QType", "QTypeInfo", "QTYPE_INFO", "qtype_from_int", "UnsupportedQTypeError"]


class QType(IntEnum):
    """ggml tensor type ids (the numbers stored in GGUF tensor infos)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30
    NVFP4 = 40


@dataclass(frozen=True)
class QTypeInfo:
    """Block geometry: ``block_size`` weights are stored in ``type_size`` bytes."""

    block_size: int
    type_size: int

    def nbytes(self, n_elements: int) -> int:
        """Bytes used by ``n_elements`` weights (must be a multiple of ``block_size``)."""
        return n_elements // self.block_size * self.type_size


QTYPE_INFO: dict[QType, QTypeInfo] = {
    QType.F32: QTypeInfo(1, 4),
    QType.F16: QTypeInfo(1, 2),
    QType.BF16: QTypeInfo(1, 2),
    QType.Q4_0: QTypeInfo(32, 18),
    QType.Q4_1: QTypeInfo(32, 20),
    QType.Q5_0: QTypeInfo(32, 22),
    QType.Q5_1: QTypeInfo(32, 24),
    QType.Q8_0: QTypeInfo(32, 34),
    QType.Q4_K: QTypeInfo(256, 144),
    QType.Q5_K: QTypeInfo(256, 176),
    QType.Q6_K: QTypeInfo(256, 210),
    QType.NVFP4: QTypeInfo(64, 36),
}


class UnsupportedQTypeError(ValueError):
    """A tensor's type is not one memra can compute with."""


def qtype_from_int(value: int, *, where: str = "") -> QType:
    """Map a ggml type id to :class:`QType`.

    Raises:
        UnsupportedQTypeError: the id is not a type memra supports; the message names
            ``where`` (e.g. file and tensor) and lists the supported types.
    """
    try:
        return QType(int(value))
    except ValueError:
        try:
            import gguf

            name = gguf.GGMLQuantizationType(int(value)).name
        except Exception:
            name = "unknown"
        supported = ", ".join(t.name for t in QType)
        raise UnsupportedQTypeError(
            f"{where}: tensor type {int(value)} ({name}) is not supported; supported types: {supported}"
        ) from None
