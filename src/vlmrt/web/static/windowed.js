// Gemma 4's two cache layer kinds beside "attention", as runtime/decode/windowed_state.py keeps them:
//   sliding_attention  K/V rows one per slot, exactly as an attention layer's (the same buffers, fed and taken back
//                      the same way): the window is the graph's (GroupQueryAttention's local_window_size; the rows
//                      kinds add it to their mask inside the graph), so the host keeps no ring and rewinds nothing
//   shared_kv          reads an earlier layer's K/V inside the graph: no state, no graph input or output of its own
// (A window-sized cache kind, GroupQueryAttention's sliding_window_cache, is not one of them: decoder.js refuses it.)

// kind -> what the host keeps: "slots" (an attention layer's buffers) or null (nothing)
export const WINDOWED_LAYERS = { sliding_attention: "slots", shared_kv: null };

// the manifest's cache layers the host keeps buffers for, as decoderPlan's layer entries
export function slotLayers(layers) {
  return layers.filter((l) => l.kind === "attention" || WINDOWED_LAYERS[l.kind] === "slots");
}
