"""Tool calls for /v1/chat/completions: `tools`, `tool_choice`, and `tool` messages.

The tools reach the model through its chat template when the template takes them (`tools` in
its Jinja source, as Qwen's and Llama 3.1's do); otherwise through a system message that lists
them and asks for calls written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(the Hermes convention that Qwen's templates also use). Earlier calls and their results are
rendered the same way.

tool_choice decides what the output may be:
  none       tools are not offered; plain text
  auto       free text; `<tool_call>` blocks (or a bare {"name", "arguments"} object) in it become
             tool_calls, the text before them the content
  required   calls to any of the tools: the output is constrained to a JSON array of one or more
             calls, each {"name": one of the tools, "arguments": that tool's parameters schema}
             (as vLLM and SGLang constrain it), or to exactly one call object when the request
             sets parallel_tool_calls to false
  {"type": "function", "function": {"name": f}}
             a call to f: the output is constrained to f's parameters schema (its arguments)
Constrained choices use the grammar machinery (jaxspec/grammar.py), speculation included.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from jaxspec.errors import JaxspecError

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


@dataclasses.dataclass
class ToolPlan:
    tools: list[dict[str, Any]]  # OpenAI tool objects ({"type": "function", "function": {...}})
    mode: str  # "auto" | "required" | "named"
    name: str | None = None  # the named function
    parallel: bool = True  # required: one or more calls (False: exactly one)

    def schema_of(self, name: str) -> dict[str, Any]:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or {"type": "object"}
        raise KeyError(name)


def plan(body) -> ToolPlan | None:
    """The request's tool plan (None: no tools offered)."""
    if not body.tools or body.tool_choice == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise JaxspecError("tools: function names must be unique")
    choice = body.tool_choice or "auto"
    parallel = body.parallel_tool_calls is not False
    if isinstance(choice, str):
        return ToolPlan(tools, choice, parallel=parallel)
    name = choice.function.name
    if name not in names:
        raise JaxspecError(f"tool_choice: no tool named {name!r} (tools: {', '.join(names)})")
    return ToolPlan(tools, "named", name, parallel)


def constraint(p: ToolPlan | None) -> dict[str, Any]:
    """Sampling parameters that force the plan's output (empty for auto)."""
    if p is None or p.mode == "auto":
        return {}
    if p.mode == "named":
        assert p.name is not None
        return {"json_schema": p.schema_of(p.name)}
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, "arguments": p.schema_of(t["function"]["name"])},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in p.tools
    ]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"json_schema": {"type": "array", "items": one, "minItems": 1} if p.parallel else one}


def _call_text(call: dict[str, Any]) -> str:
    f = call.get("function") or {}
    args = f.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    return "<tool_call>\n" + json.dumps({"name": f.get("name"), "arguments": args}) + "\n</tool_call>"


def system_prompt(tools: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(t) for t in tools)
    return (
        "You may call one or more functions to help with the user's request. The functions are:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call a function, reply with a JSON object inside <tool_call></tool_call> tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call>'
    )


def messages(body, p: ToolPlan | None, template_takes_tools: bool) -> tuple[list[dict[str, Any]], list | None]:
    """(conversation for the chat template, tools for the template or None). Assistant tool calls
    and tool results are kept in the OpenAI / HF form for templates that take tools, and written
    out as text otherwise."""
    out: list[dict[str, Any]] = []
    for m in body.messages:
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": m.text()}
        if m.tool_calls:
            calls = [c if isinstance(c, dict) else dict(c) for c in m.tool_calls]
            if template_takes_tools:
                msg["tool_calls"] = [{**c, "function": {**c.get("function", {}), "arguments": _args(c)}} for c in calls]
            else:
                msg["content"] = "\n".join([msg["content"]] * bool(msg["content"]) + [_call_text(c) for c in calls])
        if role == "tool":
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if not template_takes_tools:
                msg["content"] = f"<tool_response>\n{msg['content']}\n</tool_response>"
        out.append(msg)
    if p is None:
        return out, None
    if template_takes_tools:
        return out, p.tools
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + system_prompt(p.tools)}
    else:
        out.insert(0, {"role": "system", "content": system_prompt(p.tools)})
    return out, None


def _args(call: dict[str, Any]) -> Any:
    args = (call.get("function") or {}).get("arguments", "{}")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name, "arguments": args}}


def _as_call(obj: Any, names: set[str]) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return _call(obj["name"], args)


def parse(p: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of an output under plan p."""
    names = {t["function"]["name"] for t in p.tools}
    if p.mode == "named":
        assert p.name is not None
        return None, [_call(p.name, text)]
    if p.mode == "required":
        obj = _loads(text)
        objs = obj if isinstance(obj, list) else [obj]
        found = [_as_call(o, names) for o in objs]
        calls = [c for c in found if c is not None]
        return (None, calls) if objs and len(calls) == len(objs) else (text, [])
    calls = []
    for m in TOOL_CALL.finditer(text):
        call = _as_call(_loads(m.group(1)), names)
        if call:
            calls.append(call)
    if calls:
        content = text[: text.find("<tool_call>")].strip()
        return content or None, calls
    call = _as_call(_loads(text.strip()), names)  # templates whose models answer with a bare JSON call
    if call:
        return None, [call]
    return text, []


def _loads(s: str) -> Any:
    try:
        return json.loads(s)
    except json.JSONDecodeError:
        return None
