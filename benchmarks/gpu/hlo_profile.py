"""Where a dispatch's time goes, read from the optimized HLO that XLA compiled: for every program a
short plain and speculative `generate` compiles, the kernels it launches per loop iteration and the
things that break a GPU dispatch into pieces.

    python benchmarks/gpu/hlo_profile.py --model-path PATH [--draft EAGLE3=PATH] [--out DIR]

Counted per program (the `*after_optimizations.txt` modules of an XLA dump):
  kernels   fusions, custom calls (cuBLAS/cuDNN GEMMs, Triton/Pallas kernels) and copies outside
            loops, and per iteration of each `while` loop (a decode step, a speculation round)
  command buffers   kernel sequences XLA:GPU records as one CUDA graph, from the module's dumped
            thunk sequence (thunks.py; the optimized HLO never names them)
  breakers  `conditional` (a predicate copied to the host), host callbacks, `sort`,
            infeed/outfeed/send/recv
  copies    bytes moved by `copy` per loop iteration: a KV cache copied whole at every step (an
            update XLA could not do in place) shows here as megabytes per iteration
Timing is not done here (a dump does not change run time, but profiling would; bench_mtbench.py
times the same programs).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile

# `%x = SHAPE OPCODE(`, where SHAPE may be a tuple with spaces: `(f32[8]{0}, s8[64]{0})`
KERNEL = re.compile(
    r"=\s*(?:\([^=]*?\)|\S+)\s+(fusion|custom-call|copy|copy-start|all-reduce|all-gather|dynamic-update-slice)\("
)
COMP_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
CALLS = re.compile(
    r"(body|condition|to_apply|calls|branch_computations|true_computation|false_computation)=\{?%?([\w.\-, %]+)\}?"
)


def computations(text: str) -> tuple[dict[str, list[str]], str]:
    comps: dict[str, list[str]] = {}
    entry, cur = "", None
    for line in text.splitlines():
        if cur is None:
            m = COMP_HEAD.match(line)
            if m and "=" not in line.split("{")[0].split("(")[0]:
                cur = m.group(2)
                comps[cur] = []
                if m.group(1):
                    entry = cur
        elif line.strip() == "}":
            cur = None
        else:
            comps[cur].append(line)
    return comps, entry


def kernels_in(name: str, comps: dict[str, list[str]], seen: set[str]) -> int:
    """Kernel launches of one execution of computation `name`, descending into calls but not into
    fusions (one fusion is one kernel) or while bodies (counted per iteration separately)."""
    if name in seen or name not in comps:
        return 0
    seen = seen | {name}
    n = 0
    for line in comps[name]:
        if KERNEL.search(line):
            n += 1
        elif " call(" in line or " conditional(" in line:
            for m in CALLS.finditer(line):
                for callee in m.group(2).replace("%", "").split(","):
                    n += kernels_in(callee.strip(), comps, seen)
    return n


COPY = re.compile(r"=\s*(\w+)\[([\d,]*)\]\S*\s+copy\(")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4}


def copied_bytes(name: str, comps: dict[str, list[str]], seen: set[str]) -> int:
    """Bytes written by `copy` ops in one execution of computation `name` (descending into calls and
    conditionals like kernels_in; while bodies are counted per iteration separately)."""
    if name in seen or name not in comps:
        return 0
    seen = seen | {name}
    n = 0
    for line in comps[name]:
        m = COPY.search(line)
        if m:
            size = 1
            for d in filter(None, m.group(2).split(",")):
                size *= int(d)
            n += size * DTYPE_BYTES.get(m.group(1), 8)
        elif " call(" in line or " conditional(" in line:
            for c in CALLS.finditer(line):
                for callee in c.group(2).replace("%", "").split(","):
                    n += copied_bytes(callee.strip(), comps, seen)
    return n


def profile(path: str) -> dict:
    text = open(path).read()
    comps, entry = computations(text)
    loops = []
    for lines in comps.values():
        for line in lines:
            if " while(" in line:
                body = re.search(r"body=%?([\w.\-]+)", line)
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                if body:
                    b = body.group(1)
                    loops.append(
                        (b, kernels_in(b, comps, set()), trip.group(1) if trip else "?", copied_bytes(b, comps, set()))
                    )
    import thunks

    dump, module = os.path.dirname(path), ".".join(os.path.basename(path).split(".")[:2])
    has_sequence = module in thunks.module_files(dump)
    return dict(
        entry_kernels=kernels_in(entry, comps, set()),
        loops=loops,
        command_buffers=thunks.profile_module(dump, module).command_buffers if has_sequence else 0,
        conditional=text.count(" conditional("),
        callbacks=len(re.findall(r'custom_call_target="[^"]*callback[^"]*"', text)),
        sort=text.count(" sort("),
        host=sum(text.count(f" {op}(") for op in ("infeed", "outfeed", "send", "recv")),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--draft", action="append", default=[], help="ALGO=PATH (repeatable)")
    ap.add_argument("--out", default=None, help="keep the dump here (default: a temp dir)")
    ap.add_argument("--min-kernels", type=int, default=20, help="list only programs with at least this many")
    args = ap.parse_args()
    dump = args.out or tempfile.mkdtemp(prefix="hlo_")
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_as_text"
    import jaxspec  # after XLA_FLAGS: the backend reads them when it starts
    from jaxspec.loader import load

    loaded = load(args.model_path, "float32", progress=False)
    sp = {"temperature": 0, "max_new_tokens": 48}
    for d in ["NONE"] + args.draft:
        algo, _, path = d.partition("=")
        before = set(glob.glob(os.path.join(dump, "*after_optimizations.txt")))
        eng = jaxspec.Engine(
            _loaded=loaded,
            show_progress=False,
            speculative_algorithm=algo,
            speculative_draft_model_path=path or None,
            speculative_adaptive=False,  # the configured tree every round (adaptive may pick plain steps)
        )
        eng.generate("Write a short poem about the sea.", sp)
        new = sorted(set(glob.glob(os.path.join(dump, "*after_optimizations.txt"))) - before)
        print(f"\n## {algo} (attention backend {eng.backend}): {len(new)} programs compiled")
        print(
            "| program | kernels outside loops | loops: kernels per iteration (trip count) | MB copied per iteration | "
            "command buffers | conditional | callbacks | sort | host transfers |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for p in new:
            r = profile(p)
            total = r["entry_kernels"] + sum(k for _, k, _, _ in r["loops"])
            if total < args.min_kernels:
                continue
            loops = ", ".join(f"{k} ({t})" for _, k, t, _ in r["loops"]) or "-"
            copied = ", ".join(f"{c / 1e6:.2f}" for *_, c in r["loops"]) or "-"
            name = os.path.basename(p).split(".")[1] if "." in os.path.basename(p) else os.path.basename(p)
            print(
                f"| {name} | {r['entry_kernels']} | {loops} | {copied} | {r['command_buffers']} | {r['conditional']} | "
                f"{r['callbacks']} | {r['sort']} | {r['host']} |",
                flush=True,
            )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
