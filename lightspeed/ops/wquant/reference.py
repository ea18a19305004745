"""Weight-only quantization in plain PyTorch: the spec and the CPU path.

Owns the quantizers (FP6 e3m2, INT8, INT4), their exact dequantizers, the packed storage layout
(`QuantizedWeight`) and the reference matmul `y = x @ dequant(W).T`. Must not import triton or
anything above ops/.

Note: packed layout (tile-interleaved planes). Rows are output channels n (nn.Linear orientation).
K is padded with zero codes to Kp, a multiple of the pack tile T = `PACK_TILE` (128), so any K works.
The row planes (`pack_fp6`, `pack_nibbles`) are int32 [N, Kp/8] addressed as 16-bit half-words (int16
view, little endian: word j = half-word 2j | half-word 2j+1 << 16). In K-tile t and row n, half-word c
(0 <= c < T/4) holds the 4 values k = t*T + f*T/4 + c, f = 0..3 (field f, at bits 4f). So a 32-bit
word holds, per field, the values k and k+1 (k even) in its two halves: one 32-bit shift / mask /
packed-fp16 op dequantizes two values (`FIELDS` fields, each a *contiguous* K range of T/4 values).
  fp6   code ``s eee mm``. Plane ``hi`` int32 [N, Kp/8]: field f of half-word c = nibble ``eee m1``
        (``ee m1 m0`` for field 2: `FP6_NIBBLE_SHIFT`). Plane ``lo`` int16 [N, Kp/8], addressed as
        bytes (int8 view): byte c (same index as half-word c of ``hi``) holds field f's ``s`` at bit
        FP6_SIGN_BIT[f] and the code bit its nibble leaves out (m0; e2 for field 2) at bit
        FP6_EXTRA_BIT[f]. The bits are placed for the kernel's dequant (14 ops per 8 values, layout
        7): with l = the byte doubled to 16 bits, field 0 = ``hi << 9 & 0x1E00 | l & 0x8100``, field 1
        = ``(hi & 0x00F0 | l & ~0x00F0) << 5 & 0x9F00`` (one merge, then one shift for both parts),
        field 2 = ``hi & 0x0F00 | l << 3 & 0x9000``, field 3 = ``hi >> 3 & 0x1E00 | l << 2 & 0x8100``
        (an exhaustive search over nibble choices and lo bit places found no arrangement under 14;
        layout 6 took 16). 6 bits/value.
  int4  plane int32 [N, Kp/8], field f of half-word c = nibble ``q + 8`` (q in [-7, 7]); pad code 8.
  int8  plane int32 [N, Kp/4] (`pack_bytes`): byte f of word t*T/4 + c = field f's q (in [-127, 127]) of
        column c, i.e. byte 4c + f of the row's K-tile holds k = t*T + f*T/4 + c. Loaded as 32-bit
        words, a thread's pair of words c, c+1 gives each field's values k, k+1 in one prmt + lop3 +
        packed-fp16 subtract (plain bytes, K in order, needed 2-byte shared-memory reads and four
        times the instructions per value on the H200's wgmma operand layout).
Storage is *tile-major*: those row planes are cut into chunks of R = `ROW_GROUP` rows x one K-tile and
each chunk is stored contiguously (`tile_major` / `row_planes`), as one int8 tensor
[Kp/T, Np/R, R * B] (Np: N padded to R with rows that decode to 0; B: bytes of one row's K-tile: fp6
3T/4 = the row's hi bytes T/2 then its lo bytes T/4, chunk = R hi rows then R lo rows; int4 T/2;
int8 T). A kernel program streams whole chunks (fp6: 3 KB) instead of 32..128-byte pieces of rows
4..16 KB apart: DRAM reads short strided pieces at ~0.6 of its streaming bandwidth (measured on the
H200: 32-byte pieces 2.5 TB/s, contiguous 4.1). The chunks are K-tile major (layout 6): K-tile t of
every row group comes before K-tile t + 1 of any, so the programs of a split that work on the same
K-tile at the same time read one contiguous stretch, as a copy does (row-group major, layout 5, had
them read pieces 24 KB apart: FP6 8192 x 8192 at M = 1 took 18.3 us against 17.1-17.5 at layout 6 on
the H200).
Scales are fp16 [N, K / group_size] (one column when group_size is None): w ~= q * scale.
group_size must be a multiple of T/8 (16) dividing K, so a T/8 sub-tile never straddles two groups.
fp16 scales are clamped to [2**-14, 65504] (normal fp16), so a zero row gets the scale 2**-14 and
codes 0, and quantization divides by the *stored* scale, so the row's absmax maps to the top code.

Note: fp16 dequant tricks (the kernel's arithmetic; `dequant_planes_fp16` replays it in torch).
fp6: the fp16 with bits ``s << 15 | eeemm << 8`` equals the e3m2 value times 2**-12, for normals
(exponent bias 15 vs 3) and subnormals (fp16 subnormal step 2**-24 times mm << 8 is mm * 2**-16 =
(mm / 16) * 2**-12) alike; from the planes it is ``(hi16 << 9-4f) & 0x1E00 | ((lo8 * 0x101) << 2f) &
0x8100`` per value, done on 32-bit words for two values at once (the kernel's inline asm); 2**12 is
folded into the fp32 epilogue scale (`FP6_FP16_SCALE`). int4/int8: fp16 bits ``0x6400 | c`` are
1024 + c for 0 <= c < 1024, so ``(nib | 0x6400) - 1032`` and ``(b ^ 0x80 | 0x6400) - 1152`` (b the
byte of q) are q exactly, without an int->float convert (int4 fields 1 and 3 use ``(16 * nib | 0x6400)
/ 16 - 72``, no shift).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: bumped whenever the packed bit layout changes (QuantizedLinear refuses other versions)
LAYOUT_VERSION = 7
FORMATS = ("fp6", "int8", "int4")
FP6_MAX = 28.0
FP6_FP16_SCALE = 4096.0  # fp16(s<<15 | eeemm<<8) * 2**12 == e3m2 value
INT_MAX = {"int8": 127, "int4": 7}
QMAX = {"fp6": FP6_MAX, "int8": 127.0, "int4": 7.0}
PACK_TILE = 128  # T: K is padded to a multiple of T; a 16-bit half-word holds 4 values T/4 apart along K
FIELDS = 4  # fields per half-word (fp6 hi / int4) and per lo byte (fp6)
ROW_GROUP = 32  # R: rows per contiguous storage chunk (module Note)
SUB_TILE = 16  # group_size unit (the kernel splits a T/4 field in two for groups not a multiple of 32)
FP6_NIBBLE_SHIFT = (1, 1, 0, 1)  # hi nibble of field f = (code >> shift) & 0xF: eee m1, field 2 ee m1 m0
FP6_EXTRA_BIT = (0, 3, 1, 6)  # lo byte: bit of the code bit field f's nibble leaves out (m0; field 2: e2)
FP6_SIGN_BIT = (7, 2, 4, 5)  # lo byte: bit of s for field f
SCALE_MIN = 2.0**-14
SCALE_MAX = 65504.0
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def fp6_code_values() -> torch.Tensor:
    """The 64 e3m2 values indexed by code ``s eee mm`` (fp32, [64])."""
    codes = torch.arange(64)
    sign = torch.where(codes >= 32, -1.0, 1.0)
    exp = (codes >> 2) & 7
    man = (codes & 3).float()
    mag = torch.where(exp == 0, man / 16.0, torch.exp2(exp.float() - 3.0) * (1.0 + man / 4.0))
    return sign * mag


_FP6_POS = fp6_code_values()[:32]  # increasing with the code
_FP6_MIDS = (_FP6_POS[1:] + _FP6_POS[:-1]) / 2


def fp6_encode(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 values (already divided by the scale) to e3m2 codes, nearest-even, saturating at
    +-28. Returns uint8 codes of the same shape."""
    a = v.abs().clamp(max=FP6_MAX).float().contiguous()
    mids = _FP6_MIDS.to(a.device)
    lo = torch.searchsorted(mids, a, right=False)  # ties resolve to the lower code...
    hi = torch.searchsorted(mids, a, right=True)  # ...or the upper one
    mag = torch.where((lo != hi) & (lo % 2 == 1), hi, lo)  # a tie goes to the even code (mantissa lsb 0)
    sign = (v < 0) & (mag > 0)  # no -0 code: keeps dequant(quant(0)) == +0 and codes canonical
    return (mag + sign.to(mag.dtype) * 32).to(torch.uint8)


