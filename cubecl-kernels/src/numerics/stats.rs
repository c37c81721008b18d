//! Statistics records produced by the one-pass statistics kernels (and the host path), their exact merging, and
//! the derived stats of Transformer Engine's LogTensorStats and LogFp8TensorStats.

use crate::Fp8Format;

/// Mergeable statistics of a tensor, from one read of it.
///
/// Non-finite elements are counted apart (`nan_count`, `pos_inf_count`, `neg_inf_count`); the moments, the l1 sum
/// and min/max are over the finite elements, so every runtime gives the same answer whatever its shader compiler
/// does with NaN. The derived stats ([`mean`](Self::mean), [`std`](Self::std), ...) then follow IEEE/PyTorch
/// semantics: a NaN anywhere makes them NaN, an infinity makes sums and norms infinite.
///
/// Records of different tensors or micro-batches merge exactly with [`merge`](Self::merge): counts and sums add,
/// min/max combine, and mean/M2 use Chan's parallel formula (correct also when the groups' means differ, unlike
/// the formula in Transformer Engine's reduction).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TensorStats {
    /// Number of elements.
    pub numel: u64,
    /// Number of finite elements.
    pub finite_count: u64,
    /// Mean of the finite elements (0 if none).
    pub finite_mean: f64,
    /// Sum of squared deviations from `finite_mean` of the finite elements.
    pub finite_m2: f64,
    /// Sum of |x| over the finite elements.
    pub finite_l1: f64,
    /// Smallest finite element (+inf if none).
    pub finite_min: f64,
    /// Largest finite element (-inf if none).
    pub finite_max: f64,
    /// Smallest nonzero |x| over the finite elements (+inf if none).
    pub min_nonzero_abs: f64,
    /// Number of elements that are not ±0 (NaN and ±inf count as nonzero, as in `torch.count_nonzero`).
    pub nonzero_count: u64,
    /// Number of NaN elements.
    pub nan_count: u64,
    /// Number of +inf elements.
    pub pos_inf_count: u64,
    /// Number of -inf elements.
    pub neg_inf_count: u64,
}

impl Default for TensorStats {
    fn default() -> Self {
        Self::EMPTY
    }
}

impl TensorStats {
    /// The statistics of a tensor with no elements; the identity of [`merge`](Self::merge).
    pub const EMPTY: TensorStats = TensorStats {
        numel: 0,
        finite_count: 0,
        finite_mean: 0.0,
        finite_m2: 0.0,
        finite_l1: 0.0,
        finite_min: f64::INFINITY,
        finite_max: f64::NEG_INFINITY,
        min_nonzero_abs: f64::INFINITY,
        nonzero_count: 0,
        nan_count: 0,
        pos_inf_count: 0,
        neg_inf_count: 0,
    };

    /// Adds one element (Welford's update in f64).
    pub fn push(&mut self, x: f64) {
        self.numel += 1;
        if x != 0.0 {
            self.nonzero_count += 1;
        }
        if x.is_nan() {
            self.nan_count += 1;
        } else if x == f64::INFINITY {
            self.pos_inf_count += 1;
        } else if x == f64::NEG_INFINITY {
            self.neg_inf_count += 1;
        } else {
            self.finite_count += 1;
            let delta = x - self.finite_mean;
            self.finite_mean += delta / self.finite_count as f64;
            self.finite_m2 += delta * (x - self.finite_mean);
            self.finite_l1 += x.abs();
            self.finite_min = self.finite_min.min(x);
            self.finite_max = self.finite_max.max(x);
            if x != 0.0 {
                self.min_nonzero_abs = self.min_nonzero_abs.min(x.abs());
            }
        }
    }

    /// The statistics of the two groups together (Chan et al.'s parallel update for mean and M2).
    pub fn merge(&self, other: &TensorStats) -> TensorStats {
        let (n_a, n_b) = (self.finite_count as f64, other.finite_count as f64);
        let (finite_mean, finite_m2) = if other.finite_count == 0 {
            (self.finite_mean, self.finite_m2)
        } else if self.finite_count == 0 {
            (other.finite_mean, other.finite_m2)
        } else {
            let n = n_a + n_b;
            let delta = other.finite_mean - self.finite_mean;
            (
                self.finite_mean + delta * (n_b / n),
                self.finite_m2 + other.finite_m2 + delta * delta * (n_a * n_b / n),
            )
        };
        TensorStats {
            numel: self.numel + other.numel,
            finite_count: self.finite_count + other.finite_count,
            finite_mean,
            finite_m2,
            finite_l1: self.finite_l1 + other.finite_l1,
            finite_min: self.finite_min.min(other.finite_min),
            finite_max: self.finite_max.max(other.finite_max),
            min_nonzero_abs: self.min_nonzero_abs.min(other.min_nonzero_abs),
            nonzero_count: self.nonzero_count + other.nonzero_count,
            nan_count: self.nan_count + other.nan_count,
            pos_inf_count: self.pos_inf_count + other.pos_inf_count,
            neg_inf_count: self.neg_inf_count + other.neg_inf_count,
        }
    }

