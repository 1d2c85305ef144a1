#!/usr/bin/env bash
# Everything that needs a GPU, in parts that each fit one 10-minute command on a one-GPU machine (each part's
# steps run under time limits that sum to about 6 minutes, so four parts fit in 30 minutes of machine time):
#
#   bash benchmarks/gpu_session.sh setup full             # all of the kernel work's checks in under 20 minutes
#   bash benchmarks/gpu_session.sh setup quick            # tests, attention 16k/64k, launch sweep, fit: 9.5 min
#   bash benchmarks/gpu_session.sh setup tests            # native kernel tests, then pytest -m gpu
#   bash benchmarks/gpu_session.sh setup fit              # the ~0.6B VLM: one GPU, then 3 ranks sharing it
#   bash benchmarks/gpu_session.sh setup attention        # benchmarks/attention.py, the goal sizes first
#   bash benchmarks/gpu_session.sh setup profile          # measured layer profiles, frozen-aware rerun on them
#
# `setup` installs this tree without dependencies (a GPU image has torch, triton, lightning and transformers; wheels
# of anything else, e.g. jsonargparse, may lie in .whl/; the fla-core and einops wheels there let
# tests/test_gdn_fla.py's gpu tests run, else they skip). Every part writes under benchmarks/results/gpu/ with the
# device name, torch and triton versions in its file names or contents, runs under its own time limit (a hang
# costs that part only), and when $OUT is set packs its files into $OUT/<part>.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
RESULTS=benchmarks/results/gpu
mkdir -p "$RESULTS"

