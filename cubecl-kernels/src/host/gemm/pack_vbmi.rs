//! The packing of FP8 codes on AVX512-VBMI: 64 codes looked up in the 256-entry code → bf16 table at once
//! (`vpermi2b` on the table's low and high byte planes) and laid out as units with one byte permute per 16 units,
//! where the scalar packing looks up and stores one element at a time. The units are bf16 pairs (the bf16 path) or
//! f32 values (the FMA paths: a code's f32 value is its bf16 value with 16 zero bits below, so the same lookup
//! serves, its bytes placed in the units' upper halves). The same bits as the scalar packing (`Lines::panel` in
//! `pack.rs`), which runs where the CPU lacks VBMI and for layouts with neither the lanes nor the depth contiguous.

/// Whether this CPU packs FP8 codes with `panel` (AVX512-VBMI with AVX512-BW).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vbmi")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `table` prepared for `panel` (split into byte planes once per operand, not per panel) for units of `per`
/// depths (2: bf16 pairs; 1: f32 values); `None` where this CPU lacks what [`available`] checks.
pub fn lookup(table: [u16; 256], per: usize) -> Option<Lookup> {
    #[cfg(target_arch = "x86_64")]
    if available() {
        // SAFETY: the CPU has AVX-512F (checked just now).
        return Some(unsafe { Lookup::new(table, per) });
    }
    let _ = (table, per);
    None
}

/// One panel of `width` lanes (`count` of them stored) as units along `depth` (bf16 pairs or f32 values, as
/// `lookup` was made), from `codes` through `lookup`'s table: lane `l`'s depth `d` read at
/// `base + l · lane_stride + d · depth_stride`, unit `p` of lane `l` written at `panel[p · width + l]` (a pair
/// `lo | hi << 16`, an odd depth's last `hi` zero). `None` (nothing written) where neither the lanes nor the
/// depth are contiguous. Where `grouped` (bf16 pairs in groups of [`GROUPED`] units, the AMX path's left panels),
/// the depth-contiguous layout writes its leading units straight in groups row by row (unit `p = 16g + q` of lane
/// `l` at `panel[16g · width + 16l + q]`); returns how many units of each lane are laid out so (0 otherwise).
///
/// # Safety
/// Every read position lies inside `codes`, `panel` holds `units · width` units (`units` the depth in units) and
/// `count ≤ width ≤ 32` (the CPU has the instructions: a [`Lookup`] exists only where it does).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
pub(super) unsafe fn panel(
    panel: &mut [u32],
    (width, count): (usize, usize),
    base: usize,
    (lane_stride, depth_stride): (usize, usize),
    depth: usize,
    codes: &[u8],
    lookup: &Lookup,
    grouped: bool,
) -> Option<usize> {
    let per = lookup.per;
    let units = depth.div_ceil(per);
    // A unit from the code of its depth and, in a pair, the next depth's (`None` past the depth's end).
    let pair = |lo: u8, hi: Option<u8>| {
        let value = |c: u8| u32::from(lookup.table[usize::from(c)]);
        if per == 1 {
            value(lo) << 16
        } else {
            value(lo) | hi.map_or(0, |hi| value(hi) << 16)
        }
    };
    if lane_stride == 1 {
        // Each depth's lanes are contiguous: two depths' codes side by side in one vector (lanes `l` and `32 + l`),
        // making one unit row of pairs or two unit rows of f32 values.
        let depths = depth / 2 * 2;
        let across = if per == 2 {
            across_depths::<2>
        } else {
            across_depths::<1>
        };
        // SAFETY: the caller's contract, passed on.
        unsafe {
            across(
                panel,
                (width, count),
                base,
                depth_stride,
                depths,
                codes,
                lookup,
            )
        };
        if depths < depth {
            let at = base + depths * depth_stride;
            for (l, slot) in panel[depths / per * width..][..count]
                .iter_mut()
                .enumerate()
            {
                *slot = pair(codes[at + l], None);
            }
        }
        return Some(0);
    }
    if depth_stride != 1 {
        return None;
    }
    // Each lane's depth is contiguous: the units of 64 consecutive codes of a lane, then written down the panel.
    let grouped = grouped && per == 2;
    let along = match (per, grouped) {
        (2, true) => along_chunks::<2, 32, true>,
        (2, false) => along_chunks::<2, 32, false>,
        _ => along_chunks::<1, 64, false>,
    };
    // SAFETY: the caller's contract, passed on.
    let whole = unsafe {
        along(
            panel,
            (width, count),
            base,
            lane_stride,
            codes,
            lookup,
            depth,
        )
    };
    for p in whole..units {
        for l in 0..count {
            let at = base + l * lane_stride + per * p;
            panel[p * width + l] = pair(codes[at], (per * p + 1 < depth).then(|| codes[at + 1]));
        }
    }
    Some(if grouped { whole } else { 0 })
}

