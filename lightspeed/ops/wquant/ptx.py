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
# fp6 (pack=4: four half-words c..c+3 of the thread, in two hi words, and their four lo bytes in one
# register, so the loaded lo register feeds the asm as is): $8 / $9 = hi words of half-words 0,1 / 2,3,
# $10 = lo bytes b0..b3; l = prmt(lo, 0x1100) (b1 b1 b0 b0) for $8, prmt(lo, 0x3322) (b3 b3 b2 b2) for
# $9; field f = (hi << 9-4f) & 0x1E001E00 | (l << 2f) & 0x81008100, out $2f (from $8) and $2f+1 (from $9)
# (15 ops / 8 values).
FP6_PACK4 = tl.constexpr("""{
.reg .b32 l, m, a, b;
prmt.b32 l, $10, 0, 0x1100;
prmt.b32 m, $10, 0, 0x3322;
shl.b32 a, $8, 9;
and.b32 b, l, 0x81008100;
lop3.b32 $0, a, 0x1E001E00, b, 0xEA;
shl.b32 a, $8, 5;
shl.b32 b, l, 2;
and.b32 b, b, 0x81008100;
lop3.b32 $2, a, 0x1E001E00, b, 0xEA;
shl.b32 a, $8, 1;
shl.b32 b, l, 4;
and.b32 b, b, 0x81008100;
lop3.b32 $4, a, 0x1E001E00, b, 0xEA;
shr.u32 a, $8, 3;
shl.b32 b, l, 6;
and.b32 b, b, 0x81008100;
lop3.b32 $6, a, 0x1E001E00, b, 0xEA;
shl.b32 a, $9, 9;
and.b32 b, m, 0x81008100;
lop3.b32 $1, a, 0x1E001E00, b, 0xEA;
shl.b32 a, $9, 5;
shl.b32 b, m, 2;
and.b32 b, b, 0x81008100;
lop3.b32 $3, a, 0x1E001E00, b, 0xEA;
shl.b32 a, $9, 1;
shl.b32 b, m, 4;
and.b32 b, b, 0x81008100;
lop3.b32 $5, a, 0x1E001E00, b, 0xEA;
shr.u32 a, $9, 3;
shl.b32 b, m, 6;
and.b32 b, b, 0x81008100;
lop3.b32 $7, a, 0x1E001E00, b, 0xEA;
}""")

# fp6, pack=2 (the swapped-operand layout, where a thread's lo bytes come two per row): $4 = hi word, $5 = the two lo bytes b0 (bits 0..7) and b1 (bits 8..15); l = b1 b1 b0 b0 bytes;
# field f = (hi << 9-4f) & 0x1E001E00 | (l << 2f) & 0x81008100 (16 ops / 8 values).
FP6_PACK2 = tl.constexpr("""{
.reg .b32 l, a, b;
prmt.b32 l, $5, 0, 0x1100;
shl.b32 a, $4, 9;
and.b32 b, l, 0x81008100;
lop3.b32 $0, a, 0x1E001E00, b, 0xEA;
shl.b32 a, $4, 5;
shl.b32 b, l, 2;
and.b32 b, b, 0x81008100;
lop3.b32 $1, a, 0x1E001E00, b, 0xEA;
shl.b32 a, $4, 1;
shl.b32 b, l, 4;
and.b32 b, b, 0x81008100;
lop3.b32 $2, a, 0x1E001E00, b, 0xEA;
shr.u32 a, $4, 3;
shl.b32 b, l, 6;
and.b32 b, b, 0x81008100;
lop3.b32 $3, a, 0x1E001E00, b, 0xEA;
}""")