def fp6_decode(codes: torch.Tensor) -> torch.Tensor:
    """e3m2 codes (any int dtype, values 0..63) -> fp32 values."""
    return fp6_code_values().to(codes.device)[codes.long()]


def fp6_to_fp16_bits(codes: torch.Tensor) -> torch.Tensor:
    """The kernel's dequant, in torch: codes -> fp16 equal to value * 2**-12 (no branches)."""
    c = codes.to(torch.int32)
    bits = ((c & 32) << 10) | ((c & 31) << 8)
    return bits.to(torch.int16).view(torch.float16)


def padded_k(k: int, tile: int = PACK_TILE) -> int:
    """K rounded up to a multiple of the pack tile."""
    return -(-k // tile) * tile


@dataclass
class QuantizedWeight:
    """A packed [N, K] weight. `planes` = (the tile-major packed int8 tensor of `plane_specs`,) (module
    Note; K padded to `padded_k`, N to `padded_n`; `row_planes` gives the row-major planes), `scales`
    fp16 [N, K // group_size]; `dtype` is the dtype of the weight it came from; `tile` the pack tile T
    the planes were interleaved with."""

    format: str
    shape: tuple[int, int]
    group_size: int | None
    planes: tuple[torch.Tensor, ...]
    scales: torch.Tensor
    dtype: torch.dtype
    tile: int = PACK_TILE

    @property
    def device(self) -> torch.device:
        return self.scales.device

    @property
    def padded_k(self) -> int:
        return padded_k(self.shape[1], self.tile)

    @property
    def num_bytes(self) -> int:
        """Bytes a kernel reads: packed planes plus scales."""
        return sum(p.numel() * p.element_size() for p in self.planes) + self.scales.numel() * self.scales.element_size()

    def to(self, device) -> "QuantizedWeight":
        return QuantizedWeight(self.format, self.shape, self.group_size, tuple(p.to(device) for p in self.planes),
                               self.scales.to(device), self.dtype, self.tile)

    def expert(self, e: int) -> "QuantizedWeight":
        """Of a stack of experts' weights (planes [E, ...], scales [E, N, groups]): expert e's, as views."""
        return QuantizedWeight(self.format, self.shape, self.group_size, tuple(p[e] for p in self.planes),
                               self.scales[e], self.dtype, self.tile)


def padded_n(n: int) -> int:
    """N rounded up to a multiple of the storage row group."""
    return -(-n // ROW_GROUP) * ROW_GROUP


def _row_plane_bytes(fmt: str, tile: int) -> list[int]:
    """Bytes of one row's K-tile in each row plane (fp6: hi, lo; int4; int8)."""
    return {"fp6": [tile // 2, tile // 4], "int4": [tile // 2], "int8": [tile]}[fmt]


def tile_bytes(fmt: str, tile: int = PACK_TILE) -> int:
    """Bytes of one row's K-tile in the packed weight (fp6 3T/4, int4 T/2, int8 T)."""
    return sum(_row_plane_bytes(fmt, tile))


def plane_specs(fmt: str, n: int, k: int, tile: int = PACK_TILE) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each packed plane of an [n, k] weight: one tile-major int8 tensor
    [Kp / tile, Np / ROW_GROUP, ROW_GROUP * tile_bytes] (module Note)."""
    return [((padded_k(k, tile) // tile, padded_n(n) // ROW_GROUP, ROW_GROUP * tile_bytes(fmt, tile)), torch.int8)]


def _row_specs(fmt: str, n: int, k: int, tile: int) -> list[tuple[tuple[int, int], torch.dtype]]:
    """(shape, dtype) of the row-major planes `pack_fp6` / `pack_nibbles` / int8 produce."""
    kp = padded_k(k, tile)
    if fmt == "fp6":
        return [((n, kp // 8), torch.int32), ((n, kp // 8), torch.int16)]
    if fmt == "int4":
        return [((n, kp // 8), torch.int32)]
    return [((n, kp // 4), torch.int32)]


_PAD_BYTE = {"fp6": 0, "int4": 0x88, "int8": 0}  # rows past N decode to 0 (int4: code 8 is q = 0)


def tile_major(planes: tuple[torch.Tensor, ...], fmt: str, n: int, k: int, tile: int = PACK_TILE) -> torch.Tensor:
    """Row-major planes (`_row_specs`) -> the tile-major packed tensor (`plane_specs`)."""
    np_, nt, r = padded_n(n), padded_k(k, tile) // tile, ROW_GROUP
    chunks = []
    for plane, (shape, dtype), nb in zip(planes, _row_specs(fmt, n, k, tile), _row_plane_bytes(fmt, tile)):
        if tuple(plane.shape) != shape or plane.dtype != dtype:
            raise ValueError(f"{fmt} row plane must be {dtype} {shape} (got {plane.dtype} {tuple(plane.shape)})")
        b = plane.contiguous().view(torch.uint8).reshape(n, nt, nb)
        if np_ > n:
            b = torch.cat([b, torch.full((np_ - n, nt, nb), _PAD_BYTE[fmt], dtype=torch.uint8, device=b.device)])
        chunks.append(b.reshape(np_ // r, r, nt, nb).permute(2, 0, 1, 3).reshape(nt, np_ // r, r * nb))
    return torch.cat(chunks, dim=2).contiguous().view(torch.int8)


def row_planes(qw: "QuantizedWeight") -> tuple[torch.Tensor, ...]:
    """The row-major planes of a packed weight (inverse of `tile_major`): fp6 (hi int32, lo int16)
    [N, Kp/8], int4 (int32 [N, Kp/8],), int8 (int32 [N, Kp/4],)."""
    n, k = qw.shape
    packed = qw.planes[0]
    nt, g, _ = packed.shape
    r, out, start = ROW_GROUP, [], 0
    for (shape, dtype), nb in zip(_row_specs(qw.format, n, k, qw.tile), _row_plane_bytes(qw.format, qw.tile)):
        b = packed.view(torch.uint8)[:, :, start:start + r * nb].reshape(nt, g, r, nb)
        start += r * nb
        rows = b.permute(1, 2, 0, 3).reshape(g * r, nt * nb)[:n].contiguous()
        out.append(rows.view(dtype).reshape(shape))
    return tuple(out)


def check_quant_args(fmt: str, shape, group_size: int | None) -> None:
    """Raise a one-line ValueError if (format, [N, K] shape, group_size) cannot be packed."""
    if fmt not in FORMATS:
        raise ValueError(f"weight quantization format must be one of {FORMATS} (got {fmt!r})")
    if len(shape) != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features] (got shape {tuple(shape)})")
    n, k = shape
    if n < 1 or k < 1:
        raise ValueError(f"weight must be non-empty (got shape {tuple(shape)})")
    if group_size is not None:
        if (not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < SUB_TILE
                or group_size % SUB_TILE):
            raise ValueError(f"group_size must be None or a positive multiple of {SUB_TILE} (got {group_size!r})")
        if k % group_size:
            raise ValueError(f"group_size {group_size} does not divide in_features K={k}")


def _scales(w32: torch.Tensor, qmax: float, group_size: int | None) -> torch.Tensor:
    n, k = w32.shape
    g = k if group_size is None else group_size
    absmax = w32.abs().reshape(n, k // g, g).amax(dim=2)
    return (absmax / qmax).clamp(SCALE_MIN, SCALE_MAX).to(torch.float16)


def _expand(scales: torch.Tensor, k: int) -> torch.Tensor:
    """[N, G] -> [N, K] fp32, each group's scale repeated along its K range."""
    return scales.float().repeat_interleave(k // scales.shape[1], dim=1)


def _fields(vals: torch.Tensor, tile: int, pad: int) -> torch.Tensor:
    """[N, K] -> int64 [N, Kp/tile, FIELDS, tile/FIELDS]: [n, t, f, c] is value k = t*tile + f*tile/4 + c
    (K padded with `pad`)."""
    n, k = vals.shape
    if tile % 16 or tile < 16:
        raise ValueError(f"pack tile must be a positive multiple of 16 (got {tile})")
    kp = padded_k(k, tile)
    v = torch.full((n, kp), pad, dtype=torch.int64, device=vals.device)
    v[:, :k] = vals.to(torch.int64)
    return v.reshape(n, kp // tile, FIELDS, tile // FIELDS)


def _unfields(f: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of `_fields`: [N, T', FIELDS, tile/FIELDS] -> [N, k] (padding dropped)."""
    n = f.shape[0]
    return f.reshape(n, -1)[:, :k]


def _to_signed(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative int64 words < 2**bits -> the two's-complement int{bits} tensor."""
    dtype = torch.int32 if bits == 32 else torch.int16
    return torch.where(words >= 2 ** (bits - 1), words - 2**bits, words).to(dtype)


def _join_pairs(units: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 [N, 2L] units of `bits` bits -> int64 [N, L] words: unit 2j low, unit 2j+1 high (the
    little-endian storage of the unit array)."""
    return units[:, 0::2] | (units[:, 1::2] << bits)


def _split_pairs(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `_join_pairs` (words any int dtype): int64 [N, 2L] units."""
    w = words.to(torch.int64) & ((1 << (2 * bits)) - 1)
    return torch.stack([w & ((1 << bits) - 1), w >> bits], dim=-1).reshape(w.shape[0], -1)


def _fields_of_units(units: torch.Tensor, tile: int) -> torch.Tensor:
    """int64 [N, Kp/4] units -> [N, Kp/tile, 1, tile/4] (broadcasts against the field axis)."""
    return units.reshape(units.shape[0], -1, 1, tile // FIELDS)


def pack_nibbles(vals: torch.Tensor, tile: int = PACK_TILE, pad: int = 0) -> torch.Tensor:
    """uint8 [N, K] values 0..15 -> int32 [N, Kp/8]: half-word t*tile/4 + c (int16 view), bits
    4f..4f+3, holds value k = t*tile + f*tile/4 + c (K padded with `pad`)."""
    f = _fields(vals, tile, pad)
    shifts = torch.arange(FIELDS, device=vals.device, dtype=torch.int64)[:, None] * 4
    half = (f << shifts).sum(dim=2).reshape(f.shape[0], -1)  # disjoint bit ranges: sum == or
    return _to_signed(_join_pairs(half, 16), 32)


def unpack_nibbles(words: torch.Tensor, k: int, tile: int = PACK_TILE) -> torch.Tensor:
    """int32 [N, Kp/8] -> uint8 [N, k] (inverse of `pack_nibbles`)."""
    h = _fields_of_units(_split_pairs(words, 16), tile)
    shifts = torch.arange(FIELDS, device=words.device, dtype=torch.int64)[:, None] * 4
    return _unfields((h >> shifts) & 0xF, k).to(torch.uint8)


def pack_bytes(q: torch.Tensor, tile: int = PACK_TILE) -> torch.Tensor:
    """int8 [N, K] -> int32 [N, Kp/4]: byte f of word t*tile/4 + c holds value k = t*tile + f*tile/4 + c
    (K padded with 0)."""
    f = _fields(q.view(torch.uint8), tile, 0)  # [N, Kp/tile, FIELDS, tile/4], bytes 0..255
    return f.transpose(2, 3).to(torch.uint8).reshape(f.shape[0], -1).view(torch.int32)


def unpack_bytes(words: torch.Tensor, k: int, tile: int = PACK_TILE) -> torch.Tensor:
    """int32 [N, Kp/4] -> int8 [N, k] (inverse of `pack_bytes`)."""
    n = words.shape[0]
    b = words.contiguous().view(torch.int8).reshape(n, -1, tile // FIELDS, FIELDS)
    return _unfields(b.transpose(2, 3), k).contiguous()


def pack_fp6_lo(sign: torch.Tensor, extra: torch.Tensor, tile: int = PACK_TILE) -> torch.Tensor:
    """Sign bits and each field's extra code bit [N, K] (0/1) -> the fp6 ``lo`` plane int16 [N, Kp/8]:
    byte c (int8 view) has, for field f (value k = t*tile + f*tile/4 + c), the extra bit at bit
    FP6_EXTRA_BIT[f] and s at FP6_SIGN_BIT[f]; padding 0."""
    fs, fe = _fields(sign, tile, 0), _fields(extra, tile, 0)
    sb = torch.tensor(FP6_SIGN_BIT, device=sign.device, dtype=torch.int64)[:, None]
    eb = torch.tensor(FP6_EXTRA_BIT, device=sign.device, dtype=torch.int64)[:, None]
    byte = ((fs << sb) + (fe << eb)).sum(dim=2).reshape(fs.shape[0], -1)
    return _to_signed(_join_pairs(byte, 8), 16)


def unpack_fp6_lo(words: torch.Tensor, k: int, tile: int = PACK_TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """int16 [N, Kp/8] -> (sign, extra) uint8 [N, k] (inverse of `pack_fp6_lo`)."""
    b = _fields_of_units(_split_pairs(words, 8), tile)
    sb = torch.tensor(FP6_SIGN_BIT, device=words.device, dtype=torch.int64)[:, None]
    eb = torch.tensor(FP6_EXTRA_BIT, device=words.device, dtype=torch.int64)[:, None]
    return _unfields((b >> sb) & 1, k).to(torch.uint8), _unfields((b >> eb) & 1, k).to(torch.uint8)


def _nibble_shifts(k: int, tile: int, device) -> torch.Tensor:
    """int64 [k]: FP6_NIBBLE_SHIFT of the field each column k falls in."""
    field = (torch.arange(k, device=device) % tile) // (tile // FIELDS)
    return torch.tensor(FP6_NIBBLE_SHIFT, device=device, dtype=torch.int64)[field]


def pack_fp6(codes: torch.Tensor, tile: int = PACK_TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """e3m2 codes uint8 [N, K] -> (hi int32 [N, Kp/8], lo int16 [N, Kp/8]); padding is code 0 (+0)."""
    c = codes.to(torch.int64)
    sh = _nibble_shifts(c.shape[1], tile, c.device)
    extra = torch.where(sh == 1, c & 1, (c >> 4) & 1)  # the code bit the nibble leaves out
    return pack_nibbles((c >> sh) & 0xF, tile), pack_fp6_lo((c >> 5) & 1, extra, tile)


def unpack_fp6(hi: torch.Tensor, lo: torch.Tensor, k: int, tile: int = PACK_TILE) -> torch.Tensor:
    """(hi, lo) planes -> e3m2 codes uint8 [N, k] (inverse of `pack_fp6`)."""
    sign, extra = unpack_fp6_lo(lo, k, tile)
    nib, sh = unpack_nibbles(hi, k, tile).to(torch.int64), _nibble_shifts(k, tile, hi.device)
    low5 = torch.where(sh == 1, (nib << 1) | extra, (extra.to(torch.int64) << 4) | nib)
    return ((sign.to(torch.int64) << 5) | low5).to(torch.uint8)


def dequant_planes_fp16(qw: "QuantizedWeight") -> torch.Tensor:
    """The kernel's interpreter-path dequantization replayed in torch on the planes, field by field, one
    value per 16-bit unit (same shifts and masks): fp16 [N, Kp] equal to code value * 2**-12 (fp6) or
    q (int4, int8), padding included. (The GPU path does the same on 32-bit pairs:
    `dequant_pairs_fp16`.)"""
    n, kp = qw.shape[0], qw.padded_k
    tile = qw.tile
    out = torch.empty((n, kp // tile, FIELDS, tile // FIELDS), dtype=torch.float16, device=qw.device)
    planes = row_planes(qw)
    if qw.format == "int8":
        w = _fields_of_units(planes[0].to(torch.int64) & _ASM_MASK32, tile)[:, :, 0]
        for f in range(FIELDS):
            bits = (((w >> (8 * f)) & 0xFF) ^ 0x80) | 0x6400  # fp16 bits of 1024 + (q + 128)
            out[:, :, f] = bits.to(torch.int16).view(torch.float16) - 1152.0
        return out.reshape(n, kp)
    h = _fields_of_units(_split_pairs(planes[0], 16), tile)[:, :, 0]  # int64: shifts never overflow
    if qw.format == "fp6":
        lo = _fields_of_units(_split_pairs(planes[1], 8), tile)[:, :, 0]
        lo16 = lo | (lo << 8)  # the byte twice (module Note: field f's formula)
    for f in range(FIELDS):
        if qw.format == "int4":
            bits = ((h >> (4 * f)) & 0xF) | 0x6400  # fp16 bits of 1024 + (q + 8)
            out[:, :, f] = (bits.to(torch.int16).view(torch.float16) - 1032.0)
        else:
            out[:, :, f] = _fp6_field_bits(h, lo16, f, 0xFFFF).to(torch.int16).view(torch.float16)
    return out.reshape(n, kp)


def _fp6_field_bits(h: torch.Tensor, l: torch.Tensor, f: int, mask: int) -> torch.Tensor:
    """fp16 bits ``s << 15 | eeemm << 8`` of fp6 field f from the hi unit(s) h and the doubled lo byte(s) l
    (int64; module Note): mask 0xFFFF for one value per 16-bit unit, 0xFFFFFFFF for the pairs of the
    32-bit asm (the masks below are then repeated in both halves)."""
    rep = 0x00010001 if mask > 0xFFFF else 1
    if f == 0:
        bits = ((h << 9) & (0x1E00 * rep)) | (l & (0x8100 * rep))
    elif f == 1:
        bits = (((h & (0x00F0 * rep)) | (l & ~(0x00F0 * rep))) << 5) & (0x9F00 * rep)
    elif f == 2:
        bits = (h & (0x0F00 * rep)) | ((l << 3) & (0x9000 * rep))
    else:
        bits = ((h >> 3) & (0x1E00 * rep)) | ((l << 2) & (0x8100 * rep))
    return bits & mask


_HALF_MAGIC = 0x64006400  # fp16x2 1024, 1024
_ASM_MASK32 = (1 << 32) - 1


def _f16x2(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 32-bit words -> (low, high) fp16 halves as fp32."""
    lo = (words & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.float16).float()
    hi = ((words >> 16) & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.float16).float()
    return lo, hi


def dequant_pairs_fp16(qw: "QuantizedWeight") -> torch.Tensor:
    """The GPU kernel's inline-asm dequantization (fp16 activations) replayed in torch, instruction by
    instruction on the 32-bit words (two values per op): fp16 [N, Kp], which must be bit-identical to
    `dequant_planes_fp16` (CI cannot run the asm). fp6: ``l = prmt(lo16, 0x1100)`` (bytes b0 b0 b1 b1; the
    pack=4 asm takes 4 lo bytes b0..b3 in one register and uses ``prmt 0x1100`` for its first hi word and
    ``prmt 0x3322`` (b2 b2 b3 b3) for its second: the same bytes per word as here),
    field f = the module Note's formula on both halves at once (`_fp6_field_bits`). int4: fields 0, 2 =
    ``(w >> 4f) & 0x000F000F | 0x64006400`` minus 1032 (sub.f16x2); fields 1, 3 = ``(w >> 4f-4) &
    0x00F000F0 | 0x64006400`` times 1/16 minus 72 (fma.rn.f16x2, exact: 64 + c). int8 (words 2j, 2j+1 as
    a pair): ``t = prmt(w2j, w2j+1, 0x(4+f)(4+f)ff)`` (byte f of each word in halves 0 and 1),
    ``(t & 0x00FF00FF) ^ 0x64806480`` (lop3) minus 1152 (sub.f16x2)."""
    n, kp = qw.shape[0], qw.padded_k
    tile = qw.tile
    planes = row_planes(qw)
    w = planes[0].to(torch.int64) & _ASM_MASK32  # [N, Kp/8]: one word = half-words 2j, 2j+1 (int8: Kp/4)
    out = torch.empty((n, kp // 8, FIELDS, 2), dtype=torch.float32, device=qw.device)
    if qw.format == "int8":
        a, b = w[:, 0::2], w[:, 1::2]  # the pair of words (columns c, c+1) the asm takes
        for f in range(FIELDS):
            ba, bb = (a >> (8 * f)) & 0xFF, (b >> (8 * f)) & 0xFF
            t = ba | (ba << 8) | (bb << 16) | (bb << 24)  # prmt: bytes a_f a_f b_f b_f
            lo, hi = _f16x2((t & 0x00FF00FF) ^ 0x64806480)
            out[:, :, f, 0], out[:, :, f, 1] = lo - 1152.0, hi - 1152.0  # exact in fp16
    elif qw.format == "fp6":
        b = planes[1].to(torch.int64) & 0xFFFF
        l32 = (b & 0xFF) * 0x0101 | ((b >> 8) & 0xFF) * 0x01010000  # prmt.b32 l, lo, 0, 0x1100
        for f in range(FIELDS):
            out[:, :, f, 0], out[:, :, f, 1] = _f16x2(_fp6_field_bits(w, l32, f, _ASM_MASK32))
    else:
        w8 = w >> 8
        for f in range(FIELDS):
            src = w if f < 2 else w8
            if f % 2 == 0:
                t = (src & 0x000F000F) | _HALF_MAGIC
                lo, hi = _f16x2(t)
                out[:, :, f, 0], out[:, :, f, 1] = lo - 1032.0, hi - 1032.0  # exact in fp16
            else:
                t = (src & 0x00F000F0) | _HALF_MAGIC  # fp16 1024 + 16 c
                lo, hi = _f16x2(t)
                out[:, :, f, 0], out[:, :, f, 1] = lo / 16 - 72.0, hi / 16 - 72.0  # exact in fp16
    # [N, Kp/8, f, half] -> value k = t*tile + f*tile/4 + c with c = 2 * (word j in tile) + half
    out = out.reshape(n, kp // tile, tile // 8, FIELDS, 2).permute(0, 1, 3, 2, 4)
    return out.reshape(n, kp).to(torch.float16)


def quantize(weight: torch.Tensor, fmt: str = "fp6", group_size: int | None = None) -> QuantizedWeight:
    """Quantize a float [N, K] weight (nn.Linear layout) symmetrically, round to nearest (even on
    ties), saturating. Raises ValueError for unsupported dtypes, shapes or non-finite weights."""
    if not isinstance(weight, torch.Tensor) or weight.dtype not in _FLOAT_DTYPES:
        got = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must be float16, bfloat16 or float32 (got {got})")
    check_quant_args(fmt, weight.shape, group_size)
    n, k = weight.shape
    if not torch.isfinite(weight).all():
        raise ValueError("weight contains NaN or inf; refusing to quantize it")
    step = max(1, QUANT_CHUNK // k)  # rows are independent: quantize and pack them in chunks
    parts = [_quantize_rows(weight[i:i + step].detach(), fmt, group_size) for i in range(0, n, step)]
    scales = torch.cat([scales for scales, _ in parts])
    rows = tuple(torch.cat([planes[j] for _, planes in parts]) for j in range(len(parts[0][1])))
    return QuantizedWeight(fmt, (n, k), group_size, (tile_major(rows, fmt, n, k),), scales, weight.dtype, PACK_TILE)


# values per row chunk of `quantize`: its packing works in int64 temporaries (tens of bytes a value), so a
# whole 8192 x 28672 layer at once took ~15 GiB of GPU memory beyond the weights (BENCHMARKS.md, "Quantizer
# memory", 2026-11-30)
QUANT_CHUNK = 1 << 24


def _quantize_rows(weight: torch.Tensor, fmt: str, group_size: int | None) -> tuple[torch.Tensor, tuple]:
    """(fp16 scales [rows, groups], the row-major planes of `_row_specs`) of a block of whole rows."""
    w32 = weight.float()
    k = w32.shape[1]
    scales = _scales(w32, QMAX[fmt], group_size)
    v = w32 / _expand(scales, k)
    if fmt == "fp6":
        return scales, pack_fp6(fp6_encode(v))
    qmax = INT_MAX[fmt]
    q = torch.round(v).clamp(-qmax, qmax).to(torch.int8)
    if fmt == "int8":
        return scales, (pack_bytes(q),)
    return scales, (pack_nibbles((q + 8).to(torch.uint8), pad=8),)  # pad code 8 is q = 0


def unpack_codes(qw: QuantizedWeight) -> torch.Tensor:
    """The integer codes of a packed weight, [N, K]: e3m2 codes (uint8) for fp6, q (int8) for ints."""
    k = qw.shape[1]
    planes = row_planes(qw)
    if qw.format == "fp6":
        return unpack_fp6(planes[0], planes[1], k, qw.tile)
    if qw.format == "int4":
        return unpack_nibbles(planes[0], k, qw.tile).to(torch.int8) - 8
    return unpack_bytes(planes[0], k, qw.tile)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
    """The exact float weight [N, K] a packed weight represents: code value * fp16 scale, computed in
    fp32 (exact: at most 11 x 11 significant bits), then cast to `dtype` (None: the original dtype)."""
    codes = unpack_codes(qw)
    vals = fp6_decode(codes) if qw.format == "fp6" else codes.float()
    w = vals * _expand(qw.scales, qw.shape[1])
    return w.to(qw.dtype if dtype is None else dtype)


def stack_weights(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """One QuantizedWeight holding same-shaped weights (experts) stacked: planes [E, ...], scales [E, N,
    groups], as `grouped_quantized_matmul` takes them (copies)."""
    first = weights[0]
    for w in weights[1:]:
        if (w.format, w.shape, w.group_size, w.dtype, w.tile) != (first.format, first.shape, first.group_size,
                                                                   first.dtype, first.tile):
            raise ValueError("stack_weights: the weights differ in format, shape, group size, dtype or tile")
    planes = tuple(torch.stack([w.planes[i] for w in weights]) for i in range(len(first.planes)))
    return QuantizedWeight(first.format, first.shape, first.group_size, planes,
                           torch.stack([w.scales for w in weights]), first.dtype, first.tile)


def reference_grouped_matmul(x: torch.Tensor, qw: QuantizedWeight, experts: torch.Tensor) -> torch.Tensor:
    """y [T * k, N]: y[t * k + i] = x[t] @ dequant(W_e).T, e = experts[t, i] (`qw` stacks the experts' weights,
    see `QuantizedWeight.expert`); zero rows for e outside [0, E)."""
    per_x = experts.shape[1]
    flat = experts.reshape(-1)
    y = x.new_zeros((flat.numel(), qw.shape[0]))
    for e in flat.unique().tolist():
        if 0 <= e < qw.scales.shape[0]:
            rows = (flat == e).nonzero()[:, 0]
            y[rows] = reference_matmul(x[rows // per_x], qw.expert(e))
    return y


def reference_matmul(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequant(W).T (+ bias) in fp32, returned in x's dtype. x: [..., K] -> y: [..., N]."""
    if x.shape[-1] != qw.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features but the weight expects K={qw.shape[1]}")
    y = x.float() @ dequantize(qw, torch.float32).to(x.device).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
