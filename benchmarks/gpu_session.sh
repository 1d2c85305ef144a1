#!/usr/bin/env bash
# Everything that needs a GPU, in parts that each fit one 10-minute command on a one-GPU machine (each part's steps
# run under time limits that sum to about 6 minutes, a hang costing that step only):
#   bash benchmarks/gpu_session.sh setup quick   # or full, tests, fit, attention, profile (docs/gpu.md: what each runs)
# `setup` installs this tree without dependencies (a GPU image has torch, triton, lightning and transformers; wheels of
# anything else, e.g. jsonargparse, fla-core and einops for tests/test_gdn_fla.py, may lie in .whl/). Every part writes
# under benchmarks/results/gpu/ with the device in its file names and the versions in its log, and packs its files into
# $OUT/<part>.tar.gz if $OUT is set.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
RESULTS=benchmarks/results/gpu
mkdir -p "$RESULTS"

versions() {
  python3 - <<'PY'
import importlib, importlib.util, torch
triton = importlib.import_module("triton").__version__ if importlib.util.find_spec("triton") else "none"
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
print(f"device: {name}; torch {torch.__version__}; triton {triton}; CUDA {torch.version.cuda}")
PY
}
step() {  # step <label> <command...>: the label in the log, then the command
  echo "== $1"
  shift
  "$@"
}
kernel_tests() {  # kernel_tests <limit> [pytest options]: on real Triton (TRITON_INTERPRET unset)
  env -u TRITON_INTERPRET timeout "$1" python3 -m pytest -q -p no:cacheprovider "${@:2}" tests/test_kernels.py \
    tests/test_sliding_window.py --junitxml="$RESULTS/kernels_$dev.xml"
}
gpu_tests() {  # gpu_tests <limit> [pytest options]
  timeout "$1" python3 -m pytest -q -p no:cacheprovider "${@:2}" -m gpu tests/test_gpu.py tests/test_gdn_fla.py \
    --junitxml="$RESULTS/gpu_$dev.xml"
}
attention() {  # attention <limit> <head dim> <lengths...> (the JSON is written after every case)
  timeout "$1" python3 benchmarks/attention.py --head-dims "$2" --seq-lens "${@:3}" \
    --out "$RESULTS/attention_${dev}_d$2.json"
}
fit_example() {  # fit_example <limit> <gpu_fit.py options>
  timeout "$1" python3 benchmarks/gpu_fit.py --config examples/gpu_vlm.yaml "${@:2}"
}
pack() {  # pack <part> <files...>
  if [ -n "${OUT:-}" ]; then tar czf "$OUT/$1.tar.gz" "${@:2}" 2>/dev/null; fi
}

