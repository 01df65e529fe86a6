// Ogg/Opus muxing for the microphone: WebCodecs gives raw Opus packets, the server (like
// Moshi's) reads an Ogg stream. One Ogg page per packet keeps latency at one packet.
const CRC_TABLE = (() => {
  const table = new Uint32Array(256);
  for (let i = 0; i < 256; i++) {
    let r = i << 24;
    for (let j = 0; j < 8; j++) r = (r & 0x80000000) ? ((r << 1) ^ 0x04c11db7) : (r << 1);
    table[i] = r >>> 0;
  }
  return table;
})();

function crc32(bytes) {
  let crc = 0;
  for (const b of bytes) crc = ((crc << 8) ^ CRC_TABLE[((crc >>> 24) ^ b) & 0xff]) >>> 0;
  return crc >>> 0;
}

export class OggOpusWriter {
  constructor(sampleRate = 24000, serial = (Math.random() * 0xffffffff) >>> 0) {
    this.sampleRate = sampleRate;
    this.serial = serial;
    this.sequence = 0;
    this.granule = 0; // Opus granule positions count 48 kHz samples
  }

  // The two header pages (OpusHead, OpusTags): send them before any audio.
  headers() {
    const head = new Uint8Array(19);
    head.set(new TextEncoder().encode("OpusHead"), 0);
    const view = new DataView(head.buffer);
    view.setUint8(8, 1); // version
    view.setUint8(9, 1); // channels
    view.setUint16(10, 0, true); // pre-skip
    view.setUint32(12, this.sampleRate, true);
    view.setInt16(16, 0, true); // gain
    view.setUint8(18, 0); // mapping family
    const vendor = new TextEncoder().encode("kame-web");
    const tags = new Uint8Array(8 + 4 + vendor.length + 4);
    tags.set(new TextEncoder().encode("OpusTags"), 0);
    new DataView(tags.buffer).setUint32(8, vendor.length, true);
    tags.set(vendor, 12);
    return [this.page(head, 0x02, 0), this.page(tags, 0, 0)];
  }

  // One audio packet of `durationUs` microseconds as one page.
  audio(packet, durationUs) {
    this.granule += Math.round((durationUs * 48000) / 1e6);
    return this.page(packet, 0, this.granule);
  }

  page(packet, headerType, granule) {
    const lacing = [];
    let left = packet.length;
    while (left >= 255) { lacing.push(255); left -= 255; }
    lacing.push(left);
    const page = new Uint8Array(27 + lacing.length + packet.length);
    const view = new DataView(page.buffer);
    page.set(new TextEncoder().encode("OggS"), 0);
    view.setUint8(4, 0);
    view.setUint8(5, headerType);
    view.setUint32(6, granule % 0x100000000, true);
    view.setUint32(10, Math.floor(granule / 0x100000000), true);
    view.setUint32(14, this.serial, true);
    view.setUint32(18, this.sequence++, true);
    view.setUint32(22, 0, true);
    view.setUint8(26, lacing.length);
    page.set(lacing, 27);
    page.set(packet, 27 + lacing.length);
    view.setUint32(22, crc32(page), true);
    return page;
  }
}

// A microphone encoder: Float32 frames in, Ogg pages out (through `send`), or null when the
// browser has no Opus AudioEncoder (the caller then sends raw PCM16).
export async function createOpusUplink(sampleRate, send) {
  if (typeof AudioEncoder === "undefined") return null;
  const config = { codec: "opus", sampleRate, numberOfChannels: 1, bitrate: 32000 };
  try {
    const { supported } = await AudioEncoder.isConfigSupported(config);
    if (!supported) return null;
  } catch (_err) {
    return null;
  }
  const writer = new OggOpusWriter(sampleRate);
  for (const page of writer.headers()) send(page);
  const encoder = new AudioEncoder({
    output: (chunk) => {
      const packet = new Uint8Array(chunk.byteLength);
      chunk.copyTo(packet);
      send(writer.audio(packet, chunk.duration || 20000));
    },
    error: (err) => console.error("Opus encoder", err),
  });
  encoder.configure(config);
  let timestamp = 0;
  return {
    encode(frame) {
      const data = new AudioData({ format: "f32-planar", sampleRate, numberOfFrames: frame.length,
        numberOfChannels: 1, timestamp, data: frame });
      timestamp += (frame.length * 1e6) / sampleRate;
      encoder.encode(data);
      data.close();
    },
    close() { try { encoder.close(); } catch (_err) { /* already closed */ } },
  };
}
