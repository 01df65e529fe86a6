// The live timeline: a session's events as swimlanes on its audio timeline (ms) — the user's words,
// each backend attempt (delegation), the oracle's resets and the assistant's words — so that one
// sees the answer arrive before the user stops talking. No dependencies: the page imports it, and
// `kame replay REC --timeline out.html` inlines it beside a recording's events.
//
// Events understood: GPT-Live's server events (docs/live.md: `*_ms` on the session's timeline),
// KAME's `kame.oracle` extension, and /api/chat's JSON events (`transcript`, `llm`, `oracle`,
// `text`). An event with no time of its own (`response.event`, `llm`) is placed by its arrival
// (`at`, ms on any clock): the arrival clock's offset to the timeline is the largest (time - at)
// of the timed events seen, the freshest of them being the assistant's words and the delegations.

const FRAME_MS = 80; // one front-end frame: `frame` fields count them
const JOIN_MS = 400; // words closer than this form one block on a lane
const MIN_ATTEMPT_PX = 26; // room for "#12" on an attempt that took a few ms
const SVG = "http://www.w3.org/2000/svg";
const COLOURS = {
  user: "#2563eb", open: "#93c5fd", adopted: "#16a34a", cancelled: "#9ca3af", failed: "#dc2626",
  oracle: "#d97706", assistant: "#7c3aed", axis: "#6b7280", stop: "#dc2626",
};

export class TimelineModel {
  constructor() {
    this.user = []; // {start, end, text}
    this.attempts = new Map(); // id -> {id, n, created, firstWords, end, status, answer}
    this.oracle = []; // resets: {at, epoch, text}
    this.assistant = []; // {start, end, text}
    this.offset = null; // timeline ms minus arrival ms (see above)
    this.latest = 0; // the newest time on the timeline seen or estimated
    this.utterances = new Map(); // /api/chat: a transcript's start_s -> its user block
  }

  /** One event; `at`: when it arrived (ms), for the events that carry no time. */
  add(event, at = null) {
    const handler = HANDLERS[event.type];
    if (handler) handler(this, event, at);
  }

  timed(ms, at) {
    if (at != null) this.offset = Math.max(this.offset ?? -Infinity, ms - at);
    this.latest = Math.max(this.latest, ms);
    return ms;
  }

  now(at) {
    const ms = at != null && this.offset != null ? at + this.offset : this.latest;
    this.latest = Math.max(this.latest, ms);
    return ms;
  }

  attempt(id, at) {
    if (!this.attempts.has(id)) {
      this.attempts.set(id, { id, n: this.attempts.size + 1, created: this.now(at), firstWords: null, end: null,
                              status: "open", answer: "" });
    }
    return this.attempts.get(id);
  }

  finish(attempt, status, at, answer) {
    if (attempt.end != null) return;
    attempt.end = this.now(at);
    attempt.status = status;
    if (answer) attempt.answer = answer;
  }

  /** The user's last word ends here (null before any). */
  userEnd() { return this.user.length ? this.user[this.user.length - 1].end : null; }

  /** The answer: the newest adopted attempt's, and when its words first came (the earliest adopted
   * attempt with the same answer: a later one that agrees keeps the oracle it set); null before any. */
  answer() {
    const adopted = [...this.attempts.values()].filter((a) => a.status === "adopted" && a.firstWords != null);
    if (!adopted.length) return null;
    const text = adopted[adopted.length - 1].answer;
    const first = Math.min(...adopted.filter((a) => a.answer === text).map((a) => a.firstWords));
    return { text, firstWords: first };
  }

  /** When the answer's words first came (ms; null before any). */
  firstAnswer() { return this.answer()?.firstWords ?? null; }
}

function appendBlock(blocks, start, end, text) {
  const last = blocks[blocks.length - 1];
  if (last && start - last.end <= JOIN_MS) {
    last.end = Math.max(last.end, end);
    last.text += text;
  } else {
    blocks.push({ start, end: Math.max(end, start + FRAME_MS), text });
  }
}

