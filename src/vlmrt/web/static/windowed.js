// Gemma 4's cache layer kinds beside "attention", as runtime/decode/windowed_state.py keeps them:
//   windowed_attention  K/V buffers of `capacity` rows (the CPU target's graphs: GroupQueryAttention with
//                       sliding_window_cache evicts in the graph); fed and taken back as an attention layer's buffers,
//                       only smaller: a step's present buffers are the next step's past ones. The page never rewinds
//                       (it runs each turn from slot 0 and has no lookahead), so it needs none of the runtime's copies
//   sliding_attention   K/V rows one per slot, exactly as an attention layer's (the rows kinds add the window to
//                       their mask inside the graph), so the host keeps no ring and rewinds nothing
//   shared_kv           reads an earlier layer's K/V inside the graph: no state, no graph input or output of its own

// kind -> what the host keeps: "slots" (an attention layer's buffers, capacity rows where the layer has one) or null
export const WINDOWED_LAYERS = { windowed_attention: "slots", sliding_attention: "slots", shared_kv: null };

// the manifest's cache layers the host keeps buffers for, as decoderPlan's layer entries
export function slotLayers(layers) {
  return layers.filter((l) => l.kind === "attention" || WINDOWED_LAYERS[l.kind] === "slots");
}
