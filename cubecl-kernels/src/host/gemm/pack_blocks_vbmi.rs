//! The packing of block-scaled codes on AVX512-VBMI ([`super::BlockCodes`]: Float8BlockScaling, MXFP8): 64 codes
//! looked up as f32 values at once (the per-tensor packing's lookup, [`super::pack_vbmi`]), each multiplied by its
//! block's factor (16 factors gathered per vector by the block of their column, or one broadcast where the 16 lie
//! in one block) and laid out as units: bf16 pairs
//! (each product's top half, a NaN quiet with its sign, as `PackedElement::of_value`) or f32 values. The same bits
//! as the scalar packing (`Lines::lanes_contiguous_blocks` and `Lines::decode_panel` in `pack.rs`), which runs where
//! the CPU lacks VBMI, where a lane's run crosses a stored row's end, and where neither the lanes nor the depth are
//! contiguous.

use super::BlockCodes;
use super::pack_vbmi::Lookup;

/// Depths ahead whose codes the lanes-contiguous layout asks the cache for (`PREFETCH_AHEAD` units of pairs in
/// `pack.rs`: each depth is a stored row apart, past what the hardware prefetchers follow).
#[cfg(target_arch = "x86_64")]
const PREFETCH_DEPTHS: usize = 32;

/// One panel of `width` lanes (`count` of them stored) as units along `depth`, `per` depths each (2: bf16 pairs;
/// 1: f32 values), from `blocks`' codes through `lookup`'s f32 values (made with `per` 1) times their blocks' factors
/// (`block_of_col`: each stored column's block): lane `l`'s depth `d` read at `base + l · lane_stride + d · depth_stride`, unit `p` of lane `l` written at
/// `panel[p · width + l]` (the depth past an odd end zero). `false` (nothing written) unless the lanes are
/// contiguous at every depth and lie in the same columns of their stored rows (the depths a whole number of rows
/// apart), or each lane's depth is contiguous inside one stored row.
///
/// # Safety
/// Every read position lies inside `blocks.codes`, `panel` holds `units · width` units (`units` the depth in units),
/// `count ≤ width ≤ 32`, the factors fit the codes (one per block of the grid: `BlockCodes::check`), `block_of_col`
/// has one block per stored column, and `lookup` gives f32 values (the CPU has the instructions: a [`Lookup`] exists only where it does).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
pub(super) unsafe fn panel(
    panel: &mut [u32],
    (width, count): (usize, usize),
    base: usize,
    (lane_stride, depth_stride): (usize, usize),
    depth: usize,
    blocks: &BlockCodes<'_>,
    block_of_col: &[u32],
    lookup: &Lookup,
    per: usize,
) -> bool {
    let cols = blocks.cols;
    if count == 0 || depth == 0 {
        return false;
    }
    if lane_stride == 1 && depth_stride != 1 {
        let col = base % cols;
        if !depth_stride.is_multiple_of(cols) || col + count > cols {
            return false;
        }
        // SAFETY: the caller's contract, and the lanes inside one row's columns (checked just now).
        unsafe {
            across(
                panel,
                (width, count),
                base,
                depth_stride,
                depth,
                blocks,
                block_of_col,
                lookup,
                per,
            )
        };
        return true;
    }
    if depth_stride != 1 || (0..count).any(|l| (base + l * lane_stride) % cols + depth > cols) {
        return false;
    }
    // SAFETY: the caller's contract, and each lane inside one row (checked just now).
    unsafe {
        along(
            panel,
            (width, count),
            base,
            lane_stride,
            depth,
            blocks,
            block_of_col,
            lookup,
            per,
        )
    };
    true
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
    _blocks: &BlockCodes<'_>,
    _block_of_col: &[u32],
    lookup: &Lookup,
    _per: usize,
) -> bool {
    match *lookup {
        Lookup::Never(never) => match never {},
    }
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{__m512, __m512i};

/// The lanes-contiguous layout (each depth's `count` lanes side by side in one stored row, at the same columns):
/// two depths per lookup, each lane's factor gathered once per band of block rows.
///
/// # Safety
/// As [`panel`]'s, with the lanes at columns `base % cols ..+count` of rows `depth_stride / cols` apart.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
unsafe fn across(
    panel: &mut [u32],
    (width, count): (usize, usize),
    base: usize,
    depth_stride: usize,
    depth: usize,
    blocks: &BlockCodes<'_>,
    block_of_col: &[u32],
    lookup: &Lookup,
    per: usize,
) {
    let (codes, grid_cols) = (blocks.codes, blocks.cols.div_ceil(blocks.block.cols));
    use super::pack_vbmi::{lanes, store};
    use std::arch::x86_64::*;
    let col = base % blocks.cols;
    let mask = if count >= 32 {
        u32::MAX
    } else {
        (1 << count) - 1
    };
    let halves = [lanes(count.min(16)), lanes(count.saturating_sub(16))];
    // Each lane's block column, 16 lanes per vector.
    let mut index = [_mm512_setzero_si512(); 2];
    for (h, (&m, index)) in halves.iter().zip(&mut index).enumerate() {
        if m != 0 {
            // SAFETY: the masked lanes' columns `col + 16h + i < col + count ≤ cols` are in `block_of_col`.
            *index = unsafe {
                _mm512_maskz_loadu_epi32(m, block_of_col.as_ptr().add(col + 16 * h).cast())
            };
        }
    }
    let band_of = |d: usize| (base + d * depth_stride) / blocks.cols / blocks.block.rows;
    // The factors of the last band read: consecutive depths share one until a block row ends.
    let mut band = usize::MAX;
    let mut factors = [_mm512_setzero_ps(); 2];
    let mut factors_of = |d: usize| {
        let b = band_of(d);
        if b != band {
            band = b;
            // SAFETY: the band's `grid_cols` factors are in `factors` (the caller's contract); each masked index is
            // a block column of the band.
            let row = unsafe { blocks.factors.as_ptr().add(b * grid_cols) };
            for h in 0..2 {
                factors[h] = unsafe {
                    _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), halves[h], index[h], row)
                };
            }
        }
        factors
    };
    for d in (0..depth).step_by(2) {
        let has_hi = d + 1 < depth;
        for ahead in [d + PREFETCH_DEPTHS, d + PREFETCH_DEPTHS + 1] {
            let at = ahead.saturating_mul(depth_stride).saturating_add(base);
            if let Some(code) = codes.get(at) {
                // A hint only: the address is an element of `codes`.
                _mm_prefetch::<_MM_HINT_T0>((code as *const u8).cast());
            }
        }
        // SAFETY: depth `d`'s lanes (and depth `d + 1`'s where there is one) lie inside `codes`; the last odd
        // depth reads its own lanes twice.
        let values = unsafe {
            let lo = codes.as_ptr().add(base + d * depth_stride);
            let hi = if has_hi { lo.add(depth_stride) } else { lo };
            lookup.across::<1>(lo, hi, mask)
        };
        let lo = factors_of(d);
        let hi = if has_hi {
            factors_of(d + 1)
        } else {
            [_mm512_setzero_ps(); 2]
        };
        let products = [
            _mm512_mul_ps(_mm512_castsi512_ps(values[0]), lo[0]),
            _mm512_mul_ps(_mm512_castsi512_ps(values[1]), lo[1]),
            _mm512_mul_ps(_mm512_castsi512_ps(values[2]), hi[0]),
            _mm512_mul_ps(_mm512_castsi512_ps(values[3]), hi[1]),
        ];
        // SAFETY: the panel holds the units of depths `d` and `d + 1` (where there is one) for `width ≥ count` lanes.
        unsafe {
            if per == 2 {
                let row = panel.as_mut_ptr().add(d / 2 * width);
                let pair = |lo, hi| {
                    let hi = if has_hi {
                        bf16_top(hi)
                    } else {
                        _mm512_setzero_si512()
                    };
                    _mm512_mask_blend_epi16(0xaaaa_aaaa, _mm512_srli_epi32::<16>(bf16_top(lo)), hi)
                };
                store(
                    row,
                    [
                        pair(products[0], products[2]),
                        pair(products[1], products[3]),
                    ],
                    count,
                );
            } else {
                let row = panel.as_mut_ptr().add(d * width);
                let bits = products.map(|p| _mm512_castps_si512(p));
                store(row, [bits[0], bits[1]], count);
                if has_hi {
                    store(row.add(width), [bits[2], bits[3]], count);
                }
            }
        }
    }
}

