//! cuBLASLt's FP8 matmul on CUDA, the library Transformer Engine's GEMMs call: E4M3/E5M2 operands on the tensor
//! cores (sm ≥ 89), f32 accumulation with cuBLASLt's split accumulator (no fast accumulation), per-tensor scales
//! through its scale pointers, f32, f16 or bf16 output.
//!
//! cuBLASLt takes FP8 operands in one layout only, "TN" (both operands K-major). In row-major terms that is
//! `out[M, N] = A[M, K] · B[N, K]ᵀ`: a layer's fprop. Operands stored the other way (dgrad's weight, wgrad's
//! operands) are transposed into K-major copies first ([`crate::gemm::transpose::transpose_fp8_codes`]); a permutation of
//! the codes, so the product is the same.
//!
//! Two ways to order the library's work with CubeCL's ([`LtStream`]):
//! - on the library's own stream of the device's primary context (CubeCL's context): CubeCL's queue is synced
//!   before the call and the library's stream after it, so that neither reads a buffer before the other wrote it. A
//!   group of GEMMs (a grouped linear layer's experts) pays these two waits once ([`fp8_gemm_grouped`]);
//! - on CubeCL's own stream, as a host task of the vendored cubecl-cuda ([`launch_host_task`]): the call goes
//!   through CubeCL's launch queue like a kernel and is enqueued, on the device's thread, after the kernels that
//!   wrote its operands and before those that will read its output. Nothing waits, and the caller makes no round
//!   trip to the device's thread for the buffers' addresses. Its workspace comes from CubeCL's memory pool on that
//!   stream. Only for operands of the calling thread's stream: CubeCL does not order another stream's reuse of a
//!   buffer after this stream's reads, so a group with such an operand takes the library's own stream.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use cubecl::cuda::host_task::launch_host_task;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::prelude::*;
use cubecl::server::{Binding, Handle};
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{result as driver, sys as driver_sys};

use crate::Fp8Format;
use crate::error::KernelError;
use crate::gemm::transpose::transpose_fp8_codes;
use crate::gemm::{GemmOperand, OperandCodes, product_dims};

/// cuBLASLt's workspace per device (NVIDIA's recommendation for Hopper; 4 MiB suffice before it).
const WORKSPACE_BYTES: usize = 32 << 20;

/// Why cuBLASLt cannot run `a × b` into `F` exactly as the kernel would (`None`: it can). The reason names the
/// operand and what it lacks; the caller runs the SIMT kernel instead and records the reason.
pub fn unsupported<F: CubeElement>(a: &GemmOperand<'_>, b: &GemmOperand<'_>) -> Option<String> {
    let out_bytes = size_of::<F>();
    if out_type(F::type_name()).is_none() {
        return Some(format!(
            "{} outputs (cuBLASLt writes f32, f16 or bf16 here)",
            F::type_name()
        ));
    }
    let format = |operand: &GemmOperand<'_>, what: &str| match operand.codes {
        OperandCodes::Fp8(buffer) => Ok(buffer.format),
        OperandCodes::E2m1(_) => Err(format!(
            "the {what} is NVFP4 (cuBLASLt's block-scaled FP4 needs sm100)"
        )),
    };
    let formats = format(a, "lhs").and_then(|fa| format(b, "rhs").map(|fb| (fa, fb)));
    let (fa, fb) = match formats {
        Ok(formats) => formats,
        Err(reason) => return Some(reason),
    };
    if fa == Fp8Format::E5M2 && fb == Fp8Format::E5M2 {
        return Some("both operands are E5M2 (cuBLASLt multiplies E5M2 only by E4M3)".into());
    }
    for (operand, what) in [(a, "lhs"), (b, "rhs")] {
        if let Some(block) = operand.block {
            return Some(format!(
                "the {what} has {}x{} scale blocks (cuBLASLt takes per-tensor scales here)",
                block.rows, block.cols
            ));
        }
    }
    let (m, k) = a.used_dims(true);
    let (n, _) = b.used_dims(false);
    if !k.is_multiple_of(16) {
        return Some(format!(
            "K = {k} is not a multiple of 16 (cuBLASLt's FP8 rows are 16-byte aligned)"
        ));
    }
    if !(n * out_bytes).is_multiple_of(16) {
        return Some(format!(
            "N = {n} output columns are not 16-byte aligned rows"
        ));
    }
    if m == 0 || n == 0 || a.batch.min(b.batch) == 0 {
        return Some("an empty output".into());
    }
    if [m, n, k, a.batch.max(b.batch)]
        .iter()
        .any(|&d| i32::try_from(d).is_err())
    {
        return Some("a dimension beyond cuBLASLt's 32-bit sizes".into());
    }
    None
}