run_part() {
  local part=$1 dev log root
  dev=$(python3 -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")' |
        tr -cs 'A-Za-z0-9' '_' | sed 's/^_*//; s/_*$//' | tr '[:upper:]' '[:lower:]')  # as harness.slug
  log=$RESULTS/${part}_$dev.log root=$RESULTS/fit_$dev
  case $part in
    setup)
      if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
          .whl/*.whl
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      fi
      python3 -m pip install -q --no-deps --no-build-isolation -e . && versions ;;
    quick)  # the most important checks of every part: the tests side by side, then the timed steps alone
      rm -rf "$root" && mkdir -p "$root"
      { versions
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
        echo "== native kernel tests (TRITON_INTERPRET unset) beside pytest -m gpu"
        kernel_tests 230 --tb=short > "$RESULTS/kernels_$dev.log" 2>&1 &
        gpu_tests 230 --tb=short > "$RESULTS/gpu_$dev.log" 2>&1
        wait
        tail -n 40 "$RESULTS/kernels_$dev.log" "$RESULTS/gpu_$dev.log"
        step "attention, head dim 128, 16k and 64k" attention 130 128 16384 65536
        step "launch-table sweep, head dim 128, 16k" timeout 80 python3 benchmarks/kernel_sweep.py \
          --out "$RESULTS/kernel_sweep_${dev}_d128.json"
        step "the example VLM at world size 1 against the simulator, one step profiled" \
          fit_example 100 --steps 12 --profile-step 5 --out "$root"; } 2>&1 | tee "$log"
      pack quick "$log" "$RESULTS"/*_"$dev".xml "$RESULTS"/*_"$dev".log "$root" \
        "$RESULTS/attention_${dev}_d128.json" "$RESULTS/kernel_sweep_${dev}_d128.json" ;;
    full)  # most important first, each step under its own limit (sum 17.5 min), results written as they come
      { versions
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
        step "1. native kernel tests (TRITON_INTERPRET unset)" kernel_tests 180 --tb=short --full
        step "2. attention, head dim 128: 16k and 64k first, then 4k, 8k, 32k (EP/EE/MP; ours, flex, sdpa)" \
          attention 300 128 16384 65536 4096 8192 32768
        step "3. the example VLM at world size 1: tokens/s, MFU, step time vs the simulator; profile of one step" \
          fit_example 270 --steps 20 --profile-step 5 --batch-sizes 32 64 --out "$root"
        step "4. attention, head dim 64" attention 210 64 16384 65536 4096 8192 32768
        step "5. pytest -m gpu" gpu_tests 90 --tb=short; } 2>&1 | tee "$log"
      pack full "$log" "$RESULTS"/*_"$dev".xml "$root" "$RESULTS"/attention_"${dev}"_d*.json ;;
    tests)
      { versions
        step "native kernel tests (TRITON_INTERPRET unset)" kernel_tests 150
        step "pytest -m gpu" gpu_tests 250; } 2>&1 | tee "$log"
      pack tests "$log" "$RESULTS/kernels_$dev.xml" "$RESULTS/gpu_$dev.xml" ;;
    fit)
      rm -rf "$root" && mkdir -p "$root/per_module_dp"
      { versions
        step "one GPU, NCCL, bf16-mixed" timeout 150 lightning-mm fit --config examples/gpu_vlm.yaml \
          --trainer.default_root_dir="$root/one_gpu"
        step "3 ranks sharing the GPU (gloo): vision 1 stage, LLM 2 stages" timeout 200 lightning-mm fit --config \
          examples/gpu_vlm.yaml --config examples/gpu_vlm_shared_gpu.yaml --trainer.default_root_dir="$root/shared"
        step "per-module data parallelism, 4 ranks sharing the GPU (gloo): vision dp 2 + LLM dp 1 of 2 stages" \
          timeout 120 python3 tests/helpers/trainer_case.py '{"modalities": ["vision"], "vision": "qwen2_vl",
          "encoder_dp": [2], "llm_dp": 1, "llm_pp": 2, "microbatches": 2, "items": [0, 5], "freeze": "all",
          "balancing": "entrain", "steps": 3, "accelerator": "cuda", "backend": "gloo", "share_gpu": true}' \
          "$root/per_module_dp" && cat "$root/per_module_dp/result.json"; } 2>&1 | tee "$root/fit.log"
      pack fit "$root" ;;
    attention)
      { versions
        attention 200 128 16384 65536 32768 4096 8192
        attention 160 64 16384 65536 32768 4096 8192; } 2>&1 | tee "$log"
      pack attention "$log" "$RESULTS"/attention_"${dev}"_d*.json ;;
    profile)
      { versions
        timeout 150 python3 benchmarks/layer_profile.py --device cuda --out "$RESULTS/layer_profile_$dev.json"
        timeout 150 python3 benchmarks/frozen_aware.py --skip-free --layer-profile "$RESULTS/layer_profile_$dev.json" \
          --out "$RESULTS/frozen_aware_$dev"
        timeout 90 lightning-mm plan --config examples/gpu_vlm.yaml --write-profile "$RESULTS/plan_profile_$dev.json" \
          --out "$RESULTS/plan_$dev"; } 2>&1 | tee "$log"
      pack profile "$log" "$RESULTS/layer_profile_$dev.json" "$RESULTS/frozen_aware_$dev" \
        "$RESULTS/plan_profile_$dev.json" "$RESULTS/plan_$dev" ;;
    *) echo "unknown part '$part': setup, full, quick, tests, fit, attention, profile" >&2; return 2 ;;
  esac
}

[ $# -gt 0 ] || { echo "usage: $0 setup|full|quick|tests|fit|attention|profile ..." >&2; exit 2; }
status=0
for part in "$@"; do
  echo "=== $part"
  run_part "$part" || status=$?
done
exit $status
