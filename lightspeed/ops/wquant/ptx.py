"""The inline-PTX dequant routines of the weight-quantized matmul kernel (`triton.py`, fp16 activations on
the GPU): each takes packed 32-bit words and returns fp16x2 registers, two values per instruction. CI
cannot run them; `reference.dequant_pairs_fp16` replays them op by op in torch and a test proves that
replay bit-identical to the kernel's plain-Triton path. Imports triton (`tl.constexpr`); import lazily."""

import triton.language as tl

# GPU dequant of one 32-bit word (= half-words c, c+1 of the int16 view: the values k, k+1 of each
# field) into 4 fp16x2 registers, one per field, two values per instruction; replayed bit for bit in
# torch by `reference.dequant_pairs_fp16` (the CPU tests cannot run it). int4: 9 ops / 8 values.
INT4_PAIRS = tl.constexpr("""{
.reg .b32 t, u, c1, s, c2;
mov.b32 c1, 0x64086408;
mov.b32 s, 0x2C002C00;
mov.b32 c2, 0xD480D480;
lop3.b32 t, $4, 0x000F000F, 0x64006400, 0xEA;
sub.f16x2 $0, t, c1;
lop3.b32 t, $4, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 $1, t, s, c2;
shr.u32 u, $4, 8;
lop3.b32 t, u, 0x000F000F, 0x64006400, 0xEA;
sub.f16x2 $2, t, c1;
lop3.b32 t, u, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 $3, t, s, c2;
}""")


# int8 (pack=2: $4 / $5 = 32-bit words c, c+1, byte f of each = field f's q): per field, prmt puts byte f
# of each word in the two halves, lop3 keeps it, flips its sign bit and sets the high byte 0x64 (fp16
# 1024 + q + 128), sub.f16x2 takes 1152 off: 12 ops / 8 values.
INT8_PAIRS = tl.constexpr("{\n.reg .b32 t, c;\nmov.b32 c, 0x64806480;\n" + "\n".join(
    f"prmt.b32 t, $4, $5, 0x{4 + f}{4 + f}{f}{f};\nlop3.b32 t, t, 0x00FF00FF, c, 0x6A;\nsub.f16x2 ${f}, t, c;"
    for f in range(4)) + "\n}")


def _fp6_fields(hi: str, l: str, outs: list[str]) -> str:
    """The four fields of one hi word: field f = (hi << 9-4f) & 0x1E001E00 | (l << 2f) & 0x81008100 into
    outs[f] (l = the lo bytes doubled by prmt; f = 3 shifts hi right by 3)."""
    lines = []
    for f, out in enumerate(outs):
        lines.append(f"shl.b32 a, {hi}, {9 - 4 * f};" if f < 3 else f"shr.u32 a, {hi}, 3;")
        if f:
            lines.append(f"shl.b32 b, {l}, {2 * f};")
        lines.append(f"and.b32 b, {l if f == 0 else 'b'}, 0x81008100;")
        lines.append(f"lop3.b32 {out}, a, 0x1E001E00, b, 0xEA;")
    return "\n".join(lines)


# fp6 (pack=4: four half-words c..c+3 of the thread, in two hi words, and their four lo bytes in one
# register, so the loaded lo register feeds the asm as is): $8 / $9 = hi words of half-words 0,1 / 2,3,
# $10 = lo bytes b0..b3; l = prmt(lo, 0x1100) (b1 b1 b0 b0) for $8, prmt(lo, 0x3322) (b3 b3 b2 b2) for
# $9; field f = (hi << 9-4f) & 0x1E001E00 | (l << 2f) & 0x81008100, out $2f (from $8) and $2f+1 (from $9)
# (15 ops / 8 values).
FP6_PACK4 = tl.constexpr("{\n.reg .b32 l, m, a, b;\nprmt.b32 l, $10, 0, 0x1100;\nprmt.b32 m, $10, 0, 0x3322;\n"
                         + _fp6_fields("$8", "l", ["$0", "$2", "$4", "$6"]) + "\n"
                         + _fp6_fields("$9", "m", ["$1", "$3", "$5", "$7"]) + "\n}")

# fp6, pack=2 (the swapped-operand layout, where a thread's lo bytes come two per row): $4 = hi word,
# $5 = the two lo bytes b0 (bits 0..7) and b1 (bits 8..15); l = b1 b1 b0 b0 bytes;
# field f = (hi << 9-4f) & 0x1E001E00 | (l << 2f) & 0x81008100 (16 ops / 8 values).
FP6_PACK2 = tl.constexpr("{\n.reg .b32 l, a, b;\nprmt.b32 l, $5, 0, 0x1100;\n"
                         + _fp6_fields("$4", "l", ["$0", "$1", "$2", "$3"]) + "\n}")
