#!/usr/bin/env bash
# Peer benchmark: MaxText (PyPI `maxtext` 0.2.5) training small-cpu's DeepSeek-V3-style MoE on the CPU
# with 8 fake XLA devices, synthetic data, mesh expert=4 x fsdp=2: the peer that
# benchmarks/step_cpu.py is held against (README, "Measured on CPU"). Run it in the same window as
# step_cpu.py and compare ratios; these machines are noisy.
#
#   bash benchmarks/maxtext_cpu.sh                 # AdamW, capacity-factor 1.0 token dropping
#   MT_OPT=muon bash benchmarks/maxtext_cpu.sh     # Muon
#
# Environment knobs (defaults = the recorded benchmark):
#   MT_VENV   venv with maxtext (default ~/.cache/europa-peers/maxtext; created with PYENV_PY if missing,
#             dependencies installed if `import maxtext.trainers.pre_train.train` fails)
#   MT_MODE   ep4_capacity (default): ici_expert_parallelism=4 ici_fsdp_parallelism=2,
#                 sparse_matmul=false (einsum dispatch), capacity_factor=1.0 (token dropping)
#             ep4_dense_dropless: same mesh, sparse_matmul=false, capacity_factor=-1
#                 (dropless but every token runs through every expert)
#             ep1_ragged: ici_expert_parallelism=1 ici_fsdp_parallelism=8, sparse_matmul=true
#                 megablox=false (jax.lax.ragged_dot, dropless; no expert parallelism)
#             ep4_roe_megablox: EP=4 x fsdp=2, sparse_matmul=true megablox=true use_ring_of_experts=true
#                 (dropless; the megablox Pallas kernel runs in *interpret* mode on CPU -> very slow)
#             ep4_roe_ragged: EP=4 x fsdp=2, sparse_matmul=true megablox=false use_ring_of_experts=true:
#                 FAILS (jax.lax.ragged_dot gets 16 group sizes for 4 local experts), kept to reproduce
#             ep4_ragged_a2a: EP=4 x fsdp=2, sparse_matmul=true megablox=false (ragged_all_to_all):
#                 FAILS on XLA:CPU, kept to reproduce the error
#   MT_AXIS2  fsdp (default) | data: the size-2 axis next to expert=4
#   MT_OPT    adamw (default) | muon
#   MT_REMAT  full (default) | none | any MaxText remat_policy
#   MT_STEPS  12 (default); median is taken over 1-based steps 4..MT_STEPS
#   MT_OUT    run directory (default: a new temporary directory); log = $MT_OUT/train.log
# Last line printed: maxtext_step_s=<median s/step> tokens_per_s=<global tokens / median step s>
set -uo pipefail

MT_VENV=${MT_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/europa-peers/maxtext}
MT_MODE=${MT_MODE:-ep4_capacity}
MT_OPT=${MT_OPT:-adamw}
MT_REMAT=${MT_REMAT:-full}
MT_STEPS=${MT_STEPS:-12}
# a Python 3.12 interpreter (MaxText 0.2.5 needs jax 0.11, which needs 3.12); pyenv's if present
PYENV_PY=${PYENV_PY:-$( (pyenv prefix 3.12.1 2>/dev/null || pyenv prefix 3.12 2>/dev/null) | head -1 | sed 's|$|/bin/python|')}
[ -x "$PYENV_PY" ] || PYENV_PY=python3.12

# ---------------------------------------------------------------- environment
if [ ! -x "$MT_VENV/bin/python" ]; then
  echo "[maxtext_cpu] creating venv $MT_VENV" >&2
  "$PYENV_PY" -m venv "$MT_VENV" || { echo "venv creation failed" >&2; exit 1; }
  "$MT_VENV/bin/pip" install -q "maxtext==0.2.5" || { echo "pip install maxtext failed" >&2; exit 1; }
