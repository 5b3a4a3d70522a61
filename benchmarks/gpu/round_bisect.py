"""What a speculation round and a plain step cost, version by version and flag by flag, in one GPU call.

A round of the shipped EAGLE-3 head at (5, 4, 8) cost 2.37 ms on an H100 on 2026-11-22 and
2.96-3.23 ms on 2026-11-24, while a plain step did not change. This script times both on a
SmolLM2-shaped model with random weights (made on the machine, so no checkpoint travels) for each
library version packed beside it, and for each XLA flag set, in one process per variant:

    # dev machine: pack the library as it was at some commits (git archive, shipped drafts left out)
    python benchmarks/gpu/round_bisect.py pack --out .gpu6 e77d0b2 b0853d5 1222509 f9e55dc
    # GPU machine, one call (carry .gpu6): the working tree's library is the variant "HEAD"
    python benchmarks/gpu/round_bisect.py run --variants .gpu6 --trace --dump \
        --xla-flags "" --xla-flags="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" --out $OUT

Every variant runs with exactly the XLA flags given ("": XLA's defaults; jaxspec's own GPU defaults,
jaxspec/xla_flags.py, are switched off in the subprocess), so versions compare alike.

`--trace` also counts, after the timing, the CUDA kernel-launch and graph-launch calls of one greedy
`generate` per engine in a jax.profiler trace (per plain step and per round): whether a dispatch
replays as CUDA graphs, and how much of the kernels' span the GPU is busy. `--dump` has XLA dump
each variant's decode and round programs and profiles them (`hlo_profile.py`: kernels per loop
iteration, bytes copied per iteration, command buffers, custom calls). Every timed pass records the
programs compiled inside it, which should be none.

Each variant (a commit and a flag set) runs `time` in a fresh subprocess: batch 1, random prompts,
greedy and sampled (T = 1), ignore_eos, the first `generate` compiling and the next ones timed.
Reported per variant: ms per plain step, ms per round at (5, 4, 8), the round in plain steps, and
the accept length (near 1 with a random head; the round's cost hardly depends on it). A random head
proposes random tokens, so rounds emit about one token: the figures are costs, not speedups.

`--size toy` makes a tiny model of the same layout, so the whole script runs on a CPU in seconds
(tests/test_gpu_scripts.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tarfile
import time

SIZES = {
    # SmolLM2-135M-Instruct's shape (tied embeddings), and a toy of the same layout
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, draft_vocab=4096),
    "toy": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=49152, draft_vocab=256),  # SmolLM2's vocabulary: its tokenizer fits
}  # fmt: skip


def make_weights(out: str, size: str, seed: int = 0) -> tuple[str, str]:
    """A random target (HF llama layout, float32) and a random EAGLE-3 head for it under `out`."""
    import numpy as np
    from safetensors.numpy import save_file

    s = dict(SIZES[size])
    dv = s.pop("draft_vocab")
    h, v, inter, n = s["hidden_size"], s["vocab_size"], s["intermediate_size"], s["num_hidden_layers"]
    hd = h // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * hd
    cfg = dict(
        s,
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    rng = np.random.default_rng(seed)

    def w(*shape, scale=0.02):
        return (rng.standard_normal(shape, np.float32) * scale).astype(np.float32)

    target, head = os.path.join(out, "target"), os.path.join(out, "head")
    if not os.path.exists(os.path.join(target, "model.safetensors")):
        t = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": np.ones(h, np.float32)}
        for i in range(n):
            p = f"model.layers.{i}."
            t |= {
                p + "self_attn.q_proj.weight": w(h, h),
                p + "self_attn.k_proj.weight": w(kv, h),
                p + "self_attn.v_proj.weight": w(kv, h),
                p + "self_attn.o_proj.weight": w(h, h),
                p + "mlp.gate_proj.weight": w(inter, h),
                p + "mlp.up_proj.weight": w(inter, h),
                p + "mlp.down_proj.weight": w(h, inter),
                p + "input_layernorm.weight": np.ones(h, np.float32),
                p + "post_attention_layernorm.weight": np.ones(h, np.float32),
            }
        os.makedirs(target, exist_ok=True)
        save_file(t, os.path.join(target, "model.safetensors"))
        with open(os.path.join(target, "config.json"), "w") as f:
            json.dump(cfg, f)
    if not os.path.exists(os.path.join(head, "model.safetensors")):
        ids = np.sort(rng.choice(v, dv, replace=False))
        ids[:3] = [0, 1, 2]  # special tokens in, as a trained head has them
        ids = np.unique(ids)
        while len(ids) < dv:
            ids = np.unique(np.concatenate([ids, rng.choice(v, dv - len(ids))]))
        e = {
            "fc.weight": w(h, 3 * h),
            "midlayer.hidden_norm.weight": np.ones(h, np.float32),
            "midlayer.input_layernorm.weight": np.ones(h, np.float32),
            "midlayer.post_attention_layernorm.weight": np.ones(h, np.float32),
            "midlayer.self_attn.q_proj.weight": w(h, 2 * h),
            "midlayer.self_attn.k_proj.weight": w(kv, 2 * h),
            "midlayer.self_attn.v_proj.weight": w(kv, 2 * h),
            "midlayer.self_attn.o_proj.weight": w(h, h),
            "midlayer.mlp.gate_proj.weight": w(inter, h),
            "midlayer.mlp.up_proj.weight": w(inter, h),
            "midlayer.mlp.down_proj.weight": w(h, inter),
            "norm.weight": np.ones(h, np.float32),
            "lm_head.weight": w(dv, h),
            "d2t": (ids - np.arange(dv)).astype(np.int64),
            "t2d": np.isin(np.arange(v), ids),
        }
        os.makedirs(head, exist_ok=True)
        save_file(e, os.path.join(head, "model.safetensors"))
        from jaxspec.train.trainer import draft_hf_config  # the public EAGLE-3 layout, as train-draft writes it

        hcfg = dict(draft_hf_config(cfg, "EAGLE3", dv), torch_dtype="float32")
        with open(os.path.join(head, "config.json"), "w") as f:
            json.dump(hcfg, f)
    return target, head


def launches(trace_dir: str) -> dict:
    """Launch counts from the perfetto trace jax.profiler wrote under trace_dir: CUDA kernel-launch and
    graph-launch API calls (on a GPU; zero elsewhere), the events on the GPU's own timelines (the kernels
    that ran, whether launched one by one or from a graph), and the most frequent event names."""
    import collections
    import glob
    import gzip
    import re

    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True))
    if not paths:
        return {"error": "no perfetto trace written"}
    with gzip.open(paths[-1]) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = collections.Counter(e.get("name", "") for e in events if e.get("ph") == "X")
    gpu = {
        e.get("pid"): str(e.get("args", {}).get("name", ""))
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name" and "GPU" in str(e.get("args", {}).get("name", ""))
    }
    on_gpu = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu]
    # per GPU timeline (a kernel reported on two timelines would count twice in gpu_events)
    timelines = collections.Counter(gpu[e["pid"]] for e in on_gpu)
    kernel = sum(n for k, n in names.items() if re.match(r"cu(da)?LaunchKernel", k))
    graph = sum(n for k, n in names.items() if re.search(r"Graph\w*Launch", k))
    native = collections.Counter({k: n for k, n in names.items() if not k.startswith("$")})  # "$": Python frames
    busy: collections.Counter = collections.Counter()  # GPU time per kernel name (µs)
    count: collections.Counter = collections.Counter()
    for e in on_gpu:
        busy[e.get("name", "")] += float(e.get("dur", 0))
        count[e.get("name", "")] += 1
    span = (max(e["ts"] + e.get("dur", 0) for e in on_gpu) - min(e["ts"] for e in on_gpu)) if on_gpu else 0.0
    return {
        "kernel_launch_calls": kernel,
        "graph_launch_calls": graph,
        "gpu_events": len(on_gpu),
        # the kernels' summed time against the span from the first to the last: where they are far
        # apart, the GPU waits between kernels (launches, host round trips) rather than computes
        "gpu_busy_us": round(sum(busy.values()), 1),
        "gpu_span_us": round(float(span), 1),
        "top_events": native.most_common(12),
        "top_gpu_time": [(k, count[k], round(us, 1)) for k, us in busy.most_common(15)],
        "gpu_timelines": dict(timelines.most_common(6)),
    }


def time_here(
    weights: str, tokens: int, prompts: int, repeats: int, shape: tuple[int, int, int], trace: str | None = None
) -> dict:
    """Times the jaxspec importable in this process (one variant): plain and EAGLE-3, T = 0 and 1.
    trace: afterwards (never while timing), one greedy `generate` per engine under jax.profiler, its
    launches counted (`launches`)."""
    import inspect

    import numpy as np

    import jaxspec

    target, head = os.path.join(weights, "target"), os.path.join(weights, "head")
    accepted = set(inspect.signature(jaxspec.Engine.__init__).parameters)
    kw = dict(skip_tokenizer_init=True, show_progress=False, max_running_requests=1, context_length=1024)
    kw = {k: x for k, x in kw.items() if k in accepted or "kwargs" in accepted}
    rng = np.random.default_rng(0)
    with open(os.path.join(target, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    ids = [[int(t) for t in rng.integers(3, vocab, 32)] for _ in range(prompts)]
    steps, topk, n = shape
    out: dict = {"jax": __import__("jax").__version__, "backend": str(__import__("jax").devices()[0].platform)}
    for name, extra in (
        ("plain", dict(speculative_algorithm="NONE")),
        (
            "eagle3",
            dict(
                speculative_algorithm="EAGLE3",
                speculative_draft_model_path=head,
                speculative_num_steps=steps,
                speculative_eagle_topk=topk,
                speculative_num_draft_tokens=n,
            ),
        ),
    ):
        eng = jaxspec.Engine(target, **kw, **extra)
        for temp in (0.0, 1.0):
            sp = {"temperature": temp, "max_new_tokens": tokens, "ignore_eos": True}
            if temp:
                sp["seed"] = 0
            eng.generate(input_ids=ids[:1], sampling_params=sp)  # compile
            best = None
            with compiles() as seen:  # a program compiled (or loaded) inside the timed passes
                times = [_timed(eng, ids, sp) for _ in range(repeats)]
            for dt, res in times:
                best = dt if best is None or dt < best else best
                made = sum(r["meta_info"]["completion_tokens"] for r in res)
                rounds = sum(r["meta_info"].get("spec_verify_ct") or r["meta_info"]["completion_tokens"] for r in res)
            out[f"{name}_T{temp:g}"] = dict(
                seconds=best,
                tokens=made,
                rounds=rounds,
                ms_per_round=best / rounds * 1e3,
                accept=made / rounds,
                compiles_while_timed=len(seen),
                compiled_while_timed=sorted(set(seen))[:8],
            )
        if trace:
            import jax

            sp = {"temperature": 0.0, "max_new_tokens": tokens, "ignore_eos": True}
            where = os.path.join(trace, name)
            jax.profiler.start_trace(where, create_perfetto_trace=True)
            r = eng.generate(input_ids=ids[0], sampling_params=sp)
            jax.profiler.stop_trace()
            m = r["meta_info"]
            out[f"{name}_trace"] = dict(launches(where), rounds=m.get("spec_verify_ct") or m["completion_tokens"])
    for t in ("0", "1"):
        out[f"round_in_steps_T{t}"] = out[f"eagle3_T{t}"]["ms_per_round"] / out[f"plain_T{t}"]["ms_per_round"]
    return out


# the decode and round programs, under their names at every packed version
DUMPED = "jit_(decode|spec_decode|spec_block|spec_run|run_block)"


def hlo_summary(dump: str) -> list[dict]:
    """Per program in an XLA dump (`hlo_profile.profile`): kernels outside loops, and per `while`
    loop its kernels per iteration, trip count and bytes copied per iteration (a buffer XLA could
    not update in place), with the command buffers, conditionals and sorts of the program."""
    import collections
    import glob
    import re

    import thunks
    from hlo_profile import profile

    out = []
    sequences = thunks.module_files(dump)
    for path in sorted(glob.glob(os.path.join(dump, "*after_optimizations.txt"))):
        name = os.path.basename(path)
        r = profile(path)
        module = ".".join(name.split(".")[:2])
        # what runs: kernels per iteration of the main loop and whether a command buffer holds it
        main = thunks.profile_module(dump, module).main_loop() if module in sequences else None
        loops = [dict(kernels=k, trips=t, mb_copied=round(c / 1e6, 2)) for _, k, t, c in r["loops"] if k >= 20]
        calls: collections.Counter = collections.Counter()  # custom calls by target (Pallas kernels by name)
        with open(path) as f:
            for line in f:
                if " custom-call(" in line:
                    target = re.search(r'custom_call_target="([^"]+)"', line)
                    kernel = re.search(r'\\?"name\\?":\s*\\?"(\w+)', line)
                    calls[(target.group(1) if target else "?") + (f":{kernel.group(1)}" if kernel else "")] += 1
        out.append(
            dict(
                program=name.split(".")[1] if name.count(".") > 1 else name,
                entry_kernels=r["entry_kernels"],
                loops=loops,
                command_buffers=r["command_buffers"],
                conditional=r["conditional"],
                sort=r["sort"],
                custom_calls=dict(calls.most_common(8)),
                thunk_loop=None
                if main is None
                else dict(kernels=main.kernels, captured=main.captured, by_kind=main.by_kind),
            )
        )
    return out


def _timed(eng, ids: list, sp: dict) -> tuple[float, list]:
    t0 = time.perf_counter()
    res = [eng.generate(input_ids=p, sampling_params=sp) for p in ids]
    return time.perf_counter() - t0, res


@contextlib.contextmanager
def compiles():
    """Collects jax's compile log lines (`jax_log_compiles`) while the block runs: the programs
    traced and compiled, or fetched from the persistent cache, inside a timed pass."""
    import logging

    import jax

    seen: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if msg.startswith("Compiling "):  # once per program traced and compiled (or loaded from disk)
                seen.append(msg.split(" with ")[0][len("Compiling ") :])

    handler, log = Grab(), logging.getLogger("jax")
    log.addHandler(handler)
    jax.config.update("jax_log_compiles", True)
    try:
        yield seen
    finally:
        jax.config.update("jax_log_compiles", False)
        log.removeHandler(handler)


def pack(commits: list[str], out: str) -> None:
    """One tar.gz per commit of the library as it was then (jaxspec/, convert/, pallas_kernels/,
    without the shipped draft heads' folders but with the `jaxspec.drafts` package the engine
    imports), named by the commit."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.makedirs(out, exist_ok=True)
    for c in commits:
        sha = subprocess.run(["git", "rev-parse", "--short", c], cwd=repo, capture_output=True, text=True, check=True)
        sha = sha.stdout.strip()
        paths = [p for p in ("jaxspec", "convert", "pallas_kernels") if _exists_at(repo, sha, p)]
        dest = os.path.join(out, f"{sha}.tar.gz")
        with open(dest, "wb") as f:
            p1 = subprocess.Popen(
                ["git", "archive", "--format=tar", sha, *paths, ":(exclude,glob)jaxspec/drafts/*/**"],
                cwd=repo,
                stdout=subprocess.PIPE,
            )
            subprocess.run(["gzip", "-9"], stdin=p1.stdout, stdout=f, check=True)
            if p1.wait():
                raise SystemExit(f"git archive {sha} failed")
        print(f"{dest}: {os.path.getsize(dest) / 1e6:.2f} MB")