/// The units per group of a grouped panel (`panel`'s `grouped`): AMX's 16 depth pairs per tile row.
pub const GROUPED: usize = 16;

/// The lanes-contiguous layout's first `depths` (even) depths, two per lookup: units of `PER` depths (a row of pairs,
/// or two rows of f32 values) for `count` lanes.
///
/// # Safety
/// As [`panel`]'s, with the lanes contiguous.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
unsafe fn across_depths<const PER: usize>(
    panel: &mut [u32],
    (width, count): (usize, usize),
    base: usize,
    depth_stride: usize,
    depths: usize,
    codes: &[u8],
    lookup: &Lookup,
) {
    let mask = if count >= 32 {
        u32::MAX
    } else {
        (1 << count) - 1
    };
    for d in (0..depths).step_by(2) {
        // SAFETY: lanes `base + d · depth_stride ..+count` and the next depth's lie inside `codes` (the caller's
        // contract); `panel` holds the units of depths `d` and `d + 1` for `width ≥ count` lanes.
        unsafe {
            let lo = base + d * depth_stride;
            let looked = lookup.across::<PER>(
                codes.as_ptr().add(lo),
                codes.as_ptr().add(lo + depth_stride),
                mask,
            );
            let row = panel.as_mut_ptr().add(d / PER * width);
            store(row, [looked[0], looked[1]], count);
            if PER == 1 {
                store(row.add(width), [looked[2], looked[3]], count);
            }
        }
    }
}

/// The depth-contiguous layout's whole chunks of 64 codes (`UNITS = 64 / PER` units each: 32 pairs or 64 f32
/// values): each lane's units looked up into a buffer, then written down the panel, or where `GROUPED`, each
/// lane's 16 units of a group stored at once in the grouped layout ([`panel`]). Returns the units written per lane.
///
/// # Safety
/// As [`panel`]'s, with the depth contiguous.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
unsafe fn along_chunks<const PER: usize, const UNITS: usize, const GROUPED: bool>(
    panel: &mut [u32],
    (width, count): (usize, usize),
    base: usize,
    lane_stride: usize,
    codes: &[u8],
    lookup: &Lookup,
    depth: usize,
) -> usize {
    use std::mem::MaybeUninit;
    let whole = depth / 64 * UNITS;
    // Not cleared: the first `count` lanes' units are written before they are read.
    let mut lanes = [[MaybeUninit::<u32>::uninit(); UNITS]; 32];
    for p0 in (0..whole).step_by(UNITS) {
        if GROUPED {
            for l in 0..count {
                // SAFETY: the lane's 64 codes from depth `PER · p0` lie inside `codes` (the caller's contract);
                // the groups of units `p0 ..+UNITS` (a multiple of 16 from a multiple of 16) hold lane `l`'s 16
                // units at `16g · width + 16l` each, inside `panel`'s `units · width`.
                unsafe {
                    let looked =
                        lookup.along::<PER>(codes.as_ptr().add(base + l * lane_stride + PER * p0));
                    for (i, vector) in looked[..UNITS / 16].iter().enumerate() {
                        let at = (p0 + 16 * i) * width + 16 * l;
                        store(panel.as_mut_ptr().add(at), [*vector, *vector], 16);
                    }
                }
            }
            continue;
        }
        for (l, lane) in lanes[..count].iter_mut().enumerate() {
            // SAFETY: the lane's 64 codes from depth `PER · p0` lie inside `codes` (the caller's contract); the
            // lane holds `UNITS` units, 16 per vector.
            unsafe {
                let looked =
                    lookup.along::<PER>(codes.as_ptr().add(base + l * lane_stride + PER * p0));
                for (i, vector) in looked[..UNITS / 16].iter().enumerate() {
                    store(lane.as_mut_ptr().add(16 * i).cast(), [*vector, *vector], 16);
                }
            }
        }
        // SAFETY: the first `count` lanes' `UNITS` units were stored just above; the panel holds units
        // `p0 ..+UNITS` of `width ≥ count` lanes.
        unsafe { down_panel(panel, (width, count), p0, &lanes, UNITS) };
    }
    whole
}

