"""The GPU's programs, compiled on any machine: kernels per decode step and per speculation round,
command buffers and what breaks them, bytes copied per loop iteration, and the JAX operations the
kernels come from, for an H100 or H200 described by a target file, with no GPU at hand.

    JAX_PLATFORMS=cpu python benchmarks/gpu/gpu_programs.py [--target h100] [--model smollm2]
        [--programs decode,spec_block] [--json FILE] [--dump DIR] [--xla-flags "..."]

Needs JAX's CUDA plugin at jaxlib's own version (`pip install jax-cuda12-plugin==V
jax-cuda12-pjrt==V`, V = jaxlib's; no CUDA libraries): JAX then compiles for a GPU it does not
have (`jax.experimental.topologies`), with the real XLA:GPU pipeline, sm_90 code included. No
autotuning happens, so GEMM tiles may differ from a real GPU's: count kernels here, time them there.

The engine builds its models and traces its programs inside `compiling_for("gpu")`
(jaxspec/compile_target.py): the same code paths a GPU takes (Pallas attention, the GPU weight
layout and draft tree shape, the server's GPU dispatch loop). Every program is compiled under
jaxspec's GPU XLA flags (jaxspec/xla_flags.py; `--xla-flags` adds or overrides), as `jaxspec` on a
GPU would, and read back from XLA's dump of its thunk sequence (benchmarks/gpu/thunks.py).

Models: `smollm2` is the shipped default (SmolLM2-135M-Instruct, bfloat16 here, with its shipped
EAGLE-3 head, every program; `--model-path` and `--draft` give another checkpoint and head); `llama8b` is Llama-3.1-8B's shape with no weights at all (plain
programs only: the arrays are shapes); `toy` is a 2-layer model of SmolLM2's layout, for tests.
Programs, batch 1 unless named otherwise:
  prefill          one 128-token prefill chunk (plain)
  decode           the plain decode loop, greedy; decode_t1 at temperature 1
  spec_run         the whole speculation (first token and every round), greedy; spec_run_t1
  spec_block       adaptive speculation's block of rounds, greedy; spec_block_t1
  serve_decode     the server's plain dispatch (8 slots, 8 steps a dispatch, span 512), with its sampler
  serve_spec       the server's speculative dispatch (8 slots, 8 rounds), with its sampler (the
                   program it serves greedy and sampled calls with); serve_spec_t1: its
                   temperature-only twin
Printed per program and loop: kernels per iteration by kind, MB copied per iteration, whether a
command buffer holds the loop (and, where one does not, the top-level thunks), the largest groups
of kernels by JAX op name (and with `--sources N` by the Python line that made them: where to cut
next). `--json` writes all of it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
# `make gpu-compile` puts JAX's CUDA plugin here, beside the virtualenv rather than in it: a CUDA
# plugin in the environment makes every CPU-only start of JAX look for a GPU (and warn)
PLUGIN_DIR = os.path.join(REPO, ".gpu-compile")
TARGETS = {name: os.path.join(HERE, "targets", f"{name}.txtpb") for name in ("h100", "h200")}
PROMPT, NEW = 128, 128  # tokens in the prompt and to generate (the programs' static shapes)
SLOTS = 8  # server slots
LLAMA8B = dict(
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=131072,
)
TOY = dict(
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=2,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
PLAIN = ("prefill", "decode", "decode_t1", "serve_decode")
SPEC = ("spec_run", "spec_run_t1", "spec_block", "spec_block_t1", "serve_spec", "serve_spec_t1")
PROGRAMS = PLAIN + SPEC


def setup_env(dump: str, extra_flags: str = "") -> None:
    """XLA_FLAGS for the compiles (before JAX starts its backends): jaxspec's GPU defaults, the
    caller's flags over them, and the dump. The persistent compilation cache is off (a program
    loaded from it is not compiled, so nothing would be dumped)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX is imported: it reads it once
    sys.path.insert(0, REPO)
    from jaxspec.xla_flags import has_cuda_plugin  # (imports no JAX backend)

    if not has_cuda_plugin() and os.path.isdir(PLUGIN_DIR):  # a GPU machine's own plugin comes first
        sys.path.insert(0, PLUGIN_DIR)
    from jaxspec.xla_flags import with_gpu_defaults

    flags = with_gpu_defaults(f"{os.environ.get('XLA_FLAGS', '')} {extra_flags}".strip())
    os.environ["XLA_FLAGS"] = f"{flags} --xla_dump_to={dump} --xla_dump_hlo_as_text"
    os.environ["JAXSPEC_COMPILATION_CACHE"] = "off"


def topology_mesh(target: str):
    from jax.experimental import topologies

    with open(TARGETS.get(target, target)) as f:
        topo = topologies.get_topology_desc(platform="cuda", target_config=f.read(), topology="1x1x1")
    return topologies.make_mesh(topo, (1,), ("x",))