/// cuBLASLt's type of an output element named `name`.
fn out_type(name: &str) -> Option<sys::cudaDataType> {
    match name {
        "f32" => Some(sys::cudaDataType::CUDA_R_32F),
        "f16" => Some(sys::cudaDataType::CUDA_R_16F),
        "bf16" => Some(sys::cudaDataType::CUDA_R_16BF),
        _ => None,
    }
}

/// The stream cuBLASLt's calls run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LtStream {
    /// The library's own stream, with a host wait for CubeCL's queue before the calls and for the stream after.
    Own,
    /// CubeCL's stream of the calling thread: ordered with CubeCL's kernels, no host waits.
    CubeCl,
}

/// `out[b] = dequant(A[b]) × dequant(B[b])` by cuBLASLt, contiguous `[batch, M, N]` as `F` (f32, f16 or bf16), on the
/// CUDA device `device`. The operands must pass [`unsupported`]; their scales are per-tensor `scale_inv` values,
/// which cuBLASLt applies to the f32 accumulator (`scale_a · scale_b · Σ a·b`).
pub fn fp8_gemm<F: Float + CubeElement>(
    client: &ComputeClient<CudaRuntime>,
    device: &CudaDevice,
    a: &GemmOperand<'_>,
    b: &GemmOperand<'_>,
    stream: LtStream,
) -> Result<Handle, KernelError> {
    fp8_gemm_grouped::<F>(client, device, &[(*a, *b)], stream)?
        .0
        .pop()
        .expect("one GEMM's result")
}

