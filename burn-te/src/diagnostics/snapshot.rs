//! Snapshots (Neuron's HLO snapshots, in our terms): the inputs and outputs of layer GEMMs at chosen steps, and
//! automatically at the step of the first non-finite value (Neuron 2.1 has no such trigger), written as
//! safetensors with a JSON manifest.
//!
//! ```text
//! <dir>/rank_<r>/iteration_<i>/<layer>.<gemm>.<execution>.safetensors   tensors `activation`, `weight`, `output`, ...
//! <dir>/rank_<r>/iteration_<i>/manifest.json                            op, site, iteration, rank, shapes, dtypes,
//!                                                                       recipe, delayed-scaling scales, why
//! ```
//!
//! In eager mode the op that made the first non-finite value is written at once (`eager_<op>.safetensors`: its float
//! inputs `input0`, `input1`, ... and `output`). Which ranks write ([`SnapshotConfig::ranks`], the rank being the
//! `RANK` environment variable), which layers, and a user filter ([`set_snapshot_filter`]) decide what is written; a
//! disk budget ([`SnapshotConfig::max_bytes`]) stops snapshotting, with an error in the log, before it is exceeded.
//!
//! To snapshot the step of a non-finite value, the step's GEMM tensors are held (not copied) until
//! [`step`](super::step) and dropped there when the step is finite.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use burn::config::Config;
use burn::tensor::backend::DeviceOps;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, TensorData};
use safetensors::Dtype;
use safetensors::tensor::TensorView;

use super::nonfinite::NonFiniteOrigin;
use super::{DiagnosticsError, flags, iteration, rank};
use crate::backend::TeBackend;
use crate::fp8_state::site::GemmSite;
use crate::gemm::TensorRole;
use crate::metrics;
use crate::recipe::Recipe;

/// Where and when snapshots are written.
#[derive(Config, Debug)]
pub struct SnapshotConfig {
    /// The snapshot directory (`<dir>/rank_<r>/iteration_<i>/`).
    #[config(default = "\"./snapshots\".to_string()")]
    pub dir: String,
    /// The iterations whose GEMMs are written.
    #[config(default = "Vec::new()")]
    pub steps: Vec<u64>,
    /// Write the step of the first non-finite value (turns non-finite tracking on), and in eager mode the op that
    /// made it.
    #[config(default = true)]
    pub on_non_finite: bool,
    /// The layers whose GEMMs are written (empty: all).
    #[config(default = "Vec::new()")]
    pub layers: Vec<String>,
    /// The ranks that write (empty: all); only rank 0 by default, as the Neuron guide advises.
    #[config(default = "vec![0]")]
    pub ranks: Vec<usize>,
    /// The most bytes of tensors written in the run; snapshotting stops before exceeding it.
    #[config(default = 1_073_741_824)]
    pub max_bytes: u64,
}

/// What the filter lets through for one GEMM or op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SnapshotChoice {
    /// Its inputs only.
    Inputs,
    /// Its output only.
    Outputs,
    /// Inputs and output.
    Both,
    /// Nothing.
    Skip,
}

type Filter = Box<dyn Fn(&str, usize, u64) -> SnapshotChoice + Send + Sync>;

/// A tensor waiting to be read and written.
struct HeldTensor {
    name: &'static str,
    read: Box<dyn FnOnce() -> Result<TensorData, String> + Send>,
}

/// One GEMM of the step, held.
struct Held {
    name: String,
    execution: u64,
    recipe: Option<String>,
    scales: Box<dyn FnOnce() -> BTreeMap<String, f64> + Send>,
    tensors: Vec<HeldTensor>,
}

