//! The FP8 GEMM's operands decoded ahead of the product, for burn-te's `decoded` path: the codes become `S` values
//! (f16, bf16 or f32, as the caller picks for the device), which Burn's own autotuned matmul multiplies into f32 as
//! it does any tensor of those types, on the device's matrix units where it has them; the per-tensor scales then go
//! to the f32 product once ([`crate::gemm::cubek::scale_output`], with NVFP4's global factors), and block scales
//! (FP8's `scale_inv`, NVFP4's E4M3 codes) multiply each value as it is
//! decoded (in f32, then cast: the SIMT kernel's staging). Exact where `S` holds the values: every E4M3 and E5M2
//! value is an f16, a bf16 and an f32 value, a power-of-two block scale times one is a bf16 and an f32 value (bf16
//! has f32's exponent range), and Burn's f16 and bf16 matmuls accumulate in f32 (cubek-matmul's accumulator for
//! them).
//!
//! The copy costs a pass over each operand (one byte read, `size_of::<S>()` written per code) and holds
//! `batch · rows · cols` values of `S` until the product is done; in exchange the product runs at the speed of the
//! matmul users get for f16, with Burn's own choice of routine per shape and device, where the tiled path
//! ([`crate::gemm::cubek`]) decodes inside cubek's loaders.

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::error::KernelError;
use crate::gemm::{GemmOperand, OperandCodes};
use crate::kernel::code_view::codes_per_word;
use crate::kernel::decode::{BlockGridLaunch, decode_codes_kernel, decode_scaled_codes_kernel};
use crate::ops::{check_size, elementwise_grid};

/// Why the decoded path cannot take `operand`, or `None` where it can: FP8 codes with per-tensor or block scales,
/// and NVFP4, the blocks not straddling a batch's matrices.
pub fn decoded_refusal(operand: &GemmOperand<'_>) -> Option<String> {
    let block = operand.block?;
    (operand.batch > 1 && !operand.rows.is_multiple_of(block.rows.max(1))).then(|| {
        format!(
            "a batch of {} matrices with {} rows cannot use {}x{} scale blocks (blocks would straddle matrices)",
            operand.batch, operand.rows, block.rows, block.cols
        )
    })
}

/// The operand's codes as `S` values in their stored row-major order (`batch · rows · cols` of them, padded to
/// whole code words): unscaled with a per-tensor scale (the product's factor), times their block's scale with FP8
/// block scales, times their block's E4M3 scale with NVFP4 (its global factor the product's,
/// [`crate::gemm::cubek::scale_output`]).
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
    if words == 0 {
        return Ok(output);
    }
    let Some(block) = operand.block else {
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
        return Ok(output);
    };
    // The batch's matrices stacked: the same blocks, as their rows are whole blocks (`decoded_refusal`).
    let (grid_rows, grid_cols) = block.grid(operand.batch * operand.rows, operand.cols);
    let to_u32 = |v: usize| u32::try_from(v).map_err(|_| KernelError::TooLarge(v));
    let blocks = BlockGridLaunch::new(
        to_u32(len)?,
        to_u32(operand.cols)?,
        to_u32(block.rows)?,
        to_u32(block.cols)?,
        to_u32(grid_cols)?,
    );
    // Each block's f32 `scale_inv` (FP8), or its E4M3 scale code, four per word (NVFP4).
    let (scales, scale_words) = match operand.codes {
        OperandCodes::Fp8(_) => (operand.scale_inv, grid_rows * grid_cols),
        OperandCodes::E2m1(buffer) => {
            let scale_words = (grid_rows * grid_cols).div_ceil(4);
            check_size("NVFP4 block scales", &buffer.scales, 4, scale_words)?;
            (&buffer.scales, scale_words)
        }
    };
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
            ArrayArg::from_raw_parts(scales.clone(), scale_words),
            ArrayArg::from_raw_parts(output.clone(), words),
            words32,
            blocks,
            element,
        );
    }
    Ok(output)
}
