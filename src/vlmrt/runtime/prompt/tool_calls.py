"""Tool-call formats: how a checkpoint's chat template asks for tool calls, and how its answers are read back.

    fmt = tool_format(prompt_spec.chat_template)       # the registry entry the template's text names
    content, calls = fmt.parse(answer_text, {"get_weather": parameters})  # calls: [{"name", "arguments": {...}}],
                                                       # or [] (text); the functions given (a set of names will do)
    fmt.write(calls)                                   # earlier calls as the model writes them (templates that do
                                                       # not render an assistant's tool_calls themselves)

The registry, by name (FORMATS), chosen from the template's own text:
  hermes   the template writes `<tool_call>` (Qwen2.5 / Qwen3 / Qwen3-VL): answers hold `<tool_call>{"name": ...,
           "arguments": {...}}</tool_call>` blocks, content around them.
  qwen_xml the template writes `<function=` inside `<tool_call>` (Qwen3.5, Qwen3-Coder; vLLM's qwen3_coder parser):
           `<tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n</function>\n</tool_call>` blocks;
           a value is written as Qwen3.5's template writes it (a string bare, an object or list as JSON, anything
           else str(): 2, 2.5, True, None) and read per its parameter's schema type where the functions'
           parameters are given (as vLLM's qwen3_coder parser does), else as JSON where it is valid JSON, else as
           the text it is.
  pythonic the template writes `<|tool_list_start|>` / `<|tool_call_start|>` (LFM2, LFM2-VL):
           `<|tool_call_start|>[name(arg="v", n=1), ...]<|tool_call_end|>` (Python call syntax, literal arguments)
           then text; the markers are special tokens of LFM2's tokenizer (ids 10 and 11) that an answer's text keeps
           (ToolFormat.kept), as gemma4's.
  gemma4   the template writes `<|tool_call>` (Gemma 4): `<|tool_call>call:NAME{key:value,...}<tool_call|>` blocks, the
           values in the template's format_argument syntax (keys bare and sorted, strings between `<|"|>` quotes,
           true / false / null, numbers, [...], {...}); the markers and the quote are special tokens of its tokenizer
           that an answer's text keeps (ToolFormat.kept; VLM leaves every other special token out).
  generic  a template that does not mention tools (SmolLM2, SmolVLM, the demo model): the tools are described in a
           system turn (system_text), the answer is a JSON object {"tool_calls": [{"name", "arguments"}]} or plain
           text, and tool results are given back as a user turn (result_text).
A template that renders `tools` in a format not in the registry gets none (tool_format returns None: the caller
refuses tools rather than guess).

call_grammar: the grammar a forced call (tool_choice required / named, strict tools) is held to, in each format: a call
of a given function whose arguments validate against its parameters (JSON schema; qwen_xml and pythonic: the schema
translated into Lark rules over the format's own value syntax).

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


def _xml_value(text: str, schema=None):
    """A parameter's value: per its schema's type(s) where the function's parameters are known (as Qwen3.5's
    template writes them: str() of a number / bool / None, JSON of an object or list, a string bare), else JSON
    where the text is valid JSON, else the text."""
    kinds = _kinds(schema)
    for kind in kinds:
        if kind == "string":
            continue
        if kind == "boolean" and text in ("True", "False", "true", "false"):
            return text in ("True", "true")
        if kind == "null" and text in ("None", "null"):
            return None
        if kind in ("integer", "number") and re.fullmatch(r"-?\d+", text):
            return int(text)
        if kind == "number":
            try:
                return float(text)
            except ValueError:
                pass
        if kind in ("object", "array", None):
            try:
                return json.loads(text)
            except ValueError:
                pass
    return text


def _kinds(schema) -> list:
    """The JSON types a parameter's schema allows, in order ([None]: not known)."""
    if not isinstance(schema, dict):
        return [None]
    if "enum" in schema or "const" in schema:
        values = schema.get("enum", [schema.get("const")])
        return [None] if any(not isinstance(v, str) for v in values) else ["string"]
    subs = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(subs, list):
        return [k for sub in subs for k in _kinds(sub)]
    kind = schema.get("type")
    return kind if isinstance(kind, list) else [kind]


