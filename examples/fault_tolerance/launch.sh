#!/usr/bin/env bash
# A fault-tolerant job on this host: a torchft lighthouse and two replica groups of 2 ranks each, every group a
# torchrun with its own rendezvous (--standalone picks a free port per group). Logs: lightning_logs/group_<g>/.
#   bash examples/fault_tolerance/launch.sh [extra lightning-mm fit arguments, e.g. --trainer.max_steps 5]
# On a cluster, start the lighthouse on one host and one torchrun per group with --rdzv-endpoint on its own first
# node (docs/fault_tolerance.md).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
port="${LIGHTHOUSE_PORT:-29510}"
export TORCHFT_LIGHTHOUSE="localhost:$port" TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 OMP_NUM_THREADS=1
lightning-mm lighthouse --bind "127.0.0.1:$port" --min_replicas 1 &
lighthouse=$!
for _ in $(seq 150); do  # up to 30 s for the lighthouse to listen before the groups look for it
  (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
  sleep 0.2
done
pids=()
trap 'kill "${pids[@]}" "$lighthouse" 2>/dev/null || true' EXIT
for g in 0 1; do
  LMM_REPLICA_GROUP=$g torchrun --standalone --nproc-per-node 2 --max-restarts 3 \
    -m lightning_mm.trainer.cli fit --config "$here/job.yaml" "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
