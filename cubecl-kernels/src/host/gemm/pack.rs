//! The operands laid out as a micro-kernel reads them: 32-bit units along the depth (a bf16 pair, or one f32) in
//! panels of the output tile's rows (left operand) or columns (right operand), read from any stored layout.

use std::marker::PhantomData;

use rayon::prelude::*;

use super::{BlockCodes, HostGemmError, Kernel};
use crate::host::pool::{HostBuffer, POOLED_FROM};

/// An element of a packed operand: `PER_UNIT` consecutive depth elements make one 32-bit unit.
pub trait PackedElement: Copy + Send + Sync + 'static {
    /// Depth elements per unit (2 for bf16 bits, 1 for f32 bits).
    const PER_UNIT: usize;
    /// The element past an odd depth's end (+0).
    const ZERO: Self;
    /// The unit of `lo` and, where `PER_UNIT` is 2, `hi` in the upper half (ignored otherwise).
    fn unit(lo: Self, hi: Self) -> u32;
    /// The element of `value`: exact where `value` is one (bf16: its top half, a NaN's quiet form; f32: its bits).
    fn of_value(value: f32) -> Self;
    /// The code table as bf16 bits, which the vector packing ([`super::pack_vbmi`]) takes: every entry's value must
    /// be a bf16 value (`None` otherwise).
    fn bf16_table(table: &[Self; 256]) -> Option<[u16; 256]>;
}

/// bf16 bits, in pairs along the depth (the pair's low half the even depth).
impl PackedElement for u16 {
    const PER_UNIT: usize = 2;
    const ZERO: Self = 0;
    #[inline(always)]
    fn unit(lo: Self, hi: Self) -> u32 {
        u32::from(lo) | u32::from(hi) << 16
    }
    #[inline(always)]
    fn of_value(value: f32) -> Self {
        // The top half without branches, so the decoding loops stay tight; a NaN keeps its sign, quiet.
        let bits = value.to_bits();
        let nan = bits & 0x7fff_ffff > 0x7f80_0000;
        let top = (bits >> 16) as u16;
        if nan { top & 0x8000 | 0x7fc0 } else { top }
    }
    fn bf16_table(table: &[Self; 256]) -> Option<[u16; 256]> {
        Some(*table)
    }
}

/// f32 bits, one per unit.
impl PackedElement for u32 {
    const PER_UNIT: usize = 1;
    const ZERO: Self = 0;
    #[inline(always)]
    fn unit(lo: Self, _: Self) -> u32 {
        lo
    }
    #[inline(always)]
    fn of_value(value: f32) -> Self {
        value.to_bits()
    }
    /// An f32 whose low 16 bits are zero is its bf16 bits shifted up: every FP8 and E2M1 code's value is one
    /// (a table with a scale folded in need not be).
    fn bf16_table(table: &[Self; 256]) -> Option<[u16; 256]> {
        table
            .iter()
            .all(|bits| bits & 0xffff == 0)
            .then(|| table.map(|bits| (bits >> 16) as u16))
    }
}

/// A stored matrix as the GEMM reads it: element `(i, j)` is stored at `offset + i · strides.0 + j · strides.1`
/// of `elements` (a transposed or batched matrix is a choice of offset and strides).
#[derive(Clone, Copy)]
pub struct Source<'a, E> {
    /// The stored elements.
    pub elements: Elements<'a, E>,
    /// Where element `(0, 0)` is.
    pub offset: usize,
    /// The steps between consecutive rows and columns.
    pub strides: (usize, usize),
}

/// Stored elements and their packed element (`E`: bf16 bits `u16`, f32 bits `u32`).
#[derive(Clone, Copy)]
pub enum Elements<'a, E> {
    /// One code per byte, and each code's element.
    Codes(&'a [u8], &'a [E; 256]),
    /// Codes whose blocks each have a factor, each element made while its panel is packed.
    Blocks(BlockCodes<'a>),
}

impl<E> Elements<'_, E> {
    fn len(&self) -> usize {
        match self {
            Elements::Codes(codes, _) => codes.len(),
            Elements::Blocks(blocks) => blocks.codes.len(),
        }
    }
}

