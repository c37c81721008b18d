//! The FP8 GEMM's operands decoded ahead of the product, for burn-te's `decoded` path: the codes become `S` values
//! (f16 where the device has it, f32 elsewhere), which Burn's own autotuned matmul multiplies into f32 as it does
//! any f16 or f32 tensor, on the device's matrix units where it has them; the per-tensor scales then go to the f32
//! product once ([`crate::cubek_gemm::scale_output`]). Exact: every E4M3 and E5M2 value is an f16 and an f32 value,
//! and Burn's f16 matmul accumulates in f32 (cubek-matmul's accumulator for f16 and bf16 operands).
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
use crate::kernel::decode::decode_codes_kernel;
use crate::ops::{check_size, elementwise_grid};

/// Why the decoded path cannot take `operand` exactly, or `None` where it can: it takes FP8 codes with one scale
/// per tensor (a block scale folded into the values need not be exact in f16).
pub fn decoded_refusal(operand: &GemmOperand<'_>) -> Option<String> {
    match (operand.element(), operand.block) {
        (CodeFormat::E2m1, _) => {
            Some("NVFP4's E2M1 codes carry block factors: the decoded path takes FP8 with per-tensor scales".into())
        }
        (CodeFormat::Fp8(_), Some(block)) => Some(format!(
            "{}x{} scale blocks: the decoded path takes per-tensor scales (a block's factor folded into an f16 \
             value need not be exact)",
            block.rows, block.cols
        )),
        (CodeFormat::Fp8(_), None) => None,
    }
}

/// The operand's codes as `S` values, unscaled, in their stored row-major order (`batch · rows · cols` of them,
/// padded with zeros to whole code words).
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
    operand.check("decoded GEMM operand")?;
    let len = operand.batch * operand.rows * operand.cols;
    let element = operand.element();
    let lanes = codes_per_word(element);
    let words = len.div_ceil(lanes);
    let words32 = u32::try_from(words).map_err(|_| KernelError::TooLarge(len))?;
    check_size("decoded GEMM codes", operand.codes_handle(), 4, words)?;
    let output = client.empty(words.max(1) * lanes * size_of::<S>());
    if words > 0 {
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
