"""Request bodies of the HTTP API (OpenAI and SGLang-native): one typed pydantic schema per route,
the same schemas /openapi.json publishes, and their mapping to SamplingParams.

Every field is typed and bounded (finite numbers, 32-bit token ids and counts, 64-bit seeds, bounded
stop lists), so nothing reaches the scheduler unvalidated. Fields the OpenAI API defines but this
server cannot honour yet (logit_bias, suffix, audio, ...) are rejected with a 400 that names
them, never ignored. Structured output: `response_format` (text, json_object, json_schema) and
SGLang's `json_schema` / `regex` / `ebnf` become the sampling parameters of the same names
(jaxspec/grammar.py); `tools` / `tool_choice` / `parallel_tool_calls` are in server/tools.py.
SGLang's chat extensions `chat_template_kwargs` (an object of keyword arguments for the chat
template), `separate_reasoning` and `stream_reasoning` (server/chat_output.py) are taken. Fields
that do not change the output (`user`, `metadata`, `store`, `service_tier`) are accepted. Fields
no API defines are ignored, as OpenAI-compatible servers do, and logged.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator

from jaxspec.errors import JaxspecError
from jaxspec.logprobs import MAX_TOP_LOGPROBS
from jaxspec.sampling import (
    INT32_MAX,
    MAX_GRAMMAR_CHARS,
    Count,
    SamplingParams,
    Seed,
    Stop,
    StopTokenIds,
    TokenId,
    TopK,
    sampling_params_schema,
)
from jaxspec.server import tools


class _Body(BaseModel):
    # unknown fields are kept aside (model_extra) so the app can log them
    model_config = ConfigDict(extra="allow")

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(_Body):
    include_usage: bool = False


MAX_TOOLS = 128  # tools per request, and tool calls per message
MAX_CHOICES = 256  # prompts x n of one request: each is a scheduler request (--max-queued-requests bounds them too)
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]


# what the server itself passes to the chat template rendering (chat_template_kwargs may not)
TEMPLATE_ARGUMENTS = frozenset(
    "conversation messages tools documents chat_template add_generation_prompt continue_final_message tokenize "
    "padding truncation max_length return_tensors return_dict return_assistant_tokens_mask tokenizer_kwargs".split()
)


def _unsupported(field: str, what: str) -> JaxspecError:
    return JaxspecError(f"{field}: {what} is not supported by this server")


class _OpenAICommon(_Body):
    model: Annotated[str, Field(max_length=512)] = "default"
    max_tokens: Count | None = None
    temperature: Annotated[float, Field(allow_inf_nan=False, ge=0)] | None = None
    top_p: Annotated[float, Field(allow_inf_nan=False, gt=0, le=1)] | None = None
    top_k: TopK | None = None  # 0 is taken as -1 (off), as some clients send it
    min_p: Annotated[float, Field(allow_inf_nan=False, ge=0, le=1)] | None = None
    seed: Seed = None
    stop: Stop = None
    stop_token_ids: StopTokenIds = None
    frequency_penalty: Annotated[float, Field(allow_inf_nan=False, ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Field(allow_inf_nan=False, ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(allow_inf_nan=False, gt=0, le=2)] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES, description="choices per prompt")] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Annotated[float, Field(allow_inf_nan=False)]] | None = None
    speculative: bool = Field(True, description="jaxspec extension: false decodes this request without speculation")
    # SGLang's constrained-decoding extensions (at most one, and not with response_format)
    json_schema: Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)] | dict[str, Any] | None = Field(
        None, description="SGLang extension: the output is JSON that fits this JSON Schema"
    )
    regex: Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)] | None = Field(
        None, description="SGLang extension: the output fully matches this regular expression"
    )
    ebnf: Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)] | None = Field(
        None, description="SGLang extension: the output follows this grammar (GBNF or Lark)"
    )
    # accepted, no effect on the output
    user: Annotated[str, Field(max_length=4096)] | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        if self.logit_bias:
            raise _unsupported("logit_bias", "logit_bias")
        return self

    def constraint(self) -> dict[str, Any]:
        """Sampling parameters that constrain the output beyond the fields above (chat requests:
        response_format and tools)."""
        return {}

    def sampling(self, default_max: int | None) -> SamplingParams:
        d = dict(
            max_new_tokens=self.max_tokens if self.max_tokens is not None else default_max,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            json_schema=self.json_schema,
            regex=self.regex,
            ebnf=self.ebnf,
        )
        d.update(self.constraint())
        if d["top_k"] == 0:
            d["top_k"] = -1  # some clients send 0 for "off"
        return SamplingParams.from_dict(d)


class ContentPart(_Body):
    type: Annotated[str, Field(max_length=64)]
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text":
            raise JaxspecError(f"messages: content of type {self.type!r} is not supported (text only)")
        if self.text is None:
            raise JaxspecError("messages: a text content part needs a 'text' string")
        return self


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: Annotated[str, Field(max_length=256)] | None = None
    tool_calls: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Annotated[str, Field(max_length=256)] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content)


class JsonSchemaFormat(_Body):
    name: Annotated[str, Field(max_length=256)] = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None  # the output always fits the schema, strict or not


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise JaxspecError("response_format: type json_schema needs a json_schema object ({name, schema})")
        return self


class FunctionDef(_Body):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)] | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Body):
    name: Annotated[str, Field(max_length=64)]


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_OpenAICommon):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Count | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    reasoning_effort: str | None = None
    web_search_options: Any = None
    # SGLang's chat extensions
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='SGLang extension: keyword arguments for the chat template, e.g. {"enable_thinking": false}'
    )
    separate_reasoning: bool = Field(
        True, description="SGLang extension: with --reasoning-parser, return the reasoning as reasoning_content"
    )
    stream_reasoning: bool = Field(
        True, description="SGLang extension: false streams the reasoning as one delta once it is complete"
    )

    @model_validator(mode="after")
    def _refuse_unsupported_chat(self):
        if self.top_logprobs and not self.logprobs:
            raise JaxspecError("top_logprobs: needs logprobs: true")
        given = [k for k in ("json_schema", "regex", "ebnf") if getattr(self, k) is not None]
        if self.response_format is not None and self.response_format.type != "text" and given:
            raise JaxspecError(f"response_format and {given[0]} both constrain the output; pass one")
        if self.functions or self.function_call not in (None, "none", "auto"):
            raise _unsupported("functions", "the deprecated functions / function_call (use tools / tool_choice)")
        if self.audio is not None or (self.modalities and self.modalities != ["text"]):
            raise _unsupported("modalities", "audio output")
        if self.prediction is not None:
            raise _unsupported("prediction", "predicted outputs")
        if self.reasoning_effort is not None:
            raise _unsupported("reasoning_effort", "reasoning_effort")
        if self.web_search_options is not None:
            raise _unsupported("web_search_options", "web search")
        taken = sorted(set(self.chat_template_kwargs or {}) & TEMPLATE_ARGUMENTS)
        if taken:
            raise JaxspecError(f"chat_template_kwargs: {', '.join(taken)} cannot be set (the server passes it)")
        return self

    def top_logprobs_wanted(self) -> int | None:
        """None: no logprobs; else how many alternatives to report with each token."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling(self, default_max):
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling(default_max)

    def constraint(self) -> dict[str, Any]:
        rf = self.response_format
        forced = tools.constraint(tools.plan(self))
        if forced:
            given = [k for k in ("json_schema", "regex", "ebnf") if getattr(self, k) is not None]
            if (rf is not None and rf.type != "text") or given:
                what = given[0] if given else "response_format"
                raise JaxspecError(f"{what} cannot be combined with a tool_choice that forces a tool call")
            return forced
        if rf is None or rf.type == "text":
            return {}
        if rf.type == "json_object":
            return {"json_schema": {"type": "object"}}
        assert rf.json_schema is not None
        return {"json_schema": rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}}

    def conversation(self) -> list[dict]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_OpenAICommon):
    prompt: str | Annotated[list[TokenId], Field(min_length=1)] | list[str] | list[list[TokenId]]
    echo: bool = False
    suffix: str | None = None
    logprobs: (
        Annotated[
            int, Field(ge=0, le=MAX_TOP_LOGPROBS, description="report token logprobs with this many alternatives")
        ]
        | None
    ) = None
    best_of: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None

    @model_validator(mode="after")
    def _refuse_unsupported_completion(self):
        if self.suffix:
            raise _unsupported("suffix", "suffix")
        if self.best_of not in (None, self.n):
            raise _unsupported("best_of", f"best_of={self.best_of} (other than n)")
        return self

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one string or token list, or a batch of them (a choice per prompt and n)."""
        p = self.prompt
        batch = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        if not batch:
            raise JaxspecError("prompt: the list of prompts is empty")
        if len(batch) * self.n > MAX_CHOICES:
            raise JaxspecError(f"prompt: {len(batch)} prompts x n={self.n} exceeds {MAX_CHOICES} choices per request")
        for i, x in enumerate(batch):
            if isinstance(x, list) and not x:
                raise JaxspecError(
                    f"prompt[{i}]: the prompt is empty" if len(batch) > 1 else "prompt: the prompt is empty"
                )
        return batch  # type: ignore[return-value]


SamplingParamsDict = Annotated[
    dict[str, Any],
    WithJsonSchema(
        {
            "type": "object",
            "description": "SGLang's sampling parameters (SamplingParams; aliases: max_tokens, "
            "sampling_seed; n: that many samples, returned as a list)",
        }
    ),
]


class GenerateRequest(_Body):
    """SGLang's native /generate."""

    text: str | None = None
    input_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    sampling_params: SamplingParamsDict = Field(default_factory=dict)
    stream: bool = False
    speculative: bool = True
    rid: Annotated[str, Field(max_length=256)] | None = None
    return_logprob: bool = False
    top_logprobs_num: TopLogprobs = 0
    logprob_start_len: Annotated[int, Field(ge=-1, le=INT32_MAX)] = -1
    return_text_in_logprobs: bool = False

    @model_validator(mode="after")
    def _checks(self):
        if (self.text is None) == (self.input_ids is None):
            raise JaxspecError("pass exactly one of text or input_ids")
        n = self.sampling_params.get("n", 1)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
            raise JaxspecError(f"sampling_params.n: must be an integer in [1, {MAX_CHOICES}]")
        if self.sampling_params.get("structural_tag") is not None:
            raise _unsupported("sampling_params.structural_tag", "structural_tag (use json_schema, regex or ebnf)")
        return self

    @property
    def n(self) -> int:
        return int(self.sampling_params.get("n", 1))

    def sampling(self) -> SamplingParams:
        return SamplingParams.from_dict({k: v for k, v in self.sampling_params.items() if k != "n"})


class SaveDraftRequest(_Body):
    """POST /save_draft: where to write the draft head in use (online training)."""

    path: Annotated[str, Field(min_length=1, max_length=4096, description="a directory on the server")]


def openapi_schemas() -> dict[str, dict]:
    """JSON schemas of the request bodies (and SamplingParams) for /openapi.json, keyed by name."""
    out: dict[str, dict] = {}
    for model in (ChatCompletionRequest, CompletionRequest, GenerateRequest, SaveDraftRequest):
        s = model.model_json_schema(ref_template="#/components/schemas/{model}")
        out.update(s.pop("$defs", {}))
        out[model.__name__] = s
    sp = sampling_params_schema().json_schema(ref_template="#/components/schemas/{model}")
    out.update(sp.pop("$defs", {}))
    out["SamplingParams"] = sp
    out["GenerateRequest"]["properties"]["sampling_params"] = {"$ref": "#/components/schemas/SamplingParams"}
    return out
