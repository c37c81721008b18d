//! The byte-level GPT of `burn_te_suite::lm` (what `examples/char_gpt.rs` trains) on the Flex CPU backend: output
//! shapes, the corpus's windows against its raw bytes, the seeded batch order, every bad-input error, and a short
//! training run that must learn.

use std::path::{Path, PathBuf};

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::module::AutodiffModule;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use burn_te::{Float8CurrentScaling, Recipe, Te, TeError};
use burn_te_suite::lm::{
    CharGptConfig, Corpus, CorpusError, LmBatch, LmBatcher, LmSchedule, Window, warmup_cosine,
};

use crate::debug::temp_dir;

type B = Autodiff<Te<Flex>>;

fn tiny() -> CharGptConfig {
    CharGptConfig::new()
        .with_context(16)
        .with_hidden(32)
        .with_layers(2)
        .with_heads(4)
        .with_ffn(64)
}

fn tokens(rows: usize, seq: usize, device: &Device<B>) -> Tensor<B, 2, Int> {
    let ids: Vec<i64> = (0..rows * seq).map(|i| (i * 37 % 256) as i64).collect();
    Tensor::from_data(TensorData::new(ids, [rows, seq]), device)
}

#[test]
fn char_gpt_output_shapes() {
    let device = Default::default();
    let model = tiny().init::<B>(&device);
    assert_eq!(model.forward(tokens(3, 16, &device)).dims(), [3, 16, 256]);
    // Shorter than the context works; longer or empty is an error naming the shape.
    assert_eq!(model.forward(tokens(2, 5, &device)).dims(), [2, 5, 256]);
    let err = model.try_forward(tokens(1, 17, &device)).unwrap_err();
    assert!(
        matches!(err, TeError::InvalidShape { ref shape, .. } if shape == &[1, 17]),
        "{err}"
    );
    assert!(err.to_string().contains("1..=16"), "{err}");
    // The same under an FP8 recipe.
    let fp8 = model
        .clone()
        .with_recipe(Some(Float8CurrentScaling::default().into()));
    assert_eq!(fp8.recipe(), Some(&Recipe::Current(Default::default())));
    assert_eq!(fp8.forward(tokens(3, 16, &device)).dims(), [3, 16, 256]);

    // Causal: changing token 10 leaves the logits of positions 0..10 as they were and changes position 10's.
    let a = tokens(1, 16, &device);
    let b = a.clone().slice_assign(
        [0..1, 10..11],
        Tensor::from_data(TensorData::new(vec![255i64], [1, 1]), &device),
    );
    let diff = (model.forward(a) - model.forward(b))
        .abs()
        .max_dim(2)
        .squeeze_dim::<2>(2);
    let diff = diff.into_data().convert::<f32>().to_vec::<f32>().unwrap();
    assert!(diff[..10].iter().all(|&d| d == 0.0), "{diff:?}");
    assert!(diff[10] > 1e-4, "{diff:?}");

    let batch = LmBatcher.batch(
        vec![
            Window {
                offset: 0,
                bytes: (0..17).collect(),
            };
            4
        ],
        &device,
    );
    let out = model.forward_batch(batch);
    assert_eq!(out.logits.dims(), [4 * 16, 256]);
    assert_eq!(out.targets.dims(), [4 * 16]);
    assert_eq!(out.loss.dims(), [1]);

    assert_eq!(model.gemm_layers().len(), 2 * 4 + 1);
    assert_eq!(
        model.gemm_layers()[0],
        "blocks.0.self_attention.layernorm_qkv"
    );

    // Generation: n new bytes, cropped to the context (a prompt longer than it works), greedy is deterministic.
    let inference = model.valid();
    let prompt = b"a prompt longer than sixteen bytes";
    let greedy = inference.generate(prompt, 20, 0.0, 1).unwrap();
    assert_eq!(greedy.len(), 20);
    assert_eq!(inference.generate(prompt, 20, 0.0, 2).unwrap(), greedy);
    let sampled = inference.generate(b"", 20, 1.0, 3).unwrap();
    assert_eq!(sampled, inference.generate(b"", 20, 1.0, 3).unwrap());

    // Bad configs are errors naming the size.
    let err = tiny().with_heads(3).try_init::<B>(&device).unwrap_err();
    assert!(matches!(err, TeError::InvalidConfig { .. }), "{err}");
    let err = tiny().with_context(0).try_init::<B>(&device).unwrap_err();
    assert!(
        err.to_string().contains("context must be at least 1"),
        "{err}"
    );
}

