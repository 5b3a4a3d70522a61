"""Constrained decoding: JSON-schema-constrained generation against free generation, with and
without speculation, side by side in one run (offline engine, one request at a time, greedy).

    python benchmarks/bench_structured.py [--prompts 8] [--max-tokens 128] [--repeats 2] [--draft NAME=PATH ...]

The default model (SmolLM2-135M-Instruct), free and constrained to a JSON schema: plain decoding,
the shipped EAGLE-3 draft with its configured tree (adaptive speculation off), and with adaptive
speculation (the default); each --draft adds that EAGLE-3 head at the shipped head's tree, adaptive
speculation off. Reported: decoding tokens per second (per prompt the best of --repeats
runs less the best of the same request cut at its first token, so outputs of different lengths
compare by decoding rate), accept length, how many finished constrained outputs validate against
the schema, and llguidance's mask time per token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from common import machine

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "author": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 0, "maximum": 2100},
        "genres": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
        "summary": {"type": "string", "maxLength": 300},
    },
    "required": ["title", "author", "year", "genres", "summary"],
    "additionalProperties": False,
}
TOPICS = [
    "a famous science-fiction novel",
    "a classic detective story",
    "a children's book about animals",
    "a history book about ancient Rome",
    "a cookbook of Italian recipes",
    "a fantasy novel with dragons",
    "a biography of a scientist",
    "a poetry collection about the sea",
    "a thriller set in a big city",
    "a travel guide to Japan",
]


def prompt(topic: str) -> str:
    return f"Describe {topic} as a JSON object with the keys title, author, year, genres and summary."


def timed(eng, text, params):
    t0 = time.perf_counter()
    r = eng.chat([{"role": "user", "content": text}], params)
    return time.perf_counter() - t0, r


def run(eng, texts, params, repeats):
    """(decode tokens, decode seconds, accept length, outputs). Per prompt, the best of `repeats`
    runs, less the best of `repeats` runs of the same request cut at its first token (prefill and
    first token), so that outputs of different lengths compare by their decoding rate alone."""
    toks = secs = rounds = plain = 0
    outs = []
    for t in texts:
        full = min(timed(eng, t, params)[0] for _ in range(repeats))
        first = min(timed(eng, t, {**params, "max_new_tokens": 1})[0] for _ in range(repeats))
        _, r = timed(eng, t, params)
        n = r["meta_info"]["completion_tokens"]
        toks += n - 1
        secs += max(full - first, 1e-9)
        m = r["meta_info"]
        rounds += m.get("spec_verify_ct") or n
        plain += m.get("spec_plain_steps", 0)
        outs.append(r)
    accept = (sum(r["meta_info"]["completion_tokens"] for r in outs) - plain) / max(rounds, 1)  # rounds only
    return toks, secs, accept, outs


def mask_cost(eng, texts, params, max_tokens):
    """llguidance's mask time per token along the plain constrained outputs (median, p99 in ms)."""
    import llguidance.numpy as lnp

    from jaxspec.sampling import SamplingParams

    p = SamplingParams.from_dict(params)
    g = eng.grammar_of(p)
    gs = eng._grammars
    assert gs is not None and g is not None
    times = []
    for t in texts:
        r = eng.chat([{"role": "user", "content": t}], params)
        m = gs.matcher(g)
        bm = lnp.allocate_token_bitmask(1, eng.cfg.vocab_size)
        for tok in r["output_ids"]:
            t0 = time.perf_counter()
            lnp.fill_next_token_bitmask(m, bm)
            times.append(time.perf_counter() - t0)
            m.consume_token(tok)
    return float(np.median(times) * 1e3), float(np.percentile(times, 99) * 1e3)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--draft", action="append", default=[], help="NAME=PATH: also this EAGLE-3 head, static (repeatable)"
    )
    args = ap.parse_args()
    import jsonschema

    import jaxspec

    texts = [prompt(t) for t in TOPICS[: args.prompts]]
    free = {"temperature": 0, "max_new_tokens": args.max_tokens}
    cons = {**free, "json_schema": json.dumps(SCHEMA)}
    # the float32 model, whose default is the shipped draft (a GGUF's CPU default, gguf, has none)
    common = dict(show_progress=False, dtype="float32", context_length=1024, max_running_requests=1)
    plain = jaxspec.Engine(speculative_algorithm="NONE", **common)
    spec = jaxspec.Engine(speculative_adaptive=False, **common)
    adaptive = jaxspec.Engine(**common)  # the default: adaptive speculation on for the shipped draft
    shape = dict(
        speculative_num_steps=spec.spec.num_steps,
        speculative_eagle_topk=spec.spec.eagle_topk,
        speculative_num_draft_tokens=spec.spec.num_draft_tokens,
    )
    extra = []
    for d in args.draft:
        name, _, path = d.partition("=")
        if not path:
            ap.error(f"--draft {d!r}: use NAME=PATH")
        eng = jaxspec.Engine(speculative_draft_model_path=path, speculative_adaptive=False, **shape, **common)
        extra.append((name, eng))
    print(f"# {machine()}", file=sys.stderr)
    for eng in (plain, spec, adaptive, *(e for _, e in extra)):  # compile every program once
        run(eng, texts[:1], free, 1)
        run(eng, texts[:1], cons, 1)
    rows = {}
    for name, eng, params in [
        ("plain free", plain, free),
        ("plain constrained", plain, cons),
        ("EAGLE-3 free", spec, free),
        ("EAGLE-3 constrained", spec, cons),
        ("EAGLE-3 adaptive free", adaptive, free),
        ("EAGLE-3 adaptive constrained", adaptive, cons),
        *[
            row
            for label, e in extra
            for row in ((f"EAGLE-3 {label} free", e, free), (f"EAGLE-3 {label} constrained", e, cons))
        ],
    ]:
        toks, secs, acc, outs = run(eng, texts, params, args.repeats)
        valid = None
        if "json_schema" in params:  # outputs cut by --max-tokens are not counted as invalid
            done = [o for o in outs if o["meta_info"]["finish_reason"]["type"] == "stop"]
            valid = [0, len(done)]
            for o in done:
                try:
                    jsonschema.validate(json.loads(o["text"]), SCHEMA)
                    valid[0] += 1
                except (json.JSONDecodeError, jsonschema.ValidationError):
                    pass
        rows[name] = dict(tokens=toks, seconds=secs, tok_s=toks / secs, accept=acc, valid=valid)
        print(name, rows[name], file=sys.stderr)
    med, p99 = mask_cost(plain, texts, cons, args.max_tokens)
    r = rows
    print("| configuration | decoded tokens | decode tok/s | accept length | valid JSON / finished |")
    print("|---|---|---|---|---|")
    for name, x in rows.items():
        v = "" if x["valid"] is None else f"{x['valid'][0]}/{x['valid'][1]}"
        print(f"| {name} | {x['tokens']} | {x['tok_s']:.1f} | {x['accept']:.2f} | {v} |")
    print()
    print(f"constrained / free, plain: {r['plain constrained']['tok_s'] / r['plain free']['tok_s']:.3f}")
    for x in ("EAGLE-3", "EAGLE-3 adaptive", *(f"EAGLE-3 {name}" for name, _ in extra)):
        print(f"constrained / free, {x}: {r[x + ' constrained']['tok_s'] / r[x + ' free']['tok_s']:.3f}")
        print(f"{x} / plain, constrained: {r[x + ' constrained']['tok_s'] / r['plain constrained']['tok_s']:.3f}")
        print(f"{x} / plain, free: {r[x + ' free']['tok_s'] / r['plain free']['tok_s']:.3f}")
    print(f"llguidance mask per token: median {med:.3f} ms, p99 {p99:.3f} ms")


if __name__ == "__main__":
    main()
