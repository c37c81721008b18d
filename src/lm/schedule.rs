//! The char-GPT's learning rate: the parity study's warmup and cosine decay ([`warmup_cosine`]), or a constant, as a
//! burn-train scheduler ([`LmScheduler`]) for the `Learner` of `examples/char_gpt.rs`.

use super::burn;
use burn::lr_scheduler::LrScheduler;
use burn::tensor::backend::Backend;

/// The parity study's learning rate at `step` (from 0) of a run of `steps`: a linear warmup to `peak` over a tenth
/// of the steps, then a cosine decay to a tenth of `peak`, which it keeps past `steps`.
pub fn warmup_cosine(peak: f64, step: usize, steps: usize) -> f64 {
    let warmup = (steps / 10).max(1);
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let t = ((step - warmup) as f64 / (steps - warmup).max(1) as f64).min(1.0);
    peak * (0.1 + 0.45 * (1.0 + (std::f64::consts::PI * t).cos()))
}

/// A learning-rate schedule of the char-GPT's training.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LmSchedule {
    /// The same rate at every step.
    Constant(f64),
    /// [`warmup_cosine`] to `peak` over a run of `steps` optimizer steps.
    WarmupCosine {
        /// The rate at the end of the warmup.
        peak: f64,
        /// The run's optimizer steps (every epoch's).
        steps: usize,
    },
}

impl LmSchedule {
    /// The rate at `step` (from 0).
    pub fn at(self, step: usize) -> f64 {
        match self {
            Self::Constant(lr) => lr,
            Self::WarmupCosine { peak, steps } => warmup_cosine(peak, step, steps),
        }
    }

    /// The scheduler that burn-train's `Learner` steps once per training batch (its `lr_step`), from step 0.
    pub fn scheduler(self) -> LmScheduler {
        LmScheduler {
            schedule: self,
            step: 0,
        }
    }
}

/// [`LmSchedule`] as burn-train steps it: each [`LrScheduler::step`] gives the rate of the next batch's step. Its
/// record is the number of steps taken (the schedule itself comes from the run's arguments), so a run resumed from
/// a checkpoint with the same schedule continues it.
#[derive(Clone, Copy, Debug)]
pub struct LmScheduler {
    schedule: LmSchedule,
    step: usize,
}

impl LrScheduler for LmScheduler {
    type Record<B: Backend> = usize;

    fn step(&mut self) -> f64 {
        let lr = self.schedule.at(self.step);
        self.step += 1;
        lr
    }

    fn to_record<B: Backend>(&self) -> usize {
        self.step
    }

    fn load_record<B: Backend>(mut self, record: usize) -> Self {
        self.step = record;
        self
    }
}