    /// Whether the tensor had no elements (every derived stat is then `None`).
    pub fn is_empty(&self) -> bool {
        self.numel == 0
    }

    fn has_nan(&self) -> bool {
        self.nan_count > 0
    }

    fn has_inf(&self) -> bool {
        self.pos_inf_count + self.neg_inf_count > 0
    }

    fn defined(&self, value: f64) -> Option<f64> {
        (!self.is_empty()).then_some(value)
    }

    /// Smallest element; NaN if any element is NaN.
    pub fn min(&self) -> Option<f64> {
        self.defined(if self.has_nan() {
            f64::NAN
        } else if self.neg_inf_count > 0 {
            f64::NEG_INFINITY
        } else if self.finite_count > 0 {
            self.finite_min
        } else {
            f64::INFINITY
        })
    }

    /// Largest element; NaN if any element is NaN.
    pub fn max(&self) -> Option<f64> {
        self.defined(if self.has_nan() {
            f64::NAN
        } else if self.pos_inf_count > 0 {
            f64::INFINITY
        } else if self.finite_count > 0 {
            self.finite_max
        } else {
            f64::NEG_INFINITY
        })
    }

    /// Sum of the elements.
    pub fn sum(&self) -> Option<f64> {
        self.defined(
            if self.has_nan() || (self.pos_inf_count > 0 && self.neg_inf_count > 0) {
                f64::NAN
            } else if self.pos_inf_count > 0 {
                f64::INFINITY
            } else if self.neg_inf_count > 0 {
                f64::NEG_INFINITY
            } else {
                self.finite_mean * self.finite_count as f64
            },
        )
    }

    /// Mean of the elements.
    pub fn mean(&self) -> Option<f64> {
        if self.has_nan() || self.has_inf() {
            return self.sum();
        }
        self.defined(self.finite_mean)
    }

    /// Unbiased variance (divides by n - 1, as `torch.var`); NaN for one element or any non-finite element.
    pub fn variance(&self) -> Option<f64> {
        self.defined(if self.has_nan() || self.has_inf() || self.numel < 2 {
            f64::NAN
        } else {
            self.finite_m2 / (self.numel - 1) as f64
        })
    }

    /// Unbiased standard deviation (as `torch.std`, TE's `std` stat).
    pub fn std(&self) -> Option<f64> {
        self.variance().map(f64::sqrt)
    }

    /// Sum of x².
    pub fn sum_of_squares(&self) -> Option<f64> {
        self.defined(if self.has_nan() {
            f64::NAN
        } else if self.has_inf() {
            f64::INFINITY
        } else {
            self.finite_m2 + self.finite_count as f64 * self.finite_mean * self.finite_mean
        })
    }

    /// Sum of |x| (TE's `l1_norm`).
    pub fn l1_norm(&self) -> Option<f64> {
        self.defined(if self.has_nan() {
            f64::NAN
        } else if self.has_inf() {
            f64::INFINITY
        } else {
            self.finite_l1
        })
    }

    /// Euclidean norm (TE's `l2_norm`).
    pub fn l2_norm(&self) -> Option<f64> {
        self.sum_of_squares().map(f64::sqrt)
    }

    /// max |x| (TE's `cur_amax`); NaN if any element is NaN.
    pub fn amax(&self) -> Option<f64> {
        self.defined(if self.has_nan() {
            f64::NAN
        } else if self.has_inf() {
            f64::INFINITY
        } else if self.finite_count > 0 {
            self.finite_min.abs().max(self.finite_max.abs())
        } else {
            0.0
        })
    }

    /// `log2(max nonzero |x|) - log2(min nonzero |x|)` (TE's `dynamic_range`); 0 when no element is nonzero. With
    /// an infinity the top is inf: the range is inf, or inf - inf = NaN when every nonzero element is infinite (as
    /// PyTorch evaluates TE's formula).
    pub fn dynamic_range(&self) -> Option<f64> {
        self.defined(if self.has_nan() {
            f64::NAN
        } else if self.has_inf() {
            // min_nonzero_abs is over the finite elements: +inf when there is none, giving NaN.
            f64::INFINITY - self.min_nonzero_abs.log2()
        } else if self.min_nonzero_abs.is_finite() {
            self.amax().unwrap_or(0.0).log2() - self.min_nonzero_abs.log2()
        } else {
            0.0
        })
    }
}