def _xml_one(body: str, names: set[str] | dict) -> list[Call] | None:
    m = _XML_FUNCTION.fullmatch(body)
    if m is None:
        return None
    inner, args, at = m.group(2), {}, 0
    for p in _XML_PARAMETER.finditer(inner):
        if inner[at:p.start()].strip() or p.group(1) in args:  # text between parameters, or one given twice
            return None
        params = names.get(m.group(1)) if isinstance(names, dict) else None
        props = params.get("properties") if isinstance(params, dict) else None
        args[p.group(1)] = _xml_value(p.group(2), props.get(p.group(1)) if isinstance(props, dict) else None)
        at = p.end()
    if inner[at:].strip():
        return None
    call = _call(m.group(1), args, names)
    return None if call is None else [call]


def _xml_parse(text: str, names: set[str]) -> tuple[str, list[Call]]:
    return _blocks(text, "<tool_call>", "</tool_call>", lambda b: _xml_one(b, names))


def _xml_write(calls: list[Call]) -> str:
    return "\n".join(f"<tool_call>\n<function={c['name']}>\n" + "".join(
        f"<parameter={k}>\n{_xml_rendered(v)}\n</parameter>\n" for k, v in c["arguments"].items()) + "</function>\n</tool_call>"
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
    return _blocks(text, PY_START, PY_END, lambda b: _pythonic_list(b, names))


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


# --- gemma4 ------------------------------------------------------------------------------------------------------
G_START, G_END, G_QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_G_NAME = re.compile(r"call:([A-Za-z0-9_.\-]+)(?=\{)")
_G_SCALAR = re.compile(r"[^,}\]]*")


def _g_value(s: str, i: int):
    """(the value at s[i:], where it ends) in Gemma 4's argument syntax (format_argument): <|"|>text<|"|> strings,
    {key:value,...} with bare (or quoted) keys, [value,...], true / false / null (None), numbers; ValueError else."""
    if s.startswith(G_QUOTE, i):
        j = s.find(G_QUOTE, i + len(G_QUOTE))
        if j < 0:
            raise ValueError("unclosed string")
        return s[i + len(G_QUOTE):j], j + len(G_QUOTE)
    if s.startswith('"', i):  # (a JSON string, as some fine-tunes write them)
        return json.JSONDecoder().raw_decode(s, i)
    if s.startswith("{", i):
        out, i = {}, i + 1
        while not s.startswith("}", i):
            if s.startswith(G_QUOTE, i):
                key, i = _g_value(s, i)
            else:
                j = s.find(":", i)
                key, i = s[i:j], j
                if j < 0 or not re.fullmatch(r"[^\s{}\[\],:<>]+", key):
                    raise ValueError("bad key")
            if not s.startswith(":", i) or key in out:
                raise ValueError("bad member")
            out[key], i = _g_value(s, i + 1)
            if s.startswith(",", i) and not s.startswith("}", i + 1):
                i += 1
            elif not s.startswith("}", i):
                raise ValueError("bad object")
        return out, i + 1
    if s.startswith("[", i):
        out, i = [], i + 1
        while not s.startswith("]", i):
            v, i = _g_value(s, i)
            out.append(v)
            if s.startswith(",", i) and not s.startswith("]", i + 1):
                i += 1
            elif not s.startswith("]", i):
                raise ValueError("bad list")
        return out, i + 1
    word = _G_SCALAR.match(s, i).group()
    if word in ("true", "false"):
        return word == "true", i + len(word)
    if word in ("null", "None"):
        return None, i + len(word)
    if not re.fullmatch(r"-?\d+(\.\d+)?([eE][-+]?\d+)?", word):
        raise ValueError("bad scalar")
    return json.loads(word), i + len(word)


def _gemma4_one(body: str, names) -> list[Call] | None:
    m = _G_NAME.match(body)
    if m is None:
        return None
    try:
        args, end = _g_value(body, m.end())
    except (ValueError, IndexError, RecursionError):
        return None
    if body[end:].strip():
        return None
    call = _call(m.group(1), args, names)
    return None if call is None else [call]


def _gemma4_parse(text: str, names) -> tuple[str, list[Call]]:
    return _blocks(text, G_START, G_END, lambda b: _gemma4_one(b, names))


def _g_written(v) -> str:
    """A value as Gemma 4's template writes it (format_argument, keys bare and sorted)."""
    if isinstance(v, str):
        return G_QUOTE + v + G_QUOTE
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_g_written(x)}" for k, x in sorted(v.items())) + "}"
    if isinstance(v, list):
        return "[" + ",".join(_g_written(x) for x in v) + "]"
    return json.dumps(v)