class Builder:
    """The programs of one model, as (jitted function, arguments, static arguments) with every array
    a ShapeDtypeStruct on the target's one-device mesh."""

    def __init__(self, model: str, mesh, model_path: str | None = None, draft: str | None = None):
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from jaxspec.compile_target import compiling_for

        self.jax = jax
        self.on = NamedSharding(mesh, P())
        with compiling_for("gpu"):
            if model == "smollm2":
                from jaxspec import Engine

                spec = {} if draft is None else dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=draft)
                eng = Engine(model_path, dtype="bfloat16", show_progress=False, log_level="warning", **spec)
                self.cfg, self.spec, self.adaptive = eng.cfg, eng.spec, eng._adaptive
                self.models, self.target_models = eng.models if eng.spec.enabled else None, eng.target_models
                self.backend = eng.backend
            else:
                self._abstract(LLAMA8B if model == "llama8b" else TOY)

    def _abstract(self, fields: dict) -> None:
        """A target with no weights (its arrays are shapes), prepared with the GPU's layout."""
        import jax.numpy as jnp
        from flax import nnx

        from jaxspec.args import EngineArgs
        from jaxspec.attention import resolve_backend
        from jaxspec.config import ModelConfig
        from jaxspec.models.llama import LlamaForCausalLM
        from jaxspec.prepare import Layout, prepare
        from jaxspec.weights import Models

        self.cfg = ModelConfig(**fields)
        layout = Layout.for_target(EngineArgs(), None, fuse=True, out_major_ok=True)

        def build():
            return nnx.merge(*prepare(LlamaForCausalLM(self.cfg, jnp.bfloat16, rngs=nnx.Rngs(0)), layout))

        graphdef, params = nnx.split(nnx.eval_shape(build))
        self.backend = resolve_backend(None)
        self.target_models = Models(graphdef, params, backend=self.backend)
        self.models, self.spec, self.adaptive = None, None, {}

    def sds(self, tree):
        """Every array (or shape) of `tree` as a ShapeDtypeStruct placed on the target."""
        jax = self.jax
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.on), tree)

    def shapes(self, fn, *args, **kw):
        return self.sds(self.jax.eval_shape(lambda: fn(*args, **kw)))

    def call(self, name: str):
        import jax.numpy as jnp
        import numpy as np

        from jaxspec.cache import KVCache
        from jaxspec.decode import decode, prefill_chunk
        from jaxspec.sampling import SamplingParams, SamplingTensors, sampling_kind
        from jaxspec.speculative.loop import spec_block, spec_run, spec_start

        cfg, b = self.cfg, 1
        t1 = name.endswith("_t1")
        params = [SamplingParams(temperature=1.0 if t1 else 0.0, max_new_tokens=NEW)]
        sampled = sampling_kind(params)
        st = self.sds(SamplingTensors.build(params, [0], None))
        i32 = lambda *s: self.sds(np.zeros(s, np.int32))
        if (name.startswith("spec_") or name.startswith("serve_spec")) and self.models is None:
            raise ValueError(f"{name} needs a draft; this model has none (plain programs only)")
        if name.startswith("serve_"):
            return self._serve(name, sampled)
        spec = None if self.spec is None else self.spec.for_kind(bool(sampled))
        extra = spec.scratch_tokens if name.startswith("spec_") else 0
        s_len = -(-(PROMPT + NEW + extra) // 64) * 64
        cache = self.shapes(KVCache.create, cfg, b, s_len, jnp.bfloat16)
        last_h = self.sds(jnp.zeros((b, cfg.hidden_size), jnp.bfloat16))
        if name == "prefill":
            args = (self.target_models, cache, i32(b, PROMPT), i32(), i32(b), last_h)
            return prefill_chunk, args, {}
        if name.startswith("decode"):
            args = (self.target_models, cache, last_h, i32(b, PROMPT), i32(b), st, i32(b), i32(b, 4))
            return decode, args, dict(buf=NEW, sampled=sampled, top_logprobs=None)
        prop = self.models.draft
        dcache = self.shapes(prop.make_cache, b, s_len, jnp.bfloat16)
        feat = (3 if prop.capture_layers else 1) * cfg.hidden_size if prop.uses_hidden else 1
        args = (self.models, spec, cache, dcache, last_h, self.sds(jnp.zeros((b, feat), jnp.bfloat16)), st)
        args = (*args, i32(b), i32(b, 4))
        static = dict(buf=NEW, sampled=sampled, top_logprobs=None)
        if name.startswith("spec_run"):
            return spec_run, args, static
        state = self.shapes(spec_start, *args, **static)
        rounds = self.adaptive[bool(sampled)].block_rounds(spec)
        return spec_block, (self.models, spec, state, st, i32(b), i32(b, 4)), dict(rounds=rounds, sampled=sampled)

    def _serve(self, name: str, sampled):
        """The server's dispatch of `name`, as its scheduler builds it on a GPU (server/scheduler_state.py)."""
        import jax.numpy as jnp

        from jaxspec.logprobs import top_k_for
        from jaxspec.server.scheduler_state import dispatch_defaults
        from jaxspec.serving import SlotBatch, dispatch

        k, span = dispatch_defaults("gpu")
        spec = None
        models = self.target_models
        if name.startswith("serve_spec"):
            spec, models = self.spec.for_kind(False), self.models
        prop = None if spec is None else models.draft
        window = k * ((spec.num_steps if spec else 0) + 1)
        max_len = -(-(self.cfg.max_position_embeddings + (spec.scratch_tokens if spec else 0)) // 64) * 64
        batch = self.shapes(
            SlotBatch.create,
            self.cfg,
            prop,
            SLOTS,
            max_len,
            window,
            8,
            jnp.bfloat16,
            spec.num_steps if spec else 0,
            None,
            top_logprobs=top_k_for(self.cfg.vocab_size),
            grammar=True,
        )
        kill = self.sds(jnp.zeros((SLOTS,), bool))
        static = dict(k=k, n_act=SLOTS, span=span, sampled=sampled or True, logprobs=False, grammar=False)
        return dispatch, (models, spec, batch, kill), static


def compile_programs(builder: Builder, names, dump: str) -> dict:
    """name -> thunks.Report of each program, compiled for the builder's target."""
    import thunks

    from jaxspec.compile_target import compiling_for

    out = {}
    for name in names:
        before = set(thunks.module_files(dump))
        with compiling_for("gpu"):  # traced as on a GPU: Pallas kernels compiled, not interpreted
            fn, args, static = builder.call(name)
            fn.lower(*args, **static).compile()
        new = sorted(set(thunks.module_files(dump)) - before)
        if not new:
            raise RuntimeError(f"{name}: XLA dumped no thunk sequence (was the program loaded from a cache?)")
        out[name] = thunks.profile_module(dump, new[-1])
    return out


def describe(name: str, r, sources: int = 0) -> list[str]:
    lines = [
        f"## {name}: {r.outside} kernels outside loops, {r.command_buffers} command buffer(s) at the top level "
        f"({r.top_level} top-level thunks)"
    ]
    for lp in r.loops:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(lp.by_kind.items(), key=lambda kv: -kv[1]))
        lines.append(
            f"  {lp.path}: {lp.kernels} kernels per iteration ({kinds}); {lp.copy_bytes / 1e6:.3f} MB copied; "
            f"{'captured in a command buffer' if lp.captured else 'NOT captured'}"
            + (f"; {lp.nested} loop(s) inside" if lp.nested else "")
        )
        top = ", ".join(f"{op} {n}" for op, n in lp.ops.most_common(8))
        lines.append(f"    largest groups by JAX op: {top}")
        if sources:
            top = ", ".join(f"{src} {n}" for src, n in lp.sources.most_common(sources))
            lines.append(f"    largest groups by source line: {top}")
    if r.breakers:
        lines.append(f"  top level outside command buffers: {', '.join(r.breakers[:12])}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default="h100", help=f"{' or '.join(TARGETS)}, or a GpuTargetConfigProto text file")
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "llama8b", "toy"))
    ap.add_argument(
        "--model-path", default=None, help="smollm2: another checkpoint of its layout (default: the shipped model)"
    )
    ap.add_argument(
        "--draft", default=None, help="smollm2: an EAGLE-3 head for --model-path (default: the shipped one)"
    )
    ap.add_argument(
        "--programs", default=None, help=f"comma-separated, from {', '.join(PROGRAMS)} (default: all the model has)"
    )
    ap.add_argument("--json", default=None, help="write the reports here")
    ap.add_argument("--dump", default=None, help="keep XLA's dump in this directory (default: a temporary one)")
    ap.add_argument("--xla-flags", default="", help="more XLA flags (over jaxspec's GPU defaults)")
    ap.add_argument("--sources", type=int, default=0, help="also print the N source lines that make the most kernels")
    args = ap.parse_args(argv)
    unknown = [n for n in (args.programs or "").split(",") if n and n not in PROGRAMS]
    if unknown:
        ap.error(f"unknown program(s) {', '.join(unknown)}; available: {', '.join(PROGRAMS)}")
    if args.target not in TARGETS and not os.path.isfile(args.target):
        ap.error(f"--target {args.target}: neither {' nor '.join(TARGETS)} nor a file")
    dump = args.dump or tempfile.mkdtemp(prefix="gpu_programs_")
    setup_env(dump, args.xla_flags)
    sys.path.insert(0, HERE)
    try:
        builder = Builder(args.model, topology_mesh(args.target), args.model_path, args.draft)
        names = args.programs.split(",") if args.programs else [p for p in PROGRAMS if builder.models or p in PLAIN]
        reports = compile_programs(builder, names, dump)
    except ValueError as e:  # a program this model cannot build (a draft's, without one)
        ap.error(str(e))
    finally:
        if args.dump is None:
            shutil.rmtree(dump, ignore_errors=True)
    spec = builder.spec
    shape = "" if spec is None else f", tree {spec.num_steps}/{spec.eagle_topk}/{spec.num_draft_tokens}"
    print(f"# {args.model} on {args.target} (attention {builder.backend}{shape}); XLA_FLAGS {os.environ['XLA_FLAGS']}")
    for name, r in reports.items():
        print("\n".join(describe(name, r, args.sources)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({n: r.as_dict() for n, r in reports.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
