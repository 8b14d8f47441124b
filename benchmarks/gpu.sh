#!/usr/bin/env bash
# The GPU measurements in one command, for a machine with one CUDA GPU:
#
#     benchmarks/gpu.sh OUTDIR
#
# 1. Pretraining: GPT-2 small (124M, sequence 1024, bf16, compiled) through the recipe
#    against a plain PyTorch loop, MFU against the GPU's bf16 dense peak, a profile of the
#    recipe's step, and resume from a DCP checkpoint written on the GPU
#    (benchmarks/pretrain.py --device cuda).
# 2. The gpu-marked tests (pytest -m gpu).
# 3. Causal attention at that GPT's shape per SDPA backend (benchmarks/attention.py).
# 4. The simulator's vectorised path on cuda at 100,000 clients per round, digits MLP
#    (simulation) and MNIST CNN (simulation-mnist), against the CPU path
#    (benchmarks/simulation.py --device cuda).
# 5. Pretraining again at batch 32 (more tokens a step; no resume check), for the MFU,
#    then at that batch with the whole forward compiled as one graph (pretrain-model).
#
# STEPS names the steps to run (default: all, by the names below); BATCH is the batch of
# the last two.
# Each step has its own time limit (seconds; PRETRAIN_S, TESTS_S, ... below), so one
# that hangs leaves the others their time. Logs and JSON land in OUTDIR. PYTHON picks the
# interpreter (default python3); WORKERS the simulator's worker processes (default 4);
# CHECK_PER_ROUND the simulator's CPU-baseline size (default 2000: the MNIST CNN on a CPU
# trains a few hundred clients a second, so 100,000 would take minutes a round).
set -u
out=${1:?usage: benchmarks/gpu.sh OUTDIR}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
status=0

step() {  # step NAME SECONDS COMMAND...: run it under a limit, log to OUTDIR/NAME.log
    local name=$1 limit=$2
    shift 2
    local all="pretrain tests attention simulation simulation-mnist pretrain-b32 pretrain-model"
    [[ " ${STEPS:-$all} " == *" $name "* ]] || return 0
    echo "== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n "${TAIL_LINES:-40}" "$out/$name.log"
    echo "== $name: exit $rc after $((SECONDS - t0))s"
    [ "$rc" -eq 0 ] || status=1
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
# Fail at once, not step by step, where the GPU or the project cannot be imported.
"$py" -c 'import torch, orchard.pretrain.recipe, orchard.simulation
assert torch.cuda.is_available(), "torch sees no CUDA device"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())' || exit 2

step pretrain "${PRETRAIN_S:-210}" "$py" benchmarks/pretrain.py --device cuda --profile 5 \
    --resume-steps 8 --json "$out/pretrain.json"
step tests "${TESTS_S:-120}" "$py" -m pytest -m gpu -q -p no:cacheprovider \
    tests/pretrain/test_gpu.py tests/simulation/test_device.py
step attention "${ATTENTION_S:-40}" "$py" benchmarks/attention.py
# On an H100 host, digits at 100,000 a round (warm-up round, measured round and the check
# pair) took about two minutes. MNIST's two rounds at 100,000 had not finished in 370 s
# there: each of its uploads is 114,314 values (digits: 4,810), which the engine checks and
# folds 100,000 times a round. Each round is printed as it ends.
step simulation "${SIMULATION_S:-420}" "$py" benchmarks/simulation.py --device cuda \
    --per-round 100000 --check-per-round "${CHECK_PER_ROUND:-2000}" --rounds 1 \
    --workers "${WORKERS:-4}" --tasks digits --json "$out/simulation.json"
step simulation-mnist "${SIMULATION_MNIST_S:-1200}" "$py" benchmarks/simulation.py --device cuda \
    --per-round 100000 --check-per-round "${CHECK_PER_ROUND:-2000}" --rounds 1 \
    --workers "${WORKERS:-4}" --tasks mnist --json "$out/simulation-mnist.json"
b=${BATCH:-32}
step pretrain-b32 "${PRETRAIN_B32_S:-100}" "$py" benchmarks/pretrain.py --device cuda \
    --batch-size "$b" --warmup 2 --rounds 4 --resume-steps 0 --json "$out/pretrain-b32.json"
step pretrain-model "${PRETRAIN_MODEL_S:-100}" "$py" benchmarks/pretrain.py --device cuda \
    --batch-size "$b" --warmup 2 --rounds 4 --resume-steps 0 --compile-scope model \
    --json "$out/pretrain-model.json"
exit $status
