"""Tool-call formats: how a checkpoint's chat template asks for tool calls, and how its answers are read back.

    fmt = tool_format(prompt_spec.chat_template)       # the registry entry the template's text names
    content, calls = fmt.parse(answer_text, {"get_weather"})   # calls: [{"name", "arguments": {...}}], or [] (text)
    fmt.write(calls)                                   # earlier calls as the model writes them (templates that do
                                                       # not render an assistant's tool_calls themselves)

The registry, by name (FORMATS), chosen from the template's own text:
  hermes   the template writes `<tool_call>` (Qwen2.5 / Qwen3 / Qwen3-VL): answers hold `<tool_call>{"name": ...,
           "arguments": {...}}</tool_call>` blocks, content around them.
  qwen_xml the template writes `<function=` inside `<tool_call>` (Qwen3.5, Qwen3-Coder; vLLM's qwen3_coder parser):
           `<tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n</function>\n</tool_call>` blocks;
           a value is read as JSON where it is valid JSON (2, true, {...}, a quoted string), else as the text it is
           (the template writes strings bare).
  pythonic the template writes `<|tool_list_start|>` / `<|tool_call_start|>` (LFM2, LFM2-VL):
           `<|tool_call_start|>[name(arg="v", n=1), ...]<|tool_call_end|>` (Python call syntax, literal arguments)
           then text; where the markers are special tokens the decoded text lacks them, so a leading `[name(...)]`
           whose every name is a given tool is read as calls too.
  generic  a template that does not mention tools (SmolLM2, SmolVLM, the demo model): the tools are described in a
           system turn (system_text), the answer is a JSON object {"tool_calls": [{"name", "arguments"}]} or plain
           text, and tool results are given back as a user turn (result_text).
A template that renders `tools` in a format not in the registry gets none (tool_format returns None: the caller
refuses tools rather than guess).

Reading is lenient the way vLLM's parsers are: a block that is not valid JSON / call syntax, or that names a
function that was not given, leaves the whole answer as text (no calls).
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Callable

Call = dict  # {"name": str, "arguments": dict}


def _call(name, arguments, names: set[str]) -> Call | None:
    if not isinstance(name, str) or name not in names or not isinstance(arguments, dict):
        return None
    return {"name": name, "arguments": arguments}


def _blocks(text: str, start: str, end: str, read: Callable[[str], list | None]) -> tuple[str, list[Call]]:
    """content (the text outside the blocks) and the calls read from each start...end block; no calls (the text
    whole) when a block is unclosed or unreadable."""
    content, calls, at = [], [], 0
    while (i := text.find(start, at)) >= 0:
        j = text.find(end, i + len(start))
        if j < 0:
            return text, []
        got = read(text[i + len(start):j])
        if got is None:
            return text, []
        content.append(text[at:i])
        calls += got
        at = j + len(end)
    content.append(text[at:])
    return "".join(content), calls


# --- hermes ------------------------------------------------------------------------------------------------------
def _hermes_one(body: str, names: set[str]) -> list[Call] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some fine-tunes write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    call = _call(obj.get("name"), args, names)
    return None if call is None else [call]


def _hermes_parse(text: str, names: set[str]) -> tuple[str, list[Call]]:
    return _blocks(text, "<tool_call>", "</tool_call>", lambda b: _hermes_one(b, names))


def _hermes_write(calls: list[Call]) -> str:
    return "\n".join("<tool_call>\n" + json.dumps({"name": c["name"], "arguments": c["arguments"]},
                                                  ensure_ascii=False) + "\n</tool_call>" for c in calls)


# --- qwen_xml ----------------------------------------------------------------------------------------------------
_XML_FUNCTION = re.compile(r"\s*<function=([^>\s]+)>(.*)</function>\s*", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)


def _xml_value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def _xml_one(body: str, names: set[str]) -> list[Call] | None:
    m = _XML_FUNCTION.fullmatch(body)
    if m is None:
        return None
    inner, args, at = m.group(2), {}, 0
    for p in _XML_PARAMETER.finditer(inner):
        if inner[at:p.start()].strip() or p.group(1) in args:  # text between parameters, or one given twice
            return None
        args[p.group(1)] = _xml_value(p.group(2))
        at = p.end()
    if inner[at:].strip():
        return None
    call = _call(m.group(1), args, names)
    return None if call is None else [call]


def _xml_parse(text: str, names: set[str]) -> tuple[str, list[Call]]:
    return _blocks(text, "<tool_call>", "</tool_call>", lambda b: _xml_one(b, names))


def _xml_write(calls: list[Call]) -> str:
    def value(v) -> str:
        return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)

    return "\n".join(f"<tool_call>\n<function={c['name']}>\n" + "".join(
        f"<parameter={k}>\n{value(v)}\n</parameter>\n" for k, v in c["arguments"].items()) + "</function>\n</tool_call>"
        for c in calls)


# --- pythonic ----------------------------------------------------------------------------------------------------
PY_START, PY_END = "<|tool_call_start|>", "<|tool_call_end|>"


def _pythonic_list(body: str, names: set[str]) -> list[Call] | None:
    try:
        tree = ast.parse(body.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
        if len(args) != len(node.keywords):
            return None
        call = _call(node.func.id, args, names)
        if call is None:
            return None
        calls.append(call)
    return calls


def _pythonic_parse(text: str, names: set[str]) -> tuple[str, list[Call]]:
    if PY_START in text:
        return _blocks(text, PY_START, PY_END, lambda b: _pythonic_list(b, names))
    stripped = text.lstrip()
    if stripped.startswith("["):  # the markers were special tokens, dropped from the decoded text
        for end in [m.end() for m in re.finditer(r"\]", stripped)]:
            calls = _pythonic_list(stripped[:end], names)
            if calls:
                return stripped[end:], calls
    return text, []


def _py_value(v) -> str:
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # a double-quoted literal, as LFM2 writes them
    if isinstance(v, bool) or v is None:
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_py_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_py_value(str(k))}: {_py_value(x)}" for k, x in v.items()) + "}"
    return json.dumps(v)


def _pythonic_write(calls: list[Call]) -> str:
    body = ", ".join(f"{c['name']}(" + ", ".join(f"{k}={_py_value(v)}" for k, v in c["arguments"].items()) + ")"
                     for c in calls)
    return f"{PY_START}[{body}]{PY_END}"


# --- generic -----------------------------------------------------------------------------------------------------
def _generic_parse(text: str, names: set[str]) -> tuple[str, list[Call]]:
    body = text.strip()
    if body.startswith("```"):  # a fenced block: ```json ... ```
        body = re.sub(r"^```[a-zA-Z]*\s*|\s*```$", "", body)
    try:
        obj = json.loads(body)
    except ValueError:
        return text, []
    raw = obj.get("tool_calls") if isinstance(obj, dict) else None
    if isinstance(obj, dict) and "tool_call" in obj:
        raw = [obj["tool_call"]]
    if not isinstance(raw, list) or not raw:
        return text, []
    calls = [_call(c.get("name"), c.get("arguments", {}), names) if isinstance(c, dict) else None for c in raw]
    return ("", calls) if all(calls) else (text, [])


def _generic_write(calls: list[Call]) -> str:
    return json.dumps({"tool_calls": [{"name": c["name"], "arguments": c["arguments"]} for c in calls]},
                      ensure_ascii=False)


def generic_system_text(tools: list[dict]) -> str:
    """The system turn's description of the tools, for a template that has no tool format of its own."""
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return ("Functions you can call (with the JSON Schema of their arguments):\n" + listed + "\nTo call them, answer "
            'only {"tool_calls": [{"name": ..., "arguments": {...}}]}; else answer in text.')


