"""Data types by their storage size in bits (so 4-bit NF4 stays exact in integers)."""

from __future__ import annotations

from enum import Enum


class DType(str, Enum):
    """A tensor element type. ``bits`` is the storage width; bytes are computed from bits."""

    #: the storage width in bits: a plain attribute of each member (set below from ``_BITS``), read
    #: on every simulated allocation (a property would look the member up by hash each time)
    bits: int

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    int8 = "int8"
    uint8 = "uint8"
    bool_ = "bool"
    int64 = "int64"
    nf4 = "nf4"

    @property
    def itemsize(self) -> int:
        """Bytes per element for whole-byte types (NF4 has no whole itemsize)."""
        if self.bits % 8:
            raise ValueError(f"{self.value} has no whole-byte itemsize")
        return self.bits // 8

    def nbytes(self, numel: int) -> int:
        """Bytes of ``numel`` elements, rounded up to whole bytes."""
        return -(-numel * self.bits // 8)


_BITS = {
    DType.fp32: 32,
    DType.bf16: 16,
    DType.fp16: 16,
    DType.int8: 8,
    DType.uint8: 8,
    DType.bool_: 8,
    DType.int64: 64,
    DType.nf4: 4,
}

for _member, _bits in _BITS.items():
    _member.bits = _bits
del _member, _bits
