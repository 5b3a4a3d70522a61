"""`Engine`: the offline API, shaped like SGLang's `sgl.Engine`.

    eng = jaxspec.Engine()                                   # default model + its shipped EAGLE-3 draft
    eng.generate("text", {"temperature": 0, "max_new_tokens": 64})   # -> dict
    eng.generate(["a", "b"], {...})                            # -> list of dicts
    eng.chat([{"role": "user", "content": "hi"}], {...})      # applies the chat template

A result is {"text", "output_ids", "meta_info"}; meta_info holds prompt_tokens, completion_tokens,
finish_reason, e2e_latency, spec_verify_ct and spec_accept_length.

Shapes are bucketed (batch, prompt chunk, cache length, output buffer -> powers of two) so that
repeated calls reuse compiled programs.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import uuid
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec import compile_cache
from jaxspec.attention import resolve_backend
from jaxspec.cache import KVCache
from jaxspec.config import SpecConfig
from jaxspec.decode import LENGTH, STOPPED, decode, prefill_chunk
from jaxspec.errors import JaxspecError
from jaxspec.loader import LoadedModel, jnp_dtype, load
from jaxspec.sampling import SamplingParams, SamplingTensors
from jaxspec.sharding import check_heads, kv_sharding, make_mesh, replicate, shard_params

logger = logging.getLogger("jaxspec")

def bucket(n: int, lo: int = 1) -> int:
    """Smallest power of two >= max(n, lo)."""
    return 1 << max(int(math.ceil(math.log2(max(n, lo, 1)))), 0)


class Engine:
    def __init__(
        self,
        model_path: str | None = None,
        dtype: str = "float32",
        tokenizer_path: str | None = None,
        skip_tokenizer_init: bool = False,
        context_length: int | None = None,
        max_running_requests: int = 8,
        chunked_prefill_size: int = 512,
        attention_backend: str | None = None,
        random_seed: int = 0,
        tp_size: int = 1,
        speculative_algorithm: str | None = None,
        speculative_draft_model_path: str | None = None,
        speculative_num_steps: int | None = None,
        speculative_eagle_topk: int | None = None,
        speculative_num_draft_tokens: int | None = None,
        speculative_accept_threshold_single: float = 1.0,
        speculative_accept_threshold_acc: float = 1.0,
        speculative_token_map: str | None = None,
        speculative_draft_model_revision: str | None = None,
        speculative_draft_load_format: str | None = None,
        speculative_ngram_min_match_window_size: int = 1,
        speculative_ngram_max_match_window_size: int = 12,
        speculative_ngram_min_bfs_breadth: int = 1,
        speculative_ngram_max_bfs_breadth: int = 10,
        speculative_ngram_match_type: str = "BFS",
        speculative_ngram_branch_length: int = 18,
        speculative_ngram_capacity: int = 10 * 1000 * 1000,
        speculative_ngram_force_greedy_verify: bool | None = None,
        log_level: str = "warning",
        show_progress: bool = True,
        _loaded: LoadedModel | None = None,
    ):
        logging.basicConfig(level=log_level.upper())
        logger.setLevel(log_level.upper())
        compile_cache.enable()
        spec_args = dict(
            draft_model_path=speculative_draft_model_path, num_steps=speculative_num_steps, eagle_topk=speculative_eagle_topk,
            num_draft_tokens=speculative_num_draft_tokens, accept_threshold_single=speculative_accept_threshold_single,
            accept_threshold_acc=speculative_accept_threshold_acc, token_map=speculative_token_map,
            draft_model_revision=speculative_draft_model_revision, draft_load_format=speculative_draft_load_format,
            ngram=dict(min_match_window_size=speculative_ngram_min_match_window_size, max_match_window_size=speculative_ngram_max_match_window_size,
                       min_bfs_breadth=speculative_ngram_min_bfs_breadth, max_bfs_breadth=speculative_ngram_max_bfs_breadth,
                       match_type=speculative_ngram_match_type, branch_length=speculative_ngram_branch_length,
                       capacity=speculative_ngram_capacity, force_greedy_verify=speculative_ngram_force_greedy_verify),
        )
        # Fail fast on bad flags, before loading. The draft path may still come from the target: a
        # shipped EAGLE3 draft, or (EAGLE / NEXTN) an MTP module inside the target's checkpoint.
        algo = None if speculative_algorithm is None else str(speculative_algorithm).upper().replace("NEXTN", "EAGLE")
        early = (algo, "<from the target>", None) if algo in ("EAGLE", "EAGLE3") else None
        SpecConfig.resolve(speculative_algorithm, None, warn=False, bundled=early, **spec_args)
        try:
            attention_backend = resolve_backend(attention_backend)
        except ValueError as e:
            raise JaxspecError(str(e)) from None
        if max_running_requests < 1 or chunked_prefill_size < 1:
            raise JaxspecError("max_running_requests and chunked_prefill_size must be >= 1")
        self.tp_size = tp_size
        self.mesh = make_mesh(tp_size)  # None for tp_size 1
        if _loaded is None:
            _loaded = load(model_path, dtype, tokenizer_path, progress=show_progress, with_tokenizer=not skip_tokenizer_init, mesh=self.mesh)
        self.loaded = _loaded
        self.cfg = _loaded.cfg
        self.tokenizer = _loaded.tokenizer
        self.dtype = jnp_dtype(dtype)
        self.graphdef, self.params = nnx.split(_loaded.model)
        check_heads(self.cfg, tp_size)
        self.kv_sharding = kv_sharding(self.mesh)
        self.params = shard_params(self.params, self.mesh)
        self.context_length = int(context_length or self.cfg.max_position_embeddings)
        if self.context_length < 2:
            raise JaxspecError(f"context_length must be >= 2, got {self.context_length}")
        self.max_running_requests = max_running_requests
        self.chunked_prefill_size = chunked_prefill_size
        self.backend = attention_backend
        self.spec = SpecConfig.resolve(speculative_algorithm, self.cfg, bundled=_draft_from_target(_loaded, algo), **spec_args)
        self.speculative_algorithm = self.spec.algorithm
        self._spec_auto = speculative_algorithm is None and self.spec.enabled  # a shipped draft, not the user's choice
        self.proposer = self.dparams = None
        if self.spec.enabled:
            from jaxspec.spec.proposers import load_proposer

            self.proposer, self.dparams = load_proposer(self.spec, _loaded, dtype, show_progress)
            self.proposer = dataclasses.replace(self.proposer, attention_backend=attention_backend)
            self.dparams = replicate(self.dparams, self.mesh)
        self._corpus = None
        if self.spec.algorithm == "NGRAM":
            self.reset_ngram_corpus()
        self._rng = np.random.default_rng(random_seed)

    @classmethod
    def from_model(cls, model, tokenizer=None, **kwargs) -> "Engine":
        """An engine over an in-memory `LlamaForCausalLM` (tests, notebooks)."""
        loaded = LoadedModel(model.cfg, model, tokenizer, "<memory>", "memory")
        return cls(_loaded=loaded, **kwargs)

    # ---- public API -------------------------------------------------------------------------

    def generate(self, prompt=None, sampling_params=None, input_ids=None):
        """prompt: str | list[str]; or input_ids: list[int] | list[list[int]]. Returns dict | list[dict]."""
        if (prompt is None) == (input_ids is None):
            raise JaxspecError("pass exactly one of prompt or input_ids")
        single = isinstance(prompt, str) or (input_ids is not None and (len(input_ids) == 0 or isinstance(input_ids[0], (int, np.integer))))
        if prompt is not None:
            prompts = [prompt] if single else list(prompt)
            if not all(isinstance(p, str) for p in prompts):
                raise JaxspecError("prompt must be a string or a list of strings")
            ids = [self._encode(p) for p in prompts]
        else:
            ids = [list(input_ids)] if single else [list(x) for x in input_ids]
        results = self._generate_ids(ids, sampling_params)
        return results[0] if single else results

    def chat(self, messages, sampling_params=None):
        """messages: one conversation (list of {"role", "content"}) or a list of conversations."""
        single = bool(messages) and isinstance(messages[0], dict)
        convs = [messages] if single else list(messages)
        ids = [self._encode(self.apply_chat_template(c), add_special_tokens=False) for c in convs]
        results = self._generate_ids(ids, sampling_params)
        return results[0] if single else results

    def apply_chat_template(self, messages) -> str:
        tok = self._need_tokenizer()
        if not getattr(tok, "chat_template", None):
            raise JaxspecError("this model's tokenizer has no chat template; use generate() with a raw prompt")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise JaxspecError('messages must be a list of {"role": ..., "content": ...} dicts')
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def reset_ngram_corpus(self, reserve: int = 4096) -> None:
        """NGRAM: empties the n-gram text shared by all requests (spec/proposers/ngram.py). Its device
        copy is padded to a power of two of at least `reserve` tokens; each larger size recompiles
        the round, so a reserve that holds the whole workload compiles once."""
        from jaxspec.spec.proposers.ngram import Corpus

        if self.spec.algorithm != "NGRAM":
            raise JaxspecError("reset_ngram_corpus needs speculative_algorithm='NGRAM'")
        self._corpus = Corpus(self.spec.ngram.capacity, reserve=reserve)
        self.dparams = {**self.dparams, "corpus": self._corpus.device()}

    def shutdown(self) -> None:
        """Releases device buffers (SGLang API parity)."""
        self.params = None

    # ---- internals --------------------------------------------------------------------------

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise JaxspecError("no tokenizer loaded (skip_tokenizer_init=True); pass input_ids")
        return self.tokenizer

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._need_tokenizer()(text, add_special_tokens=add_special_tokens).input_ids)

    def _generate_ids(self, ids: list[list[int]], sampling_params) -> list[dict]:
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(ids):
                raise JaxspecError(f"got {len(sampling_params)} sampling_params for {len(ids)} prompts")
            params = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params)] * len(ids)
        spec_on = self.spec.enabled
        if spec_on and any(p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty for p in params):
            if not self._spec_auto:
                raise JaxspecError("repetition/frequency/presence penalties are not supported with speculative decoding yet")
            spec_on = False  # the shipped draft was chosen for the user: fall back to plain decoding
            logger.info("penalties requested: decoding this batch without speculation")
        for i, x in enumerate(ids):
            if len(x) == 0:
                raise JaxspecError(f"prompt {i} is empty")
            if len(x) >= self.context_length:
                raise JaxspecError(f"prompt {i} has {len(x)} tokens, which does not fit context_length={self.context_length}")
            if min(x) < 0 or max(x) >= self.cfg.vocab_size:
                raise JaxspecError(f"prompt {i} has token ids outside [0, {self.cfg.vocab_size})")
        out = []
        n = self.max_running_requests
        for s in range(0, len(ids), n):
            out += self._run_batch(ids[s : s + n], params[s : s + n], spec_on)
        return out

    def _stop_ids(self, p: SamplingParams) -> list[int]:
        stop = [] if p.ignore_eos else list(self.cfg.eos_token_ids)
        if not p.ignore_eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            stop.append(self.tokenizer.eos_token_id)
        stop += list(p.stop_token_ids or [])
        for s in p.stop_strings:  # a stop string that is a single token stops generation on device
            if self.tokenizer is not None:
                t = self.tokenizer.encode(s, add_special_tokens=False)
                if len(t) == 1:
                    stop.append(t[0])
        return sorted(set(stop))

    def _run_batch(self, ids: list[list[int]], params: list[SamplingParams], spec_on: bool) -> list[dict]:
        t0 = time.perf_counter()
        n = len(ids)
        b = min(bucket(n), max(self.max_running_requests, n))
        lens = [len(x) for x in ids]
        max_new = [min(p.max_new_tokens, self.context_length - l) for p, l in zip(params, lens)]
        buf = bucket(max(max_new + [1]), 16)
        longest = max(lens)
        chunk = min(bucket(self.chunked_prefill_size), bucket(longest, 16))
        n_chunks = -(-longest // chunk)
        extra = 0 if not spec_on else self.spec.num_draft_tokens + self.spec.num_steps * self.spec.eagle_topk + 2
        s_len = bucket(max(l + m for l, m in zip(lens, max_new)) + extra, 64)
        stops = [self._stop_ids(p) for p in params]
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
        st = SamplingTensors.build(params_p, seeds + [0] * pad)
        lens_d = jnp.asarray(lens + [1] * pad, jnp.int32)
        max_new_d = jnp.asarray(max_new + [0] * pad, jnp.int32)
        prompt_d = jnp.asarray(prompt)

        cache = KVCache.create(self.cfg, b, s_len, self.dtype, self.kv_sharding)
        last_h = replicate(jnp.zeros((b, self.cfg.hidden_size), self.dtype), self.mesh)
        if spec_on:
            out, num_out, finish, verify_ct, hist = self._spec_batch(cache, last_h, prompt, prompt_d, lens_d, st, max_new_d, stop_arr, buf, chunk, n_chunks)
        else:
            for c in range(n_chunks):
                tokens = prompt_d[:, c * chunk : (c + 1) * chunk]
                cache, last_h = prefill_chunk(self.graphdef, self.params, cache, tokens, jnp.int32(c * chunk), lens_d, last_h, backend=self.backend)
            out, num_out, finish, _ = decode(
                self.graphdef, self.params, cache, last_h, prompt_d, lens_d, st, max_new_d, jnp.asarray(stop_arr), buf=buf, backend=self.backend
            )
            out, num_out, finish = jax.device_get((out, num_out, finish))
            verify_ct, hist = num_out, None
        latency = time.perf_counter() - t0
        if self._corpus is not None and spec_on:  # finished requests feed the shared n-gram text
            self._corpus.add(list(x) + list(map(int, out[i, : num_out[i]])) for i, x in enumerate(ids))
            self.dparams = {**self.dparams, "corpus": self._corpus.device()}
        return [
            self._result(list(map(int, out[i, : num_out[i]])), int(finish[i]), lens[i], params[i], latency, int(verify_ct[i]), None if hist is None else hist[i])
            for i in range(n)
        ]

    def _spec_batch(self, cache, last_h, prompt, prompt_d, lens_d, st, max_new_d, stop_arr, buf, chunk, n_chunks):
        from jaxspec.spec.loop import spec_decode, spec_prefill_chunk

        prop, b = self.proposer, prompt.shape[0]
        dcache = replicate(prop.make_cache(b, cache.max_len, self.dtype), self.mesh)
        shifted = np.zeros_like(prompt)
        shifted[:, : prompt.shape[1] - prop.shift] = prompt[:, prop.shift :]
        dprompt = jnp.asarray(shifted)
        feat_dim = (3 if prop.capture_layers else 1) * self.cfg.hidden_size if prop.uses_hidden else 1
        last_feat = replicate(jnp.zeros((b, feat_dim), self.dtype), self.mesh)
        for c in range(n_chunks):
            sl = slice(c * chunk, (c + 1) * chunk)
            cache, dcache, last_h, last_feat = spec_prefill_chunk(
                self.graphdef, self.params, prop, self.dparams, cache, dcache, prompt_d[:, sl], dprompt[:, sl], jnp.int32(c * chunk),
                lens_d, last_h, last_feat, backend=self.backend,
            )
        res, _ = spec_decode(self.graphdef, self.params, prop, self.dparams, self.spec, cache, dcache, last_h, last_feat, st, max_new_d,
                          jnp.asarray(stop_arr), buf=buf, backend=self.backend)
        return jax.device_get(res)

    def _result(self, out_ids, finish, prompt_len, p: SamplingParams, latency, verify_ct, hist) -> dict[str, Any]:
        if finish == STOPPED:
            reason = {"type": "stop", "matched": out_ids[-1]}
        elif finish == LENGTH:
            reason = {"type": "length", "length": len(out_ids)}
        else:  # pragma: no cover - the loop only exits when every slot finished
            raise RuntimeError("decode loop returned an unfinished request")
        text = None
        if self.tokenizer is not None:
            decode_ids = lambda x: self.tokenizer.decode(x, skip_special_tokens=p.skip_special_tokens)  # noqa: E731
            text = decode_ids(out_ids)
            hits = [(text.find(s), s) for s in p.stop_strings if s and s in text]
            if hits:  # multi-token stop strings are applied after generation
                pos, s = min(hits)
                out_ids = out_ids[: tokens_through(decode_ids, out_ids, s)]
                text = text[:pos]
                reason = {"type": "stop", "matched": s}
        return {
            "text": text,
            "output_ids": out_ids,
            "meta_info": {
                "id": uuid.uuid4().hex,
                "prompt_tokens": prompt_len,
                "completion_tokens": len(out_ids),
                "finish_reason": reason,
                "e2e_latency": latency,
                "spec_verify_ct": verify_ct,
                "spec_accept_length": len(out_ids) / max(verify_ct, 1),
                **({} if hist is None else {"spec_accept_histogram": [int(x) for x in hist[1:]]}),
            },
        }


_ENGINES: dict = {}


def tokens_through(decode_ids, out_ids: list[int], stop: str) -> int:
    """The fewest leading tokens of out_ids whose decoded text contains `stop` (binary search)."""
    lo, hi = 1, len(out_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if stop in decode_ids(out_ids[:mid]) else (mid + 1, hi)
    return lo


def _draft_from_target(loaded: LoadedModel, algo: str | None) -> tuple | None:
    """A draft the target itself supplies when no draft path is given: an MTP module inside its
    checkpoint (for EAGLE / NEXTN, as SGLang falls back to the target path), else a draft of that
    algorithm shipped with jaxspec for it (jaxspec.drafts); algo None (speculative_algorithm unset)
    asks for the target's default shipped draft."""
    import os

    from jaxspec.drafts import bundled_draft_for

    if algo == "EAGLE" and loaded.source_kind == "hf" and os.path.isdir(loaded.path):
        from convert.sources import open_hf_dir
        from jaxspec.models.mtp import mtp_layout

        src = open_hf_dir(loaded.path, check_config=False)
        if mtp_layout(src.config, src.names):
            return ("EAGLE", loaded.path, None)
    return bundled_draft_for(loaded.path, loaded.cfg, algo)


def generate(prompt=None, sampling_params=None, input_ids=None, **engine_kwargs):
    """One-call convenience: `jaxspec.generate("hi", {"max_new_tokens": 16})`. Engines are reused per kwargs."""
    key = tuple(sorted(engine_kwargs.items()))
    if key not in _ENGINES:
        _ENGINES[key] = Engine(**engine_kwargs)
    return _ENGINES[key].generate(prompt, sampling_params, input_ids)