function responseEvent(model, event, at) {
  const attempt = model.attempt(event.delegation_id, at);
  const inner = event.event || {};
  const response = inner.response || {};
  if (inner.type === "response.in_progress" && attempt.firstWords == null) attempt.firstWords = model.now(at);
  else if (inner.type === "response.output_text.done") attempt.answer = inner.text || attempt.answer;
  else if (inner.type === "response.completed") {
    model.finish(attempt, response.status === "cancelled" ? "cancelled" : "adopted", at);
  } else if (inner.type === "response.failed" || inner.type === "response.incomplete") {
    model.finish(attempt, "failed", at);
  }
}

function oracleEvent(model, event, at) {
  const ms = model.timed(event.frame * FRAME_MS, at);
  const last = model.oracle[model.oracle.length - 1];
  if (event.op === "reset" || !last) model.oracle.push({ at: ms, epoch: event.epoch, text: event.text });
  else if (event.accepted !== false && last.epoch === event.epoch) last.text += ` ${event.text}`;
}

function chatTranscript(model, event, at) {
  const start = Math.round(event.start_s * 1000);
  const end = model.timed(Math.round(event.end_s * 1000), at);
  let block = model.utterances.get(start);
  if (!block) {
    block = { start, end, text: "" };
    model.utterances.set(start, block);
    model.user.push(block);
  }
  block.end = Math.max(end, start + FRAME_MS);
  block.text = event.text;
}

function chatLlm(model, event, at) {
  const attempt = model.attempt(`epoch-${event.epoch}`, at);
  if (event.phase === "first_token" && attempt.firstWords == null) attempt.firstWords = model.now(at);
  else if (event.phase === "done") model.finish(attempt, event.took_oracle ? "adopted" : "cancelled", at, event.answer);
  else if (event.phase === "cancelled") model.finish(attempt, "cancelled", at, event.answer);
  else if (event.phase === "failed") model.finish(attempt, "failed", at);
}

const HANDLERS = {
  "session.input_transcript.delta": (m, e, at) => appendBlock(m.user, e.start_ms, m.timed(e.end_ms, at), e.delta),
  "session.output_transcript.delta": (m, e, at) => appendBlock(m.assistant, e.start_ms, m.timed(e.end_ms, at), e.delta),
  "session.delegation.created": (m, e, at) => {
    m.timed(e.offset_ms, at);
    const attempt = m.attempt(e.delegation.id, at);
    attempt.created = e.offset_ms;
  },
  "response.event": responseEvent,
  "kame.oracle": oracleEvent,
  oracle: oracleEvent,
  transcript: chatTranscript,
  llm: chatLlm,
  text: (m, e, at) => {
    const start = e.frame != null ? m.timed(e.frame * FRAME_MS, at) : m.now(at);
    appendBlock(m.assistant, start, start + FRAME_MS, e.text);
  },
};

/** A model of `entries` ({event, at} or bare events, as a recording holds them). */
export function timelineOf(entries) {
  const model = new TimelineModel();
  for (const entry of entries) {
    if (entry && entry.event && entry.event.type) model.add(entry.event, entry.at ?? null);
    else if (entry && entry.type) model.add(entry);
  }
  return model;
}

// ---------------------------------------------------------------------------------- drawing

function el(name, attrs = {}, parent = null, text = null) {
  const node = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text != null) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}

/** A labelled block: a light fill with a solid edge; its dark label may run on into `room` (px, up to
 * the lane's next block), clipped there by a nested <svg>; <title> holds all of the text. */
function block(parent, x, y, width, height, colour, text, attrs = {}, room = width) {
  const box = el("svg", { x, y, width: Math.max(width, room, 2), height, ...attrs }, parent);
  el("rect", { width: Math.max(width, 2), height: "100%", rx: 3, fill: colour, "fill-opacity": 0.3 }, box);
  el("rect", { width: 3, height: "100%", fill: colour }, box);
  if (text) el("text", { x: 6, y: height - 5, "font-size": 11, fill: "#111827" }, box, text);
  el("title", {}, box, text);
  return box;
}