/// The left operand (`m × k`) in panels of `K::MR` rows: panel `i`'s unit `p` of row `r` at
/// `(i · units + p) · MR + r`, or, where [`Kernel::LHS_ROW_GROUPS`], at
/// `(i · units + p − q) · MR + r · GROUP + q` (`q = p mod GROUP`: each group of units row by row). `units` is the
/// depth in units padded to a multiple of [`Kernel::GROUP`].
pub struct PackedLhs<K: Kernel> {
    pub(super) rows: usize,
    pub(super) depth: usize,
    pub(super) units: usize,
    pub(super) data: Panels,
    kernel: PhantomData<K>,
}

/// The right operand (`k × n`) in panels of `K::NR` columns: panel `j`'s unit `p` of column `c` at
/// `(j · units + p) · NR + c`.
/// `units` as for [`PackedLhs`].
pub struct PackedRhs<K: Kernel> {
    pub(super) cols: usize,
    pub(super) depth: usize,
    pub(super) units: usize,
    pub(super) data: Panels,
    kernel: PhantomData<K>,
}

impl<K: Kernel> PackedLhs<K> {
    /// The packed units, in the layout the type's doc gives.
    pub fn units(&self) -> &[u32] {
        &self.data
    }
}

impl<K: Kernel> PackedRhs<K> {
    /// The packed units, in the layout the type's doc gives.
    pub fn units(&self) -> &[u32] {
        &self.data
    }
}

/// Packs the `rows × depth` left operand read from `source` for `K`'s micro-kernel.
pub fn pack_lhs<K: Kernel>(
    rows: usize,
    depth: usize,
    source: &Source<'_, K::Element>,
) -> Result<PackedLhs<K>, HostGemmError> {
    let (row_stride, depth_stride) = source.strides;
    let (units, data) = pack::<K>(
        K::MR,
        rows,
        depth,
        (row_stride, depth_stride),
        K::LHS_ROW_GROUPS,
        source,
    )?;
    Ok(PackedLhs {
        rows,
        depth,
        units,
        data,
        kernel: PhantomData,
    })
}

/// Packs the `depth × cols` right operand read from `source` for `K`'s micro-kernel.
pub fn pack_rhs<K: Kernel>(
    depth: usize,
    cols: usize,
    source: &Source<'_, K::Element>,
) -> Result<PackedRhs<K>, HostGemmError> {
    let (depth_stride, col_stride) = source.strides;
    let (units, data) = pack::<K>(
        K::NR,
        cols,
        depth,
        (col_stride, depth_stride),
        false,
        source,
    )?;
    Ok(PackedRhs {
        cols,
        depth,
        units,
        data,
        kernel: PhantomData,
    })
}

/// The right operand (`k × n`) checked and left where it is stored: each task of the GEMM packs the depth blocks of
/// its columns as it reaches them, into a buffer of its thread that stays in L2, laid out as [`PackedRhs`]'s panels
/// of those columns and depths (`RhsInTasks::pack_block`). A task's block is packed once per task that reads it
/// (once per `MC` rows of the output) instead of once for the whole GEMM, but the packed bf16 pairs never travel
/// to memory and back: on AMX, packing a whole right operand ahead was a sixth of the GEMM, bound by memory.
pub struct RhsInTasks<'a, K: Kernel> {
    pub(super) cols: usize,
    pub(super) depth: usize,
    lines: Lines,
    source: Source<'a, K::Element>,
    lookups: Lookups,
}

/// The `depth × cols` right operand read from `source`, checked as [`pack_rhs`] checks it, to be packed block by
/// block inside the GEMM's tasks.
pub fn rhs_in_tasks<'a, K: Kernel>(
    depth: usize,
    cols: usize,
    source: &Source<'a, K::Element>,
) -> Result<RhsInTasks<'a, K>, HostGemmError> {
    const { assert!(K::NR <= MAX_WIDTH) };
    let (depth_stride, col_stride) = source.strides;
    let lines = Lines {
        width: K::NR,
        lanes: cols,
        depth,
        lane_stride: col_stride,
        depth_stride,
        group: K::GROUP,
        row_groups: false,
    };
    lines.check(K::PATH, source)?;
    Ok(RhsInTasks {
        cols,
        depth,
        lines,
        source: *source,
        lookups: Lookups::of(source),
    })
}

