//! burn-te patch: a library's work enqueued on CubeCL's stream as a kernel launch is.
//!
//! [`launch_host_task`] sends a closure through the client's launch queue instead of a compiled kernel. On the
//! device's thread, in its place among the launches, `CudaServer::launch_checked` resolves the task's buffers as it
//! would a kernel's (making the stream wait for their writes on other streams) and calls the closure with their
//! device pointers and the stream. The caller does not wait: no round trip to the device thread per buffer, as
//! `ComputeClient::get_resource` takes. An error the closure returns is the stream's error, as a failed kernel
//! launch is: the next read or sync of that stream reports it.

use crate::CudaCompiler;
use cubecl_common::backtrace::BackTrace;
use cubecl_core::{
    CubeCount,
    ir::{ElemType, StorageType, UIntKind},
    prelude::{CompiledKernel, ComputeClient, ExecutionMode, KernelId},
    server::{Binding, KernelArguments},
};
use cubecl_runtime::{
    compiler::{CompilationError, CubeTask},
    kernel::KernelMetadata,
};
use cudarc::driver::sys::CUstream;
use std::sync::Mutex;

use crate::CudaRuntime;

/// The work of a host task: called on the device's thread with its buffers' device pointers (in the order given to
/// [`launch_host_task`]) and the CUDA stream the work must be enqueued on.
pub type HostWork = Box<dyn FnOnce(&[u64], CUstream) -> Result<(), String> + Send>;

/// A launch whose "kernel" is [`HostWork`]. Private, so that its kernel id names this type only.
pub(crate) struct HostTask {
    work: Mutex<Option<HostWork>>,
}

impl HostTask {
    /// Whether `kernel` is a host task.
    pub(crate) fn is(kernel: &dyn CubeTask<CudaCompiler>) -> bool {
        kernel.id() == KernelId::new::<HostTask>()
    }

    /// The work of `kernel`, which [`HostTask::is`] found to be a host task.
    pub(crate) fn into_work(kernel: Box<dyn CubeTask<CudaCompiler>>) -> Option<HostWork> {
        debug_assert!(Self::is(kernel.as_ref()));
        // SAFETY: the kernel id's type id is `HostTask`'s, which only this type (private to this module) reports:
        // the box holds a `HostTask`.
        let task = unsafe { Box::from_raw(Box::into_raw(kernel) as *mut HostTask) };
        task.work
            .into_inner()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl KernelMetadata for HostTask {
    fn name(&self) -> &'static str {
        "host_task"
    }

    fn id(&self) -> KernelId {
        KernelId::new::<HostTask>()
    }

    fn address_type(&self) -> StorageType {
        StorageType::Scalar(ElemType::UInt(UIntKind::U32))
    }
}

impl CubeTask<CudaCompiler> for HostTask {
    fn compile(
        &self,
        _compiler: &mut CudaCompiler,
        _compilation_options: &<CudaCompiler as cubecl_core::Compiler>::CompilationOptions,
        _mode: ExecutionMode,
        _address_type: StorageType,
    ) -> Result<CompiledKernel<CudaCompiler>, CompilationError> {
        Err(CompilationError::Generic {
            reason: "a host task runs on the host and has no kernel to compile".into(),
            backtrace: BackTrace::capture(),
        })
    }
}

/// Enqueues `work` on `client`'s stream after the work already launched there, with the device pointers of
/// `buffers`, which stay allocated until it has run. Returns at once.
pub fn launch_host_task(client: &ComputeClient<CudaRuntime>, buffers: Vec<Binding>, work: HostWork) {
    let task = HostTask {
        work: Mutex::new(Some(work)),
    };
    let arguments = KernelArguments {
        buffers,
        ..KernelArguments::new()
    };
    client.launch(Box::new(task), CubeCount::Static(1, 1, 1), arguments);
}
