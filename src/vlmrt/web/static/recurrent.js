// The recurrent state kind (manifest kv.layers kind "recurrent": Qwen3.5's Gated DeltaNet), as
// runtime/decode/recurrent_state.py keeps it for one sequence: per layer the causal conv's window [width, channels]
// and the gated delta rule's state [heads, key_dim, value_dim], with a leading 1 under gqa_in_place (HEADS layout).
// A step reads both and returns them as they are after its last row; they are the next step's inputs. The browser
// computes every answer afresh from slot 0 (VLM.chat: a follow-up turn prefills the whole conversation again), so a
// rewind is only ever to slot 0: the zero state (RecurrentState.rewind(0)); no snapshots are needed.

// the manifest's recurrent layers as the decoder plan lists them
export function recurrentLayers(kv) {
  return kv.layers.filter((l) => l.kind === "recurrent").map((l) => ({
    kind: l.kind, width: l.width, channels: l.channels, heads: l.heads, keyDim: l.key_dim, valueDim: l.value_dim,
    convInput: l.conv_input, stateInput: l.state_input, convOutput: l.conv_output, stateOutput: l.state_output,
  }));
}

export class RecurrentState {
  // layers: recurrentLayers(kv); heads: the decoder kind lays its state out with a leading batch axis (gqa_in_place)
  constructor(ort, layers, heads) {
    this.ort = ort;
    this.layers = layers;
    const lead = heads ? [1] : [];
    this.shapes = layers.map((l) => [[...lead, l.width, l.channels], [...lead, l.heads, l.keyDim, l.valueDim]]);
    this.reset();
  }

  // the state before slot 0: zeros
  reset() {
    const T = this.ort.Tensor;
    this.arrays = this.shapes.map((pair) => pair.map((s) => new T("float32", new Float32Array(s.reduce((a, b) => a * b, 1)), s)));
  }

  feed(feeds) {
    this.layers.forEach((l, i) => {
      feeds[l.convInput] = this.arrays[i][0];
      feeds[l.stateInput] = this.arrays[i][1];
    });
  }

  fetches() {
    return this.layers.flatMap((l) => [l.convOutput, l.stateOutput]);
  }

  // a step's state after its last real row (every row of it is kept: the browser drops no rows of a call, and a
  // static graph's padding is kept out by its valid-rows input)
  take(out) {
    this.layers.forEach((l, i) => {
      this.arrays[i].forEach((t) => t.dispose?.());
      this.arrays[i] = [out[l.convOutput], out[l.stateOutput]];
    });
  }
}
