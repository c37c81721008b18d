//! Burn's data-parallel training (`--features ddp`, Burn's `distributed` feature) over `Te<B>` and
//! `Debug<Te<B>>`: `Autodiff` of either is an `AutodiffBackend` on wgpu and on the CPU backends (where Burn's own
//! `Autodiff<Flex>` is not), a model whose parameters are marked distributed (as burn-train's DDP strategy marks
//! them) goes through Burn's gradient sync server and gets the gradients of the plain run bit for bit on one
//! device; burn-train's DDP strategy (`ExecutionStrategy::ddp`) accepts `Autodiff<Te<Wgpu>>` and
//! `Autodiff<Te<Flex>>` and trains a TE model on one device to the weights its single-device strategy gives
//! (burn-train 0.21 issued no gradient all-reduce in that one-device run: the sync server's path is the first
//! test's); several wgpu or Flex devices fail at once with a clear error (neither runtime has an all-reduce).

use std::sync::{Arc, Mutex};

use burn::backend::flex::FlexDevice;
use burn::backend::ndarray::NdArrayDevice;
use burn::backend::wgpu::WgpuDevice;
use burn::backend::{Autodiff, Flex, NdArray};
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::{Module, ModuleMapper, Param};
use burn::optim::SgdConfig;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::backend::distributed::{
    DistributedBackend, DistributedConfig, DistributedParamId, ReduceOperation,
};
use burn::tensor::{Tensor, TensorData};
use burn_te::backends::Wgpu;
use burn_te::nn::{Linear, LinearConfig};
use burn_te::{Float8CurrentScaling, Te, TeBackend, fp8_autocast};
use burn_te_debug::Debug;
use burn_train::metric::LossMetric;
use burn_train::{
    ExecutionStrategy, InferenceStep, Learner, RegressionOutput, SupervisedTraining, TrainOutput,
    TrainStep,
};

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

fn one_device<D: DistributedBackend + TeBackend>(device: D::Device, what: &str)
where
    Autodiff<D>: AutodiffBackend + TeBackend<Device = D::Device>,
{
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
    one_device::<Te<Wgpu>>(device(), "Autodiff<Te<Wgpu>>");
    one_device::<Debug<Te<Wgpu>>>(device(), "Autodiff<Debug<Te<Wgpu>>>");
    // Burn's own fused wgpu backend (`Fusion<CubeBackend<..>>`) under `Te`.
    one_device::<Te<burn::backend::Wgpu>>(device(), "Autodiff<Te<Fusion<Wgpu>>>");
}

/// Burn's CPU backends are not `DistributedBackend`s, so with Burn's `distributed` feature `Autodiff<Flex>` is no
/// `AutodiffBackend`; `Te<Flex>` and `Te<NdArray>` are, on their one device.
#[test]
fn one_device_ddp_syncs_the_gradients_on_the_cpu_backends() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    one_device::<Te<Flex>>(FlexDevice, "Autodiff<Te<Flex>>");
    one_device::<Debug<Te<Flex>>>(FlexDevice, "Autodiff<Debug<Te<Flex>>>");
    one_device::<Te<NdArray>>(NdArrayDevice::Cpu, "Autodiff<Te<NdArray>>");
}

/// The panic message of starting Burn's gradient sync server for `D` over `devices`.
fn start_refusal<D: DistributedBackend>(devices: &[D::Device]) -> String {
    let panic = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        D::start_communication_server(
            devices,
            DistributedConfig {
                all_reduce_op: ReduceOperation::Mean,
            },
        )
    }))
    .expect_err("a runtime without an all-reduce across devices");
    panic.downcast_ref::<String>().cloned().unwrap_or_default()
}

#[test]
fn ddp_across_devices_without_an_all_reduce_fails_at_once_with_what_to_do() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    for (message, runtime) in [
        (start_refusal::<Te<Wgpu>>(&[device(), device()]), "wgpu"),
        (
            start_refusal::<Debug<Te<Flex>>>(&[FlexDevice, FlexDevice]),
            "flex",
        ),
    ] {
        assert!(
            message.contains("across 2 devices")
                && message.contains("CUDA (NCCL)")
                && message.to_lowercase().contains(runtime)
                && message.contains("burn_te::distributed"),
            "{message}"
        );
    }
}

/// A TE linear regressor for burn-train.
#[derive(Module, Debug)]
struct Regressor<B: burn::tensor::backend::Backend> {
    fc: Linear<B>,
}

#[derive(Clone, Debug)]
struct Batch<B: burn::tensor::backend::Backend> {
    x: Tensor<B, 2>,
    y: Tensor<B, 2>,
}

#[derive(Clone)]
struct Rows;

