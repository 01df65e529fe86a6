// KAME browser client, two transports: GPT-Live over WebRTC (live-webrtc.js: POST
// /v1/live/sessions, the microphone as a media track) or /api/chat (microphone -> Ogg/Opus via
// WebCodecs where the browser has it, else the raw PCM16 extension -> gapless playback of PCM16),
// with the live transcript, oracle, assistant text, latency figures and the timeline (timeline.js).
import { LiveSession } from "./live-webrtc.js";
import { createOpusUplink } from "./ogg-opus.js";
import { TimelineModel, legend, renderTimeline } from "./timeline.js";

const KIND = { HANDSHAKE: 0, AUDIO: 1, TEXT: 2, ERROR: 5, EVENT: 7, CONTROL: 8, PCM: 9 };
const RATE = 24000;
const FRAME = 1920;
const DEFAULT_TRANSPORT = "live"; // ?transport=chat|live picks one on load
const TIMELINE_WINDOW_MS = 30000; // the live timeline shows the last 30 s

const $ = (id) => document.getElementById(id);
const ui = {
  button: $("main-button"), retry: $("retry-button"), status: $("status"), error: $("error"),
  backend: $("backend"), prompt: $("system-prompt"), apply: $("apply-button"),
  user: $("user-transcript"), oracle: $("oracle-text"), assistant: $("assistant-text"),
  rtt: $("rtt"), rttLabel: $("rtt-label"), jitter: $("jitter"), jitterFigure: $("jitter-figure"),
  ttft: $("ttft"), level: $("level"), played: $("played"),
  transport: $("transport"), remoteAudio: $("remote-audio"), timeline: $("timeline"),
  language: $("language"), persona: $("persona"), voice: $("voice"), voices: $("voices"),
};

// test hooks and figures (read by the browser test)
window.kameStats = { framesSent: 0, framesReceived: 0, framesPlayed: 0, events: 0, uplink: null };

let session = null;

// the timeline: every event of the session, placed by its own time or by its arrival
const timeline = { model: new TimelineModel(), t0: performance.now(), pending: null, ticker: null };

function resetTimeline() {
  timeline.model = new TimelineModel();
  timeline.t0 = performance.now();
  window.kameTimeline = timeline.model;
  drawTimeline();
}

function recordEvent(event) {
  timeline.model.add(event, performance.now() - timeline.t0);
  if (!timeline.pending) timeline.pending = setTimeout(drawTimeline, 250);
}

function drawTimeline() {
  timeline.pending = null;
  const now = session ? performance.now() - timeline.t0 + (timeline.model.offset ?? 0) : null;
  renderTimeline(ui.timeline, timeline.model, { now, windowMs: TIMELINE_WINDOW_MS });
}

function setStatus(text) { ui.status.textContent = text; }

function showError(text) {
  ui.error.textContent = text;
  ui.error.hidden = !text;
  ui.retry.hidden = !text;
}

function setRunning(running) {
  ui.button.textContent = running ? "Stop" : "Start";
  ui.button.setAttribute("aria-label", running ? "Stop" : "Start");
  ui.button.classList.toggle("on", running);
  ui.apply.disabled = !running;
  ui.transport.disabled = running;
  syncSessionFields(running);
  clearInterval(timeline.ticker); // while running, the timeline's cursor moves even without events
  timeline.ticker = running ? setInterval(drawTimeline, 500) : null;
}

/** The language and persona go in /api/chat's query at Start: fixed while a session runs, and not carried by
 * the GPT-Live transport yet. */
function syncSessionFields(running = Boolean(session)) {
  const off = running || ui.transport.value === "live";
  ui.language.disabled = ui.persona.disabled = ui.voice.disabled = off;
  ui.language.title = ui.persona.title = ui.voice.title = ui.transport.value === "live" ? "/api/chat only, for now" : "";
}

function wsUrl() {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const params = new URLSearchParams({ events: "1", audio: "pcm" });
  if (ui.backend.value) params.set("backend", ui.backend.value);
  if (ui.language.value) params.set("language", ui.language.value);
  if (ui.persona.value.trim()) params.set("text_prompt", ui.persona.value.trim());
  if (ui.voice.value.trim()) params.set("voice_prompt", ui.voice.value.trim());
  const token = new URLSearchParams(location.search).get("token"); // a server with auth_tokens
  if (token) params.set("token", token);
  return `${scheme}://${location.host}/api/chat?${params}`;
}

function toPcm16(frame) {
  const out = new Uint8Array(1 + frame.length * 2);
  out[0] = KIND.PCM;
  const view = new DataView(out.buffer);
  for (let i = 0; i < frame.length; i++) {
    const s = Math.max(-1, Math.min(1, frame[i]));
    view.setInt16(1 + i * 2, s * 32767, true);
  }
  return out;
}

