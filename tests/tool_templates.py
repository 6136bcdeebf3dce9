"""Chat templates with the tool parts of their families (reconstructed from the hub repos' templates, not copied), for
the tool-call tests: Qwen3-VL's (hermes: the tools listed in the system turn inside <tools>, calls as <tool_call> JSON
blocks, tool results as a user turn of <tool_response> blocks) and LFM2-VL's (pythonic: the tools as a JSON list
between <|tool_list_start|> and <|tool_list_end|> in the system turn, results in a tool turn; the template does not
render an assistant's tool_calls: the caller writes them into the content)."""

_TEXT_OF = ("{%- macro text_of(c) -%}{%- if c is string -%}{{- c -}}{%- else -%}{%- for p in c -%}"
            "{%- if p.type == 'image' or 'image' in p -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
            "{%- elif p.type == 'video' or 'video' in p -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
            "{%- elif 'text' in p -%}{{- p.text -}}{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}")

QWEN3_VL_TOOLS = _TEXT_OF + (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- text_of(messages[0].content) + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + text_of(messages[0].content) + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + text_of(message.content) + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set content = text_of(message.content) %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if (loop.first and content) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}"
    "{%- endif %}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + text_of(message.content) + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LFM2_VL_TOOLS = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(system='') -%}"
    "{%- if messages[0].role == 'system' -%}{%- for item in messages[0].content -%}"
    "{%- set ns.system = ns.system + item.text -%}{%- endfor -%}{%- set messages = messages[1:] -%}{%- endif -%}"
    "{%- if tools -%}{%- set ns.system = ns.system + ('\\n' if ns.system else '') + 'List of tools: "
    "<|tool_list_start|>[' -%}"
    "{%- for tool in tools -%}{%- set ns.system = ns.system + (tool | tojson) -%}"
    "{%- if not loop.last -%}{%- set ns.system = ns.system + ', ' -%}{%- endif -%}{%- endfor -%}"
    "{%- set ns.system = ns.system + ']<|tool_list_end|>' -%}{%- endif -%}"
    "{%- if ns.system -%}{{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for message in messages -%}{{- '<|im_start|>' + message.role + '\\n' -}}"
    "{%- if message.role == 'tool' -%}{{- '<|tool_response_start|>' -}}{%- endif -%}"
    "{%- for item in message.content -%}{%- if item.type == 'image' -%}{{- '<image>' -}}"
    "{%- elif item.type == 'text' -%}{{- item.text -}}{%- endif -%}{%- endfor -%}"
    "{%- if message.role == 'tool' -%}{{- '<|tool_response_end|>' -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
