"""Weight-only quantization in plain PyTorch: the spec and the CPU path.

Owns the quantizers (FP6 e3m2, INT8, INT4), their exact dequantizers, the packed storage layout
(`QuantizedWeight`) and the reference matmul `y = x @ dequant(W).T`. Must not import triton or
anything above ops/.

Note: packed layout (tile-interleaved planes). Rows are output channels n (nn.Linear orientation).
K is padded with zero codes to Kp, a multiple of the pack tile T = `PACK_TILE` (128), so any K works.
In K-tile t and row n, word j (0 <= j < T/8) of a plane holds the 8 values k = t*T + i*T/8 + j,
i = 0..7 (field i of the word). A kernel loads one [BLOCK_N, T/8] word tile per plane and, for each
i, gets with shifts and masks alone a [BLOCK_N, T/8] tile of the *contiguous* K range
[t*T + i*T/8, t*T + (i+1)*T/8): no reshape, gather or layout change. All rows are 16-byte multiples.
  fp6   code ``s eee mm``. Plane ``hi`` int32 [N, Kp/8]: field i = nibble ``eee m1`` at bits 4i.
        Plane ``lo`` int16 [N, Kp/8] (same word index): for field i, ``m0`` at bit (-2i) mod 16 and
        ``s`` at bit (7 - 2i) mod 16, i.e. s always 7 bits above m0 (mod 16), so one shift of the
        16-bit word (duplicated into 32 bits) puts s at bit 15 and m0 at bit 8 together. 6 bits/value.
  int4  plane int32 [N, Kp/8], field i = nibble ``q + 8`` (q in [-7, 7]) at bits 4i; pad code 8.
  int8  plane int8 [N, Kp]: q in [-127, 127], plain (no interleave needed).
Scales are fp16 [N, K / group_size] (one column when group_size is None): w ~= q * scale.
group_size must be a multiple of T/8 (16) dividing K, so a T/8 sub-tile never straddles two groups.
fp16 scales are clamped to [2**-14, 65504] (normal fp16), so a zero row gets the scale 2**-14 and
codes 0, and quantization divides by the *stored* scale, so the row's absmax maps to the top code.

Note: fp16 dequant tricks (the kernel's arithmetic; `dequant_planes_fp16` replays it in torch).
fp6: the fp16 with bits ``s << 15 | eeemm << 8`` equals the e3m2 value times 2**-12, for normals
(exponent bias 15 vs 3) and subnormals (fp16 subnormal step 2**-24 times mm << 8 is mm * 2**-16 =
(mm / 16) * 2**-12) alike; from the planes it is ``(hi << 9-4i) & 0x1E00 | (lo32 << 2i-8 ...) &
0x8100`` (2 shifts, 2 logic ops per value); 2**12 is folded into the fp32 epilogue scale
(`FP6_FP16_SCALE`). int4/int8: fp16 bits ``0x6400 | c`` are 1024 + c for 0 <= c < 1024, so
``(nib | 0x6400) - 1032`` and ``(q + 0x6480) - 1152`` are q exactly, without an int->float convert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("fp6", "int8", "int4")
FP6_MAX = 28.0
FP6_FP16_SCALE = 4096.0  # fp16(s<<15 | eeemm<<8) * 2**12 == e3m2 value
INT_MAX = {"int8": 127, "int4": 7}
QMAX = {"fp6": FP6_MAX, "int8": 127.0, "int4": 7.0}
PACK_TILE = 128  # T: K is padded to a multiple of T; a word holds 8 values T/8 apart along K
SUB_TILE = PACK_TILE // 8  # contiguous K range one field of a word tile covers; group_size unit
FP6_M0_BIT = tuple((-2 * i) % 16 for i in range(8))  # lo plane: bit of m0 for field i
FP6_SIGN_BIT = tuple((7 - 2 * i) % 16 for i in range(8))  # lo plane: bit of s for field i
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
    """A packed [N, K] weight. `planes` are the format's packed tensors (see the module Note; K padded
    to `padded_k`), `scales` fp16 [N, K // group_size]; `dtype` is the dtype of the weight it came
    from; `tile` the pack tile T the planes were interleaved with."""

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


def plane_specs(fmt: str, n: int, k: int, tile: int = PACK_TILE) -> list[tuple[tuple[int, int], torch.dtype]]:
    """(shape, dtype) of each packed plane of an [n, k] weight."""
    kp = padded_k(k, tile)
    if fmt == "fp6":
        return [((n, kp // 8), torch.int32), ((n, kp // 8), torch.int16)]
    if fmt == "int4":
        return [((n, kp // 8), torch.int32)]
    return [((n, kp), torch.int8)]


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
    """[N, K] -> int64 [N, Kp/tile, 8, tile/8]: [n, t, i, j] is value k = t*tile + i*tile/8 + j
    (K padded with `pad`)."""
    n, k = vals.shape
    if tile % 8 or tile < 8:
        raise ValueError(f"pack tile must be a positive multiple of 8 (got {tile})")
    kp = padded_k(k, tile)
    v = torch.full((n, kp), pad, dtype=torch.int64, device=vals.device)
    v[:, :k] = vals.to(torch.int64)
    return v.reshape(n, kp // tile, 8, tile // 8)


def _unfields(f: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of `_fields`: [N, T', 8, tile/8] -> [N, k] (padding dropped)."""
    n = f.shape[0]
    return f.reshape(n, -1)[:, :k]


def _to_signed(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative int64 words < 2**bits -> the two's-complement int{bits} tensor."""
    dtype = torch.int32 if bits == 32 else torch.int16
    return torch.where(words >= 2 ** (bits - 1), words - 2**bits, words).to(dtype)


def pack_nibbles(vals: torch.Tensor, tile: int = PACK_TILE, pad: int = 0) -> torch.Tensor:
    """uint8 [N, K] values 0..15 -> int32 [N, Kp/8]: word t*tile/8 + j, bits 4i..4i+3 hold value
    k = t*tile + i*tile/8 + j (K padded with `pad`)."""
    f = _fields(vals, tile, pad)
    shifts = torch.arange(8, device=vals.device, dtype=torch.int64)[:, None] * 4
    words = (f << shifts).sum(dim=2)  # disjoint bit ranges: sum == or
    return _to_signed(words.reshape(f.shape[0], -1), 32)


def unpack_nibbles(words: torch.Tensor, k: int, tile: int = PACK_TILE) -> torch.Tensor:
    """int32 [N, Kp/8] -> uint8 [N, k] (inverse of `pack_nibbles`)."""
    n = words.shape[0]
    w = words.to(torch.int64).reshape(n, -1, 1, tile // 8)
    shifts = torch.arange(8, device=words.device, dtype=torch.int64)[:, None] * 4
    return _unfields((w >> shifts) & 0xF, k).to(torch.uint8)


def pack_fp6_lo(sign: torch.Tensor, m0: torch.Tensor, tile: int = PACK_TILE) -> torch.Tensor:
    """Sign and mantissa-lsb bits [N, K] (0/1) -> the fp6 ``lo`` plane int16 [N, Kp/8]: field i of word
    j (value k = t*tile + i*tile/8 + j) has m0 at bit FP6_M0_BIT[i] and s at FP6_SIGN_BIT[i]; padding 0."""
    fs, fm = _fields(sign, tile, 0), _fields(m0, tile, 0)
    sb = torch.tensor(FP6_SIGN_BIT, device=sign.device, dtype=torch.int64)[:, None]
    mb = torch.tensor(FP6_M0_BIT, device=sign.device, dtype=torch.int64)[:, None]
    words = ((fs << sb) + (fm << mb)).sum(dim=2)
    return _to_signed(words.reshape(fs.shape[0], -1), 16)


def unpack_fp6_lo(words: torch.Tensor, k: int, tile: int = PACK_TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """int16 [N, Kp/8] -> (sign, m0) uint8 [N, k] (inverse of `pack_fp6_lo`)."""
    n = words.shape[0]
    w = (words.to(torch.int64) & 0xFFFF).reshape(n, -1, 1, tile // 8)
    sb = torch.tensor(FP6_SIGN_BIT, device=words.device, dtype=torch.int64)[:, None]
    mb = torch.tensor(FP6_M0_BIT, device=words.device, dtype=torch.int64)[:, None]
    return _unfields((w >> sb) & 1, k).to(torch.uint8), _unfields((w >> mb) & 1, k).to(torch.uint8)


def pack_fp6(codes: torch.Tensor, tile: int = PACK_TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """e3m2 codes uint8 [N, K] -> (hi int32 [N, Kp/8], lo int16 [N, Kp/8]); padding is code 0 (+0)."""
    c = codes.to(torch.int64)
    return pack_nibbles((c >> 1) & 0xF, tile), pack_fp6_lo((c >> 5) & 1, c & 1, tile)


def unpack_fp6(hi: torch.Tensor, lo: torch.Tensor, k: int, tile: int = PACK_TILE) -> torch.Tensor:
    """(hi, lo) planes -> e3m2 codes uint8 [N, k] (inverse of `pack_fp6`)."""
    sign, m0 = unpack_fp6_lo(lo, k, tile)
    return (sign << 5) | (unpack_nibbles(hi, k, tile) << 1) | m0


def dequant_planes_fp16(qw: "QuantizedWeight") -> torch.Tensor:
    """The kernel's dequantization replayed in torch on the planes, field by field (same shifts and
    masks): fp16 [N, Kp] equal to code value * 2**-12 (fp6) or q (int4, int8), padding included."""
    n, kp = qw.shape[0], qw.padded_k
    tile, sub = qw.tile, qw.tile // 8
    out = torch.empty((n, kp // tile, 8, sub), dtype=torch.float16, device=qw.device)
    if qw.format == "int8":
        bits = qw.planes[0].to(torch.int32) + 0x6480  # fp16 bits of 1152 + q
        return bits.to(torch.int16).view(torch.float16) - 1152.0
    w = qw.planes[0].to(torch.int64).reshape(n, kp // tile, sub)  # int64: shifts never overflow
    if qw.format == "fp6":
        h = qw.planes[1].to(torch.int64).reshape(n, kp // tile, sub)
        h32 = (h & 0xFFFF) | (h << 16)  # the 16-bit word twice: a right shift brings s down from the top copy
    for i in range(8):
        if qw.format == "int4":
            bits = ((w >> (4 * i)) & 0xF) | 0x6400  # fp16 bits of 1024 + (q + 8)
            out[:, :, i] = (bits.to(torch.int16).view(torch.float16) - 1032.0)
        else:
            a = w << (9 - 4 * i) if i < 3 else w >> (4 * i - 9)  # eee m1 -> bits 12..9
            d = 8 - FP6_M0_BIT[i]  # m0 -> bit 8, s (7 bits above it, mod 16) -> bit 15
            b = h32 << d if d >= 0 else h32 >> -d
            bits = (a & 0x1E00) | (b & 0x8100)
            out[:, :, i] = bits.to(torch.int16).view(torch.float16)
    return out.reshape(n, kp)


def quantize(weight: torch.Tensor, fmt: str = "fp6", group_size: int | None = None) -> QuantizedWeight:
    """Quantize a float [N, K] weight (nn.Linear layout) symmetrically, round to nearest (even on
    ties), saturating. Raises ValueError for unsupported dtypes, shapes or non-finite weights."""
    if not isinstance(weight, torch.Tensor) or weight.dtype not in _FLOAT_DTYPES:
        got = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must be float16, bfloat16 or float32 (got {got})")
    check_quant_args(fmt, weight.shape, group_size)
    w32 = weight.detach().float()
    if not torch.isfinite(w32).all():
        raise ValueError("weight contains NaN or inf; refusing to quantize it")
    n, k = w32.shape
    scales = _scales(w32, QMAX[fmt], group_size)
    v = w32 / _expand(scales, k)
    if fmt == "fp6":
        planes = pack_fp6(fp6_encode(v))
    else:
        qmax = INT_MAX[fmt]
        q = torch.round(v).clamp(-qmax, qmax).to(torch.int8)
        if fmt == "int8":
            planes = (torch.zeros((n, padded_k(k)), dtype=torch.int8, device=q.device),)
            planes[0][:, :k] = q
        else:
            planes = (pack_nibbles((q + 8).to(torch.uint8), pad=8),)  # pad code 8 is q = 0
    return QuantizedWeight(fmt, (n, k), group_size, planes, scales, weight.dtype, PACK_TILE)


def unpack_codes(qw: QuantizedWeight) -> torch.Tensor:
    """The integer codes of a packed weight, [N, K]: e3m2 codes (uint8) for fp6, q (int8) for ints."""
    k = qw.shape[1]
    if qw.format == "fp6":
        return unpack_fp6(qw.planes[0], qw.planes[1], k, qw.tile)
    if qw.format == "int4":
        return unpack_nibbles(qw.planes[0], k, qw.tile).to(torch.int8) - 8
    return qw.planes[0][:, :k]


def dequantize(qw: QuantizedWeight, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
    """The exact float weight [N, K] a packed weight represents: code value * fp16 scale, computed in
    fp32 (exact: at most 11 x 11 significant bits), then cast to `dtype` (None: the original dtype)."""
    codes = unpack_codes(qw)
    vals = fp6_decode(codes) if qw.format == "fp6" else codes.float()
    w = vals * _expand(qw.scales, qw.shape[1])
    return w.to(qw.dtype if dtype is None else dtype)


def reference_matmul(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequant(W).T (+ bias) in fp32, returned in x's dtype. x: [..., K] -> y: [..., N]."""
    if x.shape[-1] != qw.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features but the weight expects K={qw.shape[1]}")
    y = x.float() @ dequantize(qw, torch.float32).to(x.device).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