function fromPcm16(bytes) {
  const view = new DataView(bytes.buffer, bytes.byteOffset + 1, bytes.byteLength - 1);
  const out = new Float32Array(view.byteLength / 2);
  for (let i = 0; i < out.length; i++) out[i] = view.getInt16(i * 2, true) / 32768;
  return out;
}

function median(values) {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted.length ? sorted[Math.floor(sorted.length / 2)] : null;
}

class Session {
  constructor() {
    this.sentAt = [];
    this.rtts = [];
    this.received = 0;
    this.handshake = false;
    this.closedByUser = false;
    this.partial = null;
  }

  async start() {
    this.stream = await openMicrophone();
    this.context = new AudioContext({ sampleRate: RATE });
    await this.context.audioWorklet.addModule("capture-worklet.js");
    await this.context.audioWorklet.addModule("playback-worklet.js");
    this.source = this.context.createMediaStreamSource(this.stream);
    this.capture = new AudioWorkletNode(this.context, "capture");
    this.player = new AudioWorkletNode(this.context, "playback");
    this.player.connect(this.context.destination);
    this.player.port.onmessage = (e) => {
      window.kameStats.framesPlayed += e.data.played;
      ui.played.textContent = window.kameStats.framesPlayed;
    };
    this.source.connect(this.capture);
    setStatus("connecting");
    await this.connect();
    this.uplink = await createOpusUplink(RATE, (page) => this.sendAudio(KIND.AUDIO, page));
    window.kameStats.uplink = this.uplink ? "opus" : "pcm16";
    this.capture.port.onmessage = (e) => this.onMicFrame(e.data);
  }

  connect() {
    return new Promise((resolve, reject) => {
      this.ws = new WebSocket(wsUrl());
      this.ws.binaryType = "arraybuffer";
      this.ws.onmessage = (e) => {
        const bytes = new Uint8Array(e.data);
        if (!this.handshake && bytes[0] === KIND.HANDSHAKE) {
          this.handshake = true;
          setStatus("connected");
          resolve();
          return;
        }
        this.onMessage(bytes);
      };
      this.ws.onclose = (e) => {
        if (!this.handshake && e.code === 1008 && e.reason) {  // the session as asked cannot run: say why
          reject(new Error(`The server refused the session: ${e.reason}`));
        } else if (!this.handshake) {
          reject(new Error("The server refused the connection (it may be full or down). Retry in a moment."));
        } else if (!this.closedByUser) {
          this.stop();
          showError(`Connection lost (code ${e.code}${e.reason ? `: ${e.reason}` : ""}).`);
        }
      };
    });
  }

  onMicFrame(frame) {
    let sum = 0;
    for (const v of frame) sum += v * v;
    ui.level.value = Math.min(1, Math.sqrt(sum / frame.length) * 10);
    if (this.ws.readyState !== WebSocket.OPEN) return;
    if (this.uplink) this.uplink.encode(frame);
    else this.ws.send(toPcm16(frame));
    this.sentAt.push(performance.now());
    window.kameStats.framesSent += 1;
  }

  onMessage(bytes) {
    const kind = bytes[0];
    if (kind === KIND.PCM) {
      const pcm = fromPcm16(bytes);
      this.player.port.postMessage(pcm);
      this.received += pcm.length;
      while (this.received >= FRAME && this.sentAt.length) {
        this.received -= FRAME;
        this.rtts.push(performance.now() - this.sentAt.shift());
        if (this.rtts.length > 50) this.rtts.shift();
        window.kameStats.framesReceived += 1;
      }
      ui.rtt.textContent = Math.round(median(this.rtts));
    } else if (kind === KIND.TEXT) {
      const text = new TextDecoder().decode(bytes.subarray(1));
      ui.assistant.textContent += text;
      recordEvent({ type: "text", text });
    } else if (kind === KIND.EVENT) {
      window.kameStats.events += 1;
      this.onEvent(JSON.parse(new TextDecoder().decode(bytes.subarray(1))));
    } else if (kind === KIND.ERROR) {
      showError(new TextDecoder().decode(bytes.subarray(1)));
    }
  }

  onEvent(event) {
    recordEvent(event);
    if (event.type === "ready") {
      fillBackends(event.backends, event.backend);
      // the session's prompt, unless the user wrote their own (a prompt left as the last session's is replaced:
      // a Japanese session's is not the English one)
      if (!ui.prompt.value || ui.prompt.value === ui.prompt.dataset.server) ui.prompt.value = event.system_prompt;
      ui.prompt.dataset.server = event.system_prompt;
    } else if (event.type === "transcript") {
      this.showTranscript(event);
    } else if (event.type === "oracle") {
      if (event.op === "reset") {
        const line = document.createElement("div");
        line.className = "oracle-reset flash";
        ui.oracle.appendChild(line);
        while (ui.oracle.children.length > 4) ui.oracle.firstChild.remove();
      }
      const current = ui.oracle.lastElementChild || ui.oracle.appendChild(document.createElement("div"));
      current.textContent += (current.textContent ? " " : "") + event.text;
    } else if (event.type === "llm" && event.phase === "first_token" && event.latency_s != null) {
      ui.ttft.textContent = Math.round(event.latency_s * 1000);
    } else if (event.type === "error") {
      showError(event.message);
    } else if (event.type === "asr") {
      showError(`Speech recognition stopped: ${event.message}`);
    }
  }