def _exists_at(repo: str, sha: str, path: str) -> bool:
    return subprocess.run(["git", "cat-file", "-e", f"{sha}:{path}"], cwd=repo, capture_output=True).returncode == 0


def run(args) -> int:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    weights = os.path.join(args.work, f"weights-{args.size}")
    make_weights(weights, args.size)
    variants = [("HEAD", repo)]
    for name in sorted(os.listdir(args.variants)) if args.variants else []:
        if name.endswith(".tar.gz"):
            dest = os.path.join(args.work, "variants", name[: -len(".tar.gz")])
            if not os.path.exists(dest):
                os.makedirs(dest)
                with tarfile.open(os.path.join(args.variants, name)) as t:
                    t.extractall(dest, filter="data")
            variants.append((name[: -len(".tar.gz")], dest))
    os.makedirs(args.out, exist_ok=True)
    rows = []
    deadline = time.monotonic() + args.budget
    for flags in args.xla_flags or [""]:
        for name, root in variants:
            if time.monotonic() > deadline:
                print(f"budget spent: {name} {flags!r} not run", flush=True)
                continue
            env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
            env["XLA_FLAGS"] = " ".join(x for x in (os.environ.get("XLA_FLAGS", ""), flags) if x)
            env["JAXSPEC_GPU_XLA_DEFAULTS"] = "0"  # exactly these flags, for every version alike
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "time",
                "--weights",
                weights,
                "--tokens",
                str(args.tokens),
            ]
            cmd += ["--prompts", str(args.prompts), "--repeats", str(args.repeats), "--shape", args.shape]
            if args.trace:
                cmd += ["--trace", os.path.join(args.work, "traces", f"{name}-{len(rows)}")]
            dump = os.path.join(args.work, "dumps", f"{name}-{len(rows)}")
            if args.dump:
                env["XLA_FLAGS"] += f" --xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_module_re={DUMPED}"
            t0 = time.monotonic()
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=args.work)
            row: dict = {"variant": name, "xla_flags": flags, "wall_s": round(time.monotonic() - t0, 1)}
            last = (p.stdout.strip().splitlines() or [""])[-1]
            if p.returncode == 0 and last.startswith("{"):
                row |= json.loads(last)
            else:
                row["error"] = (p.stderr or p.stdout)[-1500:]
            if args.dump:
                row["hlo"] = hlo_summary(dump)
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(os.path.join(args.out, "round_bisect.json"), "w") as f:
                json.dump(rows, f, indent=1)
    print(
        "| variant | XLA flags | plain ms/step T=0 | round ms T=0 | round/step T=0 | plain ms/step T=1 | round ms T=1 | round/step T=1 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | {r['xla_flags'] or '-'} | error: {r['error'].splitlines()[-1][:80]} |||||| ")
            continue
        cells = []
        for t in ("0", "1"):
            cells += [f"{r[f'plain_T{t}']['ms_per_round']:.3f}", f"{r[f'eagle3_T{t}']['ms_per_round']:.3f}"]
            cells.append(f"{r[f'round_in_steps_T{t}']:.2f}")
        print(f"| {r['variant']} | {r['xla_flags'] or '-'} | " + " | ".join(cells) + " |")
    ok = [r for r in rows if "error" not in r]
    if ok:
        print()
        print("programs compiled inside the timed passes (plain T=0, T=1, EAGLE-3 T=0, T=1):")
        for r in ok:
            k = [r[f"{e}_T{t}"].get("compiles_while_timed", "?") for e in ("plain", "eagle3") for t in ("0", "1")]
            print(f"  {r['variant']} {r['xla_flags'] or '-'}: {k}")
    traced = [r for r in rows if "plain_trace" in r]
    if traced:
        print()
        print(
            "| variant | XLA flags | plain: kernel / graph launches / GPU events / GPU busy µs / GPU span µs per step "
            "| EAGLE-3: per round |"
        )
        print("|---|---|---|---|")
        for r in traced:
            cells = []
            for k in ("plain_trace", "eagle3_trace"):
                t = r[k]
                n = max(t["rounds"], 1)
                cells.append(
                    f"{t.get('kernel_launch_calls', 0) / n:.1f} / {t.get('graph_launch_calls', 0) / n:.2f}"
                    f" / {t.get('gpu_events', 0) / n:.0f} / {t.get('gpu_busy_us', 0) / n:.0f}"
                    f" / {t.get('gpu_span_us', 0) / n:.0f}"
                )
            print(f"| {r['variant']} | {r['xla_flags'] or '-'} | " + " | ".join(cells) + " |")
    for r in rows:
        for prog in r.get("hlo", []):
            loops = ", ".join(f"{x['kernels']} x {x['trips']} ({x['mb_copied']} MB copied)" for x in prog["loops"])
            print(
                f"  {r['variant']} {r['xla_flags'] or '-'} {prog['program']}: {prog['entry_kernels']} kernels outside "
                f"loops; loops {loops or '-'}; command buffers {prog['command_buffers']}, conditionals "
                f"{prog['conditional']}, sorts {prog['sort']}; custom calls {prog['custom_calls'] or '-'}"
            )
    return 0 if rows and all("error" not in r for r in rows) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="dev machine: the library at each commit, as tar.gz files in --out")
    p.add_argument("commits", nargs="+")
    p.add_argument("--out", required=True)
    r = sub.add_parser("run", help="time every variant (commit x XLA flag set), each in its own process")
    r.add_argument("--variants", default=None, help="directory of packed commits (the working tree is always HEAD)")
    r.add_argument(
        "--xla-flags",
        action="append",
        default=None,
        help="an XLA flag set to compare, repeatable ('' = XLA's defaults; write --xla-flags=\"--xla_...\")",
    )
    r.add_argument("--size", choices=sorted(SIZES), default="smollm2")
    r.add_argument("--tokens", type=int, default=128, help="new tokens per prompt")
    r.add_argument("--prompts", type=int, default=4)
    r.add_argument("--repeats", type=int, default=2, help="timed passes over the prompts (the best is kept)")
    r.add_argument("--shape", default="5,4,8", help="steps,topk,N of the EAGLE-3 tree")
    r.add_argument("--budget", type=float, default=480, help="seconds after which no further variant starts")
    r.add_argument(
        "--trace", action="store_true", help="after timing, count kernel and CUDA-graph launches of one generate"
    )
    r.add_argument(
        "--dump", action="store_true", help="dump each variant's decode and round programs and profile their HLO"
    )
    r.add_argument("--work", default="/tmp/round_bisect", help="scratch: weights and unpacked variants")
    r.add_argument("--out", default="/tmp/out")
    t = sub.add_parser("time", help="(internal) time the jaxspec on PYTHONPATH; prints one JSON line")
    t.add_argument("--weights", required=True)
    t.add_argument("--tokens", type=int, default=128)
    t.add_argument("--prompts", type=int, default=4)
    t.add_argument("--repeats", type=int, default=2)
    t.add_argument("--shape", default="5,4,8")
    t.add_argument("--trace", default=None, help="directory: also count launches in a jax.profiler trace")
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        pack(args.commits, args.out)
        return 0
    if args.cmd == "run":
        os.makedirs(args.work, exist_ok=True)
        return run(args)
    steps, topk, n = (int(x) for x in args.shape.split(","))
    res = time_here(args.weights, args.tokens, args.prompts, args.repeats, (steps, topk, n), args.trace)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
