//! Burn's data-parallel training (its `distributed` feature, burn-train's DDP strategy) over backend decorators:
//! [`forward_distributed_backend!`](crate::forward_distributed_backend) makes `Te<B>` (and `Debug<B>`) a
//! `DistributedBackend` for every inner backend `B` that is a [`DdpInner`], so `Autodiff<Te<B>>` stays an
//! `AutodiffBackend` with Burn's `distributed` feature on.
//!
//! What runs where (Burn 0.21, CubeCL 0.10): the gradient all-reduce across devices is the runtime's own —
//! NCCL on CUDA; CubeCL's wgpu runtime has none (`unimplemented!()` deep in CubeCL), and Burn's CPU backends
//! (Flex, NdArray) are not `DistributedBackend`s at all, so with Burn's `distributed` feature on, `Autodiff<Flex>`
//! does not compile. `Te<Flex>` and `Te<NdArray>` are `DistributedBackend`s all the same (one device, below),
//! so one program can train with burn-train's DDP on GPUs and fall back to the CPU. So here:
//! - one device: the all-reduce of a gradient over one device is the gradient itself, on every runtime (Burn's
//!   sync server still runs, the runtime is not asked);
//! - several devices on CUDA: Burn's NCCL all-reduce;
//! - several devices on a runtime without one: [`start_communication_server`] fails at once, naming the runtime
//!   and what to use instead ([`crate::distributed`]'s peers over burn-collective), rather than a panic inside
//!   the sync server's thread at the first backward.

use burn::backend::NdArray;
use burn::tensor::backend::distributed::{
    DistributedBackend, DistributedConfig, ReduceOperation, start_distributed_sync_server,
};
use burn::tensor::backend::{Backend, DeviceId};
use burn::tensor::ops::FloatTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

/// An inner backend that a decorator can make a `DistributedBackend` ([`crate::forward_distributed_backend!`]):
/// Burn's CubeCL backends, fused or not, with their runtime's all-reduce, and its CPU backends on one device.
pub trait DdpInner: Backend {
    /// Whether the backend all-reduces across devices natively on `device`'s runtime (CubeCL 0.10: CUDA, through
    /// NCCL).
    fn native_all_reduce(device: &Self::Device) -> bool;

    /// The all-reduce of `tensor` over the devices `device_ids`, resolved; over one device the tensor itself.
    fn ddp_all_reduce(
        tensor: FloatTensor<Self>,
        op: ReduceOperation,
        device_ids: Vec<DeviceId>,
    ) -> FloatTensor<Self>;

    /// Waits for the collectives launched on `device`.
    fn ddp_sync_collective(device: &Self::Device);
}