/// Several [`fp8_gemm`]s (a grouped linear layer's experts), on [`LtStream::Own`] with one wait on each side:
/// CubeCL's queue is synced once before the calls and the library's stream once after them. Each GEMM's output, or
/// why cuBLASLt cannot take it ([`unsupported`], shapes), and the stream they ran on: [`LtStream::CubeCl`] where
/// asked for and every operand comes from the calling thread's CubeCL stream, else [`LtStream::Own`]. An error of
/// the library or of the device fails them all.
pub fn fp8_gemm_grouped<F: Float + CubeElement>(
    client: &ComputeClient<CudaRuntime>,
    device: &CudaDevice,
    gemms: &[(GemmOperand<'_>, GemmOperand<'_>)],
    stream: LtStream,
) -> Result<(Vec<Result<Handle, KernelError>>, LtStream), KernelError> {
    let calls = gemms
        .iter()
        .map(|(a, b)| match checked_shape::<F>(a, b) {
            Ok(shape) => LtCall::new::<F>(client, a, b, shape).map(Ok),
            Err(refused) => Ok(Err(refused)),
        })
        .collect::<Result<Vec<_>, _>>()?;
    // CubeCL orders a stream's work after the writes of the buffers it reads from other streams, but not the
    // other streams' later reuse of those buffers: operands from another thread's stream take the library's own
    // stream and its waits.
    let ran_on = match stream {
        LtStream::CubeCl if calls.iter().flatten().all(|call| !call.foreign_inputs) => {
            LtStream::CubeCl
        }
        _ => LtStream::Own,
    };
    if calls.iter().any(Result::is_ok) {
        match ran_on {
            LtStream::CubeCl => {
                // The library and each shape's plan made here, so that their errors are this call's.
                with_lt_device(device.index, |lt_device| {
                    calls
                        .iter()
                        .flatten()
                        .try_for_each(|call| lt_device.prepare(&call.shape))
                })?;
                // A workspace from CubeCL's pool on the calls' stream (the calling thread's, as the outputs'): the
                // host tasks hold it, and CubeCL's next use of the memory comes after them.
                let workspace = client.empty(WORKSPACE_BYTES);
                for call in calls.iter().flatten() {
                    let mut buffers = call.bindings();
                    buffers.push(workspace.clone().binding());
                    let (ordinal, shape) = (device.index, call.shape);
                    let work = move |pointers: &[u64], stream: driver_sys::CUstream| {
                        let [a, b, a_scale, b_scale, out, workspace] = *pointers else {
                            return Err(format!("{} buffer addresses for 6", pointers.len()));
                        };
                        let ptrs = LtPointers {
                            a,
                            b,
                            a_scale,
                            b_scale,
                            out,
                        };
                        with_lt_device(ordinal, |lt_device| {
                            lt_device.matmul(&shape, &ptrs, stream, workspace)
                        })
                        .map_err(|error| error.to_string())
                    };
                    launch_host_task(client, buffers, Box::new(work));
                }
            }
            LtStream::Own => {
                // CubeCL's queue has written the operands (and allocated the outputs) before the library reads them.
                cubecl::future::block_on(client.sync())?;
                let ptrs = calls
                    .iter()
                    .flatten()
                    .map(|call| call.pointers(client))
                    .collect::<Result<Vec<_>, _>>()?;
                with_lt_device(device.index, |lt_device| {
                    let (stream, workspace) = (lt_device.stream, lt_device.workspace);
                    let enqueued =
                        calls
                            .iter()
                            .flatten()
                            .zip(&ptrs)
                            .try_for_each(|(call, ptrs)| {
                                lt_device.matmul(&call.shape, ptrs, stream, workspace)
                            });
                    // Waited for even when a call failed: the calls before it may still read the buffers dropped
                    // below.
                    let waited = lt_device.wait();
                    enqueued.and(waited)
                })?;
            }
        }
    }
    // The K-major copies and the inputs stay alive until here: the library has read them (its own stream) or the
    // host tasks hold them until they are enqueued, before CubeCL's next use of their memory (CubeCL's stream).
    let outputs = calls
        .into_iter()
        .map(|call| call.map(|call| call.output))
        .collect();
    Ok((outputs, ran_on))
}

/// The call's sizes, or why cuBLASLt cannot take the operands.
fn checked_shape<F: Float + CubeElement>(
    a: &GemmOperand<'_>,
    b: &GemmOperand<'_>,
) -> Result<LtShape, KernelError> {
    if let Some(reason) = unsupported::<F>(a, b) {
        return Err(KernelError::InvalidArgument {
            what: "cuBLASLt FP8 GEMM operands",
            reason,
        });
    }
    let (m, k, n, batch) = product_dims(a, b)?;
    let fp8 = |operand: &GemmOperand<'_>| match operand.codes {
        OperandCodes::Fp8(buffer) => buffer.format,
        OperandCodes::E2m1(_) => unreachable!("checked by `unsupported`"),
    };
    Ok(LtShape {
        m,
        n,
        k,
        batch,
        a_stride: if a.batch == 1 { 0 } else { m * k },
        b_stride: if b.batch == 1 { 0 } else { n * k },
        a_format: fp8(a),
        b_format: fp8(b),
        out: F::type_name(),
    })
}

/// One cuBLASLt call ready to go: its K-major operands and their scales (kept alive until the library has read
/// them) and its output.
struct LtCall {
    shape: LtShape,
    /// A's and B's K-major codes, then A's and B's `scale_inv`.
    inputs: [Handle; 4],
    output: Handle,
    /// Whether an operand buffer comes from another CubeCL stream than the output (the calling thread's).
    foreign_inputs: bool,
}

