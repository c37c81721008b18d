//! Data parallelism: a model's gradients averaged over every peer of the group — threads, processes and machines
//! alike — every step, as PyTorch's DDP does ([`Peer::all_reduce_gradients`]).
//!
//! The gradients travel on burn-collective, on the same exchange as the amax and statistics reductions (its local
//! server between threads, its global orchestrator between processes): every gradient of the step together, in
//! buckets of [`PeerConfig::gradient_bucket`](super::PeerConfig::gradient_bucket) values, summed in `f64` (exact
//! for two peers' `f32` values, and for more unless their magnitudes lie more than 2²⁹ apart), then divided by the
//! world size and rounded once to the gradient's dtype. So every peer gets the same bits, whatever order the
//! reduction adds in, and a failed peer stops the others after the group's timeout instead of hanging them.

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, FloatDType, Tensor, TensorData};

use super::Peer;
use crate::error::TeError;

/// One parameter's gradient on its way through the all-reduce.
struct Entry<B: Backend> {
    id: ParamId,
    dims: Vec<usize>,
    device: B::Device,
    dtype: DType,
    /// This peer's gradient, flattened (`None`: the parameter got none here).
    local: Option<Tensor<B, 1>>,
    /// The average over the peers (`None`: no peer had a gradient).
    reduced: Option<Vec<f32>>,
}

/// Takes every float parameter's gradient out of `grads`, in the module's order (the same at every peer).
struct TakeGradients<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    entries: Vec<Entry<B::InnerBackend>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for TakeGradients<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let local = self.grads.remove::<B::InnerBackend, D>(param.id);
        let value = param.val();
        let (device, dtype) = match &local {
            Some(grad) => (grad.device(), grad.dtype()),
            None => (value.device(), value.dtype()),
        };
        let dims = value.dims();
        let numel = dims.iter().product::<usize>();
        self.entries.push(Entry {
            id: param.id,
            dims: dims.to_vec(),
            device,
            dtype,
            local: local.map(|grad| grad.reshape([numel])),
            reduced: None,
        });
    }
}

/// Puts the averaged gradients back into `grads`, in the order [`TakeGradients`] took them.
struct PutGradients<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    entries: std::vec::IntoIter<Entry<B::InnerBackend>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for PutGradients<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(entry) = self.entries.next() else {
            return;
        };
        debug_assert_eq!(entry.id, param.id);
        let Some(values) = entry.reduced else {
            return;
        };
        let dims: [usize; D] = entry.dims.try_into().expect("the parameter's rank");
        let data = TensorData::new(values, dims);
        let grad = Tensor::<B::InnerBackend, D>::from_data(data, (&entry.device, entry.dtype));
        self.grads.register::<B::InnerBackend, D>(entry.id, grad);
    }
}

