"""Constrained decoding: JSON-schema-constrained generation against free generation, with and
without speculation, side by side in one run (offline engine, one request at a time, greedy).

    python benchmarks/bench_structured.py [--prompts 8] [--max-tokens 128] [--repeats 2]

Four configurations of the default model (SmolLM2-135M-Instruct): plain free, plain constrained,
shipped EAGLE-3 free, shipped EAGLE-3 constrained (adaptive speculation off, so both runs use
the configured tree). Reported: output tokens per second (best of --repeats per prompt, summed),
accept length, the share of constrained outputs that validate against the schema, and the host
cost of the masks: llguidance's mask time per token, and the masks asked for per round.
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


def run(eng, texts, params, repeats):
    """(tokens, seconds, accept length, outputs): per prompt, the best of `repeats` runs."""
    toks = secs = rounds = 0
    outs = []
    for t in texts:
        best = None
        for _ in range(repeats):
            t0 = time.perf_counter()
            r = eng.chat([{"role": "user", "content": t}], params)
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        n = r["meta_info"]["completion_tokens"]
        toks += n
        secs += best
        rounds += r["meta_info"].get("spec_verify_ct") or n
        outs.append(r["text"])
    return toks, secs, toks / max(rounds, 1), outs


def mask_cost(eng, texts, params, max_tokens):
    """llguidance's mask time per token along the plain constrained outputs (median, p99 in ms)."""
    import llguidance.numpy as lnp

    from jaxspec.sampling import SamplingParams

    p = SamplingParams.from_dict(params)
    g = eng.grammar_of(p)
    assert eng._grammars is not None
    times = []
    for t in texts:
        r = eng.chat([{"role": "user", "content": t}], params)
        m = eng._grammars.matcher(g)
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
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    import jsonschema

    import jaxspec

    texts = [prompt(t) for t in TOPICS[: args.prompts]]
    free = {"temperature": 0, "max_new_tokens": args.max_tokens}
    cons = {**free, "json_schema": json.dumps(SCHEMA)}
    common = dict(show_progress=False, context_length=1024, max_running_requests=1)
    plain = jaxspec.Engine(speculative_algorithm="NONE", **common)
    spec = jaxspec.Engine(speculative_adaptive=False, **common)
    print(f"# {machine()}", file=sys.stderr)
    for eng in (plain, spec):  # compile every program once
        run(eng, texts[:1], free, 1)
        run(eng, texts[:1], cons, 1)
    rows = {}
    for name, eng, params in [
        ("plain free", plain, free),
        ("plain constrained", plain, cons),
        ("EAGLE-3 free", spec, free),
        ("EAGLE-3 constrained", spec, cons),
    ]:
        toks, secs, acc, outs = run(eng, texts, params, args.repeats)
        valid = None
        if "json_schema" in params:
            valid = 0
            for o in outs:
                try:
                    jsonschema.validate(json.loads(o), SCHEMA)
                    valid += 1
                except (json.JSONDecodeError, jsonschema.ValidationError):
                    pass
        rows[name] = dict(tokens=toks, seconds=secs, tok_s=toks / secs, accept=acc, valid=valid)
        print(name, rows[name], file=sys.stderr)
    med, p99 = mask_cost(plain, texts, cons, args.max_tokens)
    r = rows
    print("| configuration | tokens | tok/s | accept length | valid JSON |")
    print("|---|---|---|---|---|")
    for name, x in rows.items():
        v = "" if x["valid"] is None else f"{x['valid']}/{len(texts)}"
        print(f"| {name} | {x['tokens']} | {x['tok_s']:.1f} | {x['accept']:.2f} | {v} |")
    print()
    print(f"constrained / free, plain: {r['plain constrained']['tok_s'] / r['plain free']['tok_s']:.3f}")
    print(f"constrained / free, EAGLE-3: {r['EAGLE-3 constrained']['tok_s'] / r['EAGLE-3 free']['tok_s']:.3f}")
    print(
        f"EAGLE-3 constrained / plain constrained: {r['EAGLE-3 constrained']['tok_s'] / r['plain constrained']['tok_s']:.3f}"
    )
    print(f"llguidance mask per token: median {med:.3f} ms, p99 {p99:.3f} ms")


if __name__ == "__main__":
    main()
