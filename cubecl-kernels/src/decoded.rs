//! The FP8 GEMM's operands decoded ahead of the product, for burn-te's `decoded` path: the codes become `S` values
//! (f16, bf16 or f32, as the caller picks for the device), which Burn's own autotuned matmul multiplies into f32 as
//! it does any tensor of those types, on the device's matrix units where it has them; the per-tensor scales then go
//! to the f32 product once ([`crate::cubek_gemm::scale_output`]), and block scales multiply each value as it is
//! decoded (in f32, then cast: the SIMT kernel's staging). Exact where `S` holds the values: every E4M3 and E5M2
//! value is an f16, a bf16 and an f32 value, a power-of-two block scale times one is a bf16 and an f32 value (bf16
//! has f32's exponent range), and Burn's f16 and bf16 matmuls accumulate in f32 (cubek-matmul's accumulator for
//! them).
//!
//! The copy costs a pass over each operand (one byte read, `size_of::<S>()` written per code) and holds
//! `batch · rows · cols` values of `S` until the product is done; in exchange the product runs at the speed of the
//! matmul users get for f16, with Burn's own choice of routine per shape and device, where the tiled path
//! ([`crate::cubek_gemm`]) decodes inside cubek's loaders.

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::error::KernelError;
use crate::gemm::GemmOperand;
use crate::kernel::code::CodeFormat;
use crate::kernel::code_view::codes_per_word;
use crate::kernel::decode::{decode_codes_kernel, decode_scaled_codes_kernel};
use crate::ops::elementwise_grid;

/// Why the decoded path cannot take `operand`, or `None` where it can: FP8 codes with per-tensor or block scales,
/// the blocks not straddling a batch's matrices. (NVFP4's E2M1 codes and their E4M3 block factors stay on the SIMT
/// kernel and the tiled path.)
pub fn decoded_refusal(operand: &GemmOperand<'_>) -> Option<String> {
    match (operand.element(), operand.block) {
        (CodeFormat::E2m1, _) => {
            Some("NVFP4's E2M1 codes: the decoded path takes FP8 codes".into())
        }
        (CodeFormat::Fp8(_), Some(block))
            if operand.batch > 1 && !operand.rows.is_multiple_of(block.rows.max(1)) =>
        {
            Some(format!(
                "a batch of {} matrices with {} rows cannot use {}x{} scale blocks (blocks would straddle \
                 matrices)",
                operand.batch, operand.rows, block.rows, block.cols
            ))
        }
        (CodeFormat::Fp8(_), _) => None,
    }
}

/// The operand's codes as `S` values in their stored row-major order (`batch · rows · cols` of them, padded to
/// whole code words): unscaled with a per-tensor scale (the product's factor), times their block's scale with block
/// scales.
pub fn decode_operand<R: Runtime, S: Float + CubeElement>(
    client: &ComputeClient<R>,
    operand: &GemmOperand<'_>,
) -> Result<Handle, KernelError> {
    if let Some(reason) = decoded_refusal(operand) {
        return Err(KernelError::InvalidArgument {
            what: "decoded GEMM operand",
            reason,
        });
    }
    // The codes' words and the scales (one, or each block of each matrix) are there.
    operand.check("decoded GEMM operand")?;
    let len = operand.batch * operand.rows * operand.cols;
    let element = operand.element();
    let lanes = codes_per_word(element);
    let words = len.div_ceil(lanes);
    let words32 = u32::try_from(words).map_err(|_| KernelError::TooLarge(len))?;
    let output = client.empty(words.max(1) * lanes * size_of::<S>());
    if let (Some(block), true) = (operand.block, words > 0) {
        // The batch's matrices stacked: the same blocks, as their rows are whole blocks (`decoded_refusal`).
        let (grid_rows, grid_cols) = block.grid(operand.batch * operand.rows, operand.cols);
        let to_u32 = |v: usize| u32::try_from(v).map_err(|_| KernelError::TooLarge(v));
        let (cube_count, cube_dim) = elementwise_grid(client, words);
        // SAFETY: the codes hold `words` words and the scales every block (checked), the output `words` vectors of
        // `lanes`; the kernel checks `words` and reads no scale past the last code's.
        unsafe {
            decode_scaled_codes_kernel::launch_unchecked::<S, R>(
                client,
                cube_count,
                cube_dim,
                lanes,
                ArrayArg::from_raw_parts(operand.codes_handle().clone(), words),
                ArrayArg::from_raw_parts(operand.scale_inv.clone(), grid_rows * grid_cols),
                ArrayArg::from_raw_parts(output.clone(), words),
                words32,
                to_u32(len)?,
                to_u32(operand.cols)?,
                to_u32(block.rows)?,
                to_u32(block.cols)?,
                to_u32(grid_cols)?,
                element,
            );
        }
    } else if words > 0 {
        let (cube_count, cube_dim) = elementwise_grid(client, words);
        // SAFETY: the codes hold `words` words (checked), the output `words` vectors of `lanes`; the kernel checks
        // `words`.
        unsafe {
            decode_codes_kernel::launch_unchecked::<S, R>(
                client,
                cube_count,
                cube_dim,
                lanes,
                ArrayArg::from_raw_parts(operand.codes_handle().clone(), words),
                ArrayArg::from_raw_parts(output.clone(), words),
                words32,
                element,
            );
        }
    }
    Ok(output)
}