/// Creates `dir/name` with `bytes` (and its parent).
fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn char_lm_windows_and_batch_order() {
    let corpus = Corpus::generate(1, 10_000);
    let bytes = corpus.bytes();
    assert_eq!(bytes.len(), 10_000);
    assert!(std::str::from_utf8(bytes).is_ok());
    assert_eq!(Corpus::generate(1, 10_000).bytes(), bytes);
    assert_ne!(Corpus::generate(2, 10_000).bytes(), bytes);

    // Validation: the last 10% (1000 bytes), windows of 33 bytes every 32.
    let split = corpus.split(32).unwrap();
    assert_eq!(split.train.len(), (9_000 - 1) / 32);
    assert_eq!(split.valid.len(), (1_000 - 1) / 32);
    let expected: Vec<usize> = (0..split.train.len()).map(|i| i * 32).collect();
    assert_eq!(split.train.offsets(), expected);
    assert_eq!(split.valid.offsets()[0], 9_000);
    assert!(split.train.offsets().last().unwrap() + 33 <= 9_000);
    assert!(split.valid.offsets().last().unwrap() + 33 <= 10_000);

    // Input/target pairs are the raw bytes shifted by one.
    let device = Default::default();
    let windows = split.train.clone().shuffled(7).take(8);
    assert_eq!(windows.len(), 8);
    let items: Vec<Window> = (0..8).map(|i| windows.get(i).unwrap()).collect();
    let batch: LmBatch<B> = LmBatcher.batch(items, &device);
    assert_eq!(batch.inputs.dims(), [8, 32]);
    let inputs = batch
        .inputs
        .into_data()
        .convert::<i64>()
        .to_vec::<i64>()
        .unwrap();
    let targets = batch
        .targets
        .into_data()
        .convert::<i64>()
        .to_vec::<i64>()
        .unwrap();
    for (row, &offset) in windows.offsets().iter().enumerate() {
        for t in 0..32 {
            assert_eq!(
                inputs[row * 32 + t],
                i64::from(bytes[offset + t]),
                "input {row},{t}"
            );
            assert_eq!(
                targets[row * 32 + t],
                i64::from(bytes[offset + t + 1]),
                "target {row},{t}"
            );
        }
    }

    // The batch order: a permutation of the windows, a function of the seed.
    let order = |seed| split.train.clone().shuffled(seed).offsets().to_vec();
    assert_eq!(order(7), order(7));
    assert_ne!(order(7), order(8));
    let mut sorted = order(7);
    sorted.sort();
    assert_eq!(sorted, expected);

    // A directory: text files in path order, each once (the `.u8` symlink and a directory loop are skipped),
    // binary (NUL) and non-UTF-8 files skipped, an empty file harmless.
    let dir = temp_dir("char-lm-dir");
    let a = write(&dir, "a", b"alpha text\n");
    write(&dir, "a.dat", &[0, 0, 0, 2, 0, 0, 0, 9]);
    write(&dir, "b-latin1", b"caf\xe9\n");
    write(&dir, "c-empty", b"");
    let z = write(&dir, "sub/z", "zeta \u{3b6}\n".as_bytes());
    std::os::unix::fs::symlink(&a, dir.join("a.u8")).unwrap();
    std::os::unix::fs::symlink(&dir, dir.join("sub/loop")).unwrap();
    let corpus = Corpus::load(&dir).unwrap();
    assert_eq!(corpus.bytes(), "alpha text\nzeta \u{3b6}\n".as_bytes());
    assert_eq!(corpus.files(), [a.clone(), z]);
    // One file.
    assert_eq!(Corpus::load(&a).unwrap().bytes(), b"alpha text\n");
}

