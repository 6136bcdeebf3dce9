// Stop strings, as runtime/prompt/stop_strings.py: the streamed answer is cut before the first stop string; a possible
// start of one is held back until the text shows it is not one.
export class StopStrings {
  constructor(stops) {
    this.stops = [...(stops || [])];
    if (this.stops.some((s) => typeof s !== "string" || !s)) throw new RangeError("stop strings must be non-empty strings");
    this.text = "";
    this.emitted = 0;
    this.stopped = false;
  }

  feed(piece) {
    if (this.stopped) return "";
    this.text += piece;
    const hits = this.stops.map((s) => this.text.indexOf(s, this.emitted)).filter((i) => i >= 0);
    if (hits.length) {
      this.stopped = true;
      this.text = this.text.slice(0, Math.min(...hits));
      return this.emit(this.text.length);
    }
    let hold = 0;
    for (const s of this.stops) {
      for (let k = Math.min(s.length - 1, this.text.length - this.emitted); k > hold; k--) {
        if (this.text.endsWith(s.slice(0, k))) { hold = k; break; }
      }
    }
    return this.emit(this.text.length - hold);
  }

  flush() {
    return this.emit(this.text.length);
  }

  emit(upto) {
    const out = this.text.slice(this.emitted, upto);
    this.emitted = Math.max(this.emitted, upto);
    return out;
  }
}
