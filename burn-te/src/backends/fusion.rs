//! [`TeBackend`] for Burn's fusion backends (`Fusion<B>`: `burn::backend::Wgpu` and `burn::backend::Cuda` with
//! Burn's default features), so `Te<burn::backend::Wgpu>` keeps Burn's fused kernels for every op but the FP8 ones.
//!
//! Each FP8 op resolves its float inputs to the inner backend's tensors (running the fusion stream up to them, as
//! Burn does before any op it cannot fuse), runs the inner backend's kernel eagerly, and registers a float output
//! back into the fusion stream as an initialized tensor (Burn's `float_from_data` path). FP8 buffers and
//! delayed-scaling states are the inner backend's: they never enter the stream, so the order of the delayed-scaling
//! records and updates is the program's, as without fusion.

use burn::backend::ir::{InitOperationIr, OperationIr, OperationOutput};
use burn::tensor::TensorMetadata;
use burn::tensor::ops::FloatTensor;
use burn_fusion::stream::OperationStreams;
use burn_fusion::{Fusion, FusionBackend, NoOp, get_client};
use burn_te_kernels::{AmaxComputeAlgo, BlockScaleRule, Fp8Format, Fp8Stats, ScaleBlock};

use crate::backend::{Fp8HostData, Fp8Primitive, Scaling, TeBackend};
use crate::error::TeError;

/// The inner backend's tensor behind a fusion tensor (the stream runs up to it first).
fn resolved<B: FusionBackend>(tensor: FloatTensor<Fusion<B>>) -> FloatTensor<B> {
    tensor.client.clone().resolve_tensor_float::<B>(tensor)
}

/// An inner backend's tensor registered into the fusion stream as an initialized tensor.
fn fused<B: FusionBackend>(tensor: FloatTensor<B>) -> FloatTensor<Fusion<B>> {
    let client = get_client::<B>(&B::float_device(&tensor));
    let (shape, dtype) = (tensor.shape(), tensor.dtype());
    let handle = B::float_tensor_handle(tensor);
    let init = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
    client
        .register(
            OperationStreams::default(),
            OperationIr::Init(init),
            NoOp::<B>::new(),
        )
        .output()
}

impl<B: FusionBackend + TeBackend> TeBackend for Fusion<B> {
    type Fp8Data = B::Fp8Data;
    type DelayedState = B::DelayedState;
    type PendingStats = B::PendingStats;

    crate::te_linear_gemms!(fprop dgrad wgrad backward grouped);

    fn fp8_quantize(
        tensor: FloatTensor<Self>,
        format: Fp8Format,
        scaling: Scaling<'_, Self::DelayedState>,
    ) -> Result<Fp8Primitive<Self>, TeError> {
        B::fp8_quantize(resolved::<B>(tensor), format, scaling)
    }

    fn fp8_quantize_block_pair(
        tensor: FloatTensor<Self>,
        format: Fp8Format,
        layouts: [(ScaleBlock, BlockScaleRule); 2],
    ) -> Result<[Fp8Primitive<Self>; 2], TeError> {
        B::fp8_quantize_block_pair(resolved::<B>(tensor), format, layouts)
    }

    fn fp8_read(tensor: &Fp8Primitive<Self>) -> Result<Fp8HostData, TeError> {
        B::fp8_read(tensor)
    }

    fn fp8_dequantize(tensor: Fp8Primitive<Self>) -> Result<FloatTensor<Self>, TeError> {
        Ok(fused::<B>(B::fp8_dequantize(tensor)?))
    }

    fn fp8_gemm(
        lhs: Fp8Primitive<Self>,
        lhs_t: bool,
        rhs: Fp8Primitive<Self>,
        rhs_t: bool,
    ) -> Result<FloatTensor<Self>, TeError> {
        Ok(fused::<B>(B::fp8_gemm(lhs, lhs_t, rhs, rhs_t)?))
    }

    const GROUPED_GEMM_ALONE_FROM: Option<usize> = B::GROUPED_GEMM_ALONE_FROM;

    fn fp8_gemm_grouped(
        gemms: Vec<crate::backend::GroupedGemmOperands<Self>>,
    ) -> Result<Vec<FloatTensor<Self>>, TeError> {
        Ok(B::fp8_gemm_grouped(gemms)?
            .into_iter()
            .map(fused::<B>)
            .collect())
    }

    fn fp8_amax(tensor: FloatTensor<Self>) -> Result<FloatTensor<Self>, TeError> {
        Ok(fused::<B>(B::fp8_amax(resolved::<B>(tensor))?))
    }

    fn fp8_max_block_dynamic_range(
        tensor: FloatTensor<Self>,
        block: ScaleBlock,
    ) -> Result<FloatTensor<Self>, TeError> {
        Ok(fused::<B>(B::fp8_max_block_dynamic_range(
            resolved::<B>(tensor),
            block,
        )?))
    }

    fn fp8_fake_quant(
        tensor: FloatTensor<Self>,
        format: Fp8Format,
        margin: f32,
    ) -> Result<FloatTensor<Self>, TeError> {
        Ok(fused::<B>(B::fp8_fake_quant(
            resolved::<B>(tensor),
            format,
            margin,
        )?))
    }

    fn fp8_stats_launch(
        tensor: FloatTensor<Self>,
        quantization: Option<(Fp8Format, Scaling<'_, Self::DelayedState>)>,
    ) -> Result<Self::PendingStats, TeError> {
        B::fp8_stats_launch(resolved::<B>(tensor), quantization)
    }
    fn fp8_non_finite_launch(tensor: FloatTensor<Self>) -> Result<Self::PendingStats, TeError> {
        B::fp8_non_finite_launch(resolved::<B>(tensor))
    }

    fn fp8_stats_read(pending: Self::PendingStats) -> Result<Fp8Stats, TeError> {
        B::fp8_stats_read(pending)
    }

    fn fp8_stats_read_many(pending: Vec<Self::PendingStats>) -> Result<Vec<Fp8Stats>, TeError> {
        B::fp8_stats_read_many(pending)
    }

    fn fp8_quantization_stats(
        tensor: FloatTensor<Self>,
        format: Fp8Format,
        scale: f32,
    ) -> Result<Fp8Stats, TeError> {
        B::fp8_quantization_stats(resolved::<B>(tensor), format, scale)
    }

    fn fp8_delayed_state_read(state: &Self::DelayedState) -> Result<(Vec<f32>, f32), TeError> {
        B::fp8_delayed_state_read(state)
    }

    fn fp8_delayed_state_load(
        device: &Self::Device,
        history: &[f32],
        scale: f32,
    ) -> Result<Self::DelayedState, TeError> {
        B::fp8_delayed_state_load(device, history, scale)
    }

    fn fp8_delayed_state_len(state: &Self::DelayedState) -> usize {
        B::fp8_delayed_state_len(state)
    }

    fn fp8_delayed_state_update(
        state: &Self::DelayedState,
        algo: AmaxComputeAlgo,
        format: Fp8Format,
        margin: f32,
    ) -> Result<(), TeError> {
        B::fp8_delayed_state_update(state, algo, format, margin)
    }

    /// The fusion tensor's id: shared by clones, distinct for live tensors (reading the buffer would run the
    /// stream).
    fn buffer_id(tensor: &FloatTensor<Self>) -> Option<u64> {
        Some(crate::hash::hash_of(&tensor.id))
    }
}
