"""Constrained decoding: JSON schemas, regexes and EBNF grammars, with speculation on.

The grammar engine is llguidance (a maintained Rust library with Python bindings): it compiles
JSON Schema, regexes and Lark / GBNF grammars, computes a next-token mask in tens of microseconds
for a 49k vocabulary, and its matcher can consume a draft path and roll it back, which is what
masking a speculation tree needs. No JSON-schema compiler lives here.

Where masks come from. A request's matcher lives on the host (`Matchers`, one per request, keyed
by an int handle that travels in `SamplingTensors.grammar`). The device programs ask for masks
with a host callback at the points where a token is chosen (jaxspec/native/host_call.py: a
pure_callback that the persistent compilation cache can keep):
  plain decoding     the next token of each slot (one mask per slot);
  draft growth       each beam's children (the draft proposes only allowed tokens; a token the
                     grammar forces is proposed at probability 1, even one outside the draft's
                     vocabulary, so forced stretches such as JSON keys are accepted a whole tree
                     depth per round: jump-forward inside the round);
  verification       every tree node, from the grammar state reached along that node's own path;
                     the target's logits are masked before acceptance, so greedy output equals
                     constrained plain decoding and sampling draws from the constrained target.
A callback gets the slot's window of emitted tokens: the matcher first consumes the tokens
committed since it last looked (so rounds inside one compiled loop see each other's output),
then, per path, consumes it, writes the mask and rolls it back. Programs without grammar
requests carry no callback at all (the handles are None, a different program).

The alternative, token-level automata as tables on the device, would keep the round free of host
calls but cannot express JSON's nesting or EBNF, and costs [states, vocabulary] entries per
grammar (see benchmarks/RESULTS.md for the measured sizes and times that decided this).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.errors import JaxspecError
from jaxspec.native.host_call import host_call
from jaxspec.sampling import MAX_GRAMMAR_CHARS

KINDS = ("json_schema", "regex", "ebnf")  # SGLang's sampling parameters, at most one per request
WORD = 32  # tokens per mask word
logger = logging.getLogger("jaxspec")


def _limits():
    import llguidance

    # llguidance's defaults, made explicit: a grammar that exceeds them fails validation with a
    # message naming the limit (a 400), and no mask step can run away with the host
    return llguidance.LLParserLimits(
        max_items_in_row=2000,
        initial_lexer_fuel=1_000_000,
        step_lexer_fuel=200_000,
        step_max_items=50_000,
        max_lexer_states=250_000,
        max_grammar_size=500_000,
        verbose_errors=False,
    )


# JSON Schema keywords whose values are schemas: maps of name -> schema, lists of schemas, one schema.
# `not`, `if`, `then` and `else` are left as written: closing an object under `not` would invert it.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "contains", "propertyNames")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "$ref")


def closed_objects(schema: Any) -> Any:
    """The schema with every object that lists `properties` and says nothing of other keys closed
    (`additionalProperties: false`), as SGLang's and vLLM's default grammar backend (xgrammar's
    strict mode) compiles JSON schemas: a pydantic model's schema then yields exactly its fields,
    not fields the model invents. A schema keeps other properties where it says so
    (`additionalProperties` or `patternProperties`), and objects without `properties` (free-form
    maps such as `{"type": "object"}`) stay open. Objects merged by an `allOf` of several schemas,
    and those that merge with `anyOf` / `oneOf` / `$ref` siblings, are left as written: closing one
    side of a merge would forbid the other side's properties."""
    merged: set[str] = set()  # pointers ("/$defs/X") of the schemas an allOf merges with others

    def find_merged(node: Any) -> None:
        if isinstance(node, dict):
            parts = node.get("allOf")
            if isinstance(parts, list) and len(parts) > 1:
                refs = [p["$ref"] for p in parts if isinstance(p, dict) and isinstance(p.get("$ref"), str)]
                merged.update(r.removeprefix("#") for r in refs)
            for v in node.values():
                find_merged(v)
        elif isinstance(node, list):
            for v in node:
                find_merged(v)

    find_merged(schema)

    def close(node: Any, path: str, in_merge: bool) -> Any:
        if not isinstance(node, dict):
            return node
        out = dict(node)
        for k in _SCHEMA_MAPS:
            if isinstance(out.get(k), dict):
                out[k] = {n: close(v, f"{path}/{k}/{n}", False) for n, v in out[k].items()}
        for k in _SCHEMA_LISTS:
            if isinstance(out.get(k), list):
                many = k == "allOf" and len(out[k]) > 1
                out[k] = [close(v, f"{path}/{k}/{i}", many) for i, v in enumerate(out[k])]
        for k in _SCHEMA_ONE:
            if isinstance(out.get(k), dict):
                out[k] = close(out[k], f"{path}/{k}", False)
            elif isinstance(out.get(k), list):  # draft-4 tuple `items`
                out[k] = [close(v, f"{path}/{k}/{i}", False) for i, v in enumerate(out[k])]
        if "properties" in out and not in_merge and path not in merged and not any(k in out for k in _OPEN_KEYS):
            out["additionalProperties"] = False
        return out

    return close(schema, "", False)