/// Units `0..units` of the first `count` lane buffers written down the panel from unit `p0` (unit `p` of lane `l`
/// at `panel[(p0 + p) · width + l]`), 16 lanes × 16 units at a time transposed in registers (an element-wise
/// copy compiled to 4-element gathers: over half the packing's time on Zen 4).
///
/// # Safety
/// AVX-512F; units `0..units` rounded up to a multiple of 16 (at most `U`) of each of the first `count ≤ 32`
/// lanes are initialized; `panel` holds units `p0 ..+units` of `width ≥ count` lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn down_panel<const U: usize>(
    panel: &mut [u32],
    (width, count): (usize, usize),
    p0: usize,
    buffers: &[[std::mem::MaybeUninit<u32>; U]; 32],
    units: usize,
) {
    use std::arch::x86_64::*;
    let panel = &mut panel[p0 * width..][..units * width];
    for l0 in (0..count).step_by(16) {
        let stored = (count - l0).min(16);
        for q0 in (0..units).step_by(16) {
            let rows: [__m512i; 16] = std::array::from_fn(|i| {
                if i < stored {
                    // SAFETY: units `q0 ..+16` of lane `l0 + i < count` are initialized (the caller's contract).
                    unsafe { _mm512_loadu_si512(buffers[l0 + i][q0..q0 + 16].as_ptr().cast()) }
                } else {
                    _mm512_setzero_si512()
                }
            });
            let columns = transpose16(rows);
            for (j, column) in columns.iter().enumerate().take(units - q0) {
                // SAFETY: unit `q0 + j < units` of lanes `l0 ..+stored` (≤ count ≤ width) is inside `panel`.
                unsafe {
                    let at = panel.as_mut_ptr().add((q0 + j) * width + l0);
                    _mm512_mask_storeu_epi32(at.cast(), lanes(stored), *column);
                }
            }
        }
    }
}

/// The 16 × 16 transpose of 32-bit elements: column `c` of the rows (element `c` of every row) as vector `c`.
/// Four rounds of 16 shuffles: pairs of rows interleaved by element, then by pairs of elements, then their
/// 128-bit quarters twice.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn transpose16(r: [std::arch::x86_64::__m512i; 16]) -> [std::arch::x86_64::__m512i; 16] {
    use std::arch::x86_64::*;
    // Quarter `k` of t[2m]: rows 2m, 2m + 1 at elements 4k, 4k + 1; of t[2m + 1]: at 4k + 2, 4k + 3.
    let t: [__m512i; 16] = std::array::from_fn(|i| {
        let (a, b) = (r[i & !1], r[i | 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_epi32(a, b)
        } else {
            _mm512_unpackhi_epi32(a, b)
        }
    });
    // Quarter `k` of u[4n + c]: rows 4n ..4n + 4 at element 4k + c.
    let u: [__m512i; 16] = std::array::from_fn(|i| {
        let (n, c) = (i / 4, i % 4);
        let (a, b) = (t[4 * n + c / 2], t[4 * n + 2 + c / 2]);
        if c % 2 == 0 {
            _mm512_unpacklo_epi64(a, b)
        } else {
            _mm512_unpackhi_epi64(a, b)
        }
    });
    let mut columns = [_mm512_setzero_si512(); 16];
    for c in 0..4 {
        // Rows 0..8 (then 8..16) of elements c and 8 + c (0x88), of 4 + c and 12 + c (0xdd), a quarter each.
        let (low_even, low_odd) = (
            _mm512_shuffle_i32x4::<0x88>(u[c], u[4 + c]),
            _mm512_shuffle_i32x4::<0xdd>(u[c], u[4 + c]),
        );
        let (high_even, high_odd) = (
            _mm512_shuffle_i32x4::<0x88>(u[8 + c], u[12 + c]),
            _mm512_shuffle_i32x4::<0xdd>(u[8 + c], u[12 + c]),
        );
        columns[c] = _mm512_shuffle_i32x4::<0x88>(low_even, high_even);
        columns[8 + c] = _mm512_shuffle_i32x4::<0xdd>(low_even, high_even);
        columns[4 + c] = _mm512_shuffle_i32x4::<0x88>(low_odd, high_odd);
        columns[12 + c] = _mm512_shuffle_i32x4::<0xdd>(low_odd, high_odd);
    }
    columns
}

/// 64 units in four vectors of 16 (32 bf16 pairs `lo | hi << 16` use the first two).
#[cfg(target_arch = "x86_64")]
type Units = [std::arch::x86_64::__m512i; 4];