def _gemma4_write(calls: list[Call]) -> str:
    return "".join(f"{G_START}call:{c['name']}{_g_written(c['arguments'])}{G_END}" for c in calls)


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
    parse: Callable[[str, set[str] | dict], tuple[str, list[Call]]]  # (answer, functions) -> (content, calls)
    write: Callable[[list[Call]], str]  # calls as the model writes them
    start: str | None  # what begins a call in an answer: a stream holds text back from it (None: generic, below)
    renders_tools: bool  # the template itself lists the tools and takes tool messages (else: generic's turns)
    kept: tuple[str, ...] = ()  # its markers an answer's text keeps where the tokenizer has them as special tokens


FORMATS = {
    "hermes": ToolFormat("hermes", _hermes_parse, _hermes_write, "<tool_call>", True),
    "qwen_xml": ToolFormat("qwen_xml", _xml_parse, _xml_write, "<tool_call>", True),
    "pythonic": ToolFormat("pythonic", _pythonic_parse, _pythonic_write, PY_START, True, (PY_START, PY_END)),
    "gemma4": ToolFormat("gemma4", _gemma4_parse, _gemma4_write, G_START, True, (G_START, G_END, G_QUOTE)),
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


# --- call grammars of qwen_xml and pythonic: a function's parameters (a JSON schema) as Lark rules ----------------
_ANNOTATIONS = {"description", "title", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly",
                "$schema", "$id"}
_STRING_KEYS = {"type", "minLength", "maxLength", "pattern", "format"}
_NUMBER_KEYS = {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
_OBJECT_KEYS = {"type", "properties", "required", "additionalProperties"}
_ARRAY_KEYS = {"type", "items", "minItems", "maxItems"}
_KEYS = {"string": _STRING_KEYS, "integer": _NUMBER_KEYS, "number": _NUMBER_KEYS, "boolean": {"type"},
         "null": {"type"}, "object": _OBJECT_KEYS, "array": _ARRAY_KEYS}
_PARAM_END = "\n</parameter>\n"  # what closes a qwen_xml parameter's value
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class _Unsupported(ValueError):
    """A schema the format's grammar cannot hold (the message says what)."""


def _branches(schema) -> list[dict]:
    """schema as alternatives of one kind each: {} (any value), {"enum": [...]}, or one with a single "type"."""
    if schema is True or schema == {}:
        return [{}]
    if not isinstance(schema, dict):
        raise _Unsupported("a schema must be a JSON object")
    s = {k: v for k, v in schema.items() if k not in _ANNOTATIONS}
    for key in ("anyOf", "oneOf"):
        if key in s:
            if len(s) > 1:
                raise _Unsupported(f"{key} beside other keywords")
            return [b for sub in s[key] for b in _branches(sub)]
    if "const" in s:
        s = {"enum": [s.pop("const")], **s}
    if "enum" in s:
        if not isinstance(s["enum"], list) or not s["enum"]:
            raise _Unsupported("enum must be a non-empty list")
        return [{"enum": s["enum"]}]
    kind = s.get("type")
    if kind is None:
        kind = "object" if "properties" in s else "array" if "items" in s else None
        if kind is None:
            if set(s) - {"type"}:
                raise _Unsupported(f"{sorted(s)[0]!r} without a type")
            return [{}]
    kinds = kind if isinstance(kind, list) else [kind]
    out = []
    for k in kinds:
        if k not in _KEYS:
            raise _Unsupported(f"type {k!r}")
        extra = set(s) - set().union(*(_KEYS.get(o, ()) for o in kinds))
        if extra:
            raise _Unsupported(f"{sorted(extra)[0]!r} (in a {k} schema)")
        out.append({**{key: v for key, v in s.items() if key in _KEYS[k]}, "type": k})
    return out


class _Lark:
    """Lark rules of a call grammar, named as they are added (literal: a marker's text as a Lark term)."""

    def __init__(self, literal: Callable[[str], str]):
        self.literal, self.lines, self._n = literal, [], 0

    def add(self, body: str, terminal: bool = False) -> str:
        self._n += 1
        name = f"{'T' if terminal else 'r'}{self._n}"
        self.lines.append(f"{name}: {body}")
        return name

    def json(self, schema: dict, **separators) -> str:
        guidance = {"whitespace_flexible": False, **separators}
        return self.add("%json " + json.dumps({**schema, "x-guidance": guidance}))

    def members(self, items: list[tuple[str, bool]], sep: str) -> str:
        """items (an expression, required?) in their order, the optional ones each left out or not, sep between
        those written: the rules of an ordered list of properties / keyword arguments."""
        rest = '""'  # (nothing more)
        after = []  # after[i]: what follows item i, written with a sep before each item
        for expr, required in reversed(items):
            more = f"{json.dumps(sep)} {expr} {rest}" if sep else f"{expr} {rest}"
            after.insert(0, rest)
            rest = self.add(more if required else f"{more} | {rest}")
        first = '""'  # the list from item i, the first written without sep
        for i in range(len(items) - 1, -1, -1):
            expr, required = items[i]
            first = self.add(f"{expr} {after[i]}" + ("" if required else f" | {first}"))
        return first


def _text_value(lark: _Lark, schema: dict) -> str:
    """A qwen_xml string value: bare text up to the closing tag, as one lexeme with it (its length held)."""
    for key in ("pattern", "format"):
        if key in schema:
            raise _Unsupported(f"{key!r} on a string (written bare in this format)")
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    count = f"{{{int(lo)},{'' if hi is None else int(hi)}}}"
    return lark.add(f"/(?s:.{count})\\n<\\/parameter>\\n/ & ~/(?s:.*<\\/parameter>.*<\\/parameter>.*)/", terminal=True)


def _xml_rendered(v) -> str:
    """A value as Qwen3.5's template writes it: a mapping or list as JSON (tojson), anything else as str()."""
    return json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else str(v)


def _xml_param(lark: _Lark, schema) -> str:
    """A qwen_xml parameter's value and its closing tag, per its schema."""
    close, alts = json.dumps(_PARAM_END), []
    for b in _branches(schema):
        kind = b.get("type")
        if "enum" in b:
            alts += [json.dumps(_xml_rendered(v) + _PARAM_END) for v in b["enum"]]
        elif kind in (None, "string"):
            alts.append(_text_value(lark, b))
        elif kind in ("integer", "number"):
            alts.append(f"{lark.json(b)} {close}")
        elif kind == "boolean":
            alts.append(f'("True" | "False") {close}')
        elif kind == "null":
            alts.append(f'"None" {close}')
        else:  # object, array: JSON as transformers' tojson writes it
            alts.append(f"{lark.json(b, item_separator=', ', key_separator=': ')} {close}")
    return alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"


def _py_any(lark: _Lark) -> str:
    """Any Python literal (str, number, True / False / None, list, dict), as _py_value writes them."""
    if "pyany" not in "".join(lark.lines):
        s, n = lark.json({"type": "string"}), lark.json({"type": "number"})
        lark.lines.append(f'pyany: {s} | {n} | "True" | "False" | "None" | "[" (pyany (", " pyany)*)? "]" '
                          f'| "{{" ({s} ": " pyany (", " {s} ": " pyany)*)? "}}"')
    return "pyany"


def _py_param(lark: _Lark, schema) -> str:
    """A Python literal of a value valid against schema (pythonic)."""
    alts = []
    for b in _branches(schema):
        kind = b.get("type")
        if "enum" in b:
            alts += [json.dumps(_py_value(v)) for v in b["enum"]]
        elif kind is None:
            alts.append(_py_any(lark))
        elif kind in ("string", "integer", "number"):
            alts.append(lark.json(b))  # a JSON string or number is the Python literal of the same value
        elif kind == "boolean":
            alts.append('("True" | "False")')
        elif kind == "null":
            alts.append('"None"')
        elif kind == "array":
            alts.append(_list_rule(b, _py_param(lark, b.get("items", {})), ", "))
        else:  # object: a dict literal, its properties in order
            alts.append(_py_object(lark, b))
    return alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"


def _list_rule(schema: dict, item: str, sep: str) -> str:
    """A list literal [a<sep>b ...] of item rules, its length held to minItems / maxItems (pythonic and Gemma 4)."""
    lo, hi = int(schema.get("minItems", 0)), schema.get("maxItems")
    if hi is not None and int(hi) < lo:
        raise _Unsupported("maxItems below minItems")
    if hi is not None and int(hi) == 0:
        return '"[]"'
    more = f'({json.dumps(sep)} {item})' + ("*" if hi is None and lo <= 1 else
                                           f"{{{max(lo - 1, 0)},{'' if hi is None else int(hi) - 1}}}")
    return f'"[" {item} {more} "]"' if lo else f'"[" ({item} {more})? "]"'


def _py_object(lark: _Lark, schema: dict) -> str:
    props = schema.get("properties")
    if not props:
        s = lark.json({"type": "string"})
        any_ = _py_any(lark)
        return f'"{{" ({s} ": " {any_} (", " {s} ": " {any_})*)? "}}"'
    required = set(schema.get("required", ()))
    items = [(f"{json.dumps(json.dumps(k, ensure_ascii=False) + ': ')} {_py_param(lark, v)}", k in required)
             for k, v in props.items()]
    return f'"{{" {lark.members(items, ", ")} "}}"'


def _g_string(lark: _Lark, schema: dict) -> str:
    """A Gemma 4 string: <|"|>text<|"|> (the text cannot hold the quote; its length held)."""
    for key in ("pattern", "format"):
        if key in schema:
            raise _Unsupported(f"{key!r} on a string (written between <|\"|> quotes in this format)")
    lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
    q = lark.literal(G_QUOTE)
    if q.startswith("<["):  # the quote is a token: text cannot spell it
        if hi is not None and int(hi) == 0:
            return f"{q} {q}"
        text = lark.add(f"/(?s:.{{{max(lo, 1)},{'' if hi is None else int(hi)}}})/", terminal=True)
        return f"{q} {text}{'?' if lo == 0 else ''} {q}"
    m = re.escape(G_QUOTE)
    closed = lark.add(f"/(?s:.{{{lo},{'' if hi is None else int(hi)}}}){m}/ & ~/(?s:.*{m}.*{m}.*)/", terminal=True)
    return f"{q} {closed}"


def _g_any(lark: _Lark) -> str:
    """Any Gemma 4 argument value."""
    if "gany" not in "".join(lark.lines):
        s, n = _g_string(lark, {}), lark.json({"type": "number"})
        key = lark.add("/[^\\s{}\\[\\],:<>\"]+/", terminal=True)
        lark.lines.append(f'gany: {s} | {n} | "true" | "false" | "null" | "[" (gany ("," gany)*)? "]" '
                          f'| "{{" ({key} ":" gany ("," {key} ":" gany)*)? "}}"')
    return "gany"


def _g_param(lark: _Lark, schema) -> str:
    """A Gemma 4 argument value valid against schema (format_argument's syntax)."""
    alts = []
    for b in _branches(schema):
        kind = b.get("type")
        if "enum" in b:
            alts += [" ".join(_g_literal(lark, _g_written(v))) for v in b["enum"]]
        elif kind is None:
            alts.append(_g_any(lark))
        elif kind == "string":
            alts.append(_g_string(lark, b))
        elif kind in ("integer", "number"):
            alts.append(lark.json(b))
        elif kind == "boolean":
            alts.append('("true" | "false")')
        elif kind == "null":
            alts.append('"null"')
        elif kind == "array":
            alts.append(_list_rule(b, _g_param(lark, b.get("items", {})), ","))
        else:
            alts.append(_g_object(lark, b))
    return alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"


def _g_literal(lark: _Lark, text: str) -> list[str]:
    """text (a written value) as Lark terms, its quotes the tokenizer's token where it has one."""
    parts = text.split(G_QUOTE)
    out = []
    for i, part in enumerate(parts):
        if i:
            out.append(lark.literal(G_QUOTE))
        if part:
            out.append(json.dumps(part))
    return out


_G_KEY = re.compile(r"[^\s{}\[\],:<>\"]+")


def _g_object(lark: _Lark, schema: dict) -> str:
    """{key:value,...}: the properties in sorted order (the template's dictsort), keys bare."""
    props = schema.get("properties")
    if not props and schema.get("additionalProperties") is not False:
        key, any_ = lark.add('/[^\\s{}\\[\\],:<>"]+/', terminal=True), _g_any(lark)
        return f'"{{" ({key} ":" {any_} ("," {key} ":" {any_})*)? "}}"'
    props, required = props or {}, set(schema.get("required", ()))
    bad = next((k for k in props if not _G_KEY.fullmatch(k)), None)
    if bad is not None:
        raise _Unsupported(f"the parameter name {bad!r} (written bare in this format)")
    items = [(f"{json.dumps(k + ':')} {_g_param(lark, props[k])}", k in required) for k in sorted(props)]
    return f'"{{" {lark.members(items, ",")} "}}"'


def _arguments(lark: _Lark, fmt: str, parameters: dict | None, held: bool) -> str:
    """The rule of a call's arguments in fmt (qwen_xml: <parameter=...> blocks; pythonic: keyword arguments), per the
    function's parameters (an object schema) where held, else any."""
    schema = (parameters or {}) if held else {}
    branches = _branches(schema or {"type": "object"})
    obj = branches[0]
    if len(branches) > 1 or obj.get("type") not in ("object", None):
        raise _Unsupported("parameters must be an object schema")
    if fmt == "gemma4":
        return _g_object(lark, obj if held else {})
    props = obj.get("properties")
    if not props and obj.get("additionalProperties") is not False:  # any arguments
        if fmt == "qwen_xml":
            name = lark.add("/[^>\\s]+/", terminal=True)
            return lark.add(f'("<parameter=" {name} ">\\n" {_text_value(lark, {})})*')
        kw = lark.add(f'{lark.add("/[A-Za-z_][A-Za-z0-9_]*/", terminal=True)} "=" {_py_any(lark)}')
        return lark.add(f'({kw} (", " {kw})*)?')
    props, required = props or {}, set(obj.get("required", ()))
    if fmt == "qwen_xml":
        items = [(f"{json.dumps(f'<parameter={k}>' + chr(10))} {_xml_param(lark, v)}", k in required)
                 for k, v in props.items()]
        return lark.members(items, "")
    bad = next((k for k in props if not _IDENT.fullmatch(k)), None)
    if bad is not None:
        raise _Unsupported(f"the parameter name {bad!r} is not a Python keyword argument")
    return lark.members([(f"{json.dumps(k + '=')} {_py_param(lark, v)}", k in required) for k, v in props.items()],
                        ", ")


def _blocks_grammar(lark: _Lark, start: str, end: str, block: str, sep: str, many: bool, optional: bool) -> str:
    """The start rule of calls written as start-marker body end-marker blocks (block: the rule between the markers;
    sep between blocks where many), or with optional, text around them."""
    s, e = lark.literal(start), lark.literal(end)
    if optional and s.startswith("<["):  # text around the calls: it cannot spell a marker's token
        text = lark.add("/(?s:.+)/", terminal=True)
        return f"start: {text}? ({s} {block} {e} {text}?)*"
    if optional:  # markers spelled in text: a call's text and its marker are one lexeme, other text has none
        m = re.escape(start).replace("/", "\\/")
        opened = lark.add(f"/(?s:.*){m}/ & ~/(?s:.*{m}.*{m}.*)/", terminal=True)
        text = lark.add(f"/(?s:.+)/ & ~/(?s:.*{m}.*)/", terminal=True)
        return f"start: ({opened} {block} {e})* {text}?"
    one = f"{s} {block} {e}"
    return f"start: {one}" + (f" ({json.dumps(sep)} {one})*" if many else "")


def _format_grammar(fmt: ToolFormat, tools: list[dict], literal, many: bool, optional: bool, held) -> str:
    """The Lark grammar of qwen_xml / pythonic calls (call_grammar)."""
    lark = _Lark(literal)
    calls = []
    for i, t in enumerate(tools):
        f = t["function"]
        try:
            args = _arguments(lark, fmt.name, f.get("parameters"), held is None or f["name"] in held)
        except (_Unsupported, TypeError, ValueError) as e:
            raise _ToolSchemaError(i, f"{e} is not supported in this model's tool calls ({fmt.name} format)") from None
        if fmt.name == "qwen_xml":
            calls.append(f'{json.dumps("<function=" + f["name"] + ">" + chr(10))} {args} "</function>"')
        elif fmt.name == "gemma4":
            calls.append(f'{json.dumps("call:" + f["name"])} {args}')
        else:
            calls.append(f'{json.dumps(f["name"] + "(")} {args} ")"')
    call = lark.add(" | ".join(calls))
    if fmt.name == "qwen_xml":  # <tool_call>\n<function=...>...</function>\n</tool_call>, blocks one a line
        block = lark.add(f'"\\n" {call} "\\n"')
        top = _blocks_grammar(lark, "<tool_call>", "</tool_call>", block, "\n", many, optional)
    elif fmt.name == "gemma4":  # <|tool_call>call:NAME{...}<tool_call|>, blocks back to back
        top = _blocks_grammar(lark, G_START, G_END, call, "", many, optional)
    else:  # <|tool_call_start|>[call, call]<|tool_call_end|>: one list holds the calls
        block = lark.add(f'"[" {call} (", " {call})* "]"' if many else f'"[" {call} "]"')
        top = _blocks_grammar(lark, PY_START, PY_END, block, "", False, optional)
    return "\n".join([top, *lark.lines]) + "\n"


class _ToolSchemaError(ValueError):
    """A tool's parameters the format's grammar cannot hold: index (in the tools given), message."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


def call_grammar(fmt: ToolFormat, tools: list[dict], literal: Callable[[str], str] = json.dumps, many: bool = True,
                 optional: bool = False, held: set[str] | None = None, at: list[int] | None = None):
    """The grammar of an answer that calls tools in fmt (one or more; one only unless many), each call's arguments
    valid against its function's parameters (held: only those functions', the others' any arguments): a GrammarSpec
    (runtime/decode/grammar.py). optional: the answer may be text instead (tool_choice auto with strict tools: text
    that does not begin a call, generic; text around the calls, the others). qwen_xml: each parameter's value as
    Qwen3.5's template writes it (a string bare, a number as itself, True / False / None, an object or list as JSON),
    held to its schema's type, enum, length (not a bare string's pattern or format); pythonic: Python literals
    (a string or number as JSON writes it, True / False / None, lists and dicts). A schema the format cannot hold is a
    GrammarError naming tools[i].function.parameters (at: the tools' indices in the request). literal: a marker's
    text as a Lark term (the tokenizer's own token where it has one: Grammars.literal)."""
    from ..decode.grammar import GrammarError, GrammarSpec

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
    if fmt.name in ("qwen_xml", "pythonic", "gemma4"):
        try:
            return GrammarSpec("lark", _format_grammar(fmt, tools, literal, many, optional, held), param="tools")
        except _ToolSchemaError as e:
            i = e.index if at is None else at[e.index]
            raise GrammarError(str(e), f"tools[{i}].function.parameters") from None
    return None


def tool_format(chat_template: str) -> ToolFormat | None:
    """The format the template's text asks for; None for a template that renders tools in a format vlmrt does not
    know (tools are then refused)."""
    if "<tool_call>" in chat_template:
        return FORMATS["qwen_xml" if "<function=" in chat_template else "hermes"]
    if PY_START in chat_template or "<|tool_list_start|>" in chat_template:
        return FORMATS["pythonic"]
    if G_START in chat_template:
        return FORMATS["gemma4"]
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
    return len(text)