impl LtCall {
    fn new<F: Float + CubeElement>(
        client: &ComputeClient<CudaRuntime>,
        a: &GemmOperand<'_>,
        b: &GemmOperand<'_>,
        shape: LtShape,
    ) -> Result<Self, KernelError> {
        // K-major codes: A as [M, K] rows, B as [N, K] rows.
        let k_major =
            |operand: &GemmOperand<'_>, k_major_as_stored: bool| -> Result<Handle, KernelError> {
                let OperandCodes::Fp8(buffer) = operand.codes else {
                    unreachable!("checked by `unsupported`")
                };
                if k_major_as_stored {
                    Ok(buffer.codes.clone())
                } else {
                    transpose_fp8_codes(
                        client,
                        &buffer.codes,
                        operand.batch,
                        operand.rows,
                        operand.cols,
                    )
                }
            };
        let a_codes = k_major(a, !a.transposed)?;
        let b_codes = k_major(b, b.transposed)?;
        let output = client.empty(shape.batch * shape.m * shape.n * size_of::<F>());
        let inputs = [a_codes, b_codes, a.scale_inv.clone(), b.scale_inv.clone()];
        let foreign_inputs = inputs.iter().any(|handle| handle.stream != output.stream);
        Ok(LtCall {
            shape,
            inputs,
            output,
            foreign_inputs,
        })
    }

    /// The buffers in [`LtPointers`]' order: A, B, A's scale, B's scale, the output.
    fn bindings(&self) -> Vec<Binding> {
        self.inputs
            .iter()
            .chain([&self.output])
            .map(|handle| handle.clone().binding())
            .collect()
    }

    /// The buffers' device pointers, each asked of CubeCL's device thread (a blocking round trip).
    fn pointers(&self, client: &ComputeClient<CudaRuntime>) -> Result<LtPointers, KernelError> {
        let pointer = |handle: &Handle| -> Result<u64, KernelError> {
            let resource = client.get_resource(handle.clone())?;
            Ok(resource.resource().ptr)
        };
        let [a, b, a_scale, b_scale] = &self.inputs;
        Ok(LtPointers {
            a: pointer(a)?,
            b: pointer(b)?,
            a_scale: pointer(a_scale)?,
            b_scale: pointer(b_scale)?,
            out: pointer(&self.output)?,
        })
    }
}

/// Runs `f` on the cuBLASLt state of the device `ordinal`, made at its first use.
fn with_lt_device<T>(
    ordinal: usize,
    f: impl FnOnce(&mut LtDevice) -> Result<T, KernelError>,
) -> Result<T, KernelError> {
    let devices = DEVICES.get_or_init(|| Mutex::new(HashMap::new()));
    let mut devices = devices
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let lt_device = match devices.entry(ordinal) {
        std::collections::hash_map::Entry::Occupied(entry) => entry.into_mut(),
        std::collections::hash_map::Entry::Vacant(entry) => entry.insert(LtDevice::new(ordinal)?),
    };
    f(lt_device)
}

static DEVICES: OnceLock<Mutex<HashMap<usize, LtDevice>>> = OnceLock::new();

/// Device pointers of one call.
struct LtPointers {
    a: u64,
    b: u64,
    a_scale: u64,
    b_scale: u64,
    out: u64,
}

/// One call's sizes, in the row-major terms of [`fp8_gemm`]; a batch stride of 0 broadcasts.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct LtShape {
    m: usize,
    n: usize,
    k: usize,
    batch: usize,
    a_stride: usize,
    b_stride: usize,
    a_format: Fp8Format,
    b_format: Fp8Format,
    /// The output element's name (`f32`, `f16`, `bf16`).
    out: &'static str,
}

/// Shapes whose plans a device keeps; past it the cache starts over (a model has a few dozen GEMM shapes).
const PLANS_KEPT: usize = 256;

