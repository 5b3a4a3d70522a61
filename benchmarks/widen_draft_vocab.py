"""Widen the shipped EAGLE-3 head's draft vocabulary without training (jaxspec/train/vocab.py).

    python benchmarks/widen_draft_vocab.py --sizes 8192 16384 --out /tmp/widened

The tokens added are, first, every token of the target's own JSON under four schemas unlike the
structured-output benchmark's (a person, a product, an event, a weather report: compact JSON, as a
server writes it under `response_format`), then the most frequent tokens of ShareGPT's answers
(conversations near an MT-bench question left out). Prints the coverage of both corpora before and
after; each head goes to OUT/headN, loadable with --speculative-draft-model-path (see
bench_mtbench.py --draft and bench_structured.py --draft).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
from common import machine

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "email": {"type": "string"},
            "hobbies": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "age", "email", "hobbies"],
    },
    "product": {
        "type": "object",
        "properties": {
            "product_name": {"type": "string"},
            "price": {"type": "number"},
            "in_stock": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["product_name", "price", "in_stock", "tags"],
    },
    "event": {
        "type": "object",
        "properties": {
            "event": {"type": "string"},
            "date": {"type": "string"},
            "location": {"type": "string"},
            "attendees": {"type": "integer"},
        },
        "required": ["event", "date", "location", "attendees"],
    },
    "weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "temperature_c": {"type": "number"},
            "conditions": {"type": "string"},
            "forecast": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"day": {"type": "string"}, "high": {"type": "number"}},
                    "required": ["day", "high"],
                },
            },
        },
        "required": ["city", "temperature_c", "conditions", "forecast"],
    },
}
ANSWER_CHARS = 4000  # each ShareGPT answer counted up to here
SUBJECTS = {
    "person": ["a software engineer from Berlin", "a retired teacher who loves gardening", "a student studying music"],
    "product": ["a pair of running shoes", "a coffee machine", "a laptop for students"],
    "event": ["a jazz concert", "a company meeting", "a marathon in spring"],
    "weather": ["Paris", "Tokyo", "Cairo"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384], help="draft vocabulary sizes to write")
    ap.add_argument("--conversations", type=int, default=6000, help="ShareGPT conversations counted")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import jaxspec
    from jaxspec.drafts import bundled_draft_for
    from jaxspec.loader import load
    from jaxspec.train.data import first_user_turn, load_conversations
    from jaxspec.train.synth import evaluation_index
    from jaxspec.train.vocab import coverage, extend_head, token_counts

    target = load(None, "float32", progress=False)
    found = bundled_draft_for(target.path, target.cfg, "EAGLE3")
    assert found is not None, "no EAGLE-3 head is shipped for the default model"
    head = found[1]
    tok = target.tokenizer
    evals = evaluation_index()
    convs = [c for c in load_conversations("sharegpt", args.conversations) if evals.match(first_user_turn(c)) is None]
    answers = (m["content"][:ANSWER_CHARS] for c in convs for m in c if m["role"] == "assistant")
    chat = token_counts((tok(a, add_special_tokens=False).input_ids for a in answers), target.cfg.vocab_size)
    eng = jaxspec.Engine(_loaded=target, speculative_algorithm="NONE", show_progress=False, context_length=1024)
    outs = [
        eng.chat(
            [{"role": "user", "content": f"Give me a JSON object describing {subject} ({kind})."}],
            {"temperature": 0, "max_new_tokens": 160, "json_schema": json.dumps(SCHEMAS[kind])},
        )["output_ids"]
        for kind in SCHEMAS
        for subject in SUBJECTS[kind]
    ]
    js = token_counts(outs, target.cfg.vocab_size)
    with open(os.path.join(head, "config.json")) as f:
        n_have = json.load(f)["draft_vocab_size"]
    from jaxspec.convert.sources import open_source

    d2t = np.asarray(open_source(head).get("d2t"), np.int64)
    have = set((np.arange(n_have) + d2t).tolist())
    print(f"# {machine()}")
    print(f"ShareGPT answer tokens {chat.sum()} ({len(convs)} conversations), target JSON tokens {js.sum()}")
    print(
        f"shipped ({n_have}): coverage of ShareGPT answers {coverage(chat, sorted(have)):.4f}, JSON {coverage(js, sorted(have)):.4f}"
    )
    rank = chat.astype(np.float64) + (js > 0) * 1e15  # the target's JSON tokens first
    order = [int(i) for i in np.argsort(-rank, kind="stable") if int(i) not in have]
    rows = target.model.embed_tokens[...] if target.model.lm_head is None else target.model.lm_head.kernel[...].T
    for size in args.sizes:
        add = order[: size - n_have]
        s = extend_head(head, np.asarray(rows), add, os.path.join(args.out, f"head{size}"))
        ids = sorted(have | set(add))
        print(
            f"{size}: coverage of ShareGPT answers {coverage(chat, ids):.4f}, JSON {coverage(js, ids):.4f}; "
            f"row map held-out cosine {s['row_map_heldout_cosine_median']:.3f}"
        )


if __name__ == "__main__":
    main()
