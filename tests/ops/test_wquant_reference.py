"""Weight-only quantization reference (lightspeed.ops.wquant.reference): the e3m2 code table, the fp16
bit trick, quantize/dequantize properties, the tile-interleaved packing (bit positions, padding, odd
shapes, the tile-major chunk storage, the kernel's dequant replayed on the planes), error bounds on
Gaussian weights, bad input."""
from __future__ import annotations

import math

import pytest
import torch

from lightspeed.ops.wquant import dequantize, fp6_decode, fp6_encode, fp6_to_fp16_bits, quantize, quantized_matmul
from lightspeed.ops.wquant.reference import (
    FP6_EXTRA_BIT,
    FP6_FP16_SCALE,
    FP6_NIBBLE_SHIFT,
    FP6_SIGN_BIT,
    PACK_TILE,
    ROW_GROUP,
    SCALE_MIN,
    QuantizedWeight,
    dequant_pairs_fp16,
    dequant_planes_fp16,
    pack_bytes,
    pack_fp6,
    pack_fp6_lo,
    pack_nibbles,
    padded_k,
    padded_n,
    plane_specs,
    reference_matmul,
    row_planes,
    tile_major,
    unpack_bytes,
    unpack_codes,
    unpack_fp6,
    unpack_fp6_lo,
    unpack_nibbles,
)

# relative Frobenius error bounds on N(0, 1) [256, 512] weights; measured (seed 1): fp6 0.052, fp6/g64 0.050,
# int8 0.0074, int8/g64 0.0059, int4 0.135, int4/g64 0.107
ERROR_BOUND = {("fp6", None): 0.06, ("fp6", 64): 0.06, ("int8", None): 0.01, ("int8", 64): 0.008,
               ("int4", None): 0.16, ("int4", 64): 0.12}


def _e3m2_value(code: int) -> float:
    """Independent decoding from the bit fields, with math.ldexp (no torch)."""
    sign = -1.0 if code & 0b100000 else 1.0
    exp = (code >> 2) & 0b111
    man = code & 0b11
    if exp == 0:
        return sign * math.ldexp(man / 4.0, 1 - 3)
    return sign * math.ldexp(1.0 + man / 4.0, exp - 3)


def test_e3m2_code_table_exhaustive():
    expected = torch.tensor([_e3m2_value(c) for c in range(64)], dtype=torch.float32)
    codes = torch.arange(64, dtype=torch.uint8)
    assert torch.equal(fp6_decode(codes), expected)
    assert expected.abs().max().item() == 28.0 and expected[1].item() == 1 / 16  # max normal, min subnormal
    # the kernel's fp16 bit trick: fp16(s<<15 | eeemm<<8) == value * 2**-12 for every code, exactly
    trick = fp6_to_fp16_bits(codes).float() * FP6_FP16_SCALE
    assert torch.equal(trick, expected)
    assert torch.isfinite(trick).all()
    # encode(decode(c)) == c for every code except -0 (32), which canonicalises to +0
    back = fp6_encode(expected)
    assert torch.equal(back[codes != 32], codes[codes != 32]) and back[32] == 0


def test_e3m2_round_to_nearest_even_and_saturation():
    pos = torch.tensor([_e3m2_value(c) for c in range(32)])
    mids = (pos[1:] + pos[:-1]) / 2
    got = fp6_encode(mids)
    lower = torch.arange(31)
    expect = torch.where(lower % 2 == 0, lower, lower + 1)  # tie -> even mantissa lsb (even code)
    assert torch.equal(got.long(), expect)
    assert torch.equal(fp6_encode(-mids).long(), torch.where(expect > 0, expect + 32, 0))  # no -0 code
    # just off the midpoints: plain nearest
    assert torch.equal(fp6_encode(mids * (1 - 1e-6)).long(), lower)
    assert torch.equal(fp6_encode(mids * (1 + 1e-6)).long(), lower + 1)
    # saturation: beyond 28 and huge values map to +-28, never inf/nan
    big = torch.tensor([28.0, 29.9, 30.0, 1e30, -1e30, -31.0])
    assert fp6_decode(fp6_encode(big)).tolist() == [28.0, 28.0, 28.0, 28.0, -28.0, -28.0]
    # subnormals: exact multiples of 1/16 below 0.25 are kept
    sub = torch.tensor([1 / 16, 2 / 16, 3 / 16, 1 / 32, 1 / 33])
    assert fp6_decode(fp6_encode(sub)).tolist() == [1 / 16, 2 / 16, 3 / 16, 0.0, 0.0]  # 1/32 ties to even (0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt,group_size", [("fp6", None), ("int8", None), ("int4", None), ("int4", 32),
                                            ("fp6", 32), ("int8", 64)])