def generic_result_text(name: str | None, call_id: str, content: str) -> str:
    """A tool message's result, as the user turn that gives it back (generic format)."""
    return f"Result of function {name or '?'} (call {call_id}):\n{content}"


@dataclass(frozen=True)
class ToolFormat:
    name: str
    parse: Callable[[str, set[str]], tuple[str, list[Call]]]  # (answer, tool names) -> (content, calls)
    write: Callable[[list[Call]], str]  # calls as the model writes them
    start: str | None  # what begins a call in an answer: a stream holds text back from it (None: generic, below)
    renders_tools: bool  # the template itself lists the tools and takes tool messages (else: generic's turns)


FORMATS = {
    "hermes": ToolFormat("hermes", _hermes_parse, _hermes_write, "<tool_call>", True),
    "qwen_xml": ToolFormat("qwen_xml", _xml_parse, _xml_write, "<tool_call>", True),
    "pythonic": ToolFormat("pythonic", _pythonic_parse, _pythonic_write, PY_START, True),
    # an answer that begins with "{" (or a ``` fence) may be a call: a stream holds it back until the end
    "generic": ToolFormat("generic", _generic_parse, _generic_write, None, False),
}


def _call_schema(tool: dict, held: bool = True) -> dict:
    """The JSON schema of one call of tool: {"name": its name, "arguments": its parameters (any object unless
    held)}."""
    f = tool["function"]
    args = (f.get("parameters") or {"type": "object"}) if held else {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": args},
            "required": ["name", "arguments"], "additionalProperties": False}


