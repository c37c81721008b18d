//! The GEMM path. This module: the three GEMMs of a linear layer (fprop, dgrad, wgrad) and the roles of the tensors
//! they multiply, the vocabulary of recipes, FP8 states, sites and the debug tools (plain types at the bottom of the
//! layers). Its submodules: the GEMMs built on the `TeBackend` trait, one layer up, which this module
//! does not use:
//! - [`fp8`]: a linear layer's FP8 GEMMs, each operand quantized as its recipe says;
//! - [`nvfp4`]: NVFP4's operand plans and quantization;
//! - [`saved`]: what the backward keeps of the forward's operands;
//! - [`microbatch`]: weights quantized once per optimizer step;
//! - `high_precision`: the GEMMs in high precision on Burn's own ops (no recipe, a fallback, the debug tools'
//!   reference);
//! - [`plain_linear`]: Burn's own `Linear` in an FP8 scope: its names, states and backward GEMMs.

pub mod fp8;
pub(crate) mod high_precision;
pub mod microbatch;
pub mod nvfp4;
pub mod plain_linear;
pub mod saved;

/// One of a layer's three GEMMs.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Gemm {
    /// Forward: activation × weight.
    Fprop,
    /// Input gradient: gradient × weight.
    Dgrad,
    /// Weight gradient: activation × gradient.
    Wgrad,
}

impl Gemm {
    /// TE's name: `fprop`, `dgrad` or `wgrad`.
    pub fn name(self) -> &'static str {
        match self {
            Gemm::Fprop => "fprop",
            Gemm::Dgrad => "dgrad",
            Gemm::Wgrad => "wgrad",
        }
    }

    /// The three GEMMs in their order of a step.
    pub const ALL: [Gemm; 3] = [Gemm::Fprop, Gemm::Dgrad, Gemm::Wgrad];

    /// Index in [`Gemm::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// Whether the GEMM multiplies `role`.
    pub fn takes(self, role: TensorRole) -> bool {
        let (lhs, rhs) = self.operands();
        lhs == role || rhs == role
    }

    /// The roles of the GEMM's operands `(lhs, rhs)`, as TE names them.
    pub fn operands(self) -> (TensorRole, TensorRole) {
        match self {
            Gemm::Fprop => (TensorRole::Activation, TensorRole::Weight),
            Gemm::Dgrad => (TensorRole::Gradient, TensorRole::Weight),
            Gemm::Wgrad => (TensorRole::Activation, TensorRole::Gradient),
        }
    }
}

/// The role of a GEMM input tensor.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum TensorRole {
    /// The layer's input.
    Activation,
    /// The layer's weight.
    Weight,
    /// The gradient of the layer's output.
    Gradient,
}

impl TensorRole {
    /// TE's name: `activation`, `weight` or `gradient`.
    pub fn name(self) -> &'static str {
        match self {
            TensorRole::Activation => "activation",
            TensorRole::Weight => "weight",
            TensorRole::Gradient => "gradient",
        }
    }

    /// Whether the tensor's rowwise use, as TE names it (blocks along the last dimension of TE's layout),
    /// reduces along this crate's columns: the activation `[tokens, in]` at fprop and the gradient
    /// `[tokens, out]` at dgrad do; the weight, stored `[in, out]` where TE stores `[out, in]`, reduces along its
    /// rows at fprop. The columnwise use (activation and gradient at wgrad, weight at dgrad) is the other way.
    pub fn rowwise_k_along_cols(self) -> bool {
        self != TensorRole::Weight
    }
}
