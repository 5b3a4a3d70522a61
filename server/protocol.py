"""Request bodies of the HTTP API (OpenAI and SGLang-native) and their mapping to SamplingParams.

Unknown fields are ignored, as OpenAI-compatible servers do; fields we cannot honour
(n > 1, logprobs, echo, tools) are rejected with a 400 that names them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxspec.errors import JaxspecError
from jaxspec.sampling import SamplingParams


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAICommon(_Body):
    model: str = "default"
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    speculative: bool = True  # jaxspec extension: false decodes this request without speculation

    def sampling(self, default_max: int | None) -> SamplingParams:
        if self.n != 1:
            raise JaxspecError(f"n={self.n} is not supported (only n=1)")
        if self.logprobs not in (None, False, 0):
            raise JaxspecError("logprobs are not supported yet")
        d = dict(max_new_tokens=self.max_tokens if self.max_tokens is not None else default_max,
                 temperature=1.0 if self.temperature is None else self.temperature, top_p=self.top_p, top_k=self.top_k,
                 min_p=self.min_p, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                 frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                 repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens)
        if d["top_k"] is not None and d["top_k"] == 0:
            d["top_k"] = -1  # some clients send 0 for "off"
        return SamplingParams.from_dict(d)


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.get("type") != "text":
                raise JaxspecError(f"message content of type {p.get('type')!r} is not supported (text only)")
            parts.append(p.get("text", ""))
        return "".join(parts)


class ChatCompletionRequest(_OpenAICommon):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    tools: Any = None

    def sampling(self, default_max):
        if self.tools:
            raise JaxspecError("tools / function calling are not supported")
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling(default_max)

    def conversation(self) -> list[dict]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_OpenAICommon):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None

    def prompt_one(self) -> str | list[int]:
        if self.echo or self.suffix:
            raise JaxspecError("echo and suffix are not supported")
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise JaxspecError("one prompt per request (batched prompts: send concurrent requests)")
            p = p[0]
        if isinstance(p, list) and not p:
            raise JaxspecError("the prompt is empty")
        return p


class GenerateRequest(_Body):
    """SGLang's native /generate."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    speculative: bool = True
    rid: str | None = None

    def sampling(self) -> SamplingParams:
        return SamplingParams.from_dict(self.sampling_params)