impl<B: burn::tensor::backend::Backend> Batcher<B, (Vec<f32>, Vec<f32>), Batch<B>> for Rows {
    fn batch(&self, items: Vec<(Vec<f32>, Vec<f32>)>, device: &B::Device) -> Batch<B> {
        let n = items.len();
        let x: Vec<f32> = items.iter().flat_map(|(x, _)| x.clone()).collect();
        let y: Vec<f32> = items.iter().flat_map(|(_, y)| y.clone()).collect();
        Batch {
            x: Tensor::from_data(TensorData::new(x, [n, 32]), device),
            y: Tensor::from_data(TensorData::new(y, [n, 16]), device),
        }
    }
}

impl<B: burn::tensor::backend::Backend + TeBackend> Regressor<B> {
    fn output(&self, batch: Batch<B>) -> RegressionOutput<B> {
        let out = fp8_autocast(true, Float8CurrentScaling::default(), || {
            self.fc.forward(batch.x)
        })
        .expect("a valid recipe");
        let loss = (out.clone() - batch.y.clone()).square().mean();
        RegressionOutput::new(loss, out, batch.y)
    }
}

impl<B: AutodiffBackend + TeBackend> TrainStep for Regressor<B> {
    type Input = Batch<B>;
    type Output = RegressionOutput<B>;
    fn step(&self, batch: Batch<B>) -> TrainOutput<RegressionOutput<B>> {
        let item = self.output(batch);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl<B: burn::tensor::backend::Backend + TeBackend> InferenceStep for Regressor<B> {
    type Input = Batch<B>;
    type Output = RegressionOutput<B>;
    fn step(&self, batch: Batch<B>) -> RegressionOutput<B> {
        self.output(batch)
    }
}

/// `count` rows of a linear target with noise-free inputs (a fixed LCG).
fn rows(count: usize, seed: u64) -> Vec<(Vec<f32>, Vec<f32>)> {
    let mut state = seed;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    (0..count)
        .map(|_| {
            let x: Vec<f32> = (0..32).map(|_| next()).collect();
            let y: Vec<f32> = (0..16).map(|j| x[j] - 0.5 * x[j + 16]).collect();
            (x, y)
        })
        .collect()
}

/// Trains the regressor on `device` for two epochs with burn-train under `strategy` (the single-device default if
/// `None`); the trained weight, as bits.
fn fit<A: AutodiffBackend + TeBackend>(
    device: &A::Device,
    strategy: Option<ExecutionStrategy<A>>,
    name: &str,
) -> Vec<u32>
where
    A::InnerBackend: TeBackend,
{
    A::seed(device, 0);
    let model = Regressor {
        fc: LinearConfig::new(32, 16)
            .with_name(Some("fc".into()))
            .init::<A>(device),
    };
    let train = DataLoaderBuilder::new(Rows)
        .batch_size(8)
        .build(InMemDataset::new(rows(64, 1)));
    let valid = DataLoaderBuilder::new(Rows)
        .batch_size(8)
        .build(InMemDataset::new(rows(16, 2)));
    let dir = std::env::temp_dir().join(format!("burn-te-ddp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut training = SupervisedTraining::new(dir.to_str().unwrap(), train, valid)
        .metric_train_numeric(LossMetric::new())
        .num_epochs(2);
    if let Some(strategy) = strategy {
        training = training.with_training_strategy(strategy.into());
    }
    let result = training.launch(Learner::new(model, SgdConfig::new().init(), 0.05));
    values(result.model.fc.weight.val())
}

/// burn-train's DDP strategy on `device` trains to the single-device strategy's weights, bit for bit.
fn ddp_trains_as_one_device<A: AutodiffBackend + TeBackend + DistributedBackend>(
    device: A::Device,
    what: &str,
) where
    A::InnerBackend: TeBackend,
{
    let single = fit::<A>(&device, None, &format!("{what}-single"));
    let config = DistributedConfig {
        all_reduce_op: ReduceOperation::Mean,
    };
    let strategy = ExecutionStrategy::ddp(vec![device.clone()], config);
    let (ddp, panics) = panics_during(|| fit::<A>(&device, Some(strategy), &format!("{what}-ddp")));
    assert!(
        panics.is_empty(),
        "{what}: panics during the DDP training: {panics:?}"
    );
    assert_eq!(
        ddp, single,
        "{what}: the weights trained by DDP on one device and by the single-device strategy"
    );
}

#[test]
fn burn_train_ddp_on_one_device_trains_as_the_single_device_strategy() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    ddp_trains_as_one_device::<Autodiff<Te<Wgpu>>>(device(), "wgpu");
    ddp_trains_as_one_device::<Autodiff<Te<Flex>>>(FlexDevice, "flex");
}