  showTranscript(event) {
    if (!this.partial) {
      this.partial = document.createElement("p");
      ui.user.appendChild(this.partial);
    }
    this.partial.textContent = event.text;
    this.partial.className = event.final ? "final" : "partial";
    if (event.final) this.partial = null;
  }

  sendAudio(kind, bytes) {
    if (this.ws.readyState !== WebSocket.OPEN) return;
    const out = new Uint8Array(bytes.length + 1);
    out[0] = kind;
    out.set(bytes, 1);
    this.ws.send(out);
  }

  configure() {
    const message = { type: "configure", backend: ui.backend.value, system_prompt: ui.prompt.value };
    const body = new TextEncoder().encode(JSON.stringify(message));
    const out = new Uint8Array(body.length + 1);
    out[0] = KIND.CONTROL;
    out.set(body, 1);
    this.ws.send(out);
  }

  stop() {
    this.closedByUser = true;
    if (this.uplink) this.uplink.close();
    if (this.ws && this.ws.readyState <= WebSocket.OPEN) this.ws.close();
    if (this.stream) this.stream.getTracks().forEach((t) => t.stop());
    if (this.context) this.context.close();
    setRunning(false);
    setStatus("idle");
  }
}

async function openMicrophone() {
  showError("");
  setStatus("requesting microphone");
  try {
    return await navigator.mediaDevices.getUserMedia({
      audio: { echoCancellation: true, noiseSuppression: true, channelCount: 1 },
    });
  } catch (err) {
    throw new Error(err.name === "NotAllowedError"
      ? "Microphone access was denied. Allow the microphone for this page, then retry."
      : `No microphone could be opened (${err.name}: ${err.message}).`);
  }
}

/** The WebRTC transport behind the same start/stop/configure as the /api/chat Session. */
class LiveTransport {
  async start() {
    this.stream = await openMicrophone();
    this.meter = levelMeter(this.stream);
    window.kameStats.transport = "live-webrtc";
    this.live = new LiveSession({
      ui, setStatus, showError,
      onEvent: (event) => { window.kameStats.events += 1; recordEvent(event); },
      onEnded: (message) => {
        this.stop();
        session = null;
        if (message) showError(message);
      },
    });
    await this.live.start(this.stream);
  }

  configure() { this.live.configure(); }

  stop() {
    if (this.live) this.live.stop();
    if (this.meter) this.meter.close();
    if (this.stream) this.stream.getTracks().forEach((t) => t.stop());
    setRunning(false);
    setStatus("idle");
    drawTimeline();
  }
}

/** The microphone's level on the meter (the track itself goes to the peer connection). */
function levelMeter(stream) {
  const context = new AudioContext();
  const analyser = context.createAnalyser();
  context.createMediaStreamSource(stream).connect(analyser);
  const samples = new Float32Array(analyser.fftSize);
  const timer = setInterval(() => {
    analyser.getFloatTimeDomainData(samples);
    let sum = 0;
    for (const v of samples) sum += v * v;
    ui.level.value = Math.min(1, Math.sqrt(sum / samples.length) * 10);
  }, 100);
  return { close: () => { clearInterval(timer); context.close(); } };
}

function fillBackends(names, current) {
  ui.backend.replaceChildren(...names.map((name) => new Option(name, name, false, name === current)));
}

async function start() {
  session = ui.transport.value === "live" ? new LiveTransport() : new Session();
  window.kameStats.transport = ui.transport.value === "live" ? "live-webrtc" : "chat";
  resetTimeline();
  setRunning(true);
  try {
    await session.start();
  } catch (err) {
    session.stop();
    session = null;
    showError(err.message);
    setStatus("error");
  }
}

ui.button.addEventListener("click", () => {
  if (session && ui.button.textContent === "Stop") {
    session.stop();
    session = null;
  } else {
    start();
  }
});
ui.retry.addEventListener("click", () => start());
ui.transport.value = new URLSearchParams(location.search).get("transport") || DEFAULT_TRANSPORT;
ui.transport.addEventListener("change", () => syncSessionFields());
syncSessionFields(false);
ui.timeline.before(legend());
resetTimeline();
ui.apply.addEventListener("click", () => session && session.configure());

fetch("/healthz").then((r) => r.json()).then((health) => {
  if (health.llm_profiles) fillBackends(health.llm_profiles.map((p) => p.name), health.llm);
  ui.voices.replaceChildren(...(health.voices || []).map((name) => new Option(name, name)));
}).catch(() => setStatus("server not ready"));