def _one_of(tools: list[dict], held) -> dict:
    schemas = [_call_schema(t, held is None or t["function"]["name"] in held) for t in tools]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def call_grammar(fmt: ToolFormat, tools: list[dict], literal: Callable[[str], str] = json.dumps, many: bool = True,
                 optional: bool = False, held: set[str] | None = None):
    """The grammar of an answer that calls tools in fmt (one or more; one only unless many), each call's arguments
    valid against its function's parameters (held: only those functions', the others' any JSON object): a GrammarSpec
    (runtime/decode/grammar.py). optional: the answer may be text instead (tool_choice auto with strict tools: text
    that does not begin a call, generic; text around the calls, hermes). None where fmt's calls cannot be held
    (pythonic: Python call syntax; qwen_xml: arguments as bare text in XML-like tags, no grammar written for it yet). literal: a marker's text as a Lark term (the tokenizer's own token where it has one:
    Grammars.literal)."""
    from ..decode.grammar import GrammarSpec

    if fmt.name == "generic":
        calls = {"type": "array", "minItems": 1, "items": _one_of(tools, held), **({} if many else {"maxItems": 1})}
        schema = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
                  "additionalProperties": False}
        if not optional:
            return GrammarSpec.json_schema(schema, param="tools")
        schema["x-guidance"] = {"whitespace_flexible": False}  # text: anything that does not begin like a call
        return GrammarSpec("lark", f'start: calls | TEXT | ""\ncalls: %json {json.dumps(schema)}\n'
                                   'TEXT: /[^{`](?s:.*)/\n', param="tools")
    if fmt.name == "hermes":  # the blocks as _hermes_write writes them, the JSON compact
        schema = dict(_one_of(tools, held), **{"x-guidance": {"whitespace_flexible": False}})
        start, end = literal("<tool_call>"), literal("</tool_call>")
        call = f'call: {start} "\\n" %json {json.dumps(schema)} "\\n" {end}\n'
        if optional and start.startswith("<["):  # text around the calls: it cannot spell a marker's token
            return GrammarSpec("lark", "start: TEXT? (call TEXT?)*\n" + call + "TEXT: /(?s:.+)/\n", param="tools")
        if optional:  # markers spelled in text: a call's text and its marker are one lexeme, other text has none
            return GrammarSpec("lark", 'start: (OPEN args "\\n</tool_call>")* TEXT?\n'
                                       f"args: %json {json.dumps(schema)}\n"
                                       "OPEN: /(?s:.*)<tool_call>\\n/ & ~/(?s:.*<tool_call>.*<tool_call>.*)/\n"
                                       "TEXT: /(?s:.+)/ & ~/(?s:.*<tool_call>.*)/\n", param="tools")
        more = ' ("\\n" call)*' if many else ""
        return GrammarSpec("lark", f"start: call{more}\n" + call, param="tools")
    return None


def tool_format(chat_template: str) -> ToolFormat | None:
    """The format the template's text asks for; None for a template that renders tools in a format vlmrt does not
    know (tools are then refused)."""
    if "<tool_call>" in chat_template:
        return FORMATS["qwen_xml" if "<function=" in chat_template else "hermes"]
    if PY_START in chat_template or "<|tool_list_start|>" in chat_template:
        return FORMATS["pythonic"]
    if re.search(r"\btools\b", chat_template):
        return None
    return FORMATS["generic"]


def held_from(fmt: ToolFormat, text: str) -> int:
    """How much of a streamed answer's text so far may be sent as content: the rest may begin a tool call (a start
    marker, or its beginning at the end of text; for generic, an answer that begins with "{" or "`")."""
    if fmt.start is None:
        lead = text.lstrip()
        return 0 if not lead or lead[0] in "{`" else len(text)
    i = text.find(fmt.start)
    if i >= 0:
        return i
    for k in range(min(len(fmt.start) - 1, len(text)), 0, -1):
        if fmt.start.startswith(text[-k:]):
            return len(text) - k
    if fmt.name == "pythonic" and text.lstrip()[:1] in ("", "["):  # a bare call list (markers dropped)
        return 0
    return len(text)
