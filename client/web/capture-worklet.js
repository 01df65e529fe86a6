// Microphone capture: hands 80 ms frames (1920 samples at 24 kHz) to the main thread.
class CaptureProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.frame = new Float32Array(1920);
    this.filled = 0;
  }
  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (channel) {
      let offset = 0;
      while (offset < channel.length) {
        const n = Math.min(channel.length - offset, this.frame.length - this.filled);
        this.frame.set(channel.subarray(offset, offset + n), this.filled);
        this.filled += n;
        offset += n;
        if (this.filled === this.frame.length) {
          this.port.postMessage(this.frame);
          this.frame = new Float32Array(1920);
          this.filled = 0;
        }
      }
    }
    return true;
  }
}
registerProcessor("capture", CaptureProcessor);
