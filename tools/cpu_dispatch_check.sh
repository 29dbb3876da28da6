#!/usr/bin/env bash
# The same run under each CPU-dispatch limit this x86-64 machine can impose: the model digests show which
# limits change the trained model (docs/reliability.md, "The same seed on every CPU").
#
#   tools/cpu_dispatch_check.sh [CONFIG] [STEPS]     (default: configs/quickstart.toml, 60 steps)
#
# Each line is `<limit>: digest <model digest> test auc <auc>`. The limits: numpy's dispatch without AVX-512,
# ATen's kernels at AVX2, MKL and oneDNN at AVX2, FBGEMM at AVX2, all of them together (an AVX2-only x86
# machine as far as these libraries can be told), FBGEMM without its JIT, and ATen without SIMD.
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-configs/quickstart.toml}
steps=${2:-60}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
run() {
    local name=$1
    shift
    env "$@" .venv/bin/recsys train --config "$config" --set "train.steps=$steps" --set "train.log_every=$steps" \
        --set eval.every=0 --out "$scratch/$name" >"$scratch/$name.log" 2>&1 || { echo "$name: failed"; tail -3 "$scratch/$name.log"; return; }
    echo "$name: $(grep -o 'digest [0-9a-f]*' "$scratch/$name.log") $(grep -o 'test auc [0-9.]*' "$scratch/$name.log")"
}
run unrestricted TIERREC_UNUSED=1
run numpy_without_avx512 NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR"
run aten_avx2 ATEN_CPU_CAPABILITY=avx2
run mkl_onednn_avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
run fbgemm_avx2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2
run all_avx2 NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR" ATEN_CPU_CAPABILITY=avx2 \
    MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2
run fbgemm_no_jit FBGEMM_NO_ASMJIT=1
run aten_no_simd ATEN_CPU_CAPABILITY=default
