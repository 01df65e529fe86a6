// Gapless playback with a small jitter buffer: starts after `prefill` samples are queued,
// plays silence on underrun and waits for the buffer to refill.
class PlaybackProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.chunks = [];
    this.offset = 0;
    this.queued = 0;
    this.prefill = 3840; // 160 ms at 24 kHz
    this.playing = false;
    this.played = 0;
    this.port.onmessage = (event) => {
      this.chunks.push(event.data);
      this.queued += event.data.length;
    };
  }
  process(_inputs, outputs) {
    const out = outputs[0][0];
    if (!this.playing && this.queued >= this.prefill) this.playing = true;
    let i = 0;
    while (this.playing && i < out.length && this.chunks.length) {
      const chunk = this.chunks[0];
      const n = Math.min(out.length - i, chunk.length - this.offset);
      out.set(chunk.subarray(this.offset, this.offset + n), i);
      i += n;
      this.offset += n;
      this.queued -= n;
      this.played += n;
      if (this.offset === chunk.length) { this.chunks.shift(); this.offset = 0; }
    }
    if (i < out.length) { out.fill(0, i); this.playing = false; }
    if (this.played >= 1920) { this.port.postMessage({ played: Math.floor(this.played / 1920) }); this.played %= 1920; }
    return true;
  }
}
registerProcessor("playback", PlaybackProcessor);