#[test]
fn char_lm_bad_inputs() {
    let dir = temp_dir("char-lm-bad");

    let missing = dir.join("no-such-file");
    let err = Corpus::load(&missing).unwrap_err();
    assert!(
        matches!(err, CorpusError::NotFound { ref path } if path == &missing),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        format!("{}: no such file or directory", missing.display())
    );

    let empty = write(&dir, "empty.txt", b"");
    let err = Corpus::load(&empty).unwrap_err();
    assert!(
        matches!(err, CorpusError::Empty { ref path } if path == &empty),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        format!("{}: empty: no text to train on", empty.display())
    );

    let short = write(&dir, "short.txt", &[b'x'; 100]);
    let err = Corpus::load(&short).unwrap().split(64).unwrap_err();
    assert!(
        matches!(
            err,
            CorpusError::TooShort {
                len: 100,
                context: 64,
                needed: 130
            }
        ),
        "{err}"
    );
    let message = err.to_string();
    assert!(
        message.contains("100 bytes") && message.contains("130 bytes"),
        "{message}"
    );
    assert!(
        message.contains("context 64") && message.contains("65 bytes"),
        "{message}"
    );
    // Exactly the minimum works: one window in each split.
    let split = Corpus::load(write(&dir, "min.txt", &[b'x'; 130]))
        .unwrap()
        .split(64)
        .unwrap();
    assert_eq!((split.train.len(), split.valid.len()), (1, 1));
    let err = Corpus::load(&short).unwrap().split(0).unwrap_err();
    assert!(matches!(err, CorpusError::ZeroContext), "{err}");

    let binary_dir = dir.join("binary");
    write(&binary_dir, "index.dat", &[0, 0, 0, 2, 0xff]);
    write(&binary_dir, "nested/latin1.txt", b"caf\xe9");
    let err = Corpus::load(&binary_dir).unwrap_err();
    assert!(
        matches!(err, CorpusError::NoTextFiles { ref dir } if dir == &binary_dir),
        "{err}"
    );
    assert!(
        err.to_string()
            .starts_with(&format!("{}: no UTF-8 text files", binary_dir.display()))
    );
    let err = Corpus::load(binary_dir.join("index.dat")).unwrap_err();
    assert!(matches!(err, CorpusError::NotText { .. }), "{err}");
    assert!(
        err.to_string()
            .ends_with("index.dat: not a UTF-8 text file (it holds NUL bytes)"),
        "{err}"
    );

    let empty_dir = dir.join("empty-files");
    write(&empty_dir, "a.txt", b"");
    let err = Corpus::load(&empty_dir).unwrap_err();
    assert!(
        matches!(err, CorpusError::Empty { ref path } if path == &empty_dir),
        "{err}"
    );
}

/// Bytes per batch of the training test.
const BATCH: usize = 32;

/// The losses of `steps` Adam steps (lr 5e-3, batch 32, context 32) on the generated corpus under `recipe`: the
/// first step's and the mean of the last 5.
fn train(recipe: Option<Recipe>, steps: usize) -> (f32, f32) {
    let device = Default::default();
    // Other tests share Flex's generator, so the initial weights vary between runs (the bounds allow for it).
    B::seed(&device, 0);
    let split = Corpus::generate(3, 40_000).split(32).unwrap();
    let windows = split.train.shuffled(5);
    let mut model = CharGptConfig::new()
        .with_context(32)
        .with_hidden(64)
        .with_layers(1)
        .with_heads(4)
        .with_ffn(128)
        .init::<B>(&device)
        .with_recipe(recipe);
    let mut optim = AdamConfig::new().init();
    let mut losses = Vec::new();
    for step in 0..steps {
        let items = (0..BATCH)
            .map(|i| windows.get((step * BATCH + i) % windows.len()).unwrap())
            .collect();
        let out = model.forward_batch(LmBatcher.batch(items, &device));
        losses.push(out.loss.clone().into_scalar().elem::<f32>());
        let grads = GradientsParams::from_grads(out.loss.backward(), &model);
        model = optim.step(5e-3, model, grads);
    }
    let last = losses[steps - 5..].iter().sum::<f32>() / 5.0;
    (losses[0], last)
}

/// The entropy (nats) of the byte frequencies of `bytes`: the loss of a model that knows only which bytes occur.
fn unigram_entropy(bytes: &[u8]) -> f32 {
    let mut counts = [0usize; 256];
    for &b in bytes {
        counts[usize::from(b)] += 1;
    }
    let n = bytes.len() as f64;
    let h: f64 = counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| -(c as f64 / n) * (c as f64 / n).ln())
        .sum();
    h as f32
}