fi
# maxtext 0.2.5 declares all runtime deps only under extras (tpu/cuda12); `pip install maxtext`
# installs none. Install the CPU subset that train.py needs (versions used for the recorded run).
if ! DECOUPLE_GCLOUD=TRUE JAX_PLATFORMS=cpu "$MT_VENV/bin/python" -c "import maxtext.trainers.pre_train.train" >/dev/null 2>&1; then
  echo "[maxtext_cpu] installing CPU dependencies into $MT_VENV" >&2
  "$MT_VENV/bin/pip" install -q \
    "jax==0.11.2" "jaxlib==0.11.2" "flax==0.12.12" "optax==0.2.8" "orbax-checkpoint==0.12.8" \
    "grain==0.2.18" "qwix==0.1.8" "tokamax==0.0.17" "pathwaysutils==0.1.13" "omegaconf==2.4.0" \
    "pydantic==2.14.4" "absl-py==2.5.1" "jaxtyping==0.3.11" "chex==0.1.92" ml-collections \
    "sentencepiece==0.2.3" "tiktoken==0.14.0" "tensorboardx==2.6.5" "aqtp==0.9.0" "drjax==0.2.1" \
    jinja2 huggingface-hub "transformers==5.24.0" pillow sympy \
    || { echo "dependency install failed" >&2; exit 1; }
  DECOUPLE_GCLOUD=TRUE JAX_PLATFORMS=cpu "$MT_VENV/bin/python" -c "import maxtext.trainers.pre_train.train" \
    || { echo "maxtext still not importable" >&2; exit 1; }
fi

MT_PKG=$("$MT_VENV/bin/python" -c "import maxtext, os; print(os.path.dirname(maxtext.__file__))")
BASE_YML="$MT_PKG/configs/base.yml"
[ -f "$BASE_YML" ] || { echo "base.yml not found at $BASE_YML" >&2; exit 1; }

MT_OUT=${MT_OUT:-$(mktemp -d -t maxtext_cpu.XXXXXX)}
mkdir -p "$MT_OUT"
LOG="$MT_OUT/train.log"

# ---------------------------------------------------------------- configuration
# Model: deepseek3 routing code paths are selected by model_name prefix "deepseek3" in MaxText
# (bias used only for expert *selection*, weights from pre-bias sigmoid scores, normalised, scaled),
# so we load configs/models/deepseek3-tiny.yml and override every shape key (override_model_config).
# Shapes of configs/small-cpu.yaml (override the whole list with MT_MODEL_KEYS="k=v k=v ...").
MODEL_KEYS=(
  model_name=deepseek3-tiny override_model_config=true decoder_block=deepseek
  vocab_size=257 base_emb_dim=256 base_num_decoder_layers=4 first_num_dense_layers=1
  base_mlp_dim=768 base_moe_mlp_dim=128 "mlp_activations=[silu,linear]"
  base_num_query_heads=8 base_num_kv_heads=8 attention_type=mla attention=dot_product
  q_lora_rank=128 kv_lora_rank=64 qk_nope_head_dim=32 qk_rope_head_dim=16 v_head_dim=32
  num_experts=32 num_experts_per_tok=4 shared_experts=1 n_routing_groups=4 topk_routing_group=2
  routed_score_func=sigmoid routed_bias=true routed_bias_update_rate=0.01 routed_scaling_factor=2.5
  enable_dropout=false logits_via_embedding=false normalization_layer_epsilon=1.0e-6
  dtype=bfloat16 weight_dtype=float32
)
[ -n "${MT_MODEL_KEYS:-}" ] && read -ra MODEL_KEYS <<< "$MT_MODEL_KEYS"
RUN_KEYS=(
  run_name=maxtext_cpu_bench base_output_directory="$MT_OUT/out" hardware=cpu
  skip_jax_distributed_system=true dataset_type=synthetic enable_checkpointing=false
  steps="$MT_STEPS" log_period=1 enable_tensorboard=false enable_goodput_recording=false
  monitor_goodput=false jax_cache_dir=""
  per_device_batch_size="${MT_PER_DEVICE_BATCH:-2}" max_target_length="${MT_SEQ:-512}"  # small-cpu: 16 x 512
  opt_type="$MT_OPT" remat_policy="$MT_REMAT"
)
# second mesh axis of size 2 next to expert=4 (ici_fsdp_parallelism=2 by default; MT_AXIS2=data for DP)
MT_AXIS2=${MT_AXIS2:-fsdp}
AX2=("ici_${MT_AXIS2}_parallelism=2")
[ "$MT_AXIS2" = fsdp ] || AX2+=(ici_fsdp_parallelism=1)
case "$MT_MODE" in
  ep4_capacity)       MODE_KEYS=(ici_expert_parallelism=4 "${AX2[@]}" sparse_matmul=false capacity_factor=1.0) ;;
  ep4_dense_dropless) MODE_KEYS=(ici_expert_parallelism=4 "${AX2[@]}" sparse_matmul=false capacity_factor=-1) ;;
  ep1_ragged)         MODE_KEYS=(ici_expert_parallelism=1 ici_fsdp_parallelism=8 sparse_matmul=true megablox=false) ;;
  ep4_roe_megablox)   MODE_KEYS=(ici_expert_parallelism=4 "${AX2[@]}" sparse_matmul=true megablox=true use_ring_of_experts=true) ;;
  ep4_roe_ragged)     MODE_KEYS=(ici_expert_parallelism=4 "${AX2[@]}" sparse_matmul=true megablox=false use_ring_of_experts=true) ;;
  ep4_ragged_a2a)     MODE_KEYS=(ici_expert_parallelism=4 "${AX2[@]}" sparse_matmul=true megablox=false) ;;
  *) echo "unknown MT_MODE=$MT_MODE" >&2; exit 2 ;;