struct State {
    config: SnapshotConfig,
    filter: Option<Filter>,
    executions: BTreeMap<String, u64>,
    written_bytes: u64,
    budget_hit: bool,
    non_finite_written: bool,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

thread_local! {
    /// This thread's GEMMs of the current step, held for its `step`.
    static HELD: std::cell::RefCell<Vec<Held>> = const { std::cell::RefCell::new(Vec::new()) };
}
static FILTER: Mutex<Option<Filter>> = Mutex::new(None);

fn lock() -> std::sync::MutexGuard<'static, Option<State>> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Sets the user's filter: `(name, device_index, execution_count) -> what to write`, `name` being
/// `<layer>.<gemm>` (or the op in eager mode) and `execution_count` how many times it ran before in this run.
pub fn set_snapshot_filter(
    filter: impl Fn(&str, usize, u64) -> SnapshotChoice + Send + Sync + 'static,
) {
    let filter: Filter = Box::new(filter);
    match lock().as_mut() {
        Some(state) => state.filter = Some(filter),
        None => *FILTER.lock().unwrap_or_else(|p| p.into_inner()) = Some(filter),
    }
}

pub(crate) fn configure(config: Option<SnapshotConfig>) -> Result<(), DiagnosticsError> {
    let mut guard = lock();
    let filter = guard
        .take()
        .and_then(|s| s.filter)
        .or_else(|| FILTER.lock().unwrap_or_else(|p| p.into_inner()).take());
    let Some(config) = config else {
        *FILTER.lock().unwrap_or_else(|p| p.into_inner()) = filter;
        return Ok(());
    };
    *guard = Some(State {
        config,
        filter,
        executions: BTreeMap::new(),
        written_bytes: 0,
        budget_hit: false,
        non_finite_written: false,
    });
    Ok(())
}

fn read_tensor<B: TeBackend>(tensor: FloatTensor<B>) -> Result<TensorData, String> {
    burn_te_kernels::cubecl::future::block_on(B::float_into_data(tensor))
        .map_err(|e| format!("{e:?}"))
}

/// Holds one GEMM's operands and output until the step ends, if this step may be written.
pub(crate) fn hold<B: TeBackend>(
    site: &GemmSite,
    operands: [(TensorRole, &FloatTensor<B>); 2],
    output: &FloatTensor<B>,
    recipe: Option<&Recipe>,
) {
    let mut guard = lock();
    let Some(state) = guard.as_mut() else { return };
    let name = format!("{site}");
    let execution = {
        let count = state.executions.entry(name.clone()).or_insert(0);
        *count += 1;
        *count - 1
    };
    let iteration = iteration();
    let chosen = state.config.steps.contains(&iteration);
    if state.budget_hit || !(chosen || state.config.on_non_finite && !state.non_finite_written) {
        return;
    }
    if !state.config.layers.is_empty() && !state.config.layers.iter().any(|l| **l == *site.layer) {
        return;
    }
    let device = B::float_device(output).id().index_id as usize;
    let choice = state
        .filter
        .as_ref()
        .map_or(SnapshotChoice::Both, |f| f(&name, device, execution));
    let mut tensors = Vec::new();
    if matches!(choice, SnapshotChoice::Inputs | SnapshotChoice::Both) {
        for (role, tensor) in operands {
            let tensor = tensor.clone();
            tensors.push(HeldTensor {
                name: role.name(),
                read: Box::new(move || read_tensor::<B>(tensor)),
            });
        }
    }
    if matches!(choice, SnapshotChoice::Outputs | SnapshotChoice::Both) {
        let tensor = output.clone();
        tensors.push(HeldTensor {
            name: "output",
            read: Box::new(move || read_tensor::<B>(tensor)),
        });
    }
    if tensors.is_empty() {
        return;
    }
    let states = match (recipe, &site.fp8) {
        (Some(Recipe::Delayed(delayed)), Some(_)) => {
            let dev = B::float_device(output);
            [operands[0].0, operands[1].0]
                .into_iter()
                .filter_map(|role| {
                    crate::gemm::fp8::delayed_state::<B>(site, delayed, role, &dev)
                        .ok()
                        .map(|s| (role, s))
                })
                .collect::<Vec<_>>()
        }
        _ => Vec::new(),
    };
    let scales = Box::new(move || {
        let mut scales = BTreeMap::new();
        for (role, state) in states {
            if let Ok((history, scale)) = B::fp8_delayed_state_read(&state) {
                scales.insert(format!("{}.scale", role.name()), f64::from(scale));
                let amax = history.first().copied().unwrap_or(0.0);
                scales.insert(format!("{}.amax_history[0]", role.name()), f64::from(amax));
            }
        }
        scales
    });
    let held = Held {
        name,
        execution,
        recipe: recipe.map(|r| format!("{r:?}")),
        scales,
        tensors,
    };
    HELD.with(|h| h.borrow_mut().push(held));
}

/// safetensors' dtype of a Burn dtype.
fn safetensors_dtype(dtype: DType) -> Result<Dtype, String> {
    Ok(match dtype {
        DType::F64 => Dtype::F64,
        DType::F32 | DType::Flex32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I64 => Dtype::I64,
        DType::I32 => Dtype::I32,
        DType::U8 => Dtype::U8,
        other => return Err(format!("dtype {other:?} has no safetensors equivalent")),
    })
}

/// A file's tensors, their manifest entry, and the file name.
struct Entry {
    file: String,
    manifest: serde_json::Value,
    tensors: Vec<(String, TensorData)>,
}

/// Writes entries under `<dir>/rank_<r>/iteration_<i>/` within the budget, with the manifest.
fn write_entries(
    state: &mut State,
    iteration: u64,
    why: &str,
    entries: Vec<Entry>,
) -> Result<(), DiagnosticsError> {
    let dir = iteration_dir(&state.config, iteration);
    let io = |path: &Path, e: &dyn std::fmt::Display| DiagnosticsError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    };
    std::fs::create_dir_all(&dir).map_err(|e| io(&dir, &e))?;
    let manifest_path = dir.join("manifest.json");
    let mut manifest: Vec<serde_json::Value> = std::fs::read(&manifest_path)
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok())
        .unwrap_or_default();
    for entry in entries {
        let bytes: u64 = entry
            .tensors
            .iter()
            .map(|(_, d)| d.bytes.len() as u64)
            .sum();
        if state.written_bytes + bytes > state.config.max_bytes {
            state.budget_hit = true;
            metrics::increment_counter("SnapshotsSkippedBudget", 1);
            let message = format!(
                "snapshot budget reached: {} written, {} more for {} would exceed SnapshotConfig::max_bytes = {}; \
                 no more snapshots this run",
                metrics::format_bytes(state.written_bytes as f64),
                metrics::format_bytes(bytes as f64),
                entry.file,
                metrics::format_bytes(state.config.max_bytes as f64)
            );
            tracing::error!(target: "burn_te::diagnostics", "{message}");
            break;
        }
        let path = dir.join(&entry.file);
        let views = entry
            .tensors
            .iter()
            .map(|(name, data)| {
                let dtype = safetensors_dtype(data.dtype).map_err(|e| io(&path, &e))?;
                TensorView::new(dtype, data.shape.to_vec(), &data.bytes)
                    .map(|view| (name.clone(), view))
                    .map_err(|e| io(&path, &e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        safetensors::serialize_to_file(views, None, &path).map_err(|e| io(&path, &e))?;
        state.written_bytes += bytes;
        metrics::increment_counter("SnapshotFiles", 1);
        let mut item = entry.manifest;
        item["file"] = entry.file.clone().into();
        item["why"] = why.into();
        item["tensors"] = entry
            .tensors
            .iter()
            .map(|(name, data)| {
                (
                    name.clone(),
                    serde_json::json!({"shape": data.shape.to_vec(), "dtype": format!("{:?}", data.dtype)}),
                )
            })
            .collect::<serde_json::Map<_, _>>()
            .into();
        manifest.push(item);
    }
    let text = serde_json::to_string_pretty(&manifest).map_err(|e| io(&manifest_path, &e))?;
    std::fs::write(&manifest_path, text).map_err(|e| io(&manifest_path, &e))?;
    tracing::info!(target: "burn_te::diagnostics", "snapshot of iteration {iteration} ({why}) in {}", dir.display());
    Ok(())
}

/// At the end of a step: writes the held GEMMs if the step was chosen or holds the first non-finite value; drops
/// them otherwise.
pub(crate) fn finish_step(
    iteration: u64,
    origin: Option<&NonFiniteOrigin>,
) -> Result<(), DiagnosticsError> {
    let held = HELD.with(|h| std::mem::take(&mut *h.borrow_mut()));
    let mut guard = lock();
    let Some(state) = guard.as_mut() else {
        return Ok(());
    };
    let chosen = state.config.steps.contains(&iteration);
    let non_finite = origin.is_some() && state.config.on_non_finite && !state.non_finite_written;
    if !(chosen || non_finite) || held.is_empty() {
        return Ok(());
    }
    if non_finite {
        state.non_finite_written = true;
    }
    let why = match origin {
        Some(origin) if non_finite => format!("first non-finite value: {origin}"),
        _ => "chosen step".to_string(),
    };
    let mut entries = Vec::new();
    for held in held {
        let mut tensors = Vec::new();
        for tensor in held.tensors {
            let data = (tensor.read)().map_err(DiagnosticsError::Read)?;
            tensors.push((tensor.name.to_string(), data));
        }
        entries.push(Entry {
            file: format!("{}.{}.safetensors", held.name, held.execution),
            manifest: serde_json::json!({
                "op": "te_linear",
                "site": held.name,
                "execution": held.execution,
                "iteration": iteration,
                "rank": rank(),
                "recipe": held.recipe,
                "scales": (held.scales)(),
            }),
            tensors,
        });
    }
    write_entries(state, iteration, &why, entries)
}

/// Eager mode: writes the op that made the first non-finite value (its float inputs and its output).
pub(crate) fn write_failure<B: TeBackend>(
    label: &str,
    origin: &NonFiniteOrigin,
    inputs: Vec<FloatTensor<B>>,
    output: &FloatTensor<B>,
) -> Result<(), DiagnosticsError> {
    let mut guard = lock();
    let Some(state) = guard.as_mut() else {
        return Ok(());
    };
    if !flags().snapshots || !state.config.on_non_finite || state.budget_hit {
        return Ok(());
    }
    let device = B::float_device(output).id().index_id as usize;
    let execution = *state.executions.get(label).unwrap_or(&0);
    let choice = state
        .filter
        .as_ref()
        .map_or(SnapshotChoice::Both, |f| f(label, device, execution));
    let mut tensors = Vec::new();
    if matches!(choice, SnapshotChoice::Inputs | SnapshotChoice::Both) {
        for (k, input) in inputs.into_iter().enumerate() {
            tensors.push((
                format!("input{k}"),
                read_tensor::<B>(input).map_err(DiagnosticsError::Read)?,
            ));
        }
    }
    if matches!(choice, SnapshotChoice::Outputs | SnapshotChoice::Both) {
        tensors.push((
            "output".to_string(),
            read_tensor::<B>(output.clone()).map_err(DiagnosticsError::Read)?,
        ));
    }
    if tensors.is_empty() {
        return Ok(());
    }
    let entry = Entry {
        file: format!("eager_{label}.safetensors"),
        manifest: serde_json::json!({
            "op": origin.op,
            "site": label,
            "iteration": origin.iteration,
            "rank": rank(),
            "layer": origin.layer,
            "gemm": origin.gemm.map(|g| g.name()),
        }),
        tensors,
    };
    write_entries(
        state,
        origin.iteration,
        &format!("eager mode, first non-finite value: {origin}"),
        vec![entry],
    )
}

/// Where the snapshots of `iteration` go on this rank (`None` without snapshots).
pub fn snapshot_dir(iteration: u64) -> Option<PathBuf> {
    lock().as_ref().map(|s| iteration_dir(&s.config, iteration))
}

/// `<dir>/rank_<r>/iteration_<i>`.
fn iteration_dir(config: &SnapshotConfig, iteration: u64) -> PathBuf {
    Path::new(&config.dir)
        .join(format!("rank_{}", rank()))
        .join(format!("iteration_{iteration}"))
}