/// cuBLASLt on one device: its primary context (shared with CubeCL), a stream, a handle, a workspace, and the plan
/// of each GEMM shape met so far.
struct LtDevice {
    context: driver_sys::CUcontext,
    stream: driver_sys::CUstream,
    handle: sys::cublasLtHandle_t,
    workspace: driver_sys::CUdeviceptr,
    plans: HashMap<LtShape, LtPlan>,
}

/// What cuBLASLt needs for one GEMM shape, made once: the operation (layout, scale pointers set per call), the
/// three matrix layouts, and the algorithm its heuristic picked.
struct LtPlan {
    desc: Guard<sys::cublasLtMatmulDesc_t>,
    lt_a: Guard<sys::cublasLtMatrixLayout_t>,
    lt_b: Guard<sys::cublasLtMatrixLayout_t>,
    lt_d: Guard<sys::cublasLtMatrixLayout_t>,
    algo: sys::cublasLtMatmulAlgo_t,
}

// SAFETY: the raw handles are used under the `DEVICES` mutex only, with the context bound to the calling thread.
unsafe impl Send for LtDevice {}

fn library_error(what: &str, error: impl core::fmt::Debug) -> KernelError {
    KernelError::Library {
        library: "cuBLASLt",
        reason: format!("{what}: {error:?}"),
    }
}

impl LtDevice {
    fn new(ordinal: usize) -> Result<Self, KernelError> {
        // Probed once: without the library every GEMM takes the kernel, and need not look again.
        static PRESENT: OnceLock<bool> = OnceLock::new();
        // SAFETY: probing for the shared library loads nothing into the process's CUDA state.
        if !*PRESENT.get_or_init(|| unsafe { sys::is_culib_present() }) {
            return Err(KernelError::Library {
                library: "cuBLASLt",
                reason: "libcublasLt.so was not found on the loader path (LD_LIBRARY_PATH); it ships with the \
                         CUDA toolkit and the `nvidia-cublas` wheel"
                    .into(),
            });
        }
        let ordinal =
            i32::try_from(ordinal).map_err(|_| library_error("device ordinal", ordinal))?;
        driver::init().map_err(|e| library_error("cuInit", e))?;
        let device = driver::device::get(ordinal).map_err(|e| library_error("cuDeviceGet", e))?;
        // SAFETY: `device` is valid; the primary context is the one CubeCL's CUDA runtime retained.
        let context = unsafe { driver::primary_ctx::retain(device) }
            .map_err(|e| library_error("cuDevicePrimaryCtxRetain", e))?;
        unsafe { driver::ctx::set_current(context) }
            .map_err(|e| library_error("cuCtxSetCurrent", e))?;
        let stream = driver::stream::create(driver::stream::StreamKind::NonBlocking)
            .map_err(|e| library_error("cuStreamCreate", e))?;
        let handle = lt::create_handle().map_err(|e| library_error("cublasLtCreate", e))?;
        // SAFETY: the context is current; the workspace lives as long as the process.
        let workspace = unsafe { driver::malloc_sync(WORKSPACE_BYTES) }
            .map_err(|e| library_error("cuMemAlloc (workspace)", e))?;
        Ok(Self {
            context,
            stream,
            handle,
            workspace,
            plans: HashMap::new(),
        })
    }