/** Each block's room for its label: up to the next block's start (or the lane's end), in px. */
function rooms(blocks, x, right) {
  return blocks.map((b, i) => (i + 1 < blocks.length ? x(blocks[i + 1].start) : right) - x(b.start) - 3);
}

function packRows(attempts, minMs) {
  const ends = []; // each row's last end
  return attempts.map((attempt) => {
    const end = Math.max(attempt.end ?? Infinity, attempt.created + minMs);
    let row = ends.findIndex((rowEnd) => rowEnd <= attempt.created);
    if (row < 0) row = ends.push(end) - 1;
    else ends[row] = end;
    return row;
  });
}

/**
 * Draw `model` into `container` (its content is replaced). Options: `now` (ms: the live cursor),
 * `windowMs` (show only the last so many ms), `pxPerSecond` (a fixed scale that may overflow).
 */
export function renderTimeline(container, model, options = {}) {
  const attempts = [...model.attempts.values()];
  const end = Math.max(options.now ?? 0, model.latest, 5000);
  const from = options.windowMs ? Math.max(0, end - options.windowMs) : 0;
  const label = 92;
  const span = end - from;
  const width = options.pxPerSecond ? label + (span / 1000) * options.pxPerSecond + 20
                                    : Math.max(container.clientWidth || 900, 480);
  const scale = (width - label - 20) / span;
  const x = (ms) => label + (Math.max(ms, from) - from) * scale;
  const rows = packRows(attempts, (MIN_ATTEMPT_PX + 2) / scale);
  const rowCount = Math.max(1, ...rows.map((r) => r + 1));
  const lane = 26;
  const lanes = { user: 24, attempts: 24 + lane + 6 };
  const backendHeight = Math.max(lane, rowCount * 18 + 4);
  lanes.oracle = lanes.attempts + backendHeight + 6;
  lanes.assistant = lanes.oracle + lane + 6;
  const height = lanes.assistant + lane + 8;
  const svg = el("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img",
                          "aria-label": "timeline", "font-family": "system-ui, sans-serif" });
  drawAxis(svg, from, end, x, height);
  for (const [name, y, h] of [["You", lanes.user, lane], ["Backend", lanes.attempts, backendHeight],
                              ["Oracle", lanes.oracle, lane], ["Assistant", lanes.assistant, lane]]) {
    el("rect", { x: 0, y, width, height: h, fill: "#f3f4f6" }, svg);
    el("text", { x: 6, y: y + 16, "font-size": 12, "font-weight": 600, fill: "#1d2433" }, svg, name);
  }
  drawBlocks(svg, model.user.filter((b) => b.end >= from), lanes.user + 2, lane - 4, "user", x, width);
  attempts.forEach((a, i) => {
    const next = attempts.find((b, j) => j > i && rows[j] === rows[i]); // the next one in its row
    const room = (next ? x(next.created) : width) - x(a.created) - 3;
    drawAttempt(svg, a, lanes.attempts + rows[i] * 18 + 3, x, end, from, room);
  });
  model.oracle.forEach((o, i) => {
    const next = model.oracle[i + 1]?.at ?? end;
    if (next < from) return;
    block(svg, x(o.at), lanes.oracle + 2, x(next) - x(o.at), lane - 4, COLOURS.oracle, `⟲ ${o.text.trim()}`,
          { "data-kind": "oracle-reset" });
  });
  drawBlocks(svg, model.assistant.filter((b) => b.end >= from), lanes.assistant + 2, lane - 4, "assistant", x,
             width);
  drawMarkers(svg, model, x, height, options.now, from);
  container.replaceChildren(svg, summary(model));
  return svg;
}

function drawBlocks(svg, blocks, y, height, kind, x, right) {
  const room = rooms(blocks, x, right);
  blocks.forEach((b, i) => block(svg, x(b.start), y, x(b.end) - x(b.start), height, COLOURS[kind], b.text.trim(),
                                 { "data-kind": kind }, room[i]));
}