/// [`DdpInner`] for a Burn `DistributedBackend`: its own all-reduce across devices.
macro_rules! ddp_inner_by_burn {
    () => {
        fn native_all_reduce(device: &Self::Device) -> bool {
            Self::name(device).contains("cuda")
        }

        fn ddp_all_reduce(
            tensor: FloatTensor<Self>,
            op: ReduceOperation,
            device_ids: Vec<DeviceId>,
        ) -> FloatTensor<Self> {
            all_reduce::<Self>(tensor, op, device_ids)
        }

        fn ddp_sync_collective(device: &Self::Device) {
            if Self::native_all_reduce(device) {
                Self::sync_collective(device);
            }
        }
    };
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> DdpInner
    for CubeBackend<R, F, I, BT>
{
    ddp_inner_by_burn!();
}

#[cfg(feature = "fusion")]
impl<B: burn_fusion::FusionBackend + DistributedBackend> DdpInner for burn_fusion::Fusion<B> {
    ddp_inner_by_burn!();
}

/// [`DdpInner`] for a CPU backend, which Burn gives no all-reduce: one device, where the all-reduce is the
/// identity.
macro_rules! ddp_inner_on_one_device {
    ($backend:ty) => {
        impl DdpInner for $backend {
            fn native_all_reduce(_device: &Self::Device) -> bool {
                false
            }

            fn ddp_all_reduce(
                tensor: FloatTensor<Self>,
                _op: ReduceOperation,
                device_ids: Vec<DeviceId>,
            ) -> FloatTensor<Self> {
                // `start_communication_server` refuses several devices of a runtime without an all-reduce, so
                // only a sync server started around it gets here.
                assert!(
                    device_ids.len() <= 1,
                    "burn-te: {} has no all-reduce across {} devices (start the sync server through the \
                     decorator: it refuses several devices)",
                    core::any::type_name::<Self>(),
                    device_ids.len()
                );
                tensor
            }

            fn ddp_sync_collective(_device: &Self::Device) {}
        }
    };
}

#[cfg(feature = "flex")]
ddp_inner_on_one_device!(burn::backend::Flex);
ddp_inner_on_one_device!(NdArray);

/// Starts Burn's gradient sync server for the decorator `D` over `devices` (inner backend `B`); panics with what
/// to do instead when several devices need an all-reduce the runtime does not have.
pub fn start_communication_server<D: DistributedBackend, B: DdpInner<Device = D::Device>>(
    devices: &[D::Device],
    config: DistributedConfig,
) {
    if devices.len() > 1 && !B::native_all_reduce(&devices[0]) {
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
fn all_reduce<B: DistributedBackend>(
    tensor: FloatTensor<B>,
    op: ReduceOperation,
    device_ids: Vec<DeviceId>,
) -> FloatTensor<B> {
    if device_ids.len() <= 1 {
        // Sum and mean over one device.
        return tensor;
    }
    // Safety: the handle is wrapped again into the decorator's `CollectiveTensor` (forward_distributed_backend!),
    // whose `resolve` syncs through `ddp_sync_collective` before anyone uses it.
    unsafe { B::all_reduce(tensor, op, device_ids).assume_resolved() }
}

/// Implements Burn's `DistributedBackend` for a backend decorator `$decorator<B>` (see [`crate::forward_backend!`])
/// whose inner backend is a [`DdpInner`], and [`DdpInner`] for it (so decorators stack): the gradient sync server
/// is the decorator's own, the all-reduce and its sync are the inner backend's (see [`crate::decorators::ddp`]).
#[macro_export]
macro_rules! forward_distributed_backend {
    ($decorator:ident) => {
        const _: () = {
            use $crate::__private::burn::tensor::backend::DeviceId;
            use $crate::__private::burn::tensor::backend::distributed::{
                CollectiveTensor, DistributedBackend, DistributedConfig, ReduceOperation,
            };
            use $crate::__private::burn::tensor::ops::FloatTensor;
            use $crate::decorators::ddp::DdpInner;

            impl<B: DdpInner> DistributedBackend for $decorator<B>
            where
                $decorator<B>: $crate::Decorator<Inner = B>,
            {
                fn start_communication_server(devices: &[B::Device], config: DistributedConfig) {
                    $crate::decorators::ddp::start_communication_server::<Self, B>(devices, config);
                }

                fn all_reduce(
                    tensor: FloatTensor<Self>,
                    op: ReduceOperation,
                    device_ids: Vec<DeviceId>,
                ) -> CollectiveTensor<Self> {
                    CollectiveTensor::new(B::ddp_all_reduce(tensor, op, device_ids))
                }

                fn sync_collective(device: &B::Device) {
                    B::ddp_sync_collective(device);
                }
            }

            impl<B: DdpInner> DdpInner for $decorator<B>
            where
                $decorator<B>: $crate::Decorator<Inner = B>,
            {
                fn native_all_reduce(device: &B::Device) -> bool {
                    B::native_all_reduce(device)
                }

                fn ddp_all_reduce(
                    tensor: FloatTensor<Self>,
                    op: ReduceOperation,
                    device_ids: Vec<DeviceId>,
                ) -> FloatTensor<Self> {
                    B::ddp_all_reduce(tensor, op, device_ids)
                }

                fn ddp_sync_collective(device: &B::Device) {
                    B::ddp_sync_collective(device);
                }
            }
        };
    };
}