    /// Enqueues `out = scale_a · scale_b · A·Bᵀ` (row-major) on `stream` with `workspace` (of [`WORKSPACE_BYTES`]);
    /// on the library's own stream, [`wait`](Self::wait) for it.
    fn matmul(
        &mut self,
        shape: &LtShape,
        ptrs: &LtPointers,
        stream: driver_sys::CUstream,
        workspace: driver_sys::CUdeviceptr,
    ) -> Result<(), KernelError> {
        self.prepare(shape)?;
        let plan = &self.plans[shape];
        set_scale_pointers(plan.desc.0, ptrs.a_scale, ptrs.b_scale)?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc.0,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                ptrs.b as *const core::ffi::c_void,
                plan.lt_a.0,
                ptrs.a as *const core::ffi::c_void,
                plan.lt_b.0,
                ptrs.out as *const core::ffi::c_void,
                plan.lt_d.0,
                ptrs.out as *mut core::ffi::c_void,
                plan.lt_d.0,
                &plan.algo,
                workspace as *mut core::ffi::c_void,
                WORKSPACE_BYTES,
                stream as sys::cudaStream_t,
            )
        }
        .map_err(|e| library_error("cublasLtMatmul", e))
    }

    /// Makes the plan of `shape` unless the device has it, with the device's context current on this thread.
    fn prepare(&mut self, shape: &LtShape) -> Result<(), KernelError> {
        unsafe { driver::ctx::set_current(self.context) }
            .map_err(|e| library_error("cuCtxSetCurrent", e))?;
        if !self.plans.contains_key(shape) {
            if self.plans.len() >= PLANS_KEPT {
                self.plans.clear();
            }
            let plan = self.plan(shape)?;
            self.plans.insert(*shape, plan);
        }
        Ok(())
    }

    /// The plan of one shape: its descriptors and the heuristic's algorithm. The heuristic is asked with scale
    /// pointers set, as every call sets its own; the device's workspace address stands for them (the heuristic
    /// reads no device memory).
    ///
    /// In cuBLASLt's column-major terms the row-major `out[M, N]` is `D[N, M] = op(B-side) · op(A-side)` with
    /// cuBLASLt's A our `b` ([N, K] rows = K × N column-major, used transposed) and its B our `a` ([M, K] rows =
    /// K × M column-major, used as is): the "TN" layout FP8 requires.
    fn plan(&self, shape: &LtShape) -> Result<LtPlan, KernelError> {
        use sys::cublasLtMatmulDescAttributes_t as Desc;
        let data_type = |format: Fp8Format| match format {
            Fp8Format::E4M3 => sys::cudaDataType::CUDA_R_8F_E4M3,
            Fp8Format::E5M2 => sys::cudaDataType::CUDA_R_8F_E5M2,
        };
        let out_type = out_type(shape.out).expect("checked by `unsupported`");
        let desc = Guard::new(
            lt::create_matmul_desc(
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cudaDataType::CUDA_R_32F,
            )
            .map_err(|e| library_error("cublasLtMatmulDescCreate", e))?,
            |d| unsafe { lt::destroy_matmul_desc(d) }.map(|_| ()),
        );
        let set_desc = |attribute: Desc, value: *const core::ffi::c_void, size: usize| {
            unsafe { lt::set_matmul_desc_attribute(desc.0, attribute, value, size) }
                .map_err(|e| library_error("cublasLtMatmulDescSetAttribute", e))
        };
        let transposed: i32 = 1; // CUBLAS_OP_T
        let as_is: i32 = 0; // CUBLAS_OP_N
        set_desc(
            Desc::CUBLASLT_MATMUL_DESC_TRANSA,
            (&transposed as *const i32).cast(),
            size_of::<i32>(),
        )?;
        set_desc(
            Desc::CUBLASLT_MATMUL_DESC_TRANSB,
            (&as_is as *const i32).cast(),
            size_of::<i32>(),
        )?;
        set_scale_pointers(desc.0, self.workspace, self.workspace)?;
        let fast_accumulation: i8 = 0;
        set_desc(
            Desc::CUBLASLT_MATMUL_DESC_FAST_ACCUM,
            (&fast_accumulation as *const i8).cast(),
            size_of::<i8>(),
        )?;

        let layout = |data_type, rows: usize, cols: usize, ld: usize, stride: usize| {
            let layout = Guard::new(
                lt::create_matrix_layout(data_type, rows as u64, cols as u64, ld as i64)
                    .map_err(|e| library_error("cublasLtMatrixLayoutCreate", e))?,
                |l| unsafe { lt::destroy_matrix_layout(l) }.map(|_| ()),
            );
            if shape.batch > 1 {
                use sys::cublasLtMatrixLayoutAttribute_t as Layout;
                let count = shape.batch as i32;
                let offset = stride as i64;
                unsafe {
                    lt::set_matrix_layout_attribute(
                        layout.0,
                        Layout::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                        (&count as *const i32).cast(),
                        size_of::<i32>(),
                    )
                    .and_then(|_| {
                        lt::set_matrix_layout_attribute(
                            layout.0,
                            Layout::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                            (&offset as *const i64).cast(),
                            size_of::<i64>(),
                        )
                    })
                }
                .map_err(|e| library_error("cublasLtMatrixLayoutSetAttribute", e))?;
            }
            Ok::<_, KernelError>(layout)
        };
        let lt_a = layout(
            data_type(shape.b_format),
            shape.k,
            shape.n,
            shape.k,
            shape.b_stride,
        )?;
        let lt_b = layout(
            data_type(shape.a_format),
            shape.k,
            shape.m,
            shape.k,
            shape.a_stride,
        )?;
        let lt_d = layout(out_type, shape.n, shape.m, shape.n, shape.m * shape.n)?;

        let preference = Guard::new(
            lt::create_matmul_pref()
                .map_err(|e| library_error("cublasLtMatmulPreferenceCreate", e))?,
            |p| unsafe { lt::destroy_matmul_pref(p) }.map(|_| ()),
        );
        let workspace_bytes = WORKSPACE_BYTES;
        unsafe {
            lt::set_matmul_pref_attribute(
                preference.0,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&workspace_bytes as *const usize).cast(),
                size_of::<usize>(),
            )
        }
        .map_err(|e| library_error("cublasLtMatmulPreferenceSetAttribute", e))?;
        let heuristic = unsafe {
            lt::get_matmul_algo_heuristic(
                self.handle,
                desc.0,
                lt_a.0,
                lt_b.0,
                lt_d.0,
                lt_d.0,
                preference.0,
            )
        }
        .map_err(|e| {
            library_error(
                "cublasLtMatmulAlgoGetHeuristic (no algorithm for these operands)",
                e,
            )
        })?;
        Ok(LtPlan {
            desc,
            lt_a,
            lt_b,
            lt_d,
            algo: heuristic.algo,
        })
    }

    /// Waits for the library's stream (every call enqueued so far).
    fn wait(&self) -> Result<(), KernelError> {
        unsafe { driver::stream::synchronize(self.stream) }
            .map_err(|e| library_error("cuStreamSynchronize", e))
    }
}

