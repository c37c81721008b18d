//! The activations of `LayerNormMLP` and `TransformerLayer`, with TE's definitions. The gated (GLU) variants
//! split their input in halves along the last dimension and return `act(first) · second`, so FC1 produces twice
//! the FFN width for them.

use burn::prelude::*;
use burn::tensor::activation::{relu, sigmoid};

use crate::backend::TeBackend;
use crate::error::TeError;
use crate::fused::{self, Pointwise};

/// An MLP activation (TE's `activation=` names: `gelu`, `geglu`, `qgelu`, `qgeglu`, `relu`, `reglu`, `srelu`,
/// `sreglu`, `silu`, `swiglu`).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum Activation {
    /// GELU, tanh approximation (TE's kernel).
    Gelu,
    /// Gated GELU.
    Geglu,
    /// Quick GELU: `x · σ(1.702 x)`.
    Qgelu,
    /// Gated quick GELU.
    Qgeglu,
    /// ReLU.
    Relu,
    /// Gated ReLU.
    Reglu,
    /// Squared ReLU: `relu(x)²`.
    Srelu,
    /// Gated squared ReLU.
    Sreglu,
    /// SiLU (swish): `x · σ(x)`.
    Silu,
    /// Gated SiLU.
    Swiglu,
}

impl Activation {
    /// Every activation, in TE's order.
    pub const ALL: [Activation; 10] = [
        Activation::Gelu,
        Activation::Geglu,
        Activation::Qgelu,
        Activation::Qgeglu,
        Activation::Relu,
        Activation::Reglu,
        Activation::Srelu,
        Activation::Sreglu,
        Activation::Silu,
        Activation::Swiglu,
    ];

    /// TE's name.
    pub fn te_name(self) -> &'static str {
        match self {
            Activation::Gelu => "gelu",
            Activation::Geglu => "geglu",
            Activation::Qgelu => "qgelu",
            Activation::Qgeglu => "qgeglu",
            Activation::Relu => "relu",
            Activation::Reglu => "reglu",
            Activation::Srelu => "srelu",
            Activation::Sreglu => "sreglu",
            Activation::Silu => "silu",
            Activation::Swiglu => "swiglu",
        }
    }

    /// The activation with TE's name `name`.
    pub fn from_te_name(name: &str) -> Result<Self, TeError> {
        Self::ALL
            .into_iter()
            .find(|a| a.te_name() == name)
            .ok_or_else(|| {
                let known: Vec<_> = Self::ALL.iter().map(|a| a.te_name()).collect();
                super::config_error(
                    "activation",
                    format!("unknown activation {name:?}; expected one of {known:?}"),
                )
            })
    }

    /// Whether this is a gated variant (input twice the output width).
    pub fn is_gated(self) -> bool {
        matches!(
            self,
            Activation::Geglu
                | Activation::Qgeglu
                | Activation::Reglu
                | Activation::Sreglu
                | Activation::Swiglu
        )
    }

    /// The activation applied to `x [.., n]`; gated variants take `[.., 2n]` and return `[.., n]`, and give an
    /// error on an odd last dimension.
    pub fn apply<B: TeBackend, const D: usize>(
        self,
        x: Tensor<B, D>,
    ) -> Result<Tensor<B, D>, TeError> {
        let dims = x.dims();
        let width = dims[D - 1];
        if self.is_gated() && !width.is_multiple_of(2) {
            return Err(TeError::InvalidShape {
                module: self.te_name().to_string(),
                reason: "a gated activation needs an even last dimension (gate and value halves)"
                    .into(),
                shape: dims.to_vec(),
            });
        }
        if let Some(y) = fused::activation::try_fused(&x, self.kernel(), self.is_gated())? {
            return Ok(y);
        }
        if !self.is_gated() {
            return Ok(self.pointwise(x));
        }
        let value = x.clone().narrow(D - 1, width / 2, width / 2);
        Ok(self.pointwise(x.narrow(D - 1, 0, width / 2)) * value)
    }

    /// The fused kernel's pointwise function (a gated variant uses its base function's).
    pub(crate) fn kernel(self) -> Pointwise {
        match self {
            Activation::Gelu | Activation::Geglu => Pointwise::Gelu,
            Activation::Qgelu | Activation::Qgeglu => Pointwise::QuickGelu,
            Activation::Relu | Activation::Reglu => Pointwise::Relu,
            Activation::Srelu | Activation::Sreglu => Pointwise::SquaredRelu,
            Activation::Silu | Activation::Swiglu => Pointwise::Silu,
        }
    }

    fn pointwise<B: Backend, const D: usize>(self, x: Tensor<B, D>) -> Tensor<B, D> {
        match self {
            Activation::Gelu | Activation::Geglu => {
                // TE's 0.5 x (1 + tanh(u)), u = √(2/π) (x + 0.044715 x³), written as x σ(2u): the same function
                // (0.5 (1 + tanh u) = σ(2u)) in fewer ops, with an exp where tanh is slow (libm's tanhf, ~3×
                // expf on the host); the graph keeps as much as before (2u for σ's backward, σ for the product's).
                // In f32 it is also the more accurate form for negative x, where 1 + tanh u cancels.
                let two_u = (x.clone() + x.clone().powi_scalar(3) * 0.044715)
                    * (8.0 / std::f64::consts::PI).sqrt();
                x * sigmoid(two_u)
            }
            Activation::Qgelu | Activation::Qgeglu => x.clone() * sigmoid(x * 1.702),
            Activation::Relu | Activation::Reglu => relu(x),
            Activation::Srelu | Activation::Sreglu => relu(x).square(),
            Activation::Silu | Activation::Swiglu => x.clone() * sigmoid(x),
        }
    }
}