impl<K: Kernel> RhsInTasks<'_, K> {
    /// Columns `col0 ..+cols` over units `p0 ..+kc` (a depth block: `p0` a multiple of `K::KC`) packed into
    /// `into` as [`PackedRhs`] would hold them, with `kc` units per panel: panel `j` (columns `col0 + j · NR ..`)
    /// from `j · kc · NR`. `into` holds `cols.div_ceil(NR) · kc · NR` units; `scratch` is a buffer the scalar
    /// packing of block-scaled codes may use.
    pub(super) fn pack_block(
        &self,
        (col0, cols): (usize, usize),
        (p0, kc): (usize, usize),
        into: &mut [u32],
        scratch: &mut Vec<K::Element>,
    ) {
        let per = <K::Element as PackedElement>::PER_UNIT;
        let d0 = p0 * per;
        let lines = Lines {
            lanes: cols,
            depth: (kc * per).min(self.depth - d0),
            ..self.lines
        };
        // The block's own stored offset: every index the panels read is an index into the same storage.
        let source = Source {
            offset: self.source.offset + col0 * lines.lane_stride + d0 * lines.depth_stride,
            ..self.source
        };
        let panel_len = kc * K::NR;
        for (j, panel) in into[..cols.div_ceil(K::NR) * panel_len]
            .chunks_exact_mut(panel_len)
            .enumerate()
        {
            lines.pack_panel(panel, j, &source, &self.lookups, scratch);
        }
    }
}

/// `lanes` lines of `depth` elements in panels of `width` lanes for `K` (its `MR` or `NR`), each group of units
/// row by row where `row_groups`: the units per lane (padded to `K::GROUP`) and the packed data.
fn pack<K: Kernel>(
    width: usize,
    lanes: usize,
    depth: usize,
    (lane_stride, depth_stride): (usize, usize),
    row_groups: bool,
    source: &Source<'_, K::Element>,
) -> Result<(usize, Panels), HostGemmError> {
    const { assert!(K::MR <= MAX_WIDTH && K::NR <= MAX_WIDTH) };
    const { assert!(K::GROUP * MAX_WIDTH <= MAX_GROUPED && K::KC.is_multiple_of(K::GROUP)) };
    let lines = Lines {
        width,
        lanes,
        depth,
        lane_stride,
        depth_stride,
        group: K::GROUP,
        row_groups,
    };
    lines.pack(K::PATH, source)
}

/// Packed panels: `len` units of a buffer from `start`, its first 64-byte boundary (a pooled block starts at one;
/// a smaller buffer is padded to have one), so that every panel (a multiple of 16 units long) starts a cache line:
/// AMX loads a tile row by row, and a row across two lines costs several times one within a line.
pub(super) struct Panels {
    buffer: HostBuffer<u32>,
    start: usize,
    len: usize,
}

impl std::ops::Deref for Panels {
    type Target = [u32];
    fn deref(&self) -> &[u32] {
        &self.buffer[self.start..][..self.len]
    }
}

/// 32-bit units per cache line.
const LINE_UNITS: usize = 64 / size_of::<u32>();

/// Units of depth ahead whose codes [`Lines::panel`] asks the cache for where the lanes are contiguous (measured on
/// Zen 3: 16 made such a packing 1.6–3.3× faster, as fast per code as a depth-contiguous one).
const PREFETCH_AHEAD: usize = 16;

