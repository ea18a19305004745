"""The inline-PTX dequant routines of the weight-quantized matmul kernel (`kernels.py`, fp16 activations on
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
    """The four fields of one hi word into outs[f] (l = the lo bytes doubled by prmt; reference.py's
    Note has the formulas): field 0 shl / and / lop3, field 1 lop3 merge / shl / and, field 2 shl / and /
    lop3, field 3 shr / shl / and / lop3: 13 ops."""
    return "\n".join([
        f"shl.b32 a, {hi}, 9;", f"and.b32 b, {l}, 0x81008100;", f"lop3.b32 {outs[0]}, a, 0x1E001E00, b, 0xEA;",
        f"lop3.b32 a, {hi}, 0x00F000F0, {l}, 0xE2;", "shl.b32 a, a, 5;", f"and.b32 {outs[1]}, a, 0x9F009F00;",
        f"shl.b32 b, {l}, 3;", "and.b32 b, b, 0x90009000;", f"lop3.b32 {outs[2]}, {hi}, 0x0F000F00, b, 0xEA;",
        f"shr.u32 a, {hi}, 3;", f"shl.b32 b, {l}, 2;", "and.b32 b, b, 0x81008100;",
        f"lop3.b32 {outs[3]}, a, 0x1E001E00, b, 0xEA;"])


# fp6 (pack=4: four half-words c..c+3 of the thread, in two hi words, and their four lo bytes in one
# register, so the loaded lo register feeds the asm as is): $8 / $9 = hi words of half-words 0,1 / 2,3,
# $10 = lo bytes b0..b3; l = prmt(lo, 0x1100) (b1 b1 b0 b0) for $8, prmt(lo, 0x3322) (b3 b3 b2 b2) for
# $9; field f of $8 -> $2f, of $9 -> $2f+1 (14 ops / 8 values; lop3 0xEA = (a & b) | c, 0xE2 = b ? a : c).
FP6_PACK4 = tl.constexpr("{\n.reg .b32 l, m, a, b;\nprmt.b32 l, $10, 0, 0x1100;\nprmt.b32 m, $10, 0, 0x3322;\n"
                         + _fp6_fields("$8", "l", ["$0", "$2", "$4", "$6"]) + "\n"
                         + _fp6_fields("$9", "m", ["$1", "$3", "$5", "$7"]) + "\n}")

# fp6, pack=2 (the swapped-operand layout, where a thread's lo bytes come two per row): $4 = hi word,
# $5 = the two lo bytes b0 (bits 0..7) and b1 (bits 8..15); l = b1 b1 b0 b0 bytes (14 ops / 8 values).
FP6_PACK2 = tl.constexpr("{\n.reg .b32 l, a, b;\nprmt.b32 l, $5, 0, 0x1100;\n"
                         + _fp6_fields("$4", "l", ["$0", "$1", "$2", "$3"]) + "\n}")
