//! The bf16 path's packing of FP8 codes on AVX512-VBMI: 64 codes looked up in the 256-entry code → bf16 table at
//! once (`vpermi2b` on the table's low and high byte planes) and laid out as bf16 pairs with one byte permute per
//! 16 units, where the scalar packing looks up and stores one element at a time. The same bits as the scalar
//! packing (`Lines::panel` in `pack.rs`), which runs where the CPU lacks VBMI and for layouts with neither
//! the lanes nor the depth contiguous.

/// Whether this CPU packs FP8 codes with [`panel`] (AVX512-VBMI with AVX512-BW).
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

/// `table` prepared for [`panel`] (split into byte planes once per operand, not per panel); `None` where this CPU
/// lacks what [`available`] checks.
pub fn lookup(table: &[u16; 256]) -> Option<Lookup<'_>> {
    #[cfg(target_arch = "x86_64")]
    if available() {
        // SAFETY: the CPU has AVX-512F (checked just now).
        return Some(unsafe { Lookup::new(table) });
    }
    let _ = table;
    None
}

/// One panel of `width` lanes (`count` of them stored) as bf16 pairs along `depth`, from `codes` through
/// `lookup`'s table: lane `l`'s depth `d` read at `base + l · lane_stride + d · depth_stride`, unit `p` of lane `l` written
/// at `panel[p · width + l]` (`lo | hi << 16`, an odd depth's last `hi` zero). `false` (nothing written) where
/// neither the lanes nor the depth are contiguous.
///
/// # Safety
/// Every read position lies inside `codes`, `panel` holds `depth.div_ceil(2) · width` units and
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
    lookup: &Lookup<'_>,
) -> bool {
    let table = lookup.table;
    let units = depth.div_ceil(2);
    let unit = |lo: u8, hi: Option<u8>| {
        u32::from(table[usize::from(lo)])
            | hi.map_or(0, |hi| u32::from(table[usize::from(hi)]) << 16)
    };
    if lane_stride == 1 {
        // Each depth's lanes are contiguous: per unit, the two depths' codes side by side in one vector.
        let mask = if count >= 32 {
            u32::MAX
        } else {
            (1 << count) - 1
        };
        let whole = depth / 2;
        for p in 0..whole {
            // SAFETY: lanes `base + 2p · depth_stride ..+count` and the next depth's lie inside `codes` (the
            // caller's contract); `panel[p · width ..]` holds `width ≥ count` units.
            unsafe {
                let lo = base + 2 * p * depth_stride;
                let pair = lookup.pairs_across(
                    codes.as_ptr().add(lo),
                    codes.as_ptr().add(lo + depth_stride),
                    mask,
                );
                store(panel.as_mut_ptr().add(p * width), pair, count);
            }
        }
        if whole < units {
            let at = base + 2 * whole * depth_stride;
            for (l, slot) in panel[whole * width..][..count].iter_mut().enumerate() {
                *slot = unit(codes[at + l], None);
            }
        }
        return true;
    }
    if depth_stride != 1 {
        return false;
    }
    // Each lane's depth is contiguous: 32 units of a lane from 64 consecutive codes, then written down the panel.
    const CHUNK: usize = 32;
    let whole = depth / 2 / CHUNK * CHUNK;
    let mut lanes = [[0u32; CHUNK]; 32];
    for p0 in (0..whole).step_by(CHUNK) {
        for (l, lane) in lanes[..count].iter_mut().enumerate() {
            // SAFETY: the lane's 64 codes from depth `2 · p0` lie inside `codes` (the caller's contract).
            unsafe {
                let pair = lookup.pairs_along(codes.as_ptr().add(base + l * lane_stride + 2 * p0));
                store(lane.as_mut_ptr(), pair, CHUNK);
            }
        }
        for (p, slot) in panel[p0 * width..][..CHUNK * width]
            .chunks_exact_mut(width)
            .enumerate()
        {
            for (s, lane) in slot[..count].iter_mut().zip(&lanes[..count]) {
                *s = lane[p];
            }
        }
    }
    for p in whole..units {
        for l in 0..count {
            let at = base + l * lane_stride + 2 * p;
            panel[p * width + l] = unit(codes[at], (2 * p + 1 < depth).then(|| codes[at + 1]));
        }
    }
    true
}

/// 32 bf16 pairs (`lo | hi << 16`) in two vectors of 16.
#[cfg(target_arch = "x86_64")]
type Pairs = [std::arch::x86_64::__m512i; 2];

