// GPT-Live over WebRTC (docs/live.md): the offer with the microphone as a sendrecv audio track and
// the `oai-events` data channel goes to POST /v1/live/sessions; the answer's remote track plays in
// an <audio> element; the Live events fill the panes and the timeline.
const ICE_GATHER_LIMIT_MS = 3000; // the server takes no trickled candidates: the offer carries them

export class LiveSession {
  /** `page`: {ui, setStatus, showError, onEvent(event), onEnded(message)} from app.js. */
  constructor(page) {
    this.page = page;
    this.closedByUser = false;
    this.delegations = new Map(); // delegation id -> its line in the oracle pane
    this.stats = null;
  }

  async start(stream) {
    const { ui, setStatus } = this.page;
    this.stream = stream;
    this.pc = new RTCPeerConnection({ iceServers: [] });
    this.pc.addTrack(stream.getAudioTracks()[0], stream);
    this.channel = this.pc.createDataChannel("oai-events");
    this.channel.onmessage = (e) => this.onMessage(e.data);
    this.channel.onclose = () => this.ended("The server closed the session.");
    this.pc.ontrack = (e) => {
      ui.remoteAudio.srcObject = e.streams[0] || new MediaStream([e.track]);
      ui.remoteAudio.play().catch(() => {}); // autoplay may wait for a gesture: the Start click was one
    };
    this.pc.onconnectionstatechange = () => {
      if (this.pc.connectionState === "failed") this.ended("The peer connection failed (no route to the server?).");
    };
    await this.pc.setLocalDescription(await this.pc.createOffer());
    await this.gathered();
    setStatus("connecting");
    const answer = await this.post(this.pc.localDescription.sdp);
    await this.pc.setRemoteDescription({ type: "answer", sdp: answer });
    // over WebRTC the page cannot pair a frame sent with the frame back: it shows the network's round
    // trip (the ICE pair's) and the browser's jitter buffer delay, each named for what it is
    this.page.ui.rttLabel.textContent = "network round trip";
    this.page.ui.jitterFigure.hidden = false;
    this.stats = setInterval(() => this.readStats(), 1000);
  }

  gathered() {
    if (this.pc.iceGatheringState === "complete") return Promise.resolve();
    return new Promise((resolve) => {
      const done = () => { if (this.pc.iceGatheringState === "complete") resolve(); };
      this.pc.addEventListener("icegatheringstatechange", done);
      setTimeout(resolve, ICE_GATHER_LIMIT_MS);
    });
  }

  async post(sdp) {
    const { ui } = this.page;
    const token = new URLSearchParams(location.search).get("token");
    const headers = { "content-type": "application/json" };
    if (token) headers.authorization = `Bearer ${token}`;
    const responses = { model: ui.backend.value || "" };
    if (ui.prompt.value.trim()) responses.instructions = ui.prompt.value;
    const body = { session: { model: "gpt-live-1", delegation: { type: "responses", responses } },
                   transport: { type: "webrtc", sdp } };
    const reply = await fetch("/v1/live/sessions?kame_events=true", { method: "POST", headers, body: JSON.stringify(body) });
    const json = await reply.json().catch(() => ({}));
    if (!reply.ok) {
      const why = json.error ? json.error.message : `HTTP ${reply.status}`;
      throw new Error(reply.status === 503 ? `The server refused the connection (${why}). Retry in a moment.`
                                           : `The server refused the session: ${why}`);
    }
    return json.transport.sdp;
  }

  send(event) {
    if (this.channel && this.channel.readyState === "open") this.channel.send(JSON.stringify(event));
  }

