"""Pull a kernel's read-only operands toward L2 before its PDL wait (Hopper's bulk L2 prefetch), so that their
HBM read overlaps the kernel before it instead of starting after it. Only for data that no earlier kernel
writes: the weights. No reference twin: a prefetch changes no value, only when bytes arrive."""
import triton
import triton.language as tl


@triton.jit
def prefetch_rows_l2(row_ptrs, row_len, PIECES: tl.constexpr, PDL: tl.constexpr):
    """Start an L2 prefetch of each row that row_ptrs [R] points at: row_len elements, 16-byte aligned, with
    row_len * element size divisible by 16 * PIECES. A row goes in PIECES bulk requests, R * PIECES in all,
    so that a program's threads share the requests rather than repeat them. Compiled only under PDL (the
    interpreter has no inline assembly) and for PIECES > 0."""
    if PDL:
        if PIECES > 0:
            piece = row_len // PIECES
            ptrs = row_ptrs[:, None] + (tl.arange(0, PIECES) * piece)[None, :]
            nbytes = tl.zeros([row_ptrs.shape[0], PIECES], tl.int32) + piece * (row_ptrs.dtype.element_ty.primitive_bitwidth // 8)
            tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                      [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)
