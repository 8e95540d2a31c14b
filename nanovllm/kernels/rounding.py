"""Rounding an fp32 intermediate to the model dtype and back, where HF's eager code stores it in that dtype."""
import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """bf16 rounds to nearest even with integer ops: the compiler folds a cast pair that feeds an add into one
    fma, which skips the rounding (seen on the H100: 24% of rotary outputs one bit off the torch twin).
    NaN stays NaN (the integer carry would turn a NaN with a small payload into inf)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x