/// Two vectors of 16 units.
#[cfg(target_arch = "x86_64")]
type Pairs = [std::arch::x86_64::__m512i; 2];

/// The first `count ≤ 32` units of `pairs` stored at `dst`.
///
/// # Safety
/// AVX-512F; `dst` holds `count` units.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn store(dst: *mut u32, pairs: Pairs, count: usize) {
    use std::arch::x86_64::*;
    let first = count.min(16);
    let rest = count - first;
    // SAFETY: the masks cover `count` units of `dst`.
    unsafe {
        _mm512_mask_storeu_epi32(dst.cast(), lanes(first), pairs[0]);
        if rest > 0 {
            _mm512_mask_storeu_epi32(dst.add(16).cast(), lanes(rest), pairs[1]);
        }
    }
}

/// The mask of the first `n ≤ 16` lanes.
#[cfg(target_arch = "x86_64")]
pub(crate) fn lanes(n: usize) -> u16 {
    if n >= 16 { u16::MAX } else { (1 << n) - 1 }
}

/// Byte permutes (`low` is index 0..64, `high` 64..128) from two 64-byte planes to 16 units each: for pairs,
/// [`Lookup::across`] (`ACROSS`: unit `l` from lanes `l` and `32 + l`) and [`Lookup::along`] (`ALONG`: unit `p` from
/// depths `2p` and `2p + 1`); for f32 values, both (`VALUES`: unit `u` of vector `v` from code `16v + u`, its two low
/// bytes zeroed by [`UPPER_HALVES`]).
#[cfg(target_arch = "x86_64")]
const ACROSS: [[u8; 64]; 4] = [order(0, 1, 32), order(16, 1, 32), [0; 64], [0; 64]];
#[cfg(target_arch = "x86_64")]
const ALONG: [[u8; 64]; 4] = [order(0, 2, 1), order(32, 2, 1), [0; 64], [0; 64]];
#[cfg(target_arch = "x86_64")]
const VALUES: [[u8; 64]; 4] = [
    order(0, 1, 0),
    order(16, 1, 0),
    order(32, 1, 0),
    order(48, 1, 0),
];

/// The bytes an f32 unit keeps: its upper two (bf16 bits shifted up), the lower two zero.
#[cfg(target_arch = "x86_64")]
const UPPER_HALVES: u64 = 0xcccc_cccc_cccc_cccc;

/// Unit `u` (of 16) as bytes `low[i]`, `high[i]`, `low[i + hi_at]`, `high[i + hi_at]` with `i = first + step · u`.
#[cfg(target_arch = "x86_64")]
const fn order(first: usize, step: usize, hi_at: usize) -> [u8; 64] {
    let mut index = [0u8; 64];
    let mut u = 0;
    while u < 16 {
        let i = first + step * u;
        index[4 * u] = i as u8;
        index[4 * u + 1] = (64 + i) as u8;
        index[4 * u + 2] = (i + hi_at) as u8;
        index[4 * u + 3] = (64 + i + hi_at) as u8;
        u += 1;
    }
    index
}

/// Two byte permutes' indices as vectors.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn indices(order: &[[u8; 64]; 4]) -> [std::arch::x86_64::__m512i; 4] {
    // SAFETY: 64 bytes read from each 64-byte array.
    order.map(|bytes| unsafe { std::arch::x86_64::_mm512_loadu_si512(bytes.as_ptr().cast()) })
}

/// The code → bf16 table, and the same as four 64-entry blocks of its low bytes and of its high bytes, with the
/// permutes that lay looked-up planes out as units of `per` depths. Made by [`lookup`] only where the CPU has the
/// instructions.
#[cfg(target_arch = "x86_64")]
pub struct Lookup {
    table: [u16; 256],
    per: usize,
    low: [std::arch::x86_64::__m512i; 4],
    high: [std::arch::x86_64::__m512i; 4],
    across: [std::arch::x86_64::__m512i; 4],
    along: [std::arch::x86_64::__m512i; 4],
}

/// Never made where the CPU is not x86-64.
#[cfg(not(target_arch = "x86_64"))]
pub enum Lookup {
    #[allow(dead_code)]
    Never(std::convert::Infallible),
}

/// [`panel`] where no [`Lookup`] can exist.
///
/// # Safety
/// None needed: it cannot be called.
#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn panel(
    _panel: &mut [u32],
    _counts: (usize, usize),
    _base: usize,
    _strides: (usize, usize),
    _depth: usize,
    _codes: &[u8],
    lookup: &Lookup,
    _grouped: bool,
) -> Option<usize> {
    match *lookup {
        Lookup::Never(never) => match never {},
    }
}