esac

export XLA_FLAGS="--xla_force_host_platform_device_count=8${MT_EXTRA_XLA_FLAGS:+ $MT_EXTRA_XLA_FLAGS}"
export JAX_PLATFORMS=cpu DECOUPLE_GCLOUD=TRUE TF_CPP_MIN_LOG_LEVEL=1

echo "[maxtext_cpu] mode=$MT_MODE opt=$MT_OPT remat=$MT_REMAT steps=$MT_STEPS log=$LOG" >&2
echo "[maxtext_cpu] keys: ${MODEL_KEYS[*]} ${RUN_KEYS[*]} ${MODE_KEYS[*]}" >&2

# Thin launcher: identical to `python -m maxtext.trainers.pre_train.train base.yml k=v ...`, except
# that it also logs the exact parameter count (MaxText itself prints it rounded to 0.001 billion).
cd "$MT_OUT" || exit 1
start=$(date +%s)
timeout "${MT_TIMEOUT:-1200}" "$MT_VENV/bin/python" -u - "$BASE_YML" "${MODEL_KEYS[@]}" "${RUN_KEYS[@]}" "${MODE_KEYS[@]}" >"$LOG" 2>&1 <<'PY'
import sys
from absl import app
from maxtext.utils import max_utils, max_logging
_count = max_utils.calculate_num_params_from_pytree
def _logged_count(params):
  n = _count(params)
  max_logging.log(f"exact number parameters: {n}")
  return n
max_utils.calculate_num_params_from_pytree = _logged_count
from maxtext.trainers.pre_train import train
app.run(train.main, argv=["maxtext.trainers.pre_train.train"] + sys.argv[1:])
PY
rc=$?
echo "[maxtext_cpu] train exit code $rc after $(( $(date +%s) - start )) s" >&2

grep -E "Num_devices|number parameters|Total TFLOPs|completed step" "$LOG" | sed 's/^.*\] //' >&2
if [ $rc -ne 0 ]; then
  echo "[maxtext_cpu] FAILED; last error lines:" >&2
  grep -E "Error|error:|UNIMPLEMENTED" "$LOG" | grep -v DECOUPLED | tail -3 >&2
fi

"$MT_VENV/bin/python" - "$LOG" "$MT_STEPS" "$(( 8 * ${MT_PER_DEVICE_BATCH:-2} * ${MT_SEQ:-512} ))" <<'PY'
import re, statistics, sys
log, nsteps, global_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rows, stamps = {}, {}
pat = re.compile(r"^I\d{4} (\d\d):(\d\d):([\d.]+) .*completed step: (\d+), seconds: ([\d.]+), "
                 r"TFLOP/s/device: [\d.]+, Tokens/s/device: ([\d.]+)")
for line in open(log):
  m = pat.search(line)
  if m:
    s = int(m.group(4))
    rows[s] = (float(m.group(5)), float(m.group(6)))
    stamps[s] = int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
steady = [rows[s] for s in range(3, nsteps) if s in rows]   # MaxText steps are 0-based: 1-based 4..N
if not steady:
  print("maxtext_step_s=nan tokens_per_s=nan")
  sys.exit(1)
step_s = statistics.median(r[0] for r in steady)
tok_dev = statistics.median(r[1] for r in steady)
print(f"[maxtext_cpu] steady steps used: {len(steady)}; MaxText Tokens/s/device median {tok_dev:.1f} (x8 = {8*tok_dev:.1f})", file=sys.stderr)
first, last = 3, max(stamps)
if last > first and first in stamps:  # cross-check: mean wall-clock between log lines of steps 4..N
  print(f"[maxtext_cpu] wall-clock mean s/step over steps {first+2}..{last+1}: {(stamps[last]-stamps[first])/(last-first):.4f}", file=sys.stderr)
print(f"maxtext_step_s={step_s:.4f} tokens_per_s={global_tokens/step_s:.1f}")
PY