/// A hint that the codes of unit `p + PREFETCH_AHEAD` (of `per` depths each, every one of them: a bf16 pair's
/// second depth is another row too) of a lane starting at `base` will be read soon, the depths `depth_stride` apart
/// (none where that is past the end of `data`, which a saturated index is, or off x86-64).
#[inline(always)]
fn prefetch_ahead<S>(data: &[S], base: usize, (per, p): (usize, usize), depth_stride: usize) {
    for depth in per * (p + PREFETCH_AHEAD)..per * (p + PREFETCH_AHEAD + 1) {
        let at = depth.saturating_mul(depth_stride).saturating_add(base);
        #[cfg(target_arch = "x86_64")]
        if let Some(value) = data.get(at) {
            use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
            // SAFETY: a prefetch changes no architectural state; the address is an element of `data`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>((value as *const S).cast()) };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (data, at);
    }
}

/// The widest panel of any path (the bf16 path's `NR`).
const MAX_WIDTH: usize = 32;

/// The most units in one group of a panel (`GROUP × width`) that is laid out row by row.
const MAX_GROUPED: usize = 16 * MAX_WIDTH;

/// The vector packing's tables for one source, made once for every panel where the CPU has AVX512-VBMI: the codes'
/// elements as bf16 (`codes`), or, for block-scaled codes, their values as f32 (every FP8 value is a bf16 value, so
/// the same lookup serves) and each stored column's block (`blocks`).
pub(super) struct Lookups {
    codes: Option<super::pack_vbmi::Lookup>,
    blocks: Option<(super::pack_vbmi::Lookup, Vec<u32>)>,
}

impl Lookups {
    fn of<E: PackedElement>(source: &Source<'_, E>) -> Self {
        match source.elements {
            Elements::Codes(_, table) => Self {
                codes: E::bf16_table(table)
                    .and_then(|table| super::pack_vbmi::lookup(table, E::PER_UNIT)),
                blocks: None,
            },
            Elements::Blocks(blocks) => Self {
                codes: None,
                blocks: u32::bf16_table(&blocks.values.map(f32::to_bits))
                    .and_then(|table| super::pack_vbmi::lookup(table, 1))
                    .map(|lookup| {
                        let of_col = (0..blocks.cols)
                            .map(|c| u32::try_from(c / blocks.block.cols).unwrap_or(u32::MAX))
                            .collect::<Vec<_>>();
                        (lookup, of_col)
                    }),
            },
        }
    }
}

/// `lanes` rows (or columns) of `depth` elements each, lane `l`'s depth `d` stored at
/// `offset + l · lane_stride + d · depth_stride`, packed in panels of `width` lanes.
#[derive(Clone, Copy)]
struct Lines {
    width: usize,
    lanes: usize,
    depth: usize,
    lane_stride: usize,
    depth_stride: usize,
    /// Units per group: the depth is padded with zero units to a multiple.
    group: usize,
    /// Each group row by row (`[group][width][GROUP]`) rather than unit by unit.
    row_groups: bool,
}

impl Lines {
    /// The units per lane and the panels: lane `first + l` of panel `first / width` at `(panel · units + p) ·
    /// width + l` (or grouped as [`PackedLhs`] says); lanes past the end, the depth past an odd end and the units
    /// past the depth's last group are zero. An error where the strides reach beyond `source` (checked
    /// arithmetic: a stride that overflows is out of bounds too).
    fn pack<E: PackedElement>(
        self,
        path: super::HostGemmPath,
        source: &Source<'_, E>,
    ) -> Result<(usize, Panels), HostGemmError> {
        let (units, panel_len) = self.check(path, source)?;
        // Every unit is written below; a large buffer is a pooled block that the next step's GEMM of this shape
        // reuses, pages and all (`crate::host::pool`). The panels start at a cache line (`Panels`): a pooled block
        // starts at a huge page, a smaller buffer is padded by up to a line (with the pool off, a large one may
        // start mid-line: slower, not wrong).
        let len = self.lanes.div_ceil(self.width) * panel_len;
        let pad = if len.saturating_mul(size_of::<u32>()) >= POOLED_FROM {
            0
        } else {
            LINE_UNITS - 1
        };
        let mut buffer = HostBuffer::<u32>::for_overwrite(len + pad);
        let start = Some(buffer.as_ptr().align_offset(64))
            .filter(|&start| start <= pad)
            .unwrap_or(0);
        let data = &mut buffer[start..start + len];
        let lookups = Lookups::of(source);
        data.par_chunks_mut(panel_len.max(1))
            .enumerate()
            .for_each_init(Vec::<E>::new, |scratch, (i, panel)| {
                self.pack_panel(panel, i, source, &lookups, scratch)
            });
        Ok((units, Panels { buffer, start, len }))
    }

    /// The units per lane (padded to a multiple of the group) and the units per panel, or an error where the strides
    /// reach beyond `source` (checked arithmetic: a stride that overflows is out of bounds too), a block-scaled
    /// source's factors do not fit its grid, or the panels would not fit in memory.
    fn check<E: PackedElement>(
        &self,
        path: super::HostGemmPath,
        source: &Source<'_, E>,
    ) -> Result<(usize, usize), HostGemmError> {
        let Lines {
            width,
            lanes,
            depth,
            lane_stride,
            depth_stride,
            group,
            ..
        } = *self;
        if let Elements::Blocks(blocks) = &source.elements {
            blocks.check(path)?;
        }
        let stored = source.elements.len();
        if lanes > 0 && depth > 0 {
            let last = (lanes - 1)
                .checked_mul(lane_stride)
                .zip((depth - 1).checked_mul(depth_stride))
                .and_then(|(l, d)| l.checked_add(d))
                .and_then(|reach| reach.checked_add(source.offset));
            if last.is_none_or(|last| last >= stored) {
                return Err(HostGemmError::OutOfBounds {
                    what: path,
                    lanes,
                    depth,
                    last,
                    stored,
                });
            }
        }
        let too_large = HostGemmError::TooLarge {
            what: path,
            lanes,
            depth,
        };
        let units = depth
            .div_ceil(E::PER_UNIT)
            .div_ceil(group)
            .checked_mul(group)
            .ok_or(too_large.clone())?;
        let panel_len = units
            .checked_mul(width)
            .filter(|len| {
                len.checked_mul(lanes.div_ceil(width))
                    .and_then(|len| len.checked_add(LINE_UNITS))
                    .is_some()
            })
            .ok_or(too_large)?;
        Ok((units, panel_len))
    }

    /// Panel `i` (lanes `i · width ..`) of a source [`Lines::check`] passed, every unit of it written: lanes past
    /// the end, the depth past an odd end and the units past the depth's last group zero; `scratch` a buffer the
    /// scalar packing of block-scaled codes may use.
    fn pack_panel<E: PackedElement>(
        &self,
        panel: &mut [u32],
        i: usize,
        source: &Source<'_, E>,
        lookups: &Lookups,
        scratch: &mut Vec<E>,
    ) {
        let Lines {
            width,
            lanes,
            depth,
            lane_stride,
            depth_stride,
            group,
            row_groups,
        } = *self;
        let depth_units = depth.div_ceil(E::PER_UNIT);
        let count = width.min(lanes - i * width);
        let base = source.offset + i * width * lane_stride;
        // The leading units of each lane already laid out in groups (the vector packing of a depth-contiguous left
        // operand does that); the rest unit by unit until regrouped below.
        let mut grouped = 0;
        match source.elements {
            Elements::Codes(codes, table) => {
                let packed = lookups
                    .codes
                    .as_ref()
                    .and_then(|lookup| self.vector_panel(panel, count, base, codes, lookup));
                match packed {
                    Some(units) => grouped = units,
                    None => self.panel(panel, count, base, codes, |c| table[usize::from(c)]),
                }
            }
            Elements::Blocks(blocks) => {
                let packed = lookups.blocks.as_ref().is_some_and(|(lookup, of_col)| {
                    self.vector_blocks_panel::<E>(panel, count, base, &blocks, lookup, of_col)
                });
                // Else the scalar packing of the layout.
                if !packed && lane_stride == 1 && depth_stride != 1 {
                    self.lanes_contiguous_blocks::<E>(panel, count, base, &blocks)
                } else if !packed {
                    let lines = self.decode_panel(scratch, count, base, &blocks);
                    lines.panel(panel, count, 0, scratch, |e| e);
                }
            }
        }
        panel[depth_units * width..].fill(0);
        let (head, panel) = panel.split_at_mut(grouped * width);
        if count < width {
            for chunk in head.chunks_exact_mut(group * width) {
                chunk[count * group..].fill(0);
            }
            for slot in panel.chunks_exact_mut(width) {
                slot[count..].fill(0);
            }
        }
        if row_groups {
            // Each group transposed through a copy: unit `q` of lane `l` from `q · width + l` to `l · group + q`,
            // the copy read in order (the copy made once per panel, not zeroed per group).
            let mut copy = [0u32; MAX_GROUPED];
            for chunk in panel.chunks_exact_mut(group * width) {
                let copy = &mut copy[..chunk.len()];
                copy.copy_from_slice(chunk);
                for (q, units) in copy.chunks_exact(width).enumerate() {
                    for (row, &unit) in chunk.chunks_exact_mut(group).zip(units) {
                        row[q] = unit;
                    }
                }
            }
        }
    }

    /// Writes every unit of one panel (`count` lanes from `base`), reading the stored `data` through `element`.
    #[inline(always)]
    fn panel<S: Copy, E: PackedElement>(
        &self,
        panel: &mut [u32],
        count: usize,
        base: usize,
        data: &[S],
        element: impl Fn(S) -> E,
    ) {
        let Lines {
            width,
            depth,
            lane_stride,
            depth_stride,
            ..
        } = *self;
        let per = E::PER_UNIT;
        let units = depth.div_ceil(per);
        let unit = |lo: S, hi: S| E::unit(element(lo), element(hi));
        let last = |lo: S| E::unit(element(lo), E::ZERO);
        if depth_stride == 1 {
            // Each lane's depth is contiguous (a row-major left operand, a transposed right one): a few units of
            // every lane at a time, so the reads run along each lane and the writes stay in a few cache lines.
            const STEP: usize = 8;
            let mut lines = [&data[..0]; MAX_WIDTH];
            for (l, line) in lines[..count].iter_mut().enumerate() {
                *line = &data[base + l * lane_stride..][..depth];
            }
            let lines = &lines[..count];
            let whole = depth / per;
            for (s, slots) in panel[..whole / STEP * STEP * width]
                .chunks_exact_mut(STEP * width)
                .enumerate()
            {
                for (l, line) in lines.iter().enumerate() {
                    let chunk = &line[s * STEP * per..][..STEP * per];
                    for i in 0..STEP {
                        slots[i * width + l] = unit(chunk[per * i], chunk[per * i + per - 1]);
                    }
                }
            }
            for p in whole / STEP * STEP..units {
                for (l, line) in lines.iter().enumerate() {
                    panel[p * width + l] = if p < whole {
                        unit(line[per * p], line[per * p + per - 1])
                    } else {
                        last(line[depth - 1])
                    };
                }
            }
        } else if lane_stride == 1 {
            // The lanes are contiguous at each depth (a row-major right operand, a transposed left one). Each
            // depth is a row of the matrix apart, often a page or more: the hardware prefetchers stop at a page's
            // end, so the codes of the depth `PREFETCH_AHEAD` units on are asked for here.
            for p in 0..units {
                prefetch_ahead(data, base, (per, p), depth_stride);
                let slot = &mut panel[p * width..][..count];
                let lo = &data[base + per * p * depth_stride..][..count];
                let hi_depth = per * p + per - 1;
                if hi_depth < depth {
                    let hi = &data[base + hi_depth * depth_stride..][..count];
                    for ((o, &a), &b) in slot.iter_mut().zip(lo).zip(hi) {
                        *o = unit(a, b);
                    }
                } else {
                    for (o, &a) in slot.iter_mut().zip(lo) {
                        *o = last(a);
                    }
                }
            }
        } else {
            for l in 0..count {
                for p in 0..units {
                    let at = base + l * lane_stride + per * p * depth_stride;
                    let hi_depth = per * p + per - 1;
                    panel[p * width + l] = if hi_depth < depth {
                        unit(data[at], data[at + (per - 1) * depth_stride])
                    } else {
                        last(data[at])
                    };
                }
            }
        }
    }

    /// One panel (`count` lanes from `base`) of block-scaled codes whose lanes are contiguous at each depth: each
    /// depth's run of `count` codes decoded into a buffer on the stack and written into the panel from there (a
    /// copy of the whole panel's elements in between, then read back, cost three times the depth-contiguous
    /// packing on Zen 3).
    fn lanes_contiguous_blocks<E: PackedElement>(
        &self,
        panel: &mut [u32],
        count: usize,
        base: usize,
        blocks: &BlockCodes<'_>,
    ) {
        let (width, depth, depth_stride) = (self.width, self.depth, self.depth_stride);
        let per = E::PER_UNIT;
        // Where every depth's run lies inside one stored row, at the same columns (a whole number of rows apart):
        // each lane's block column found once, and each run's factors from its row's band, with no division per
        // element (`decode_run` elsewhere: a run that crosses a row's end).
        let (cols, block) = (blocks.cols, blocks.block);
        let (grid_cols, col) = (cols.div_ceil(block.cols), base % cols);
        let same_columns = depth_stride.is_multiple_of(cols) && col + count <= cols;
        let mut block_col = [0; MAX_WIDTH];
        for (l, b) in block_col[..count].iter_mut().enumerate() {
            *b = (col + l) / block.cols;
        }
        let decode = |d: usize, run: &mut [E]| {
            let at = base + d * depth_stride;
            if same_columns {
                let factors = &blocks.factors[at / cols / block.rows * grid_cols..][..grid_cols];
                let codes = &blocks.codes[at..][..run.len()];
                for ((o, &code), &b) in run.iter_mut().zip(codes).zip(&block_col) {
                    *o = E::of_value(blocks.values[usize::from(code)] * factors[b]);
                }
            } else {
                blocks.decode_run(at, run);
            }
        };
        // The unit's low and high depth (the same run where a unit holds one depth).
        let mut runs = [[E::ZERO; MAX_WIDTH]; 2];
        for p in 0..depth.div_ceil(per) {
            prefetch_ahead(blocks.codes, base, (per, p), depth_stride);
            for (half, run) in runs.iter_mut().enumerate().take(per) {
                let d = per * p + half;
                let run = &mut run[..count];
                if d < depth {
                    decode(d, run);
                } else {
                    run.fill(E::ZERO);
                }
            }
            let (lo, hi) = (&runs[0][..count], &runs[per - 1][..count]);
            let slot = &mut panel[p * width..][..count];
            for ((o, &lo), &hi) in slot.iter_mut().zip(lo).zip(hi) {
                *o = E::unit(lo, hi);
            }
        }
    }

    /// The `count` lanes from `base` of block-scaled codes decoded into `scratch` lane by lane (where each lane's
    /// depth is contiguous, or neither is; [`Self::lanes_contiguous_blocks`] takes the lanes-contiguous layout), and
    /// the lines that read them there, so the codes are read in order in runs of one block.
    fn decode_panel<E: PackedElement>(
        &self,
        scratch: &mut Vec<E>,
        count: usize,
        base: usize,
        blocks: &BlockCodes<'_>,
    ) -> Lines {
        let (depth, lane_stride, depth_stride) = (self.depth, self.lane_stride, self.depth_stride);
        // Every element is decoded below: only a grown buffer's new part is zeroed first, not each panel's.
        scratch.resize(count * depth, E::ZERO);
        for (l, line) in scratch.chunks_exact_mut(depth.max(1)).enumerate() {
            let first = base + l * lane_stride;
            if depth_stride == 1 {
                blocks.decode_run(first, line);
            } else {
                for (d, element) in line.iter_mut().enumerate() {
                    blocks.decode_run(first + d * depth_stride, std::slice::from_mut(element));
                }
            }
        }
        Lines {
            lane_stride: depth,
            depth_stride: 1,
            ..*self
        }
    }

    /// The block-scaled panel (`count` lanes from `base`) by the vector packing on AVX512-VBMI
    /// ([`super::pack_blocks_vbmi`]; `lookup` gives the codes' f32 values, `block_of_col` each stored column's
    /// block): `false`, nothing written, where the layout is not one it takes.
    fn vector_blocks_panel<E: PackedElement>(
        &self,
        panel: &mut [u32],
        count: usize,
        base: usize,
        blocks: &BlockCodes<'_>,
        lookup: &super::pack_vbmi::Lookup,
        block_of_col: &[u32],
    ) -> bool {
        // SAFETY: `pack` checked that every lane's reach lies inside the codes and the factors fit the grid
        // (`BlockCodes::check`); `panel` holds `units · width` units; `count ≤ width ≤ MAX_WIDTH = 32`; the lookup
        // was made for f32 values and `block_of_col` has one block per stored column.
        unsafe {
            super::pack_blocks_vbmi::panel(
                panel,
                (self.width, count),
                base,
                (self.lane_stride, self.depth_stride),
                self.depth,
                blocks,
                block_of_col,
                lookup,
                E::PER_UNIT,
            )
        }
    }

    /// [`Lines::panel`] for codes through `lookup`'s bf16 table on AVX512-VBMI ([`super::pack_vbmi`]), where the
    /// layout has the lanes or the depth contiguous (`None`, nothing written, otherwise): how many leading units of
    /// each lane it wrote in groups row by row (where the panel is grouped and the depth contiguous; else 0).
    fn vector_panel(
        &self,
        panel: &mut [u32],
        count: usize,
        base: usize,
        codes: &[u8],
        lookup: &super::pack_vbmi::Lookup,
    ) -> Option<usize> {
        let grouped = self.row_groups && self.group == super::pack_vbmi::GROUPED;
        // SAFETY: `pack` checked that every lane's reach lies inside `codes`; `panel` holds `units · width` units;
        // `count ≤ width ≤ MAX_WIDTH = 32`.
        unsafe {
            super::pack_vbmi::panel(
                panel,
                (self.width, count),
                base,
                (self.lane_stride, self.depth_stride),
                self.depth,
                codes,
                lookup,
                grouped,
            )
        }
    }
}
