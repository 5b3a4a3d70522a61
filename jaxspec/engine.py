"""`Engine`: the offline API, shaped like SGLang's `sgl.Engine`.

    eng = jaxspec.Engine()                                   # default model + its shipped EAGLE-3 draft
    eng.generate("text", {"temperature": 0, "max_new_tokens": 64})   # -> dict
    eng.generate(["a", "b"], {...})                            # -> list of dicts
    eng.chat([{"role": "user", "content": "hi"}], {...})      # applies the chat template

A result is {"text", "output_ids", "meta_info"} (jaxspec/requests.py); meta_info holds prompt_tokens,
completion_tokens, finish_reason, e2e_latency, spec_verify_ct and spec_accept_length; with
return_logprob=True also SGLang's output_token_logprobs / output_top_logprobs (and, from
logprob_start_len >= 0, input_token_logprobs / input_top_logprobs) as [logprob, token id, text]
entries (jaxspec/logprobs.py says which distribution they are from).

Shapes are bucketed (batch, prompt chunk, cache length, output buffer -> powers of two) so that
repeated calls reuse compiled programs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import compile_cache, grammar
from jaxspec.args import EngineArgs, compatibility_notes
from jaxspec.attention import resolve_backend
from jaxspec.cache import KVCache
from jaxspec.config import SpecConfig
from jaxspec.decode import decode, prefill_chunk, prompt_logprobs
from jaxspec.errors import JaxspecError
from jaxspec.grammar import Grammars, requested
from jaxspec.loader import LoadedModel, jnp_dtype, load_target
from jaxspec.logprobs import top_k_for
from jaxspec.prepare import Layout, draft_from_target, prepare_draft, prepare_target
from jaxspec.quant import draft_quantization
from jaxspec.requests import (
    LogprobArgs,
    TokenLogprobRows,
    bucket,
    check_prompt,
    draft_prompt,
    input_logprobs,
    logprob_rows,
    offline_result,
    stop_token_ids,
)
from jaxspec.sampling import GREEDY_EPS, SamplingParams, SamplingTensors, nth_sample, sampling_kind, split_n
from jaxspec.sharding import check_heads, kv_sharding, make_mesh, replicate
from jaxspec.speculative.adaptive import Adaptive, shape_label
from jaxspec.speculative.loop import spec_block, spec_prefill_chunk, spec_run, spec_start
from jaxspec.speculative.online import OnlineConfig, OnlineTrainer
from jaxspec.speculative.online_process import OnlineProcess, wanted_process
from jaxspec.speculative.proposers import Proposer
from jaxspec.speculative.proposers.eagle import EagleProposer, unpack_features
from jaxspec.speculative.proposers.ngram import Corpus
from jaxspec.speculative.proposers.suffix import with_text_match
from jaxspec.weights import Models

logger = logging.getLogger("jaxspec")

# the public API's types
SamplingArg = SamplingParams | dict[str, Any] | None  # SGLang's sampling_params dict, or SamplingParams
Conversation = list[dict[str, str]]  # [{"role": "user", "content": "hi"}, ...]
Result = dict[str, Any]  # {"text", "output_ids", "meta_info"}

DEFAULT_BATCH = 8  # max_running_requests when unset (the server instead sizes it to memory)

# engines whose adaptive speculation keeps block programs compiled ahead (clear_cache drops them)
_LIVE: weakref.WeakSet = weakref.WeakSet()


def clear_cache() -> None:
    """Drops the block programs engines compiled ahead for adaptive speculation (with
    jax.clear_caches(): frees their memory mappings); they compile again when next needed."""
    for eng in list(_LIVE):
        eng._block_programs.clear()
        for adaptive in eng._adaptive.values():
            adaptive.ready.clear()


class Engine:
    """The offline engine. Takes the flags of `jaxspec generate` as keyword arguments (their names
    with underscores: jaxspec.args.EngineArgs), or one EngineArgs; the model path may come first.

    skip_tokenizer_init: no tokenizer (input_ids in, output_ids out); show_progress: loading bars.
    Target and draft run with fused q/k/v and gate/up projections (models/llama.py:fuse_projections),
    on XLA:CPU with one device also with out-major kernels (models/llama.py:out_major); a model passed
    in (`from_model`, `_loaded`) is changed as a copy and stays as it was. _out_major=False keeps
    the in-major kernels, _draft_sampling=False the target-only acceptance rule for sampled requests
    (SpecConfig.draft_sampling; benchmarks compare the two)."""

    def __init__(
        self,
        model_path: str | EngineArgs | None = None,
        *,
        skip_tokenizer_init: bool = False,
        show_progress: bool = True,
        _loaded: LoadedModel | None = None,
        _fuse: bool = True,
        _out_major: bool = True,
        _draft_sampling: bool = True,
        **kwargs: Any,
    ):
        if isinstance(model_path, EngineArgs):
            if kwargs:
                raise JaxspecError(
                    f"pass either an EngineArgs or keyword arguments, not both (got {', '.join(sorted(kwargs))})"
                )
            args = model_path
        else:
            args = EngineArgs.from_kwargs({**kwargs, **({} if model_path is None else {"model_path": model_path})})
        self.args = args
        logging.basicConfig(level=args.log_level.upper())
        logger.setLevel(args.log_level.upper())
        compile_cache.enable()
        args.validate()  # fail fast on bad flags, before loading
        for note in compatibility_notes(args):
            logger.warning(note)
        try:
            attention_backend = resolve_backend(args.attention_backend)
        except ValueError as e:
            raise JaxspecError(str(e)) from None
        self.tp_size = args.tp_size
        self.mesh = make_mesh(args.tp_size, args.ep_size)  # None for tp_size 1
        given = _loaded is not None  # the caller's model: fused as a copy, never changed
        if _loaded is None:
            _loaded = load_target(args, self.mesh, progress=show_progress, with_tokenizer=not skip_tokenizer_init)
        self.loaded = _loaded
        self.cfg = _loaded.cfg
        self.tokenizer: Any = _loaded.tokenizer  # a transformers tokenizer, or None
        self._grammars: Grammars | None = None  # built on the first constrained request
        self.dtype = jnp_dtype(args.dtype)
        self.params: Any
        check_heads(self.cfg, args.tp_size, args.ep_size)
        # a checkpoint's own quantization (fp8, int8, w8a8_int8; a GGUF's on CPU: jaxspec/default_mode.py)
        self.quantization = args.quantization or _loaded.quantization
        layout = Layout.for_target(args, self.quantization, fuse=_fuse, out_major_ok=_out_major)
        self.graphdef, self.params = prepare_target(_loaded, layout, self.mesh, given)
        self.kv_sharding = kv_sharding(self.mesh)
        self.context_length = int(args.context_length or self.cfg.max_position_embeddings)
        if self.context_length < 2:
            raise JaxspecError(f"context_length must be >= 2, got {self.context_length}")
        self.max_running_requests = args.max_running_requests or DEFAULT_BATCH
        self.chunked_prefill_size = args.chunked_prefill_size
        self.backend = attention_backend
        self.spec = SpecConfig.resolve(args, self.cfg, bundled=draft_from_target(_loaded, args.algorithm))
        if not _draft_sampling:
            self.spec = dataclasses.replace(self.spec, draft_sampling=False)
        self.speculative_algorithm = self.spec.algorithm
        # a shipped draft, not the user's choice
        self._spec_auto = args.speculative_algorithm is None and self.spec.enabled
        self.proposer: Proposer | None = None
        self.dparams: dict[str, Any] | None = None
        if self.spec.enabled:
            try:
                draft_backend = resolve_backend(args.speculative_draft_attention_backend or attention_backend)
            except ValueError as e:
                raise JaxspecError(str(e)) from None
            mode = draft_quantization(
                self.quantization,
                args.speculative_draft_model_quantization,
                int8_on_cpu=args.tp_size == 1 and not args.speculative_online_train,
            )
            draft_layout = dataclasses.replace(layout, quantization=mode)
            self._draft_layout = draft_layout
            proposer, self.dparams = prepare_draft(
                self.spec, _loaded, args.dtype, draft_layout, self.mesh, show_progress
            )
            self.proposer = dataclasses.replace(
                proposer, attention_backend=draft_backend, attention_mode=self.spec.attention_mode
            )
        self.adaptive = Adaptive(self.spec) if self.spec.adaptive else None
        # per kind: rounds that sample may run another shape (SpecConfig.for_kind), with its own candidates
        sampled_spec = self.spec.for_kind(True)
        self._adaptive: dict[bool, Adaptive] = {}
        if self.adaptive is not None:
            self._adaptive = {
                False: self.adaptive,
                True: Adaptive(sampled_spec) if sampled_spec is not self.spec else self.adaptive,
            }
        # (shape label, rounds, program signature) -> block programs adaptive speculation compiled ahead
        self._block_programs: dict[tuple, Any] = {}
        if self.adaptive is not None:
            _LIVE.add(self)
        self._corpus: Corpus | None = None
        if self.spec.text_match is not None:  # NGRAM, or text-match candidates beside a draft model
            self.reset_ngram_corpus()
        self._rng = np.random.default_rng(args.random_seed)
        self.online: OnlineTrainer | OnlineProcess | None = None
        if args.speculative_online_train:
            if not self.spec.enabled:
                raise JaxspecError("speculative_online_train needs a draft (--speculative-algorithm EAGLE3)")
            cfg = OnlineConfig.from_args(args)
            self.online = OnlineProcess(self, cfg) if wanted_process(cfg, self.loaded) else OnlineTrainer(self, cfg)
            # the draft cache keeps the target's features for it to train on (no second forward)
            assert isinstance(self.proposer, EagleProposer)  # (OnlineTrainer refuses other drafts)
            self.proposer = dataclasses.replace(self.proposer, keep_features=True)
        if self.spec.suffix is not None and self.proposer is not None:
            self.proposer = with_text_match(self.proposer)

    def swap_draft(self, path: str) -> None:
        """Replaces the draft's weights with the head at `path` (same architecture and draft vocabulary;
        online training writes it). Dispatches after this call use the new weights; none recompiles."""
        spec = dataclasses.replace(self.spec, draft_model_path=path)
        proposer, dparams = prepare_draft(spec, self.loaded, self.args.dtype, self._draft_layout, self.mesh, False)
        if str(jax.tree.structure(dparams)) != str(jax.tree.structure(self.dparams)):
            raise JaxspecError(f"the head at {path} does not have the served draft's layout")
        if self.dparams and "corpus" in self.dparams:  # the text shared by requests stays
            dparams = {**dparams, "corpus": self.dparams["corpus"]}
        self.dparams = dparams

    def save_draft(self, path: str) -> str:
        """Writes the draft head in use (adapted by online training) to `path` in the public EAGLE-3
        layout; a fresh engine loads it with speculative_draft_model_path. Returns the path."""
        if self.online is None:
            raise JaxspecError("save_draft needs speculative_online_train (the draft in use is its checkpoint)")
        return self.online.save(path)

    @classmethod
    def from_model(cls, model, tokenizer=None, **kwargs) -> Engine:
        """An engine over an in-memory `LlamaForCausalLM` (tests, notebooks)."""
        loaded = LoadedModel(model.cfg, model, tokenizer, "<memory>", "memory")
        return cls(_loaded=loaded, **kwargs)

    # ---- public API -------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: SamplingArg | list[SamplingArg] = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        return_text_in_logprobs: bool = False,
    ) -> Result | list[Result]:
        """prompt: str | list[str]; or input_ids: list[int] | list[list[int]]. Returns dict | list[dict]
        (one per prompt; see the module docstring); sampling_params: one for all prompts, or one each;
        its `n` draws that many samples of a prompt (a list of n results per prompt, prompt by prompt).
        return_logprob: report each output token's logprob, with its top_logprobs_num (<= 20) most
        likely alternatives, and from logprob_start_len >= 0 on those of the prompt tokens too
        (SGLang's arguments); return_text_in_logprobs: each entry's token text."""
        if (prompt is None) == (input_ids is None):
            raise JaxspecError("pass exactly one of prompt or input_ids")
        single = isinstance(prompt, str) or (
            input_ids is not None and (len(input_ids) == 0 or isinstance(input_ids[0], (int, np.integer)))
        )
        if prompt is not None:
            prompts: list = [prompt] if single else list(prompt)
            if not all(isinstance(p, str) for p in prompts):
                raise JaxspecError("prompt must be a string or a list of strings")
            ids = [self.encode(p) for p in prompts]
        else:
            given: list = list(input_ids or [])
            ids = [given] if single else [list(x) for x in given]
        lp = LogprobArgs.check(return_logprob, top_logprobs_num, logprob_start_len, return_text_in_logprobs)
        results = self._generate_ids(ids, sampling_params, lp)
        return results[0] if single and len(results) == 1 else results

    def chat(
        self,
        messages: Conversation | list[Conversation],
        sampling_params: SamplingArg | list[SamplingArg] = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
    ) -> Result | list[Result]:
        """messages: one conversation (list of {"role", "content"}) or a list of conversations;
        the logprob arguments as in generate()."""
        single = bool(messages) and isinstance(messages[0], dict)
        convs: list = [messages] if single else list(messages)
        ids = [self.encode(self.apply_chat_template(c), add_special_tokens=False) for c in convs]
        lp = LogprobArgs.check(return_logprob, top_logprobs_num, -1, return_text_in_logprobs)
        results = self._generate_ids(ids, sampling_params, lp)
        return results[0] if single and len(results) == 1 else results

    def apply_chat_template(
        self, messages: Conversation, tools: list[dict] | None = None, template_kwargs: dict | None = None
    ) -> str:
        """The prompt text of a conversation (tools: OpenAI tool objects, for templates that take them;
        template_kwargs: further variables for the template, e.g. {"enable_thinking": False})."""
        tok = self._need_tokenizer()
        if not getattr(tok, "chat_template", None):
            raise JaxspecError("this model's tokenizer has no chat template; use generate() with a raw prompt")
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages
        ):
            raise JaxspecError('messages must be a list of {"role": ..., "content": ...} dicts')

        kw = {**(template_kwargs or {}), **({} if tools is None else {"tools": tools})}
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)

    def reset_ngram_corpus(self, reserve: int | None = None) -> None:
        """NGRAM and text-match candidates: empties the text shared by all requests
        (speculative/proposers/ngram.py). Its device copy is padded to a power of two of at least
        `reserve` tokens (None: the current text's, 4096 at first); each larger size recompiles the
        round, so a reserve that holds the whole workload compiles once."""
        match = self.spec.text_match
        if match is None:
            raise JaxspecError(
                "reset_ngram_corpus needs speculative_algorithm='NGRAM' or speculative_suffix_draft_tokens"
            )
        if reserve is None:
            reserve = 4096 if self._corpus is None else self._corpus.reserve
        self._corpus = Corpus(match.capacity, reserve=reserve)
        self.dparams = {**(self.dparams or {}), "corpus": self._corpus.device()}

    @property
    def models(self) -> Models:
        """The target and the draft as the compiled programs take them (jaxspec/weights.py)."""
        return Models(self.graphdef, self.params, self.proposer, self.dparams, self.backend)

    @property
    def target_models(self) -> Models:
        """The target alone, for the programs that decode without the draft (whatever the draft,
        they compile once)."""
        return Models(self.graphdef, self.params, backend=self.backend)

    def shutdown(self) -> None:
        """Releases device buffers (SGLang API parity)."""
        self.params = None

    # ---- internals --------------------------------------------------------------------------

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise JaxspecError("no tokenizer loaded (skip_tokenizer_init=True); pass input_ids")
        return self.tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._need_tokenizer()(text, add_special_tokens=add_special_tokens).input_ids)

    def _generate_ids(self, ids: list[list[int]], sampling_params, lp: LogprobArgs | None = None) -> list[dict]:
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(ids):
                raise JaxspecError(f"got {len(sampling_params)} sampling_params for {len(ids)} prompts")
            given = [split_n(p) for p in sampling_params]
        else:
            given = [split_n(sampling_params)] * len(ids)
        # n samples of a prompt: n requests, one after another in the results
        ids = [x for x, (_, n) in zip(ids, given) for _ in range(n)]
        params = [nth_sample(SamplingParams.from_dict(d), j) for d, n in given for j in range(n)]
        spec_on = self.spec.enabled
        if spec_on and any(p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty for p in params):
            if not self._spec_auto:
                raise JaxspecError(
                    "repetition/frequency/presence penalties are not supported with speculative decoding yet"
                )
            spec_on = False  # the shipped draft was chosen for the user: fall back to plain decoding
            logger.info("penalties requested: decoding this batch without speculation")
        for i, x in enumerate(ids):
            check_prompt(x, self.context_length, self.cfg.vocab_size, name=f"prompt {i}")
        grammars = [self.grammar_of(p) for p in params]  # validated before anything runs
        out = []
        n = self.max_running_requests
        for s in range(0, len(ids), n):
            out += self._run_batch(ids[s : s + n], params[s : s + n], spec_on, lp, grammars[s : s + n])
        return out

    def grammar_of(self, p: SamplingParams) -> str | None:
        """The validated grammar of a request's json_schema / regex / ebnf (None: unconstrained);
        raises JaxspecError for an invalid one."""
        if requested(p) is None:
            return None
        if self.tp_size > 1:
            raise JaxspecError("json_schema / regex / ebnf are not supported with tensor parallelism (tp_size > 1) yet")
        if self._grammars is None:
            eos = sorted(set(self.cfg.eos_token_ids) | {self._need_tokenizer().eos_token_id} - {None})
            self._grammars = Grammars(self.tokenizer, self.cfg.vocab_size, eos)
        return self._grammars.check(p)

    def open_grammar(self, grammar: str) -> int:
        """A matcher for a grammar that grammar_of returned, registered for the device programs:
        its handle (jaxspec/grammar.py; close it with grammar.close_handle)."""
        assert self._grammars is not None, "grammar_of validates a grammar first"
        return self._grammars.open(grammar)

    def shared_text_stats(self) -> dict[str, int] | None:
        """The text NGRAM / text-match candidates share across requests: tokens held (separators
        included), their bound (--speculative-ngram-capacity), the device copy's size. None: none."""
        c = self._corpus
        if c is None:
            return None
        return {"tokens": len(c.buf), "capacity": c.capacity, "device_tokens": c.device_size()}

    def feed_ngram_corpus(self, sequences: list[list[int]]) -> None:
        """NGRAM: appends finished requests (prompt + output ids) to the shared n-gram text."""
        if self._corpus is None:
            return
        self._corpus.add(sequences)
        self.dparams = {**(self.dparams or {}), "corpus": self._corpus.device()}

    def _run_batch(
        self,
        ids: list[list[int]],
        params: list[SamplingParams],
        spec_on: bool,
        lp: LogprobArgs | None = None,
        grammars: list[str | None] | None = None,
    ) -> list[dict]:
        handles = None
        if grammars is not None and any(g is not None for g in grammars):
            handles = [-1 if g is None else self.open_grammar(g) for g in grammars]
        try:
            out = self._run_batch_with(ids, params, spec_on, lp, handles)
            why = [w for w in (grammar.rejection(h) for h in handles or []) if w is not None]
            if why:  # never return output that breaks its grammar
                raise JaxspecError(f"internal error: {why[0]}")
            return out
        finally:
            for h in handles or []:
                grammar.close_handle(h)

    def _run_batch_with(
        self, ids: list[list[int]], params: list[SamplingParams], spec_on: bool, lp: LogprobArgs | None, handles
    ) -> list[dict]:
        t0 = time.perf_counter()
        top = None if lp is None else (0 if lp.top_logprobs_num == 0 else top_k_for(self.cfg.vocab_size))
        n = len(ids)
        b = min(bucket(n), max(self.max_running_requests, n))
        lens = [len(x) for x in ids]
        max_new = [min(p.max_new_tokens, self.context_length - n_in) for p, n_in in zip(params, lens)]
        buf = bucket(max(max_new + [1]), 16)
        longest = max(lens)
        chunk = min(bucket(self.chunked_prefill_size), bucket(longest, 16))
        n_chunks = -(-longest // chunk)
        extra = self.spec.scratch_tokens if spec_on else 0
        s_len = bucket(max(n_in + m for n_in, m in zip(lens, max_new)) + extra, 64)
        stops = [stop_token_ids(self.cfg, self.tokenizer, p) for p in params]
        k = bucket(max(len(s) for s in stops), 4)
        seeds = [p.seed if p.seed is not None else int(self._rng.integers(2**31)) for p in params]

        pad = b - n
        prompt = np.zeros((b, n_chunks * chunk), np.int32)
        for i, x in enumerate(ids):
            prompt[i, : len(x)] = x
        stop_arr = np.full((b, k), -1, np.int32)
        for i, s in enumerate(stops):
            stop_arr[i, : len(s)] = s
        params_p = params + [SamplingParams(temperature=0.0)] * pad
        st = SamplingTensors.build(params_p, seeds + [0] * pad, None if handles is None else handles + [-1] * pad)
        sampled = sampling_kind(params)  # the most specific sampler these requests need
        lens_d = jnp.asarray(lens + [1] * pad, jnp.int32)
        max_new_d = jnp.asarray(max_new + [0] * pad, jnp.int32)
        prompt_d = jnp.asarray(prompt)

        cache = KVCache.create(self.cfg, b, s_len, self.dtype, self.kv_sharding)
        last_h = replicate(jnp.zeros((b, self.cfg.hidden_size), self.dtype), self.mesh)
        if spec_on:
            (out, num_out, finish, verify_ct, hist, lps), used, feats = self._spec_batch(
                cache, last_h, prompt, prompt_d, lens_d, st, max_new_d, stop_arr, buf, chunk, n_chunks, sampled, n, top
            )
        else:
            for c in range(n_chunks):
                tokens = prompt_d[:, c * chunk : (c + 1) * chunk]
                cache, last_h = prefill_chunk(self.target_models, cache, tokens, jnp.int32(c * chunk), lens_d, last_h)
            out, num_out, finish, _, lps = decode(
                self.target_models,
                cache,
                last_h,
                prompt_d,
                lens_d,
                st,
                max_new_d,
                jnp.asarray(stop_arr),
                buf=buf,
                sampled=sampled,
                top_logprobs=top,
            )
            out, num_out, finish, lps = jax.device_get((out, num_out, finish, lps))
            verify_ct, hist, used, feats = num_out, None, None, None
        latency = time.perf_counter() - t0
        if spec_on:  # finished requests feed the shared n-gram text
            self.feed_ngram_corpus([list(x) + list(map(int, out[i, : num_out[i]])) for i, x in enumerate(ids)])
        results = [
            offline_result(
                self.tokenizer,
                list(map(int, out[i, : num_out[i]])),
                int(finish[i]),
                lens[i],
                params[i],
                latency,
                int(verify_ct[i]),
                None if hist is None else hist[i],
                None if used is None else used[i],
                None if lp is None else logprob_rows(lps, i, 0, int(num_out[i]), lp.top_logprobs_num),
                None if lp is None or lp.logprob_start_len < 0 else self._prompt_logprobs(ids[i], params[i], lp),
                lp,
            )
            for i in range(n)
        ]
        if self.online is not None and feats is not None:  # online draft training learns from them
            for i, r in enumerate(results):
                self.online.observe(ids[i], r["output_ids"], feats[i])
        return results

    def prompt_logprob_rows(self, ids: list[int], temperature: float, k: int) -> TokenLogprobRows:
        """Each prompt token's logprob given the tokens before it, with its k (<= 20) most likely
        alternatives: [(logprob, [(token id, logprob)])] per token (entry 0 is (0.0, []): nothing
        predicts the first token). One forward over the prompt alone, through its own compiled
        program per padded length (no request's cache is touched; safe beside the server's calls)."""
        chunk = 256 if len(ids) > 256 else bucket(len(ids), 16)
        padded = np.zeros((1, -(-len(ids) // chunk) * chunk), np.int32)
        padded[0, : len(ids)] = ids
        lps = prompt_logprobs(
            self.target_models,
            jnp.asarray(padded),
            jnp.asarray([temperature], jnp.float32),
            k=0 if k == 0 else top_k_for(self.cfg.vocab_size),
            chunk=chunk,
        )
        lps = jax.tree_util.tree_map(lambda a: np.asarray(a)[None], jax.device_get(lps))
        rows = logprob_rows(lps, 0, 0, len(ids), k)
        return [(0.0, [])] + rows[1:]

    def _prompt_logprobs(self, ids: list[int], p: SamplingParams, lp: LogprobArgs) -> dict[str, Any]:
        """input_token_logprobs / input_top_logprobs of one prompt."""
        rows = self.prompt_logprob_rows(ids, p.temperature, lp.top_logprobs_num)
        return input_logprobs(ids, rows, min(lp.logprob_start_len, len(ids)))

    def _spec_batch(
        self, cache, last_h, prompt, prompt_d, lens_d, st, max_new_d, stop_arr, buf, chunk, n_chunks, sampled, n, top
    ):
        """Prefill, then rounds (in blocks chosen by adaptive speculation when it is on) of the tree
        shape of `sampled`'s kind (SpecConfig.for_kind). top: None, or the top-logprob count to
        record. Returns ((out, num_out, finish, verify_ct, hist, lps) on the host, per request the
        rounds run with each adaptive candidate ({shape label: rounds}) or None, the target features
        the draft cache kept [b, S, F] or None)."""
        models, b = self.models, prompt.shape[0]
        spec = self.spec.for_kind(bool(sampled))
        prop = models.draft
        dcache = replicate(prop.make_cache(b, cache.max_len, self.dtype), self.mesh)
        dprompt = jnp.asarray(draft_prompt(prompt, prop.shift))
        feat_dim = (3 if prop.capture_layers else 1) * self.cfg.hidden_size if prop.uses_hidden else 1
        last_feat = replicate(jnp.zeros((b, feat_dim), self.dtype), self.mesh)
        for c in range(n_chunks):
            sl = slice(c * chunk, (c + 1) * chunk)
            cache, dcache, last_h, last_feat = spec_prefill_chunk(
                models, cache, dcache, prompt_d[:, sl], dprompt[:, sl], jnp.int32(c * chunk), lens_d, last_h, last_feat
            )
        stop_d = jnp.asarray(stop_arr)
        args = (models, spec, cache, dcache, last_h, last_feat, st, max_new_d, stop_d)
        used = None
        if self.adaptive is None:  # the first token and every round in one program
            state = spec_run(*args, buf=buf, sampled=sampled, top_logprobs=top)
        else:
            state = spec_start(*args, buf=buf, sampled=sampled, top_logprobs=top)
            adaptive = self._adaptive[bool(sampled)]
            state, rounds = self._adaptive_blocks(adaptive, models, state, st, max_new_d, stop_d, sampled, n)
            used = [{shape_label(c): int(k) for c, k in zip(adaptive.candidates, r)} for r in rounds]
        res = jax.device_get((state.out, state.num_out, state.finish, state.verify_ct, state.hist, state.lps))
        # the target features the draft cache kept, [b, S, F] (online draft training)
        feats = None if self.online is None else unpack_features(state.draft.cache.k[prop.feature_layer][:, :, 0])
        return res, used, feats

    def _adaptive_blocks(self, adaptive: Adaptive, models: Models, state, st, max_new_d, stop_d, sampled, n):
        """Rounds in blocks chosen by `adaptive` (speculative/adaptive.py) until every request is
        done. Every block runs a program compiled ahead with `lower().compile()` and kept in
        self._block_programs: the configured shape's when first needed, the other candidates' in
        the background (Adaptive.run). Returns (state, rounds per candidate [n, len(candidates)])."""
        dyn = (state, st, max_new_d, stop_d)  # what the programs depend on besides shape and rounds
        sig = (sampled, jax.tree.structure(dyn), *((x.shape, x.dtype) for x in jax.tree.leaves(dyn)))
        # the state is donated to each block: programs compile against its shapes
        state_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)

        def program(spec):
            rounds = adaptive.block_rounds(spec)
            key = (shape_label(spec), rounds, *sig)
            if key not in self._block_programs:
                self._block_programs[key] = spec_block.lower(
                    models, spec, state_shapes, st, max_new_d, stop_d, rounds=rounds, sampled=sampled
                ).compile()
            return self._block_programs[key]

        def block(spec, state):
            return program(spec)(models, state, st, max_new_d, stop_d)

        greedy = np.asarray(st.temperature[:n]) <= GREEDY_EPS
        return adaptive.run(block, state, greedy, sig, program)


_ENGINES: dict = {}


def generate(
    prompt: str | list[str] | None = None,
    sampling_params: SamplingArg | list[SamplingArg] = None,
    input_ids: list[int] | list[list[int]] | None = None,
    **engine_kwargs: Any,
) -> Result | list[Result]:
    """One-call convenience: `jaxspec.generate("hi", {"max_new_tokens": 16})`. Engines are reused per kwargs."""
    key = tuple(sorted(engine_kwargs.items()))
    if key not in _ENGINES:
        _ENGINES[key] = Engine(**engine_kwargs)
    return _ENGINES[key].generate(prompt, sampling_params, input_ids)