/// The first `count ≤ 32` units of `pairs` stored at `dst`.
///
/// # Safety
/// AVX-512F; `dst` holds `count` units.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn store(dst: *mut u32, pairs: Pairs, count: usize) {
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
fn lanes(n: usize) -> u16 {
    if n >= 16 { u16::MAX } else { (1 << n) - 1 }
}

/// Byte permutes (`low` is index 0..64, `high` 64..128) from two 64-byte planes to 2 × 16 units, for
/// [`Lookup::pairs_across`] (`ACROSS`: unit `l` from lanes `l` and `32 + l`) and [`Lookup::pairs_along`] (`ALONG`:
/// unit `p` from depths `2p` and `2p + 1`).
const ACROSS: [[u8; 64]; 2] = [order(0, 1, 32), order(16, 1, 32)];
const ALONG: [[u8; 64]; 2] = [order(0, 2, 1), order(32, 2, 1)];

/// Unit `u` (of 16) as bytes `low[i]`, `high[i]`, `low[i + hi_at]`, `high[i + hi_at]` with `i = first + step · u`.
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
fn indices(order: &[[u8; 64]; 2]) -> [std::arch::x86_64::__m512i; 2] {
    // SAFETY: 64 bytes read from each 64-byte array.
    order.map(|bytes| unsafe { std::arch::x86_64::_mm512_loadu_si512(bytes.as_ptr().cast()) })
}

/// The code → bf16 table, and the same as four 64-entry blocks of its low bytes and of its high bytes, with the
/// permutes that lay looked-up planes out as units. Made by [`lookup`] only where the CPU has the instructions.
#[cfg(target_arch = "x86_64")]
pub struct Lookup<'a> {
    table: &'a [u16; 256],
    low: [std::arch::x86_64::__m512i; 4],
    high: [std::arch::x86_64::__m512i; 4],
    across: [std::arch::x86_64::__m512i; 2],
    along: [std::arch::x86_64::__m512i; 2],
}

/// Never made where the CPU is not x86-64.
#[cfg(not(target_arch = "x86_64"))]
pub enum Lookup<'a> {
    #[allow(dead_code)]
    Never(std::convert::Infallible, std::marker::PhantomData<&'a ()>),
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
    lookup: &Lookup<'_>,
) -> bool {
    match *lookup {
        Lookup::Never(never, _) => match never {},
    }
}

#[cfg(target_arch = "x86_64")]
impl<'a> Lookup<'a> {
    /// Splits `table` into its byte planes.
    #[target_feature(enable = "avx512f")]
    fn new(table: &'a [u16; 256]) -> Self {
        use std::arch::x86_64::*;
        let plane = |shift: u16| -> [__m512i; 4] {
            std::array::from_fn(|block| {
                let bytes: [u8; 64] =
                    std::array::from_fn(|i| (table[64 * block + i] >> shift) as u8);
                // SAFETY: 64 bytes read from a 64-byte array.
                unsafe { _mm512_loadu_si512(bytes.as_ptr().cast()) }
            })
        };
        Lookup {
            table,
            low: plane(0),
            high: plane(8),
            across: indices(&ACROSS),
            along: indices(&ALONG),
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

    /// The units of 32 lanes from two depths: lane `l`'s `lo` at `lo[l]`, its `hi` at `hi[l]`; lanes outside
    /// `mask` are read as code 0 (their units are not stored).
    ///
    /// # Safety
    /// AVX512-VBMI/BW/VL; the masked lanes of `lo` and `hi` are readable.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
    unsafe fn pairs_across(&self, lo: *const u8, hi: *const u8, mask: u32) -> Pairs {
        use std::arch::x86_64::*;
        // SAFETY: masked loads of the caller's readable lanes.
        let codes = unsafe {
            _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_maskz_loadu_epi8(mask, lo.cast())),
                _mm256_maskz_loadu_epi8(mask, hi.cast()),
            )
        };
        let [low, high] = self.planes(codes);
        let [first, second] = self.across;
        [
            _mm512_permutex2var_epi8(low, first, high),
            _mm512_permutex2var_epi8(low, second, high),
        ]
    }

    /// The 32 units of 64 consecutive depths of one lane (unit `p` from depths `2p`, `2p + 1`).
    ///
    /// # Safety
    /// AVX512-VBMI/BW; 64 bytes readable at `codes`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    unsafe fn pairs_along(&self, codes: *const u8) -> Pairs {
        use std::arch::x86_64::*;
        // SAFETY: the caller's 64 readable bytes.
        let [low, high] = self.planes(unsafe { _mm512_loadu_si512(codes.cast()) });
        let [first, second] = self.along;
        [
            _mm512_permutex2var_epi8(low, first, high),
            _mm512_permutex2var_epi8(low, second, high),
        ]
    }
}