def grammar_of(kind: str, spec: Any) -> str:
    """The llguidance grammar for one of KINDS. json_schema: a JSON string or a dict."""
    import llguidance

    if kind == "json_schema":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise JaxspecError(f"invalid json_schema: not JSON ({e})") from None
        if not isinstance(spec, (dict, bool)):
            raise JaxspecError(f"invalid json_schema: a schema is a JSON object, got {type(spec).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(
            closed_objects(spec), defaults={"whitespace_flexible": False}
        )
    if not isinstance(spec, str):
        raise JaxspecError(f"invalid {kind}: expected a string, got {type(spec).__name__}")
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "ebnf":
        try:
            return llguidance.grammar_from("gbnf", spec)
        except ValueError as e:
            raise JaxspecError(f"invalid ebnf: {e}") from None
    raise JaxspecError(f"unknown grammar kind {kind!r}; known: {', '.join(KINDS)}")


def requested(params) -> tuple[str, Any] | None:
    """(kind, spec) of a SamplingParams that asks for constrained output, or None. Raises when it
    asks for more than one."""
    given = [(k, getattr(params, k)) for k in KINDS if getattr(params, k) is not None]
    if len(given) > 1:
        raise JaxspecError(f"pass at most one of {', '.join(KINDS)}; got {' and '.join(k for k, _ in given)}")
    return given[0] if given else None


class Grammars:
    """Compiles and validates grammars for one tokenizer. vocab_size: the model's (padded) vocabulary;
    eos_ids: the tokens that end a constrained output once the grammar is complete."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int]):
        import llguidance.hf

        if tokenizer is None:
            raise JaxspecError("constrained decoding (json_schema / regex / ebnf) needs the tokenizer")
        try:
            self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids))
        except ValueError as e:
            raise JaxspecError(f"constrained decoding is not available with this tokenizer: {e}") from None
        self.vocab_size = vocab_size
        self.limits = _limits()

    def check(self, params) -> str | None:
        """The validated llguidance grammar of a request (None: unconstrained). Raises JaxspecError
        with the library's message for an invalid schema, regex or grammar, or one over the limits."""
        import llguidance

        req = requested(params)
        if req is None:
            return None
        kind, spec = req
        if params.ignore_eos:
            raise JaxspecError(f"{kind} cannot be combined with ignore_eos: a constrained output ends with EOS")
        size = len(spec) if isinstance(spec, str) else len(json.dumps(spec))
        if size > MAX_GRAMMAR_CHARS:
            raise JaxspecError(f"{kind} is too large: {size} characters (the limit is {MAX_GRAMMAR_CHARS})")
        try:
            grammar = grammar_of(kind, spec)
        except JaxspecError:
            raise
        except Exception as e:  # the library's own parse errors
            raise JaxspecError(f"invalid {kind}: {e}") from None
        is_error, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tok, limits=self.limits)
        if is_error:
            raise JaxspecError(f"invalid {kind}: {msgs[0].strip()}")
        return grammar

    def open(self, grammar: str) -> int:
        """A new matcher for `grammar`, registered: its handle (close it with close_handle)."""
        return open_handle(self.matcher(grammar), self.tok)

    def matcher(self, grammar: str):
        import llguidance

        m = llguidance.LLMatcher(self.tok, grammar, log_level=0, limits=self.limits)
        if m.is_error():
            raise JaxspecError(f"invalid grammar: {m.get_error()}")
        return m