#[test]
fn char_lm_training_lowers_the_loss() {
    // The uniform guess over 256 bytes: 5.545 nats; the byte frequencies of the generated text: 3.04 nats. After
    // 80 steps the model must beat the latter by 0.3 nats: it uses the context (the words, capitals after a full
    // stop), not only which bytes are common. Over 8 initial seeds the last loss ranged 1.74-2.27 (f32) and
    // 1.47-2.57 (Float8CurrentScaling).
    let uniform = 256f32.ln();
    let unigram = unigram_entropy(Corpus::generate(3, 40_000).bytes());
    assert!((unigram - 3.04).abs() < 0.01, "unigram entropy {unigram}");
    for (name, recipe) in [
        ("f32", None),
        ("current", Some(Float8CurrentScaling::default().into())),
    ] {
        let (first, last) = train(recipe, 80);
        eprintln!("{name}: first step {first:.3}, mean of the last 5 of 80 steps {last:.3}");
        // The first loss is the uniform guess's (small initial logits).
        assert!((first - uniform).abs() < 0.15, "{name}: first loss {first}");
        assert!(first - last > 2.5, "{name}: 80 steps: {first} -> {last}");
        assert!(
            last < unigram - 0.3,
            "{name}: 80 steps: {last}, unigram entropy {unigram}"
        );
    }
}

/// The parity study's schedule over 400 steps (peak 2e-3): warmup over 40 steps from peak/40, the peak at the end of
/// the warmup and the start of the decay, 0.55 · peak halfway through the decay (step 220: cos(π/2) = 0), a tenth of
/// the peak at step 400 and after it.
#[test]
fn warmup_cosine_follows_the_parity_studys_schedule() {
    let peak = 2e-3;
    let expected = [
        (0, peak / 40.0),
        (19, peak * 20.0 / 40.0),
        (39, peak),
        (40, peak),
        (220, 0.55 * peak),
        (400, 0.1 * peak),
        (800, 0.1 * peak),
    ];
    for (step, lr) in expected {
        let got = warmup_cosine(peak, step, 400);
        assert!(
            (got - lr).abs() <= 1e-15,
            "step {step}: {got} (expected {lr})"
        );
    }
    // Step 130 of 400: a quarter into the decay, 0.1 + 0.45 · (1 + cos(π/4)).
    let quarter = peak * (0.1 + 0.45 * (1.0 + std::f64::consts::FRAC_1_SQRT_2));
    assert!((warmup_cosine(peak, 130, 400) - quarter).abs() <= 1e-15);
}

/// The example's scheduler as burn-train's `Learner` calls it (one `step()` before each optimizer step): the first
/// call gives step 0's rate, the 40th the peak, the 221st 0.55 · peak (the hand-derived values above). A run
/// resumed from its record at step 130 goes on with step 130's rate (a quarter into the decay), and a constant
/// schedule gives its rate at every step.
#[test]
fn the_examples_scheduler_steps_the_schedule_and_resumes_from_its_record() {
    use burn::lr_scheduler::LrScheduler;
    type B = burn::backend::Flex;
    let peak = 2e-3;
    let mut scheduler = LmSchedule::WarmupCosine { peak, steps: 400 }.scheduler();
    let rates: Vec<f64> = (0..221).map(|_| scheduler.step()).collect();
    for (call, lr) in [(1, peak / 40.0), (40, peak), (41, peak), (221, 0.55 * peak)] {
        let got = rates[call - 1];
        assert!(
            (got - lr).abs() <= 1e-15,
            "call {call}: {got} (expected {lr})"
        );
    }
    let mut first = LmSchedule::WarmupCosine { peak, steps: 400 }.scheduler();
    (0..130).for_each(|_| {
        first.step();
    });
    let record = first.to_record::<B>();
    let mut resumed = LmSchedule::WarmupCosine { peak, steps: 400 }
        .scheduler()
        .load_record::<B>(record);
    let quarter = peak * (0.1 + 0.45 * (1.0 + std::f64::consts::FRAC_1_SQRT_2));
    let got = resumed.step();
    assert!(
        (got - quarter).abs() <= 1e-15,
        "resumed at 130: {got} (expected {quarter})"
    );
    assert_eq!(got, first.step(), "step 130, resumed vs run on");
    assert_eq!(resumed.step(), first.step(), "step 131, resumed vs run on");
    let mut constant = LmSchedule::Constant(3e-3).scheduler();
    assert!((0..5).all(|_| constant.step() == 3e-3));
}