device_slug() {
  python3 - <<'PY'
import re, torch
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
print(re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_").lower())
PY
}

versions() {
  python3 - <<'PY'
import torch
try:
    import triton; tv = triton.__version__
except ImportError:
    tv = "none"
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
print(f"device: {name}; torch {torch.__version__}; triton {tv}; CUDA {torch.version.cuda}")
PY
}

pack() {  # pack <part> <files...>
  local part=$1; shift
  if [ -n "${OUT:-}" ]; then tar czf "$OUT/$part.tar.gz" "$@" 2>/dev/null; fi
}

run_part() {
  local part=$1 dev
  dev=$(device_slug)
  case $part in
    setup)
      if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      fi
      python3 -m pip install -q --no-deps --no-build-isolation -e . && versions ;;
    quick)  # the most important checks of every part, in one 9.5-minute command: tests first (the kernel tests and
            # pytest -m gpu side by side), then the timed steps alone on the GPU
      local log=$RESULTS/quick_$dev.log root=$RESULTS/fit_$dev
      rm -rf "$root"; mkdir -p "$root"
      { versions; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
        echo "== native kernel tests (TRITON_INTERPRET unset) beside pytest -m gpu";
        env -u TRITON_INTERPRET timeout 230 python3 -m pytest -q --tb=short -p no:cacheprovider tests/test_kernels.py \
          tests/test_sliding_window.py --junitxml="$RESULTS/kernels_$dev.xml" > "$RESULTS/kernels_$dev.log" 2>&1 &
        timeout 230 python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_gdn_fla.py \
          --junitxml="$RESULTS/gpu_$dev.xml" > "$RESULTS/gpu_$dev.log" 2>&1;
        wait; tail -n 40 "$RESULTS/kernels_$dev.log" "$RESULTS/gpu_$dev.log";
        echo "== attention, head dim 128, 16k and 64k";
        timeout 130 python3 benchmarks/attention.py --head-dims 128 --seq-lens 16384 65536 \
          --out "$RESULTS/attention_${dev}_d128.json";
        echo "== launch-table sweep, head dim 128, 16k";
        timeout 80 python3 benchmarks/kernel_sweep.py --out "$RESULTS/kernel_sweep_${dev}_d128.json";
        echo "== the example VLM at world size 1 against the simulator, one step profiled";
        timeout 100 python3 benchmarks/gpu_fit.py --config examples/gpu_vlm.yaml --steps 12 --profile-step 5 \
          --out "$root"; } 2>&1 | tee "$log"
      pack quick "$log" "$RESULTS"/*_"$dev".xml "$RESULTS"/*_"$dev".log "$root" "$RESULTS"/attention_"${dev}"_d128.json \
        "$RESULTS"/kernel_sweep_"${dev}"_d128.json ;;
    full)  # most important first, each step under its own limit (sum 17.5 min), results written as they come
      local log=$RESULTS/full_$dev.log
      { versions; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
        echo "== 1. native kernel tests (TRITON_INTERPRET unset)";
        env -u TRITON_INTERPRET timeout 180 python3 -m pytest -q --tb=short -p no:cacheprovider --full \
          tests/test_kernels.py tests/test_sliding_window.py --junitxml="$RESULTS/kernels_$dev.xml";
        echo "== 2. attention, head dim 128: 16k and 64k first, then 4k, 8k, 32k (EP/EE/MP; ours, flex, sdpa)";
        timeout 300 python3 benchmarks/attention.py --head-dims 128 --seq-lens 16384 65536 4096 8192 32768 \
          --out "$RESULTS/attention_${dev}_d128.json";
        echo "== 3. the example VLM at world size 1: tokens/s, MFU, step time vs the simulator; profile of one step";
        timeout 270 python3 benchmarks/gpu_fit.py --config examples/gpu_vlm.yaml --steps 20 --profile-step 5 --batch-sizes 32 64 \
          --out "$RESULTS/fit_$dev";
        echo "== 4. attention, head dim 64";
        timeout 210 python3 benchmarks/attention.py --head-dims 64 --seq-lens 16384 65536 4096 8192 32768 \
          --out "$RESULTS/attention_${dev}_d64.json";
        echo "== 5. pytest -m gpu";
        timeout 90 python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_gdn_fla.py --junitxml="$RESULTS/gpu_$dev.xml";
      } 2>&1 | tee "$log"
      pack full "$log" "$RESULTS"/*_"$dev".xml "$RESULTS/fit_$dev" "$RESULTS"/attention_"${dev}"_d*.json ;;
    tests)
      local log=$RESULTS/tests_$dev.log
      { versions; echo "== native kernel tests (TRITON_INTERPRET unset)";
        env -u TRITON_INTERPRET timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_sliding_window.py \
          --junitxml="$RESULTS/kernels_$dev.xml";
        echo "== pytest -m gpu";
        timeout 250 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_gdn_fla.py --junitxml="$RESULTS/gpu_$dev.xml"; } \
        2>&1 | tee "$log"
      pack tests "$log" "$RESULTS/kernels_$dev.xml" "$RESULTS/gpu_$dev.xml" ;;
    fit)
      local root=$RESULTS/fit_$dev
      rm -rf "$root"; mkdir -p "$root"
      { versions; echo "== one GPU, NCCL, bf16-mixed";
        timeout 150 lightning-mm fit --config examples/gpu_vlm.yaml --trainer.default_root_dir="$root/one_gpu";
        echo "== 3 ranks sharing the GPU (gloo): vision 1 stage, LLM 2 stages";
        timeout 200 lightning-mm fit --config examples/gpu_vlm.yaml --config examples/gpu_vlm_shared_gpu.yaml \
          --trainer.default_root_dir="$root/shared";
        echo "== per-module data parallelism, 4 ranks sharing the GPU (gloo): vision dp 2 + LLM dp 1 of 2 stages";
        mkdir -p "$root/per_module_dp";
        timeout 120 python3 tests/helpers/trainer_case.py '{"modalities": ["vision"], "vision": "qwen2_vl",
          "encoder_dp": [2], "llm_dp": 1, "llm_pp": 2, "microbatches": 2, "items": [0, 5], "freeze": "all",
          "balancing": "entrain", "steps": 3, "accelerator": "cuda", "backend": "gloo", "share_gpu": true}' \
          "$root/per_module_dp" && cat "$root/per_module_dp/result.json"; } 2>&1 | tee "$root/fit.log"
      pack fit "$root" ;;
    attention)
      local log=$RESULTS/attention_$dev.log
      { versions;
        # writes its JSON after every case: a run cut by its limit keeps what it measured
        timeout 200 python3 benchmarks/attention.py --head-dims 128 --seq-lens 16384 65536 32768 4096 8192 \
          --out "$RESULTS/attention_${dev}_d128.json";
        timeout 160 python3 benchmarks/attention.py --head-dims 64 --seq-lens 16384 65536 32768 4096 8192 \
          --out "$RESULTS/attention_${dev}_d64.json"; } \
        2>&1 | tee "$log"
      pack attention "$log" "$RESULTS"/attention_"${dev}"_d*.json ;;
    profile)
      local log=$RESULTS/profile_$dev.log
      { versions;
        timeout 150 python3 benchmarks/layer_profile.py --device cuda --out "$RESULTS/layer_profile_$dev.json";
        timeout 150 python3 benchmarks/frozen_aware.py --skip-free --layer-profile "$RESULTS/layer_profile_$dev.json" \
          --out "$RESULTS/frozen_aware_$dev";
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
