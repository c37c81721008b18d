//! The tensors of a layer that features act on, by TE's names.

use std::fmt;

use burn_te::{Gemm, TensorRole};

/// A tensor of a layer's GEMMs: the three GEMM inputs and the three GEMM outputs.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub enum TensorName {
    /// The layer's input (fprop and wgrad input).
    Activation,
    /// The layer's weight (fprop and dgrad input).
    Weight,
    /// The gradient of the layer's output (dgrad and wgrad input).
    Gradient,
    /// The fprop output.
    Output,
    /// The wgrad output (the weight's gradient).
    Wgrad,
    /// The dgrad output (the input's gradient).
    Dgrad,
}

impl TensorName {
    /// Every tensor name, inputs first.
    pub const ALL: [TensorName; 6] = [
        TensorName::Activation,
        TensorName::Weight,
        TensorName::Gradient,
        TensorName::Output,
        TensorName::Wgrad,
        TensorName::Dgrad,
    ];

    /// The three GEMM inputs.
    pub const INPUTS: [TensorName; 3] = [
        TensorName::Activation,
        TensorName::Weight,
        TensorName::Gradient,
    ];

    /// TE's name, e.g. `activation`.
    pub fn name(self) -> &'static str {
        match self {
            TensorName::Activation => "activation",
            TensorName::Weight => "weight",
            TensorName::Gradient => "gradient",
            TensorName::Output => "output",
            TensorName::Wgrad => "wgrad",
            TensorName::Dgrad => "dgrad",
        }
    }

    /// The tensor of TE's name `name`.
    pub fn from_name(name: &str) -> Option<TensorName> {
        TensorName::ALL.into_iter().find(|t| t.name() == name)
    }

    /// The GEMM-input role of the tensor (None for outputs).
    pub fn role(self) -> Option<TensorRole> {
        match self {
            TensorName::Activation => Some(TensorRole::Activation),
            TensorName::Weight => Some(TensorRole::Weight),
            TensorName::Gradient => Some(TensorRole::Gradient),
            _ => None,
        }
    }

    /// The output tensor of `gemm`.
    pub fn output_of(gemm: Gemm) -> TensorName {
        match gemm {
            Gemm::Fprop => TensorName::Output,
            Gemm::Dgrad => TensorName::Dgrad,
            Gemm::Wgrad => TensorName::Wgrad,
        }
    }

    /// Whether the tensor is a GEMM input (quantized in FP8 GEMMs).
    pub fn is_input(self) -> bool {
        TensorName::INPUTS.contains(&self)
    }
}

impl From<TensorRole> for TensorName {
    fn from(role: TensorRole) -> Self {
        match role {
            TensorRole::Activation => TensorName::Activation,
            TensorRole::Weight => TensorName::Weight,
            TensorRole::Gradient => TensorName::Gradient,
        }
    }
}

impl fmt::Display for TensorName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
