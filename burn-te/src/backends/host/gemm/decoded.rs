//! The `f32` path: both operands decoded to f32 with their scales multiplied in (`decode(code) · scale_inv`, per
//! tensor or per block), then the `gemm` crate (burn-flex's matmul) with f32 accumulation; transposed operands
//! read through strides, a batch of one broadcast against the other operand's batch. Any CPU runs it.

use std::mem::MaybeUninit;

use burn_te_kernels::host;
use burn_te_kernels::host::gemm::BlockCodes;
use rayon::prelude::*;

use super::operand::HostOperand;
use crate::primitive::ElementFormat;

/// Work (`m·n·k`) from which one GEMM is split across rayon's threads (burn-flex's threshold).
pub(super) const PARALLEL_GEMM: usize = 192 * 192 * 192;

/// Scratch buffers kept for the decoded operands are dropped after a GEMM when larger than this (elements): each
/// thread that runs this path keeps its two operands' buffers, at most 64 MiB each, until it ends.
const KEPT_SCRATCH: usize = 1 << 24;

thread_local! {
    /// The decoded operands of this thread's last GEMM, reused so each GEMM does not fault in fresh pages.
    static SCRATCH: std::cell::RefCell<[Vec<f32>; 2]> = const { std::cell::RefCell::new([Vec::new(), Vec::new()]) };
}

/// `out[b] = lhs[b] · rhs[b]` (`m × n` each, row-major, every value written, none read).
pub(super) fn gemm(
    lhs: &HostOperand<'_>,
    rhs: &HostOperand<'_>,
    (m, n, k): (usize, usize, usize),
    out: &mut [MaybeUninit<f32>],
) {
    with_decoded(lhs, rhs, |a, b| {
        Gemm {
            m,
            n,
            k,
            lhs: (lhs, a),
            rhs: (rhs, b),
        }
        .run(out)
    });
}

/// `decode(code) · scale_inv` of every stored element (per tensor or per block).
pub(crate) fn dequantize(operand: &HostOperand<'_>) -> Vec<f32> {
    let mut values = Vec::new();
    decode_into(operand, &mut values);
    values
}

struct Gemm<'a> {
    m: usize,
    n: usize,
    k: usize,
    lhs: (&'a HostOperand<'a>, &'a [f32]),
    rhs: (&'a HostOperand<'a>, &'a [f32]),
}

impl Gemm<'_> {
    /// `out[b] = lhs[b] · rhs[b]` for every batch: large matrices split across threads, small ones one batch per
    /// thread.
    fn run(&self, out: &mut [MaybeUninit<f32>]) {
        let per_matrix = self.m * self.n;
        let large = self.m * self.n * self.k >= PARALLEL_GEMM;
        let batches = out.len() / per_matrix;
        if large || batches == 1 {
            let parallelism = if large {
                gemm::Parallelism::Rayon(0)
            } else {
                gemm::Parallelism::None
            };
            for (b, dst) in out.chunks_mut(per_matrix).enumerate() {
                self.one(b, dst, parallelism);
            }
        } else {
            out.par_chunks_mut(per_matrix)
                .enumerate()
                .for_each(|(b, dst)| self.one(b, dst, gemm::Parallelism::None));
        }
    }

    fn one(&self, batch: usize, dst: &mut [MaybeUninit<f32>], parallelism: gemm::Parallelism) {
        let (lhs_offset, (lhs_rs, lhs_cs)) = self.lhs.0.layout(batch);
        let (rhs_offset, (rhs_rs, rhs_cs)) = self.rhs.0.layout(batch);
        let (a, b) = (&self.lhs.1[lhs_offset..], &self.rhs.1[rhs_offset..]);
        // SAFETY: `dst` holds `m × n` elements written at row stride `n` and never read (`read_dst` false); `a` and `b` hold every element their
        // strides reach (`m × k` and `k × n` from their batch offsets, checked by `gemm_output_shape`'s dims).
        unsafe {
            gemm::gemm(
                self.m,
                self.n,
                self.k,
                dst.as_mut_ptr().cast::<f32>(),
                1,
                self.n as isize,
                false,
                a.as_ptr(),
                lhs_cs as isize,
                lhs_rs as isize,
                b.as_ptr(),
                rhs_cs as isize,
                rhs_rs as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                parallelism,
            );
        }
    }
}

/// Runs `f` on both operands decoded to f32, in this thread's scratch buffers (fresh ones if they are in use, as
/// when a rayon worker runs a second GEMM while waiting on the first).
fn with_decoded<R>(
    lhs: &HostOperand<'_>,
    rhs: &HostOperand<'_>,
    f: impl FnOnce(&[f32], &[f32]) -> R,
) -> R {
    SCRATCH.with(|scratch| match scratch.try_borrow_mut() {
        Ok(mut buffers) => {
            let [a, b] = &mut *buffers;
            decode_into(lhs, a);
            decode_into(rhs, b);
            let result = f(a, b);
            for buffer in buffers.iter_mut() {
                if buffer.capacity() > KEPT_SCRATCH {
                    *buffer = Vec::new();
                }
            }
            result
        }
        Err(_) => f(&dequantize(lhs), &dequantize(rhs)),
    })
}

/// [`dequantize`] into `values`, resized to the operand (only grown elements are initialised before decoding).
fn decode_into(operand: &HostOperand<'_>, values: &mut Vec<f32>) {
    values.resize(operand.codes.len(), 0.0);
    let codes = operand.codes;
    match (operand.format, operand.block) {
        (ElementFormat::Fp8(format), None) => {
            host::dequantize_into(codes, operand.scale_inv[0], format, values)
        }
        (ElementFormat::E2m1, None) => {
            for (value, &code) in values.iter_mut().zip(codes) {
                *value = ElementFormat::E2m1.decode(code) * operand.scale_inv[0];
            }
        }
        (format, Some(block)) => {
            let table: [f32; 256] = std::array::from_fn(|code| format.decode(code as u8));
            // The scales fit the grid: the backend checked the tensor before its GEMM or dequantization.
            BlockCodes {
                codes,
                values: &table,
                cols: operand.dims.2,
                block,
                factors: operand.scale_inv,
            }
            .decode_f32(values);
        }
    }
}
