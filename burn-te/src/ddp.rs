//! Burn's data-parallel training (its `distributed` feature, burn-train's DDP strategy) over backend decorators:
//! [`forward_distributed_backend!`](crate::forward_distributed_backend) makes `Te<B>` (and `Debug<B>`) a
//! `DistributedBackend` when `B` is one, so `Autodiff<Te<B>>` stays an `AutodiffBackend` with Burn's
//! `distributed` feature on.
//!
//! What runs where (Burn 0.21, CubeCL 0.10): the gradient all-reduce across devices is the runtime's own —
//! NCCL on CUDA; CubeCL's wgpu runtime has none (`unimplemented!()` deep in CubeCL), and Burn's CPU backends
//! (Flex, NdArray) are not `DistributedBackend`s at all. So here:
//! - one device: the all-reduce of a gradient over one device is the gradient itself, on every runtime (Burn's
//!   sync server still runs, the runtime is not asked);
//! - several devices on CUDA: Burn's NCCL all-reduce;
//! - several devices on a runtime without one: [`start_communication_server`] fails at once, naming the runtime
//!   and what to use instead ([`crate::distributed`]'s peers over burn-collective), rather than a panic inside
//!   the sync server's thread at the first backward.

use burn::tensor::backend::distributed::{
    DistributedBackend, DistributedConfig, ReduceOperation, start_distributed_sync_server,
};
use burn::tensor::backend::{Backend, DeviceId};
use burn::tensor::ops::FloatTensor;

/// Whether Burn's `DistributedBackend` `B` all-reduces across devices natively on `device`'s runtime (CubeCL
/// 0.10: CUDA, through NCCL).
pub fn native_all_reduce<B: Backend>(device: &B::Device) -> bool {
    B::name(device).contains("cuda")
}

/// Starts Burn's gradient sync server for the decorator `D` over `devices` (inner backend `B`); panics with what
/// to do instead when several devices need an all-reduce the runtime does not have.
pub fn start_communication_server<D: DistributedBackend, B: Backend<Device = D::Device>>(
    devices: &[D::Device],
    config: DistributedConfig,
) {
    if devices.len() > 1 && !native_all_reduce::<B>(&devices[0]) {
        panic!(
            "burn-te: Burn's data-parallel training across {} devices needs the runtime's collective all-reduce, \
             which CubeCL 0.10 has on CUDA (NCCL) only; `{}` has none. Train on one device, or run one peer per \
             device with burn_te::distributed (burn-collective; see the README's \"Distributed\").",
            devices.len(),
            B::name(&devices[0]),
        );
    }
    start_distributed_sync_server::<D>(devices, config);
}

/// `B`'s all-reduce of `tensor` over the devices `device_ids`; over one device (any runtime) the tensor itself.
pub fn all_reduce<B: DistributedBackend>(
    tensor: FloatTensor<B>,
    op: ReduceOperation,
    device_ids: Vec<DeviceId>,
) -> FloatTensor<B> {
    if device_ids.len() <= 1 {
        // Sum and mean over one device.
        return tensor;
    }
    // Safety: the handle is wrapped again into the decorator's `CollectiveTensor` (forward_distributed_backend!),
    // whose `resolve` syncs through `sync_collective` below before anyone uses it.
    unsafe { B::all_reduce(tensor, op, device_ids).assume_resolved() }
}

/// `B`'s sync of the collectives launched on `device` (nothing to wait for without a native all-reduce: only
/// one-device reductions ran).
pub fn sync_collective<B: DistributedBackend>(device: &B::Device) {
    if native_all_reduce::<B>(device) {
        B::sync_collective(device);
    }
}

/// Implements Burn's `DistributedBackend` for a backend decorator `$decorator<B>` (see [`crate::forward_backend!`])
/// whose inner backend is one: the gradient sync server is the decorator's own, the all-reduce and its sync are
/// the inner backend's (see [`crate::ddp`]).
#[macro_export]
macro_rules! forward_distributed_backend {
    ($decorator:ident) => {
        const _: () = {
            use $crate::__private::burn::tensor::backend::distributed::{
                CollectiveTensor, DistributedBackend, DistributedConfig, ReduceOperation,
            };
            use $crate::__private::burn::tensor::ops::FloatTensor;

            impl<B: DistributedBackend> DistributedBackend for $decorator<B>
            where
                $decorator<B>: $crate::Decorator<Inner = B>,
            {
                fn start_communication_server(devices: &[B::Device], config: DistributedConfig) {
                    $crate::ddp::start_communication_server::<Self, B>(devices, config);
                }

                fn all_reduce(
                    tensor: FloatTensor<Self>,
                    op: ReduceOperation,
                    device_ids: Vec<$crate::__private::burn::tensor::backend::DeviceId>,
                ) -> CollectiveTensor<Self> {
                    CollectiveTensor::new($crate::ddp::all_reduce::<B>(tensor, op, device_ids))
                }

                fn sync_collective(device: &B::Device) {
                    $crate::ddp::sync_collective::<B>(device);
                }
            }
        };
    };
}
