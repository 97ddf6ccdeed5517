#!/usr/bin/env bash
# N europa-jax CPU processes on this machine: the multi-process path without Slurm.
#
#   launch/local.sh N CONFIG [europa-jax train options...]
#   launch/local.sh N import HF_DIR --config CONFIG --out RUN_DIR [import options...]
#   e.g. launch/local.sh 2 configs/tiny-cpu.yaml --set train.steps=20
#
# Each process gets mesh.data × mesh.expert / N CPU devices, and they train (or import a
# Hugging Face checkpoint, each reading its own shards) as one job (gloo collectives).
# Rank i logs to $EUROPA_LOG_DIR/rank-i.log; rank 0 is also shown here.
# TERM and USR1 sent to this script go to every rank: they save a checkpoint and exit 75,
# as under Slurm. When one rank ends, the others get EUROPA_RANK_EXIT_WAIT_S seconds to
# end too, then are killed, so a dead rank never leaves the rest hanging. The exit code
# is the highest of the ranks' (128 + signal for a rank killed by a signal), like srun's.
set -euo pipefail

usage="usage: launch/local.sh N CONFIG [europa-jax train options...] | N import HF_DIR --config CONFIG --out RUN_DIR"
if [ "$#" -lt 2 ]; then echo "$usage" >&2; exit 2; fi
n=$1; shift
if ! [[ "$n" =~ ^[1-9][0-9]*$ ]]; then
  echo "local.sh: N: '$n' is not a positive integer; $usage" >&2; exit 2
fi
if [ "$1" = import ]; then
  command=("$@")  # europa-jax import checks its own arguments
else
  config=$1; shift
  if [ ! -f "$config" ]; then echo "local.sh: CONFIG: $config: no such file" >&2; exit 2; fi
  command=(train "$config" "$@")
fi

: "${EUROPA_LOG_DIR:=logs/local-$(date +%Y%m%d-%H%M%S)-$$}"
: "${EUROPA_RANK_EXIT_WAIT_S:=60}"
: "${EUROPA_JAX:=europa-jax}"  # the command; e.g. "python -m europa_jax.cli"
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
mkdir -p "$EUROPA_LOG_DIR"

# A free port for the coordinator (process 0), chosen by the kernel.
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

pids=()
for ((i = 0; i < n; i++)); do
  EUROPA_JAX_COORDINATOR=127.0.0.1:$port EUROPA_JAX_NUM_PROCESSES=$n EUROPA_JAX_PROCESS_ID=$i \
    $EUROPA_JAX "${command[@]}" >"$EUROPA_LOG_DIR/rank-$i.log" 2>&1 &
  pids+=($!)
done
echo "local.sh: $n processes (pids ${pids[*]}), logs in $EUROPA_LOG_DIR" >&2
tail -n +1 -F "$EUROPA_LOG_DIR/rank-0.log" 2>/dev/null &
tail_pid=$!

forward() { kill -s "$1" "${pids[@]}" 2>/dev/null || true; }
# Background processes of a script ignore SIGINT, so Ctrl-C becomes TERM: save and stop.
trap 'forward TERM' TERM INT
trap 'forward USR1' USR1

running() { local p count=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && count=$((count + 1)); done; echo "$count"; }

while [ "$(running)" -eq "$n" ]; do sleep 1; done  # until the first rank ends
deadline=$((SECONDS + EUROPA_RANK_EXIT_WAIT_S))
while [ "$(running)" -gt 0 ] && [ "$SECONDS" -lt "$deadline" ]; do sleep 1; done
if [ "$(running)" -gt 0 ]; then
  echo "local.sh: a rank ended ${EUROPA_RANK_EXIT_WAIT_S} s ago; killing the others" >&2
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
fi

rc=0
for ((i = 0; i < n; i++)); do
  status=0
  wait "${pids[$i]}" || status=$?
  if [ "$status" -ne 0 ]; then echo "local.sh: rank $i exited with $status" >&2; fi
  if [ "$status" -gt "$rc" ]; then rc=$status; fi
done
sleep 1  # let tail show rank 0's last lines
kill "$tail_pid" 2>/dev/null || true
exit "$rc"