/// Points the operation's A and B scales at the `scale_inv` values of our `a` and `b`. cuBLASLt's A is our B and
/// its B our A: the scales swap with them.
fn set_scale_pointers(
    desc: sys::cublasLtMatmulDesc_t,
    a_scale: u64,
    b_scale: u64,
) -> Result<(), KernelError> {
    use sys::cublasLtMatmulDescAttributes_t as Desc;
    for (attribute, pointer) in [
        (Desc::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, b_scale),
        (Desc::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, a_scale),
    ] {
        // SAFETY: `desc` is a live descriptor; the value is copied.
        unsafe {
            lt::set_matmul_desc_attribute(
                desc,
                attribute,
                (&pointer as *const u64).cast(),
                size_of::<u64>(),
            )
        }
        .map_err(|e| library_error("cublasLtMatmulDescSetAttribute", e))?;
    }
    Ok(())
}

/// A cuBLASLt descriptor destroyed when dropped.
struct Guard<T: Copy>(T, fn(T) -> Result<(), lt::CublasError>);

impl<T: Copy> Guard<T> {
    fn new(value: T, destroy: fn(T) -> Result<(), lt::CublasError>) -> Self {
        Self(value, destroy)
    }
}

impl<T: Copy> Drop for Guard<T> {
    fn drop(&mut self) {
        // A failed destroy leaks one small descriptor; the GEMM's result stands either way.
        let _ = (self.1)(self.0);
    }
}