#[cfg(target_arch = "x86_64")]
impl Lookup {
    /// Splits `table` into its byte planes, for units of `per` depths.
    #[target_feature(enable = "avx512f")]
    fn new(table: [u16; 256], per: usize) -> Self {
        use std::arch::x86_64::*;
        let plane = |shift: u16| -> [__m512i; 4] {
            std::array::from_fn(|block| {
                let bytes: [u8; 64] =
                    std::array::from_fn(|i| (table[64 * block + i] >> shift) as u8);
                // SAFETY: 64 bytes read from a 64-byte array.
                unsafe { _mm512_loadu_si512(bytes.as_ptr().cast()) }
            })
        };
        let (across, along) = if per == 1 {
            (&VALUES, &VALUES)
        } else {
            (&ACROSS, &ALONG)
        };
        Lookup {
            table,
            per,
            low: plane(0),
            high: plane(8),
            across: indices(across),
            along: indices(along),
        }
    }

    /// The low and the high bytes of the table entries of 64 codes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    fn planes(&self, codes: std::arch::x86_64::__m512i) -> [std::arch::x86_64::__m512i; 2] {
        use std::arch::x86_64::*;
        // `vpermi2b` reads an index's low 7 bits (two 64-entry blocks); bit 7 picks the upper two blocks.
        let upper = _mm512_movepi8_mask(codes);
        let look = |blocks: &[__m512i; 4]| {
            let below = _mm512_permutex2var_epi8(blocks[0], codes, blocks[1]);
            let above = _mm512_permutex2var_epi8(blocks[2], codes, blocks[3]);
            _mm512_mask_blend_epi8(upper, below, above)
        };
        [look(&self.low), look(&self.high)]
    }

    /// The units of 32 lanes from two depths (lane `l`'s `lo` at `lo[l]`, its `hi` at `hi[l]`): 32 pairs in the first
    /// two vectors, or the 32 f32 values of `lo` and then of `hi` in all four. Lanes outside `mask` are read as code
    /// 0 (their units are not stored).
    ///
    /// # Safety
    /// AVX512-VBMI/BW/VL; the masked lanes of `lo` and `hi` are readable.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
    pub(super) unsafe fn across<const PER: usize>(
        &self,
        lo: *const u8,
        hi: *const u8,
        mask: u32,
    ) -> Units {
        use std::arch::x86_64::*;
        // SAFETY: masked loads of the caller's readable lanes.
        let codes = unsafe {
            _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_maskz_loadu_epi8(mask, lo.cast())),
                _mm256_maskz_loadu_epi8(mask, hi.cast()),
            )
        };
        self.units::<PER>(codes, &self.across)
    }

    /// The units of 64 consecutive depths of one lane: 32 pairs (unit `p` from depths `2p`, `2p + 1`) in the first
    /// two vectors, or 64 f32 values in all four.
    ///
    /// # Safety
    /// AVX512-VBMI/BW; 64 bytes readable at `codes`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    unsafe fn along<const PER: usize>(&self, codes: *const u8) -> Units {
        // SAFETY: the caller's 64 readable bytes.
        let codes = unsafe { std::arch::x86_64::_mm512_loadu_si512(codes.cast()) };
        self.units::<PER>(codes, &self.along)
    }

    /// The f32 values of 64 codes (a lookup made for f32 values, `per` 1), code `16v + u` in unit `u` of vector
    /// `v`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    pub(super) fn values(&self, codes: std::arch::x86_64::__m512i) -> Units {
        debug_assert_eq!(self.per, 1, "a lookup made for bf16 pairs");
        self.units::<1>(codes, &self.along)
    }

    /// 64 codes looked up and laid out as units of `PER` depths by `order` (made for `PER`: [`Lookup::new`]).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    fn units<const PER: usize>(
        &self,
        codes: std::arch::x86_64::__m512i,
        order: &[std::arch::x86_64::__m512i; 4],
    ) -> Units {
        use std::arch::x86_64::*;
        let [low, high] = self.planes(codes);
        if PER == 2 {
            let zero = _mm512_setzero_si512();
            [
                _mm512_permutex2var_epi8(low, order[0], high),
                _mm512_permutex2var_epi8(low, order[1], high),
                zero,
                zero,
            ]
        } else {
            order.map(|order| _mm512_maskz_permutex2var_epi8(UPPER_HALVES, low, order, high))
        }
    }
}
