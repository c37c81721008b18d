#!/bin/bash
# The GPU checks of issue 44 in one run on a CUDA machine without a Rust toolchain, from binaries built elsewhere.
#
# Build on the CPU machine (x86-64), then carry target/gpuc to the GPU machine and run this from the repo root:
#   cargo bench --features cuda,autotune --bench cuda --no-run
#   cargo test --release --features cuda,autotune --test kernels --no-run
#   mkdir -p target/gpuc && for b in cuda kernels; do
#     f=$(ls -t target/release/deps/$b-* | grep -v '\.d$' | head -1); strip -o /tmp/$b "$f"; xz -T2 -6 -c /tmp/$b > target/gpuc/$b.xz
#   done; git rev-parse HEAD > target/gpuc/BUILT_FROM
# A session may have left them built: target/gpuc/BUILT_FROM names the commit; where `git diff $(cat
# target/gpuc/BUILT_FROM) --stat -- '*.rs' '*.toml'` is empty, carry them as they are.
# With a toolchain on the GPU machine, `cargo bench --features cuda,autotune --bench cuda` and
# `cargo test --release --features cuda,autotune --test kernels` do the same.
#
# The whole run keeps within BUDGET_S seconds (default 540), in this order:
# 1. the CUDA tests of the device paths: a TransformerLayer trained on every path and recipe (cuBLASLt on both
#    streams; its printed losses kept in $OUT/tests-train.txt), then the GEMM tests that compare the two streams bit
#    for bit, and every FP8 code through every tiled routine (the device's own FP8 conversion from sm 89);
# 2. the TransformerLayer step per float type of STEP_FLOATS (default "f16 bf16"), each in its own process: on
#    Burn's fused `Cuda`, and in FP8 on cuBLASLt on CubeCL's stream and on its own stream, with activations of that
#    type; each row also prints the host's share of its step;
# 3. with the time left (GEMMS=0 skips it), the f32 process's GEMMs at 4096³ (cuBLASLt on both streams, the tiled
#    routines).
# A fresh machine autotunes Burn's kernels for minutes at each float type's first step. CubeCL caches the results
# under target/autotune; the run packs them into $OUT/autotune.tar.xz, and a later run that finds that file in
# target/gpuc starts from it. On an H200 without one, the run starts from tools/gpu-autotune-h200.tar.xz, the
# choices of Burn 0.21's kernels an H200 made here (2026-12-04; CubeCL keys them by device index, not model).
# PROFILE=<float> runs only the steps of that float type under CubeCL's profiler (CUBECL_DEBUG_OPTION=profile-medium),
# its log in $OUT/profile-<float>.log.xz: every launch is timed alone, so the steps' times there are not their speed.
# Results go to $OUT (or target/gpu-out).
set -u
G=target/gpuc
OUT=${OUT:-target/gpu-out}; mkdir -p "$OUT"
t0=$(date +%s); deadline=$(( t0 + ${BUDGET_S:-540} ))
left() { echo $(( deadline - $(date +%s) )); }
el() { echo "[t=$(( $(date +%s) - t0 ))s] $*"; }
unxz() { (xz -dc $G/$1.xz 2>/dev/null || python3 -c "import lzma,sys;sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $G/$1.xz) > $G/$1; chmod +x $G/$1; }
unxz cuda; unxz kernels
seed=$G/autotune.tar.xz
[ -f $seed ] || { nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && seed=tools/gpu-autotune-h200.tar.xz; }
if [ -f $seed ] && [ ! -d target/autotune ]; then
  mkdir -p target && python3 -c "import tarfile,sys;tarfile.open(sys.argv[1]).extractall('target')" $seed && el "autotune cache seeded from $seed"
fi
export CRITERION_HOME=/tmp/criterion CUBECL_AUTOTUNE_LEVEL=minimal
if ! ldconfig -p | grep -q libcublasLt; then
  d=$(dirname "$(find / -name 'libcublasLt.so*' 2>/dev/null | head -1)"); export LD_LIBRARY_PATH=$d:${LD_LIBRARY_PATH:-}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
tests() { # timeout name filter...
  local s=$1 name=$2; shift 2; el "tests ($name, ${s}s): $*"
  timeout $s $G/kernels --test-threads 1 "$@" 2>&1 | tee $OUT/tests-$name.txt | grep -E "^test |test result|panicked|^  left|^ right" | head -30
}
if [ -n "${PROFILE:-}" ]; then # CubeCL's per-kernel profile of the steps of one float type, instead of the checks below
  el "profile ($PROFILE, $(( $(left) - 20 )) s)"
  BURN_TE_BENCH_FLOAT=$PROFILE CUBECL_DEBUG_LOG=$OUT/profile-$PROFILE.log CUBECL_DEBUG_OPTION=profile-medium \
    timeout $(( $(left) - 20 )) $G/cuda --bench transformer_layer --warm-up-time 1 --measurement-time 2 2>&1 \
    | grep -E "^cuda|time:|returns after" | tee $OUT/bench-profile-$PROFILE.txt
  ls -la $OUT; xz -T4 -9 $OUT/profile-$PROFILE.log; el done; exit 0
fi
tests ${TRAIN_S:-110} train --nocapture device_gemm::transformer_layer_trains_the_same_on_every_path
tests ${STREAM_S:-120} streams gemm::every_code_through_every_tiled_routine gemm::every_code_decoded_ahead_in_each_lane device_gemm::the_decoded_path device_gemm::each_forced_tiled_routine device_gemm::exact_sums device_gemm::random_operands device_gemm::a_group device_gemm::bf16_operands device_gemm::empty_batches
bench() { # float seconds filter
  el "$1 ($2 s): $3"
  BURN_TE_BENCH_FLOAT=$1 timeout $2 $G/cuda --bench "$3" --warm-up-time 1 --measurement-time 3 2>&1 | tee $OUT/bench-$1.txt | grep -E "^cuda|time:|thrpt:|paths|returns after|panicked|rror" | head -40
}
for float in ${STEP_FLOATS:-f16 bf16}; do
  [ $(left) -gt 70 ] && bench $float $(( $(left) - 40 )) "transformer_layer"
done
[ "${GEMMS:-1}" = 1 ] && [ $(left) -gt 70 ] && bench f32 $(( $(left) - 30 )) "gemm 4096x4096x4096"
el "packing the autotune cache"
[ -d target/autotune ] && python3 -c "import tarfile;t=tarfile.open('$OUT/autotune.tar.xz','w:xz');t.add('target/autotune','autotune');t.close()"
ls -la $OUT; el done