class _Entry:
    def __init__(self, matcher, tokenizer=None) -> None:
        self.matcher = matcher
        self.tokenizer = tokenizer  # llguidance's LLTokenizer, for forced_token
        self.eos = frozenset(tokenizer.eos_tokens) if tokenizer is not None else frozenset()
        self.consumed = 0  # output tokens the matcher has consumed
        self.error: str | None = None  # why the matcher refused an emitted token (a bug: see advance)
        self.lock = threading.Lock()

    def forced_token(self, mask_row) -> int:
        """Where the grammar forces the next bytes (a JSON key, punctuation), the first token of
        their tokenization, if the mask allows it; else -1. llguidance's own fast-forward tokens
        stop wherever the tokenization is ambiguous (`":"` or `":` then `"`), but a draft is only
        a guess: the usual tokenization is the one a model writes."""
        ff = self.matcher.compute_ff_bytes()
        if not ff or self.tokenizer is None:
            return -1
        toks = self.tokenizer.tokenize_bytes(ff)
        if not toks:
            return -1
        t = toks[0]
        return t if (int(mask_row[t // WORD]) >> (t % WORD)) & 1 else -1

    def advance(self, tokens, upto: int, first: int) -> None:
        """Consumes output tokens [consumed, upto); tokens[i] is output token first + i.

        Every emitted token was allowed by a mask of this matcher, so a refusal is a bug: it is
        logged and kept in `error`, and the server fails the request rather than return output
        that breaks its grammar. One case is not a refusal: a grammar that cannot be extended
        (a closed JSON object, a regex at its longest) stops its matcher as soon as its last token
        is consumed, and llguidance then refuses the EOS that its mask allowed, unless both came
        in one call. Where the two tokens arrive depends on how rounds fall into program calls."""
        if upto <= self.consumed or self.error is not None:
            return
        if self.consumed < first or upto - first > len(tokens):  # would mean a missed sync: never silent
            self.error = f"the matcher at token {self.consumed} cannot see tokens {first}..{upto}: masks are stale"
            logger.error("grammar %s", self.error)
            return
        toks = [int(t) for t in tokens[self.consumed - first : upto - first]]
        if not (self.matcher.is_stopped() and all(t in self.eos for t in toks)):
            if not self.matcher.consume_tokens(toks):
                self.error = f"the grammar matcher rejected an emitted token: {self.matcher.get_error()}"
                logger.error("%s (tokens %s at output position %d)", self.error, toks, self.consumed)
        self.consumed = upto


_entries: dict[int, _Entry] = {}
_ids = itertools.count()
_lock = threading.Lock()


def open_handle(matcher, tokenizer=None) -> int:
    """Registers a request's matcher (tokenizer: its LLTokenizer, for forced-token drafts); the
    returned handle goes into SamplingTensors.grammar."""
    h = next(_ids) % (2**31 - 1)
    with _lock:
        _entries[h] = _Entry(matcher, tokenizer)
    return h


def close_handle(h: int) -> None:
    with _lock:
        _entries.pop(h, None)


def rejection(h: int) -> str | None:
    """Why the matcher behind handle h refused an emitted token (None: it never did, or h is
    unknown). Read it once the programs that advance the matcher have returned."""
    e = _entries.get(h)
    return None if e is None else e.error


def _on_host(fn):
    """A host callback body that sees its arguments as numpy arrays. JAX may hand a callback
    jax.Arrays; indexing or iterating those dispatches an XLA computation from inside the running
    program, which on a busy XLA:CPU can wait for the very threads the program holds (a deadlock)
    and costs a dispatch per element anyway. np.asarray only copies the bytes out."""

    @functools.wraps(fn)
    def run(*args):
        return fn(*(np.asarray(a) if isinstance(a, jax.Array) else a for a in args))

    return run


@_on_host
def _host_masks(n_words, invalid_allows, handles, out, base, num_out, done, paths, plen):
    """The host callback body. handles/base/num_out/done [B]; out [B, W]; paths [B, P, D];
    plen [B, P] -> (bitmask [B, P, n_words] int32 (bit t % 32 of word t // 32: token t allowed),
    forced [B, P] int32: when drafting, the first of the tokens the grammar forces after the path
    (llguidance's fast-forward tokens: the canonical tokenization of forced text), or -1)."""
    b, p = plen.shape
    res = np.full((b, p, n_words), -1, np.int32)
    forced = np.full((b, p), -1, np.int32)
    fill = np.int32(-1) if invalid_allows else np.int32(0)
    for r in range(b):
        e = _entries.get(int(handles[r]))
        if e is None or done[r]:
            continue
        with e.lock:
            e.advance(out[r], int(num_out[r]), int(base[r]))
            m = e.matcher
            for i in range(p):
                n = int(plen[r, i])
                got = m.try_consume_tokens(paths[r, i, :n].tolist()) if n else 0
                if got == n and not m.is_error():
                    row = res[r, i]
                    m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
                    if not invalid_allows:  # drafting: a guess at the next token where text is forced
                        forced[r, i] = e.forced_token(row)
                    elif not row.any():  # a finished grammar: nothing to verify
                        row[:] = -1
                else:
                    res[r, i] = fill
                if got:
                    m.rollback(got)
    return res, forced


def allowed(handles, state, paths, plen, vocab: int, ids=None, invalid_allows: bool = True):
    """Which tokens each path may be followed by. handles [B] int32 (-1: unconstrained); state: a
    decoding state (out, num_out, base, done); paths [B, P, D] int32 target tokens after the last
    emitted one, plen [B, P] their lengths; vocab: the target's vocabulary size; ids [V'] the
    target ids to report (default: the whole vocabulary; a draft passes its vocabulary's target
    ids). Returns (bool [B, P, V'], forced [B, P] int32: drafting only, the target token the
    grammar forces after the path, or -1). A path the grammar rejects allows every token
    (invalid_allows: verification, where such a node is never reached) or none (drafting)."""
    b, p = plen.shape
    n_words = -(-vocab // WORD)
    base = state.base if state.base is not None else jnp.zeros_like(state.num_out)
    bits, forced = host_call(
        functools.partial(_host_masks, n_words, invalid_allows),
        (jax.ShapeDtypeStruct((b, p, n_words), jnp.int32), jax.ShapeDtypeStruct((b, p), jnp.int32)),
        handles,
        state.out,
        base,
        state.num_out,
        state.done,
        paths,
        plen,
        name=f"grammar.masks/{n_words}/{invalid_allows}",
    )
    if ids is None:
        ids = jnp.arange(vocab, dtype=jnp.int32)
    word = jnp.take(bits, ids // WORD, axis=-1)  # [B, P, V']
    return ((word >> (ids % WORD)) & 1).astype(bool), forced


@_on_host
def _host_sync(handles, out, base, num_out):
    consumed = np.zeros(handles.shape, np.int32)
    for r, h in enumerate(handles):
        e = _entries.get(int(h))
        if e is not None:
            with e.lock:
                e.advance(out[r], int(num_out[r]), int(base[r]))
                consumed[r] = e.consumed
    return consumed


def sync(handles, state):
    """Has each constrained slot's matcher consume its emitted tokens (state: out, num_out, base)
    now, so that the next program's masks start from them even when the host has not read them
    yet. Returns the tokens each matcher has consumed [B] int32 (a program output: XLA keeps the
    call only when its result is used)."""
    if handles is None:
        return jnp.zeros_like(state.num_out)
    base = state.base if state.base is not None else jnp.zeros_like(state.num_out)
    return host_call(
        _host_sync,
        jax.ShapeDtypeStruct(handles.shape, jnp.int32),
        handles,
        state.out,
        base,
        state.num_out,
        name="grammar.sync",
    )


@dataclasses.dataclass
class Emitted:
    """What `allowed` reads of a decoding state, for code that has no state yet (a first token)."""

    out: jax.Array  # [B, W]
    num_out: jax.Array  # [B]
    base: jax.Array | None
    done: jax.Array  # [B]

    @classmethod
    def none(cls, b: int, max_new_tokens=None) -> Emitted:
        """Nothing emitted yet (done: no token to choose, where max_new_tokens <= 0)."""
        zeros = jnp.zeros((b,), jnp.int32)
        done = zeros > 0 if max_new_tokens is None else max_new_tokens <= 0
        return cls(jnp.zeros((b, 1), jnp.int32), zeros, None, done)


def mask_logits(logits, handles, state, paths=None, plen=None):
    """logits [B, P, V] (or [B, V] for the next token after the emitted ones) with the tokens the
    grammar forbids at -inf; unchanged when handles is None (no constrained request)."""
    if handles is None:
        return logits
    squeeze = logits.ndim == 2
    if squeeze:
        logits = logits[:, None]
    b, p, v = logits.shape
    if paths is None:
        paths = jnp.zeros((b, p, 1), jnp.int32)
        plen = jnp.zeros((b, p), jnp.int32)
    ok, _ = allowed(handles, state, paths, plen, v)
    logits = jnp.where(ok, logits, -jnp.inf)
    return logits[:, 0] if squeeze else logits
