//! Burn's data-parallel training (`--features ddp`, Burn's `distributed` feature) over `Te<B>` and
//! `Debug<Te<B>>`: `Autodiff` of either is an `AutodiffBackend`, a model whose parameters are marked distributed
//! (as burn-train's DDP strategy marks them) goes through Burn's gradient sync server and gets the gradients of
//! the plain run bit for bit on one wgpu device; several wgpu devices fail at once with a clear error (CubeCL's
//! wgpu runtime has no all-reduce).

use std::sync::{Arc, Mutex};

use burn::backend::Autodiff;
use burn::backend::wgpu::WgpuDevice;
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::backend::distributed::{
    DistributedBackend, DistributedConfig, DistributedParamId, ReduceOperation,
};
use burn::tensor::{Tensor, TensorData};
use burn_te::backends::Wgpu;
use burn_te::nn::{Linear, LinearConfig};
use burn_te::{Float8CurrentScaling, Te, TeBackend, fp8_autocast};
use burn_te_debug::Debug;

/// Marks every parameter distributed, as burn-train's DDP strategy does (`Learner::grad_sharded`).
struct Shard;
impl<B: AutodiffBackend> ModuleMapper<B> for Shard {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let tensor = tensor.set_distributed(DistributedParamId::from(id.val()));
        Param::from_mapped_value(id, tensor, mapper)
    }
}

/// The tests run one at a time: [`panics_during`] sets the process's panic hook.
static SERIAL: Mutex<()> = Mutex::new(());

/// `f`'s result and every panic message of any thread while it ran (CubeCL's device threads catch the panics
/// of the operations they run, e.g. its wgpu runtime's `unimplemented!()` all-reduce: only the hook sees them).
fn panics_during<T>(f: impl FnOnce() -> T) -> (T, Vec<String>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        record.lock().unwrap().push(info.to_string())
    }));
    let out = f();
    let _ = std::panic::take_hook();
    std::panic::set_hook(previous);
    let seen = seen.lock().unwrap().clone();
    (out, seen)
}

fn device() -> WgpuDevice {
    // The first use of the device fails loudly (with wgpu's own message) when there is none.
    WgpuDevice::default()
}

fn values<B: burn::tensor::backend::Backend, const D: usize>(t: Tensor<B, D>) -> Vec<u32> {
    let data = t.into_data().convert::<f32>();
    data.to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// One FP8 training step of `model`: the output and the weight and bias gradients, as bits.
fn step<B: AutodiffBackend + TeBackend>(model: &Linear<B>, device: &B::Device) -> [Vec<u32>; 3] {
    let x: Vec<f32> = (0..24 * 32)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
        .collect();
    let x = Tensor::<B, 2>::from_data(TensorData::new(x, [24, 32]), device);
    let y = fp8_autocast(true, Float8CurrentScaling::default(), || model.forward(x)).unwrap();
    let grads = (y.clone() * y.clone()).sum().backward();
    let dw = model.weight.val().grad(&grads).unwrap();
    let db = model.bias.as_ref().unwrap().val().grad(&grads).unwrap();
    [values(y), values(dw), values(db)]
}

fn one_device<D: DistributedBackend + TeBackend<Device = WgpuDevice>>(what: &str)
where
    Autodiff<D>: AutodiffBackend + TeBackend<Device = WgpuDevice>,
{
    let device = device();
    let model = LinearConfig::new(32, 16)
        .with_name(Some("fc".into()))
        .init::<Autodiff<D>>(&device);
    let plain = step(&model, &device);

    D::start_communication_server(
        std::slice::from_ref(&device),
        DistributedConfig {
            all_reduce_op: ReduceOperation::Mean,
        },
    );
    let sharded = model.map(&mut Shard);
    assert!(sharded.weight.val().is_distributed(), "{what}");
    let (synced, panics) = panics_during(|| step(&sharded, &device));
    D::close_communication_server(&device);
    assert!(
        panics.is_empty(),
        "{what}: panics during the synced step: {panics:?}"
    );
    assert_eq!(
        synced, plain,
        "{what}: the gradients synced over one device are the plain ones"
    );
}

#[test]
fn one_device_ddp_syncs_the_gradients_of_te_and_debug() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    one_device::<Te<Wgpu>>("Autodiff<Te<Wgpu>>");
    one_device::<Debug<Te<Wgpu>>>("Autodiff<Debug<Te<Wgpu>>>");
}

#[test]
fn ddp_across_wgpu_devices_fails_at_once_with_what_to_do() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let device = device();
    let devices = [device.clone(), device];
    let panic = std::panic::catch_unwind(|| {
        Te::<Wgpu>::start_communication_server(
            &devices,
            DistributedConfig {
                all_reduce_op: ReduceOperation::Mean,
            },
        )
    })
    .expect_err("wgpu has no all-reduce across devices");
    let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        message.contains("across 2 devices")
            && message.contains("CUDA (NCCL)")
            && message.contains("wgpu")
            && message.contains("burn_te::distributed"),
        "{message}"
    );
}
