// Prompt text, as runtime/prompt/build.py + runtime/prompt/conversation.py: the bundle's Jinja chat template rendered over the
// messages (@huggingface/jinja, which trims blocks as transformers' apply_chat_template does), each image placeholder
// then replaced, in order, by the image's expansion (a named host op).

import { Template } from "./vendor/jinja.js";

// SmolVLM / Idefics3: per tile `<fake><row_r_col_c><image>×n`, a newline per grid row, then the global tile
function gridMarkers(rows, cols, tiles, p) {
  const { fake_token: fake, image_token: image, global_token: glob } = p.params;
  const run = image.repeat(p.tokens_per_tile);
  if (rows === 0 && cols === 0) return `${fake}${glob}${run}${fake}`;
  let text = "";
  for (let r = 0; r < rows; r++) {
    for (let c = 0; c < cols; c++) text += fake + p.params.tile_marker.replace("{row}", r + 1).replace("{col}", c + 1) + run;
    text += "\n";
  }
  return text + `\n${fake}${glob}${run}${fake}`;
}

// InternVL: `<img>` + `<IMG_CONTEXT>` × (tokens per tile × tiles) + `</img>`; Gemma 4: `<boi>` + the image token ×
// the image's tokens (tileTokens: each tile's, from the tiling) + `<eoi>`
function wrappedRun(rows, cols, tiles, p, tileTokens = null) {
  const n = tileTokens ? tileTokens.reduce((a, b) => a + b, 0) : p.tokens_per_tile * tiles;
  return p.params.start_token + p.params.image_token.repeat(n) + p.params.end_token;
}

export const EXPANSION = { grid_markers: gridMarkers, wrapped_run: wrappedRun };

export class ConversationError extends Error {}

// OpenAI-style messages -> {messages: [{role, content: [{type: "text", text} | {type: "image", index}]}], images}
export function parseMessages(messages) {
  if (!Array.isArray(messages) || !messages.length) throw new ConversationError("messages must be a non-empty list of {role, content} objects");
  const out = [], images = [];
  messages.forEach((m, i) => {
    const where = `message ${i + 1}`;
    if (!m || !["system", "user", "assistant"].includes(m.role)) throw new ConversationError(`${where}: needs a role of system, user, assistant`);
    let parts;
    if (typeof m.content === "string") parts = [{ type: "text", text: m.content }];
    else if (Array.isArray(m.content) && m.content.length) {
      parts = m.content.map((p, j) => {
        if (p && p.type === "text" && typeof p.text === "string") return { type: "text", text: p.text };
        if (p && (p.type === "image_url" || p.type === "image")) {
          if (m.role !== "user") throw new ConversationError(`${where}: images can only be in user messages`);
          const url = p.type === "image_url" ? (typeof p.image_url === "string" ? p.image_url : p.image_url?.url) : (p.image ?? p.url);
          if (!url) throw new ConversationError(`${where}, part ${j + 1}: an image part needs image_url.url`);
          images.push(url);
          return { type: "image", index: images.length - 1 };
        }
        throw new ConversationError(`${where}, part ${j + 1}: type must be text, image_url or image`);
      });
    } else throw new ConversationError(`${where}: content must be a string or a non-empty list of parts`);
    out.push({ role: m.role, content: parts });
  });
  if (out[out.length - 1].role !== "user") throw new ConversationError("the last message must be the user's");
  return { messages: out, images };
}

export class ChatTemplate {
  constructor(p) {
    this.p = p;
    if (!p.chat_template) throw new ConversationError("this bundle was exported before conversations (no chat template); re-export it");
    this.template = new Template(p.chat_template);
  }

  templateMessages(conv) {
    const p = this.p, msgs = [];
    if (p.system_prompt && conv.messages[0].role !== "system") msgs.push({ role: "system", content: [{ type: "text", text: p.system_prompt }] });
    for (const m of conv.messages) {
      if (p.content_format === "string") {
        const n = m.content.filter((x) => x.type === "image").length;
        const text = m.content.filter((x) => x.type === "text").map((x) => x.text).join("\n");
        msgs.push({ role: m.role, content: (p.image_in_text || "").repeat(n) + text });
      } else {
        msgs.push({ role: m.role, content: m.content.map((x) => (x.type === "text" ? { type: "text", text: x.text } : { type: "image" })) });
      }
    }
    return msgs;
  }

  // the prompt text; grids: [rows, cols, tiles(, tile tokens)] per image, in order
  render(conv, grids) {
    const p = this.p, expand = EXPANSION[p.expansion];
    if (!expand) throw new Error(`this vlmrt has no prompt expansion op '${p.expansion}'; upgrade vlmrt`);
    const text = this.template.render({
      messages: this.templateMessages(conv), add_generation_prompt: true, ...p.template_strings,
    });  // (raise_exception is the renderer's own)
    const pieces = p.image_placeholder ? text.split(p.image_placeholder) : [text];
    if (pieces.length - 1 !== grids.length) {
      throw new ConversationError(`the rendered conversation has ${pieces.length - 1} image tokens (${p.image_placeholder}) for ${grids.length} images: message text must not contain '${p.image_placeholder}'`);
    }
    let out = pieces[0];
    grids.forEach((g, i) => { out += expand(g[0], g[1], g[2], p, g[3]) + pieces[i + 1]; });
    return out;
  }
}
