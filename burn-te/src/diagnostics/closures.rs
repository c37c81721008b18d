//! Tensors printed at the step's one sync (torch-xla's `add_step_closure`): register tensors during the step, and
//! they are read back at [`step`](super::step), in one transaction each, where the step syncs anyway — reading them
//! where they are made would wait for the device there.

use std::cell::RefCell;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData, Transaction};

use super::DiagnosticsError;

type Closure = Box<dyn FnOnce() -> Result<(), DiagnosticsError>>;

thread_local! {
    /// This thread's closures, run by its next `step`.
    static PENDING: RefCell<Vec<Closure>> = const { RefCell::new(Vec::new()) };
}

/// Calls `closure` at the next [`step`](super::step) with the data of `tensors` (in their order), read back there
/// in one transaction. Closures run in the order they were added, by the step of the thread that added them.
pub fn add_step_closure<B: Backend, const D: usize>(
    tensors: Vec<Tensor<B, D>>,
    closure: impl FnOnce(Vec<TensorData>) + Send + 'static,
) {
    let run = move || {
        let transaction = tensors
            .into_iter()
            .fold(Transaction::default(), |t, tensor| t.register(tensor));
        let data = transaction
            .try_execute()
            .map_err(|err| DiagnosticsError::Read(format!("{err:?}")))?;
        closure(data);
        Ok(())
    };
    PENDING.with(|p| p.borrow_mut().push(Box::new(run)));
}

/// Prints `label = <tensor>` at the next [`step`](super::step) (to stdout and as a `tracing` info event), with the
/// iteration it was registered in.
pub fn print_at_step<B: Backend, const D: usize>(label: impl Into<String>, tensor: &Tensor<B, D>) {
    let label = label.into();
    let iteration = super::iteration();
    add_step_closure(vec![tensor.clone()], move |data| {
        for data in data {
            let text = format!("[iteration {iteration}] {label} = {data}");
            tracing::info!(target: "burn_te::diagnostics", "{text}");
            println!("{text}");
        }
    });
}

/// Runs the closures registered since the last step; the first error is returned after all ran.
pub(crate) fn run_pending() -> Result<(), DiagnosticsError> {
    let pending = PENDING.with(|p| std::mem::take(&mut *p.borrow_mut()));
    let mut first_error = None;
    for closure in pending {
        if let Err(err) = closure() {
            first_error.get_or_insert(err);
        }
    }
    first_error.map_or(Ok(()), Err)
}