/// The depth-contiguous layout (each lane a run of one stored row): 64 depths of a lane per lookup, their factors
/// gathered by the block of each column, the units written to a buffer per lane and then down the panel.
///
/// # Safety
/// As [`panel`]'s, with each lane's `depth` codes inside one stored row.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
unsafe fn along(
    panel: &mut [u32],
    (width, count): (usize, usize),
    base: usize,
    lane_stride: usize,
    depth: usize,
    blocks: &BlockCodes<'_>,
    block_of_col: &[u32],
    lookup: &Lookup,
    per: usize,
) {
    let (codes, grid_cols) = (blocks.codes, blocks.cols.div_ceil(blocks.block.cols));
    use super::pack_vbmi::{down_panel, lanes, store};
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;
    // Unit `u` of 16 from the upper halves of depths `2u` and `2u + 1` of two vectors of 16 depths.
    const PAIRS: [u16; 32] = {
        let mut index = [0u16; 32];
        let mut u = 0;
        while u < 16 {
            index[2 * u] = 4 * u as u16 + 1;
            index[2 * u + 1] = 4 * u as u16 + 3;
            u += 1;
        }
        index
    };
    // SAFETY: 64 bytes read from a 64-byte array.
    let pairs = unsafe { _mm512_loadu_si512(PAIRS.as_ptr().cast()) };
    // Blocks a whole number of 16-column vectors wide: a vector from a column that is a multiple of 16 lies in one.
    let aligned = blocks.block.cols.is_multiple_of(16);
    // Not cleared: the first `count` lanes' units of a chunk are written before they are read.
    let mut lanes_units = [[MaybeUninit::<u32>::uninit(); 64]; 32];
    for d0 in (0..depth).step_by(64) {
        let n = (depth - d0).min(64);
        let units = n.div_ceil(per);
        for (l, lane) in lanes_units[..count].iter_mut().enumerate() {
            let first = base + l * lane_stride + d0;
            let col = first % blocks.cols;
            let band = first / blocks.cols / blocks.block.rows;
            let code_mask = if n == 64 { u64::MAX } else { (1 << n) - 1 };
            // The lane's codes two chunks on (each lane is a stream of its own, a row apart from the next).
            if let Some(code) = codes.get(first + 2 * 64) {
                _mm_prefetch::<_MM_HINT_T0>((code as *const u8).cast());
            }
            // SAFETY: the lane's `n` codes from `first` lie inside `codes`; its band's factors inside `factors`;
            // columns `col ..+n` inside `block_of_col` (the lane lies inside one row); the lane buffer holds 64
            // units.
            unsafe {
                let row = blocks.factors.as_ptr().add(band * grid_cols);
                let values = lookup.values(_mm512_maskz_loadu_epi8(
                    code_mask,
                    codes.as_ptr().add(first).cast(),
                ));
                let mut products = [_mm512_setzero_ps(); 4];
                for (i, product) in products.iter_mut().enumerate() {
                    let m = lanes(n.saturating_sub(16 * i));
                    if m == 0 {
                        break;
                    }
                    let factor = if aligned && col.is_multiple_of(16) {
                        // The 16 columns inside one block: its factor for all.
                        _mm512_set1_ps(*row.add(*block_of_col.get_unchecked(col + 16 * i) as usize))
                    } else {
                        let index = _mm512_maskz_loadu_epi32(
                            m,
                            block_of_col.as_ptr().add(col + 16 * i).cast(),
                        );
                        _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), m, index, row)
                    };
                    *product = _mm512_maskz_mul_ps(m, _mm512_castsi512_ps(values[i]), factor);
                }
                let out = lane.as_mut_ptr().cast::<u32>();
                if per == 2 {
                    let top = products.map(|p| bf16_top(p));
                    let units = [
                        _mm512_permutex2var_epi16(top[0], pairs, top[1]),
                        _mm512_permutex2var_epi16(top[2], pairs, top[3]),
                    ];
                    store(out, units, 32);
                } else {
                    let bits = products.map(|p| _mm512_castps_si512(p));
                    store(out, [bits[0], bits[1]], 32);
                    store(out.add(32), [bits[2], bits[3]], 32);
                }
            }
        }
        // SAFETY: units `0..64 / per` (a multiple of 16) of each of the first `count` lanes were stored just above;
        // the panel holds units `d0 / per ..+units` of `width ≥ count` lanes.
        unsafe { down_panel(panel, (width, count), d0 / per, &lanes_units, units) };
    }
}

/// Each f32's bits with a NaN made quiet, its sign kept (`0x7fc0_0000` and the sign): the upper half is the
/// bf16 element `PackedElement::of_value` gives.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
fn bf16_top(values: __m512) -> __m512i {
    use std::arch::x86_64::*;
    let bits = _mm512_castps_si512(values);
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(values, values);
    let quiet = _mm512_or_si512(
        _mm512_and_si512(bits, _mm512_set1_epi32(i32::MIN)),
        _mm512_set1_epi32(0x7fc0_0000),
    );
    _mm512_mask_blend_epi32(nan, bits, quiet)
}
