//! AdvisorProbe: the precision advisor's own statistics of a layer (base namespace, registered with the
//! built-in features).

use crate::config::{FeatureSpec, Need, SCHEDULE_KEYS, Schedule};
use crate::error::{ConfigError, DebugError};
use crate::feature::{DebugTensor, Feature, Inspection};
use crate::routing::Routing;
use crate::tensor::TensorName;

/// The probe's feature name (base namespace).
pub const PROBE: &str = "AdvisorProbe";

/// The advisor's probe: logs `<layer>_activation_kurtosis` (read on the host: one sync per layer at its steps),
/// `<layer>_activation_elements` (`tokens · in`) and `<layer>_weight_out` (`out`) of every layer it selects: the
/// GEMM's FLOPs are `2 · tokens · in · out`.
pub struct AdvisorProbe {
    schedule: Schedule,
}

impl AdvisorProbe {
    /// Builds the feature from its config entry.
    pub fn from_spec(spec: &FeatureSpec) -> Result<Box<dyn Feature>, ConfigError> {
        let items = spec.items(Need::No, Need::No, &[], Some(&SCHEDULE_KEYS))?;
        let schedule = match items.first() {
            Some(item) => item.schedule()?,
            None => Schedule::default(),
        };
        Ok(Box::new(AdvisorProbe { schedule }))
    }
}

impl Feature for AdvisorProbe {
    fn name(&self) -> &str {
        PROBE
    }

    fn inspect_tensor_enabled(
        &self,
        _layer: &str,
        tensor: TensorName,
        iteration: u64,
    ) -> Option<Routing> {
        let probed = tensor == TensorName::Activation || tensor == TensorName::Weight;
        probed
            .then(|| Schedule::routing([&self.schedule], iteration))
            .flatten()
    }

    fn inspect_tensor(
        &self,
        layer: &str,
        tensor: TensorName,
        x: &dyn DebugTensor,
        _iteration: u64,
        out: &mut Inspection,
    ) -> Result<(), DebugError> {
        let shape = x.shape();
        match tensor {
            TensorName::Activation => {
                let values = x.to_vec()?;
                out.log_scalar(format!("{layer}_activation_kurtosis"), kurtosis(&values));
                out.log_scalar(
                    format!("{layer}_activation_elements"),
                    shape.iter().product::<usize>() as f64,
                );
            }
            TensorName::Weight => {
                // Burn's weight is [in, out]: the GEMM's FLOPs are 2 · (tokens · in) · out.
                out.log_scalar(
                    format!("{layer}_weight_out"),
                    shape.last().copied().unwrap_or(0) as f64,
                );
            }
            _ => {}
        }
        Ok(())
    }
}

/// `E[(x − μ)⁴] / σ⁴` over the finite values (3 for a normal distribution; 3 when constant or empty).
pub fn kurtosis(values: &[f32]) -> f64 {
    let finite: Vec<f64> = values
        .iter()
        .filter(|v| v.is_finite())
        .map(|&v| f64::from(v))
        .collect();
    let n = finite.len() as f64;
    if n == 0.0 {
        return 3.0;
    }
    let mean = finite.iter().sum::<f64>() / n;
    let (m2, m4) = finite.iter().fold((0.0, 0.0), |(m2, m4), v| {
        let d = (v - mean) * (v - mean);
        (m2 + d, m4 + d * d)
    });
    let (m2, m4) = (m2 / n, m4 / n);
    if m2 == 0.0 { 3.0 } else { m4 / (m2 * m2) }
}
