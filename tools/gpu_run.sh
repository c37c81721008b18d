#!/bin/bash
# The GPU checks of issue 44 in one run on a CUDA machine without a Rust toolchain, from binaries built elsewhere.
#
# Build on the CPU machine (x86-64), then carry target/gpuc to the GPU machine and run this from the repo root:
#   cargo bench --features cuda,autotune --bench cuda --no-run
#   cargo test --release --features cuda,autotune --test kernels --no-run
#   mkdir -p target/gpuc && for b in cuda kernels; do
#     f=$(ls -t target/release/deps/$b-* | grep -v '\.d$' | head -1); strip -o /tmp/$b "$f"; xz -T2 -6 -c /tmp/$b > target/gpuc/$b.xz
#   done
# With a toolchain on the GPU machine, `cargo bench --features cuda,autotune --bench cuda` and
# `cargo test --release --features cuda,autotune --test kernels` do the same.
#
# Order: the tests that compare cuBLASLt on CubeCL's stream with its own stream, check bf16 and run every tiled
# routine (each plane routine on the matrix units, `each_forced_tiled_routine_runs_or_falls_back_counted`) first, then the
# steps (f16 and bf16 processes, each with FP8 on both streams). A fresh machine autotunes Burn's kernels for
# minutes at each float type's first step; CubeCL caches the results under target/autotune, so a second run on the
# same machine is quick. Results go to $OUT (or target/gpu-out).
set -u
G=target/gpuc
OUT=${OUT:-target/gpu-out}; mkdir -p "$OUT"
unxz() { (xz -dc $G/$1.xz 2>/dev/null || python3 -c "import lzma,sys;sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $G/$1.xz) > $G/$1; chmod +x $G/$1; }
unxz cuda; unxz kernels
export CRITERION_HOME=$OUT/criterion CUBECL_AUTOTUNE_LEVEL=minimal
if ! ldconfig -p | grep -q libcublasLt; then
  d=$(dirname "$(find / -name 'libcublasLt.so*' 2>/dev/null | head -1)"); export LD_LIBRARY_PATH=$d:${LD_LIBRARY_PATH:-}
fi
t0=$(date +%s); el() { echo "[t=$(( $(date +%s) - t0 ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
el "tests: cuBLASLt streams, bf16, the tiled path"
timeout ${TESTS_S:-200} $G/kernels --test-threads 1 device_gemm cubek_tiled 2>&1 | tee $OUT/tests.txt | grep -E "^test |test result|panicked" | head -40
run() { # float timeout filter
  el "$1: $3"
  BURN_TE_BENCH_FLOAT=$1 timeout $2 $G/cuda --bench "$3" --warm-up-time 1 --measurement-time 3 2>&1 | tee $OUT/$1.txt | grep -E "^cuda|time:|thrpt:|paths|fallbacks|panicked|rror" | head -70
}
run f16 ${F16_S:-240} "transformer_layer"
run bf16 ${BF16_S:-240} "gemm 4096x4096x4096|transformer_layer"
run f32 ${F32_S:-200} "gemm 4096x4096x4096"
el done