function drawAttempt(svg, attempt, y, x, end, from, room) {
  const stop = attempt.end ?? end;
  if (stop < from) return;
  const colour = COLOURS[attempt.status];
  const text = `#${attempt.n} ${attempt.status}${attempt.answer ? `: ${attempt.answer}` : ""}`;
  const width = Math.max(x(stop) - x(attempt.created), MIN_ATTEMPT_PX); // a fast LLM's is still legible
  const box = block(svg, x(attempt.created), y, width, 16, colour, text,
                    { "data-kind": "attempt", "data-status": attempt.status }, room);
  if (attempt.status === "cancelled") {
    el("line", { x1: 0, y1: 8, x2: width, y2: 8, stroke: "#4b5563", "stroke-width": 1 }, box);
  }
  if (attempt.firstWords != null) { // first words: a dark tick
    el("rect", { x: x(attempt.firstWords) - 1.5, y: y - 1, width: 3, height: 18, fill: "#111827",
                 "data-kind": "first-words" }, svg);
  }
}

function drawAxis(svg, from, end, x, height) {
  const step = niceStep(end - from);
  for (let t = Math.ceil(from / step) * step; t <= end; t += step) {
    el("line", { x1: x(t), y1: 16, x2: x(t), y2: height, stroke: "#e5e7eb" }, svg);
    el("text", { x: x(t) + 2, y: 12, "font-size": 10, fill: COLOURS.axis }, svg, `${(t / 1000).toFixed(step < 1000 ? 1 : 0)} s`);
  }
}

function niceStep(spanMs) {
  return [250, 500, 1000, 2000, 5000, 10000, 30000, 60000].find((s) => spanMs / s <= 14) ?? 120000;
}

function drawMarkers(svg, model, x, height, now, from) {
  const userEnd = model.userEnd();
  if (userEnd != null && userEnd >= from) {
    el("line", { x1: x(userEnd), y1: 16, x2: x(userEnd), y2: height, stroke: COLOURS.stop, "stroke-width": 1.5,
                 "stroke-dasharray": "4 3", "data-kind": "user-end" }, svg);
  }
  if (now != null) el("line", { x1: x(now), y1: 16, x2: x(now), y2: height, stroke: "#111827", "stroke-width": 1 }, svg);
}

/** One line under the lanes: when the answer's first words came, against the end of the user's words. */
function summary(model) {
  const line = document.createElement("p");
  line.className = "timeline-summary";
  line.style.cssText = "margin:0.3rem 0;font-size:0.9rem";
  const answer = model.answer();
  const userEnd = model.userEnd();
  if (answer == null || userEnd == null) {
    line.textContent = `${model.attempts.size} backend attempt(s) so far; no answer completed yet.`;
  } else {
    const lead = (userEnd - answer.firstWords) / 1000;
    const when = lead >= 0 ? `${lead.toFixed(1)} s before` : `${(-lead).toFixed(1)} s after`;
    line.textContent = `The answer${answer.text ? ` ("${answer.text.trim()}")` : ""}: its first words came ${when}`
      + ` you stopped talking (dashed red line); ${model.attempts.size} backend attempt(s).`;
  }
  line.dataset.testid = "timeline-summary";
  return line;
}

/** A legend, as a line of coloured words (HTML), for the page and the replay file. */
export function legend() {
  const line = document.createElement("p");
  line.className = "timeline-legend";
  line.style.cssText = "margin:0.2rem 0;font-size:0.8rem";
  const items = [["user", "your words"], ["open", "attempt running"], ["adopted", "answered (completed)"],
                 ["cancelled", "superseded"], ["failed", "failed"], ["oracle", "oracle reset"],
                 ["assistant", "assistant's words"]];
  for (const [key, text] of items) {
    const span = document.createElement("span");
    span.style.cssText = `margin-right:0.8rem;border-left:0.8rem solid ${COLOURS[key]};padding-left:0.3rem`;
    span.textContent = text;
    line.appendChild(span);
  }
  line.append("▮ first words · red dashes: you stopped");
  return line;
}