def test_round_trip_properties(fmt, group_size, dtype):
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(7, 64, generator=gen) * 0.05).to(dtype)
    w[1] = 0.0  # zero row
    w[2] = w[2] * 1e-3  # tiny row: subnormal codes
    w[3, 5] = 3.0  # outlier
    qw = quantize(w, fmt, group_size)
    deq = dequantize(qw)
    assert deq.shape == w.shape and torch.isfinite(deq).all()
    assert torch.isfinite(qw.scales.float()).all() and (qw.scales.float() > 0).all()
    assert dequantize(qw, dtype=None).dtype == dtype
    assert torch.equal(deq[1], torch.zeros(64))
    top = {"fp6": 28.0, "int8": 127.0, "int4": 7.0}[fmt]
    g = 64 if group_size is None else group_size
    scale_full = qw.scales.float().repeat_interleave(g, dim=1)
    w32 = w.float()
    # every group's absmax maps exactly to the top code times its scale, unless the scale sits at the
    # fp16 floor SCALE_MIN (the tiny row 2), where it maps below the top code
    for r in (0, 2, 3):
        for j in range(64 // g):
            sl = slice(j * g, (j + 1) * g)
            i = w32[r, sl].abs().argmax()
            if w32[r, sl].abs().max() / top >= SCALE_MIN:
                assert deq[r, sl][i].abs().item() == top * qw.scales[r, j].float().item()
            else:
                assert qw.scales[r, j].float().item() == SCALE_MIN
    # error per element is at most half a grid step (fp6: relative step 2**-2 of the binade)
    err = (deq - w32).abs()
    if fmt == "fp6":
        bound = torch.maximum(w32.abs() / scale_full * 2.0**-3, torch.full_like(w32, 1 / 32)) * scale_full
    else:
        bound = 0.5 * scale_full
    assert (err <= bound * (1 + 1e-6)).all()
    # idempotent: quantizing the dequantized weight gives the same codes
    assert torch.equal(unpack_codes(quantize(deq, fmt, group_size)), unpack_codes(qw))


def test_zero_and_extreme_rows_get_valid_scales():
    w = torch.zeros(3, 32)
    w[1] = 1e-30
    w[2, 0] = 1e30
    qw = quantize(w, "fp6")
    assert (qw.scales.float() >= SCALE_MIN).all() and torch.isfinite(qw.scales.float()).all()
    deq = dequantize(qw)
    assert torch.isfinite(deq).all() and deq[0].abs().sum() == 0


@pytest.mark.parametrize("n,k", [(1, 1), (3, 48), (5, 130), (2, 256), (11, 400)])
def test_pack_unpack_round_trip_odd_shapes(n, k):
    gen = torch.Generator().manual_seed(n * k)
    nib = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    bit = torch.randint(0, 2, (2, n, k), generator=gen, dtype=torch.uint8)
    kp = padded_k(k)
    assert kp % PACK_TILE == 0 and kp - PACK_TILE < k <= kp
    words = pack_nibbles(nib, pad=9)
    assert words.dtype == torch.int32 and words.shape == (n, kp // 8)
    assert torch.equal(unpack_nibbles(words, k), nib)
    # layout: value k = t*T + f*T/4 + c sits at bits 4f of half-word t*T/4 + c (int16 view, little
    # endian: half-word 2j is the low half of word j); padding holds the pad code
    sub = PACK_TILE // 4
    halves = words.view(torch.int16)
    for kk in {0, 1, k // 2, k - 1, min(k + 1, kp - 1), kp - 1}:
        t, f, c = kk // PACK_TILE, (kk % PACK_TILE) // sub, kk % sub
        got = (int(halves[n - 1, t * sub + c]) >> (4 * f)) & 0xF
        assert got == (int(nib[n - 1, kk]) if kk < k else 9)
        word = int(words[n - 1, (t * sub + c) // 2]) & 0xFFFFFFFF
        assert (word >> (16 * (c % 2) + 4 * f)) & 0xF == got
    lo = pack_fp6_lo(bit[0], bit[1])
    assert lo.dtype == torch.int16 and lo.shape == (n, kp // 8)
    s_back, m_back = unpack_fp6_lo(lo, k)
    assert torch.equal(s_back, bit[0]) and torch.equal(m_back, bit[1])
    for kk in {0, k - 1}:
        t, f, c = kk // PACK_TILE, (kk % PACK_TILE) // sub, kk % sub
        byte = int(lo.view(torch.int8)[0, t * sub + c]) & 0xFF
        assert (byte >> FP6_SIGN_BIT[f]) & 1 == bit[0, 0, kk] and (byte >> FP6_EXTRA_BIT[f]) & 1 == bit[1, 0, kk]
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    qwords = pack_bytes(q)
    assert qwords.dtype == torch.int32 and qwords.shape == (n, kp // 4)
    assert torch.equal(unpack_bytes(qwords, k), q)
    # layout: value k = t*T + f*T/4 + c is byte f of word t*T/4 + c; padding is 0
    for kk in {0, 1, k // 2, k - 1, min(k + 1, kp - 1), kp - 1}:
        t, f, c = kk // PACK_TILE, (kk % PACK_TILE) // sub, kk % sub
        byte = int(qwords.view(torch.int8)[n - 1, 4 * (t * sub + c) + f])
        assert byte == (int(q[n - 1, kk]) if kk < k else 0)
    codes = torch.randint(0, 64, (n, k), generator=gen, dtype=torch.uint8)
    hi, lo = pack_fp6(codes)
    assert torch.equal(unpack_fp6(hi, lo, k), codes)
    assert torch.equal(unpack_fp6(hi, lo, kp)[:, k:], torch.zeros(n, kp - k, dtype=torch.uint8))  # pad = +0


def test_fp6_bit_places_each_field():
    """The lo bits are a partition of the byte, and each field's formula (reference `_fp6_field_bits`, the
    kernel's) takes every code bit from where `pack_fp6` put it: one field at a time, each of the 64 codes
    alone in an otherwise zero tile gives fp16 bits s << 15 | eeemm << 8 there and zeros elsewhere."""
    assert sorted(FP6_EXTRA_BIT + FP6_SIGN_BIT) == list(range(8))  # one byte per half-word of hi
    assert set(FP6_NIBBLE_SHIFT) <= {0, 1}
    for f in range(4):
        codes = torch.zeros(64, PACK_TILE, dtype=torch.uint8)
        col = f * PACK_TILE // 4 + 5
        codes[:, col] = torch.arange(64, dtype=torch.uint8)
        qw = QuantizedWeight("fp6", (64, PACK_TILE), None, (tile_major(pack_fp6(codes), "fp6", 64, PACK_TILE),),
                             torch.ones(64, 1, dtype=torch.float16), torch.float16)
        want = torch.zeros(64, PACK_TILE, dtype=torch.float16)
        want[:, col] = fp6_to_fp16_bits(torch.arange(64, dtype=torch.uint8))
        for replay in (dequant_planes_fp16, dequant_pairs_fp16):
            assert torch.equal(replay(qw).view(torch.int16), want.view(torch.int16)), (f, replay.__name__)


@pytest.mark.parametrize("fmt", ["fp6", "int4", "int8"])
@pytest.mark.parametrize("k", [8, 200, 384])
def test_gpu_pair_dequant_replay_is_bit_identical(fmt, k):
    """The GPU kernel's inline asm (two values per 32-bit op, replayed op by op in torch) gives the same
    fp16 bits as the interpreter path's one-value-at-a-time formulas, padding included: CI cannot run
    the asm, so this proves the formulas equivalent."""
    gen = torch.Generator().manual_seed(k + 1)
    qw = quantize(torch.randn(5, k, generator=gen), fmt)
    pairs, single = dequant_pairs_fp16(qw), dequant_planes_fp16(qw)
    assert torch.equal(pairs.view(torch.int16), single.view(torch.int16))
    if fmt == "fp6":  # every code (both signs) in every field and both halves of a word
        codes = torch.arange(64, dtype=torch.uint8).repeat(4)
        codes = torch.stack([codes, codes.roll(1), codes.roll(33)])
        packed = tile_major(pack_fp6(codes), "fp6", 3, 256)
        qw = QuantizedWeight("fp6", (3, 256), None, (packed,), torch.ones(3, 1, dtype=torch.float16), torch.float16)
    elif fmt == "int4":  # every nibble in every field and both halves
        nib = torch.arange(16, dtype=torch.uint8).repeat(16)
        planes = (tile_major((pack_nibbles(torch.stack([nib, nib.roll(1), nib.roll(7)]), pad=8),), "int4", 3, 256),)
        qw = QuantizedWeight("int4", (3, 256), None, planes, torch.ones(3, 1, dtype=torch.float16), torch.float16)
    else:  # every byte (-128 included, which quantize never writes) in every field and both halves
        q = torch.arange(-128, 128, dtype=torch.int32).to(torch.int8).repeat(2)
        planes = (tile_major((pack_bytes(torch.stack([q, q.roll(1), q.roll(77)])),), "int8", 3, 512),)
        qw = QuantizedWeight("int8", (3, 512), None, planes, torch.ones(3, 1, dtype=torch.float16), torch.float16)
    pairs, single = dequant_pairs_fp16(qw), dequant_planes_fp16(qw)
    assert torch.equal(pairs.view(torch.int16), single.view(torch.int16))
    assert torch.equal(single.float() * (FP6_FP16_SCALE if fmt == "fp6" else 1), dequantize(qw, torch.float32))


@pytest.mark.parametrize("fmt,group_size", [("fp6", None), ("int4", None), ("int8", None), ("int4", 32)])
@pytest.mark.parametrize("k", [8, 200, 384])
def test_plane_shapes_padding_and_kernel_dequant_replay(fmt, group_size, k):
    """Planes match `plane_specs` with every row a 16-byte multiple; the kernel's shift-and-mask dequant
    (replayed in torch) gives exactly the code values, and zero on the padding."""
    if group_size and k % group_size:
        pytest.skip("group does not divide K")
    gen = torch.Generator().manual_seed(k)
    w = torch.randn(6, k, generator=gen)
    qw = quantize(w, fmt, group_size)
    assert qw.tile == PACK_TILE and qw.padded_k == padded_k(k)
    for plane, (shape, dtype) in zip(qw.planes, plane_specs(fmt, 6, k)):
        assert plane.shape == shape and plane.dtype == dtype and plane.is_contiguous()
        assert plane.shape[-1] % 16 == 0 and shape[1] * ROW_GROUP == padded_n(6)
    # tile-major: chunk [K-tile t, row group g] holds each row's K-tile bytes, row by row (fp6: the R hi rows,
    # then the R lo rows); rows past N decode to 0
    rows = row_planes(qw)
    assert torch.equal(tile_major(rows, fmt, 6, k), qw.planes[0])
    sizes = {"fp6": [64, 32], "int4": [64], "int8": [128]}[fmt]
    packed = qw.planes[0].view(torch.uint8)
    for t in range(qw.padded_k // PACK_TILE):
        start = 0
        for plane, nb in zip(rows, sizes):
            row_bytes = plane.contiguous().view(torch.uint8).reshape(6, -1)
            for r in (0, 5):
                got = packed[t, 0, start + r * nb:start + (r + 1) * nb]
                assert torch.equal(got, row_bytes[r, t * nb:(t + 1) * nb])
            start += ROW_GROUP * nb
    deq = dequant_planes_fp16(qw).float()
    codes = unpack_codes(qw)
    exact = fp6_decode(codes) / FP6_FP16_SCALE if fmt == "fp6" else codes.float()
    assert torch.equal(deq[:, :k], exact)
    assert torch.equal(deq[:, k:], torch.zeros(6, qw.padded_k - k))


def test_kernel_dequant_replay_all_fp6_codes_every_field():
    codes = torch.arange(64, dtype=torch.uint8).repeat(4)  # 256 values: each code in 4 fields of 2 tiles
    codes = torch.stack([codes, codes.roll(5)])
    packed = tile_major(pack_fp6(codes), "fp6", 2, 256)
    qw = QuantizedWeight("fp6", (2, 256), None, (packed,), torch.ones(2, 1, dtype=torch.float16), torch.float16)
    got = dequant_planes_fp16(qw).float() * FP6_FP16_SCALE
    assert torch.equal(got, fp6_decode(codes))
    assert torch.equal(fp6_to_fp16_bits(codes).float(), dequant_planes_fp16(qw).float())


@pytest.mark.parametrize("fmt", ["fp6", "int8", "int4"])
def test_any_k_works(fmt):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(5, 20, generator=gen)
    qw = quantize(w, fmt)
    assert dequantize(qw).shape == (5, 20)
    x = torch.randn(3, 20, generator=gen)
    torch.testing.assert_close(quantized_matmul(x, qw), x @ dequantize(qw).T)


@pytest.mark.parametrize("fmt,group_size", list(ERROR_BOUND))
def test_relative_frobenius_error_gaussian(fmt, group_size):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(256, 512, generator=gen)
    err = ((dequantize(quantize(w, fmt, group_size)) - w).norm() / w.norm()).item()
    print(f"{fmt} group_size={group_size}: relative Frobenius error {err:.4f}")
    assert err < ERROR_BOUND[(fmt, group_size)]


def test_reference_matmul_and_cpu_dispatch():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(24, 64, generator=gen)
    qw = quantize(w, "int8")
    x = torch.randn(2, 3, 64, generator=gen)
    bias = torch.randn(24, generator=gen)
    y = quantized_matmul(x, qw, bias)
    assert y.shape == (2, 3, 24) and y.dtype == x.dtype
    torch.testing.assert_close(y, x @ dequantize(qw).T + bias)
    torch.testing.assert_close(reference_matmul(x.half(), qw).float(), (x.half().float() @ dequantize(qw).T), atol=2e-2,
                               rtol=2e-3)


@pytest.mark.parametrize("call,match", [
    (lambda: quantize(torch.randn(4, 64), "int4", group_size=8), "multiple of 16"),
    (lambda: quantize(torch.randn(4, 96), "int8", group_size=64), "does not divide"),
    (lambda: quantize(torch.randn(4, 96), "int8", group_size=24), "multiple of 16"),
    (lambda: quantize(torch.randn(4, 64), "fp8"), "must be one of"),
    (lambda: quantize(torch.randint(0, 3, (4, 64)), "int8"), "float16, bfloat16 or float32"),
    (lambda: quantize(torch.full((4, 64), float("nan")), "fp6"), "NaN"),
    (lambda: quantize(torch.randn(64), "fp6"), "2-D"),
    (lambda: quantized_matmul(torch.randn(2, 32), quantize(torch.randn(4, 64), "fp6")), "K=64"),
    (lambda: quantized_matmul(torch.randn(2, 64).long(), quantize(torch.randn(4, 64), "fp6")), "x must be"),
    (lambda: quantized_matmul(torch.randn(2, 64), quantize(torch.randn(4, 64), "fp6"), torch.randn(5)), "bias"),
])
def test_bad_input_raises_one_line_value_error(call, match):
    with pytest.raises(ValueError, match=match) as info:
        call()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("fmt,group_size", [("fp6", None), ("int8", None), ("int4", None), ("int4", 32), ("fp6", 64)])
def test_quantize_in_row_chunks_is_bit_identical(fmt, group_size, monkeypatch):
    """`quantize` works through the rows in chunks of QUANT_CHUNK values (its int64 packing
    temporaries): chunks of 1, 3 and 7 rows of a 37-row weight (a partial last chunk, chunks across the
    32-row storage groups) give the same bytes and scales as one chunk."""
    from lightspeed.ops.wquant import reference

    gen = torch.Generator().manual_seed(7)
    w = torch.randn(37, 192, generator=gen).to(torch.bfloat16)
    whole = quantize(w, fmt, group_size)
    for rows in (1, 3, 7):
        monkeypatch.setattr(reference, "QUANT_CHUNK", rows * 192 + 5)
        part = quantize(w, fmt, group_size)
        assert torch.equal(part.planes[0], whole.planes[0]) and torch.equal(part.scales, whole.scales)
        assert part.dtype == whole.dtype == torch.bfloat16