  onMessage(data) {
    const event = JSON.parse(data);
    const { ui, setStatus, showError } = this.page;
    this.page.onEvent(event);
    switch (event.type) {
      case "session.started":
        setStatus("connected");
        break;
      case "session.input_transcript.delta":
        this.userLine().textContent += event.delta;
        break;
      case "session.output_transcript.delta":
        ui.assistant.textContent += event.delta;
        break;
      case "session.delegation.created":
        this.delegationLine(event.delegation.id);
        break;
      case "response.event":
        this.progress(event.delegation_id, event.event);
        break;
      case "kame.llm":
        if (event.phase === "first_token" && event.latency_s != null) ui.ttft.textContent = Math.round(event.latency_s * 1000);
        break;
      case "error":
        showError(event.error.message);
        break;
      case "session.closed":
        this.ended(this.closedByUser ? null : `The session ended (${event.reason}).`);
        break;
      default:
    }
  }

  userLine() {
    const { ui } = this.page;
    return ui.user.lastElementChild || ui.user.appendChild(document.createElement("p"));
  }

  delegationLine(id) {
    const { ui } = this.page;
    if (!this.delegations.has(id)) {
      const line = document.createElement("div");
      line.className = "oracle-reset flash delegation";
      line.textContent = `#${this.delegations.size + 1} thinking…`;
      ui.oracle.appendChild(line);
      this.delegations.set(id, line);
      while (ui.oracle.children.length > 6) ui.oracle.firstChild.remove();
    }
    return this.delegations.get(id);
  }

  progress(id, inner) {
    const line = this.delegationLine(id);
    const n = line.textContent.split(" ")[0];
    if (inner.type === "response.output_text.done") line.textContent = `${n} ${inner.text}`;
    else if (inner.type === "response.completed") line.classList.add(inner.response.status === "cancelled" ? "cancelled" : "adopted");
    else if (inner.type === "response.failed") line.classList.add("failed");
  }

  configure() {
    const { ui } = this.page;
    const responses = { model: ui.backend.value || "" };
    if (ui.prompt.value.trim()) responses.instructions = ui.prompt.value;
    this.send({ type: "session.update", session: { delegation: { type: "responses", responses } } });
  }

  async readStats() {
    const report = await this.pc.getStats();
    report.forEach((s) => {
      if (s.type === "candidate-pair" && s.nominated && s.currentRoundTripTime != null) {
        this.page.ui.rtt.textContent = Math.round(s.currentRoundTripTime * 1000);
        window.kameStats.networkRttMs = s.currentRoundTripTime * 1000;
      } else if (s.type === "inbound-rtp" && s.kind === "audio" && s.totalSamplesReceived != null) {
        window.kameStats.framesPlayed = Math.floor(s.totalSamplesReceived / 3840); // 80 ms at 48 kHz
        // the share made up by the jitter buffer (nothing there to play, or packets it could not decode)
        window.kameStats.concealedShare = s.concealedSamples / Math.max(1, s.totalSamplesReceived);
        this.page.ui.played.textContent = window.kameStats.framesPlayed;
        const last = this.lastInbound;
        if (last && s.jitterBufferEmittedCount > last.jitterBufferEmittedCount) {
          // the mean delay of the samples played since the last reading (a second)
          const ms = (1000 * (s.jitterBufferDelay - last.jitterBufferDelay))
            / (s.jitterBufferEmittedCount - last.jitterBufferEmittedCount);
          window.kameStats.jitterBufferMs = ms;
          (window.kameStats.jitterBufferTrace ||= []).push(Math.round(ms));
          this.page.ui.jitter.textContent = Math.round(ms);
        }
        this.lastInbound = s;
      } else if (s.type === "outbound-rtp" && s.kind === "audio") {
        window.kameStats.packetsSent = s.packetsSent;
      }
    });
  }

  ended(message) {
    if (this.closedByUser) return;
    this.page.onEnded(message);
  }

  stop() {
    if (this.closedByUser) return;
    this.closedByUser = true;
    clearInterval(this.stats);
    this.page.ui.rttLabel.textContent = "frame round trip"; // the WebSocket transports' figure again
    this.page.ui.jitterFigure.hidden = true;
    this.send({ type: "session.close" });
    // session.close first: the server answers session.closed and closes; the peer goes in any case
    setTimeout(() => this.pc.close(), 300);
    this.page.ui.remoteAudio.srcObject = null;
  }
}