/// [`TensorStats`] plus what quantizing the tensor with a given FP8 format and scale would do to it.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Fp8Stats {
    /// The high-precision statistics.
    pub tensor: TensorStats,
    /// Elements that are nonzero but whose code is ±0.
    pub underflow_count: u64,
    /// Elements with `|x| > fp8_max * scale_inv` (±inf included).
    pub overflow_count: u64,
    /// Sum of `(x - dequantize(quantize(x)))²` over the finite elements.
    pub squared_error_sum: f64,
    /// Smallest `scale_inv` the quantization applied (+inf for no elements): the tensor's one, or the smallest
    /// over its blocks.
    pub scale_inv_min: f64,
    /// Largest `scale_inv` the quantization applied (-inf for no elements).
    pub scale_inv_max: f64,
    /// Statistics of the `scale_inv` values themselves, one per block (one for a per-tensor scale): their std is
    /// the debug tools' `scale_inv_std`. Merging keeps them exact across tensors and micro-batches.
    pub scale_inv_stats: TensorStats,
}

impl Fp8Stats {
    /// The FP8 statistics of a tensor with no elements.
    pub const EMPTY: Fp8Stats = Fp8Stats {
        tensor: TensorStats::EMPTY,
        underflow_count: 0,
        overflow_count: 0,
        squared_error_sum: 0.0,
        scale_inv_min: f64::INFINITY,
        scale_inv_max: f64::NEG_INFINITY,
        scale_inv_stats: TensorStats::EMPTY,
    };

    /// The same statistics with `scale_inv_stats` over these `scale_inv` values (one per block, or the tensor's one).
    pub fn with_scale_invs(self, scale_invs: impl IntoIterator<Item = f32>) -> Fp8Stats {
        let mut scale_inv_stats = TensorStats::EMPTY;
        for scale_inv in scale_invs {
            scale_inv_stats.push(f64::from(scale_inv));
        }
        Fp8Stats {
            scale_inv_stats,
            ..self
        }
    }

    /// Adds one element quantized as `code` with `scale` and `scale_inv` in `format` (the host path; the kernels
    /// do the same).
    pub fn push(&mut self, x: f32, code: u8, format: Fp8Format, scale_inv: f32) {
        self.tensor.push(x as f64);
        self.scale_inv_min = self.scale_inv_min.min(scale_inv as f64);
        self.scale_inv_max = self.scale_inv_max.max(scale_inv as f64);
        if x != 0.0 && code & 0x7f == 0 {
            self.underflow_count += 1;
        }
        if !x.is_nan() && x.abs() > format.max() * scale_inv {
            self.overflow_count += 1;
        }
        if x.is_finite() {
            let error = x - format.decode(code) * scale_inv;
            self.squared_error_sum += (error * error) as f64;
        }
    }

    /// The statistics of the two groups together.
    pub fn merge(&self, other: &Fp8Stats) -> Fp8Stats {
        Fp8Stats {
            tensor: self.tensor.merge(&other.tensor),
            underflow_count: self.underflow_count + other.underflow_count,
            overflow_count: self.overflow_count + other.overflow_count,
            squared_error_sum: self.squared_error_sum + other.squared_error_sum,
            scale_inv_min: self.scale_inv_min.min(other.scale_inv_min),
            scale_inv_max: self.scale_inv_max.max(other.scale_inv_max),
            scale_inv_stats: self.scale_inv_stats.merge(&other.scale_inv_stats),
        }
    }

    fn percent(&self, count: u64) -> Option<f64> {
        let numel = self.tensor.numel;
        (numel > 0).then(|| 100.0 * count as f64 / numel as f64)
    }

    /// `100 * #(x != 0 and q == ±0) / numel` (TE's `underflows%`; never negative).
    pub fn underflows_percent(&self) -> Option<f64> {
        self.percent(self.underflow_count)
    }

    /// `100 * #(|x| > fp8_max * scale_inv) / numel` (TE's `overflows%`).
    pub fn overflows_percent(&self) -> Option<f64> {
        self.percent(self.overflow_count)
    }

    /// `mean((x - dequantize(quantize(x)))²)` (TE's `mse`); NaN or inf when the tensor has such elements.
    pub fn mse(&self) -> Option<f64> {
        let t = &self.tensor;
        t.defined(if t.has_nan() {
            f64::NAN
        } else if t.has_inf() {
            f64::INFINITY
        } else {
            self.squared_error_sum / t.numel as f64
        })
    }
}