impl Peer {
    /// Averages the gradients `grads` of `module` over every peer of the group (PyTorch DDP's all-reduce), so the
    /// replicas stay identical: each gradient is the mean of the peers' gradients, the same bits at every peer. A
    /// parameter without a gradient at some peer counts as zeros there (DDP's unused parameters); one without a
    /// gradient at every peer stays without (a frozen parameter).
    ///
    /// A collective call, once per step at every peer, with the same model (the parameters are matched by their
    /// order in the module); it fails after the group's timeout when a peer does not make it, like the other
    /// exchanges (see the [module docs](super)). With one peer, `grads` comes back unchanged.
    pub fn all_reduce_gradients<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        module: &M,
        grads: GradientsParams,
    ) -> Result<GradientsParams, TeError> {
        self.all_reduce_gradients_data_parallel(module, grads, 1)
    }

    /// [`all_reduce_gradients`](Self::all_reduce_gradients) of a model split over tensor-parallel groups of
    /// `tp_size` consecutive ranks (see [`tensor_parallel`](super::tensor_parallel)): each gradient is averaged over
    /// its data-parallel group only, the ranks that hold the same shards (the same index in their tensor-parallel
    /// groups), as Megatron's data-parallel groups do. Every rank of the world calls it; the exchange carries
    /// `tp_size` slots of the gradients, one per shard. An error when `tp_size` does not divide the world.
    pub fn all_reduce_gradients_data_parallel<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        module: &M,
        mut grads: GradientsParams,
        tp_size: usize,
    ) -> Result<GradientsParams, TeError> {
        let world = self.world_size();
        if tp_size == 0 || !world.is_multiple_of(tp_size) {
            return Err(TeError::Collective(format!(
                "a tensor-parallel size of {tp_size} does not divide the world of {world} peers"
            )));
        }
        if world / tp_size == 1 {
            return Ok(grads);
        }
        // This rank's shard's slot: the sums over the world then add up each data-parallel group apart.
        let (slot, slots) = (self.rank() % tp_size, tp_size);
        let in_slot = |values: Vec<f64>| {
            let n = values.len();
            let mut all = vec![0.0; n * slots];
            all[slot * n..(slot + 1) * n].copy_from_slice(&values);
            all
        };
        let of_slot = |sums: Vec<f64>| {
            let n = sums.len() / slots;
            sums[slot * n..(slot + 1) * n].to_vec()
        };
        let mut take = TakeGradients::<B> {
            grads: &mut grads,
            entries: Vec::new(),
        };
        module.visit(&mut take);
        let mut entries = take.entries;

        // Which parameters have a gradient here, and at some peer: one small exchange.
        let here: Vec<bool> = entries.iter().map(|e| e.local.is_some()).collect();
        let flags = here.iter().map(|&h| f64::from(u8::from(h))).collect();
        let present_somewhere =
            of_slot(self.sum("gradient all-reduce (parameters)", in_slot(flags))?);

        // Every parameter's values in the module's order, zeros where this peer has no gradient.
        let numel = |e: &Entry<_>| e.dims.iter().product::<usize>();
        let total: usize = entries.iter().map(numel).sum();
        let mut values = Vec::with_capacity(total);
        let locals: Vec<Tensor<B::InnerBackend, 1>> = entries
            .iter_mut()
            .filter_map(|e| e.local.take().map(|t| t.cast(FloatDType::F32)))
            .collect();
        let mut present = if locals.is_empty() {
            Vec::new()
        } else {
            // One device read for all of them.
            Tensor::cat(locals, 0)
                .try_into_data()
                .map_err(|err| TeError::Read(format!("the gradients: {err:?}")))?
                .to_vec::<f32>()
                .map_err(|err| TeError::Read(format!("the gradients: {err:?}")))?
        }
        .into_iter();
        for (entry, &mine) in entries.iter().zip(&here) {
            let n = numel(entry);
            if mine {
                values.extend(present.by_ref().take(n));
            } else {
                values.extend(std::iter::repeat_n(0.0f32, n));
            }
        }

        // The sums in buckets of at most `PeerConfig::gradient_bucket` values (as DDP's buckets bound what is in
        // flight), each added exactly in f64, averaged and rounded once: the bucketing changes no value.
        let group = (world / tp_size) as f64;
        let mut means = Vec::with_capacity(total);
        for bucket in values.chunks(self.state.gradient_bucket.div_ceil(slots)) {
            let bucket = bucket.iter().map(|&v| f64::from(v)).collect();
            let sum = of_slot(self.sum("gradient all-reduce", in_slot(bucket))?);
            means.extend(sum.into_iter().map(|s| (s / group) as f32));
        }
        let mut means = means.into_iter();
        for (entry, &had) in entries.iter_mut().zip(&present_somewhere) {
            let mean: Vec<f32> = means.by_ref().take(numel(entry)).collect();
            if had > 0.0 {
                entry.reduced = Some(mean);
            }
        }
        let mut put = PutGradients::<B> {
            grads: &mut grads,
            entries: entries.into_iter(),
        };
        module.visit(&mut put);
        Ok(grads)
    }
}
