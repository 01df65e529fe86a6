"""`kame bench load`: N concurrent real-time sessions against a running server; latency, CPU, RSS."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from client.loadgen import load_level_in_processes, load_level_timed, percentile_ms
from client.phone_client import CARRIERS

FRAME_MS = 80.0


def register(bench_sub: argparse._SubParsersAction) -> None:
    load = bench_sub.add_parser("load", help="concurrent real-time sessions against a running server")
    load.add_argument("--url", default="ws://127.0.0.1:8998/api/chat", type=server_url,
                      help="the server: its /api/chat websocket, or just http(s)://HOST:PORT (default "
                           "ws://127.0.0.1:8998/api/chat); the other transports' paths come from it")
    load.add_argument("--sessions", type=int, default=4, help="the most sessions to try (default 4)")
    load.add_argument("--seconds", type=float, default=10.0, help="per load level (default 10)")
    load.add_argument("--levels", default=None,
                      help="comma list of session counts (default: 1, 2, 4, ... up to --sessions)")
    load.add_argument("--token", default=None, help="auth token, if the server needs one")
    load.add_argument("--transport", default="moshi", type=_transports,
                      help="moshi: /api/chat; realtime: /v1/realtime; live, live-webrtc: /v1/live/sessions over "
                           "WebSocket or WebRTC (client delegation); twilio, telnyx, vonage: a call on the carrier's "
                           "media stream /<carrier>/media (a loopback server without [phone] tokens), marks "
                           "returned as a real-time playout plays them; sip: a SIP call (PCMU over RTP) to --sip; "
                           "a comma list, or both (moshi,realtime): each level on each, side by side")
    load.add_argument("--sip", default=None, metavar="HOST:PORT",
                      help="where `kame serve --sip` listens, for --transport sip (default: the URL's host, 5060)")
    load.add_argument("--input", default=None,
                      help="audio file each session speaks, looped (default: noise, which ASR leaves alone)")
    load.add_argument("--processes", type=int, default=1,
                      help="load generator processes to spread the sessions over (a session's Opus encoding holds "
                           "its process' GIL ~1 ms a frame: one process carries ~30 sessions; default 1)")
    load.add_argument("--warmup", type=float, default=1.0,
                      help="seconds one unmeasured session talks on each transport before the first level, so "
                           "that no level pays the server's first-use costs (default 1; 0: none)")
    load.add_argument("--server-pid", type=int, default=None,
                      help="the server's process id: its CPU with its children's (Opus processes) by psutil")
    load.add_argument("--json-out", default=None)
    load.set_defaults(func=run_load)


TRANSPORTS = ("moshi", "realtime", "live", "live-webrtc", *CARRIERS, "sip")


def server_url(value: str) -> str:
    """The server's /api/chat websocket URL from what a user gives: ws(s)://..., or http(s)://HOST[:PORT][/]
    (the page's address), whose path defaults to /api/chat."""
    parts = urlsplit(value)
    schemes = {"ws": "ws", "wss": "wss", "http": "ws", "https": "wss"}
    if parts.scheme not in schemes or not parts.netloc:
        raise argparse.ArgumentTypeError(f"not a server address: {value!r} (ws://HOST:PORT/api/chat, or "
                                         "http://HOST:PORT)")
    path = parts.path if parts.path not in ("", "/") else "/api/chat"
    return urlunsplit((schemes[parts.scheme], parts.netloc, path, parts.query, ""))


def _transports(value: str) -> list[str]:
    names = ["moshi", "realtime"] if value == "both" else value.split(",")
    if unknown := [name for name in names if name not in TRANSPORTS]:
        raise argparse.ArgumentTypeError(f"unknown transport {unknown[0]!r}: one of {', '.join(TRANSPORTS)} or both")
    return names


def http_base(url: str) -> str:
    """The server's HTTP address, from its websocket URL."""
    parts = urlsplit(url)
    return f"{'https' if parts.scheme == 'wss' else 'http'}://{parts.netloc}"


def scrape(url: str) -> dict[str, float]:
    """A few figures from the server's /metrics (the event loop's lag histogram as `lag_le_<bound>`); a
    server of several processes (front processes, Ray replicas) labels each one's samples: they are summed."""
    text = urllib.request.urlopen(f"{http_base(url)}/metrics", timeout=5).read().decode()
    wanted = {"process_cpu_seconds_total": "cpu_s", "process_resident_memory_bytes": "rss_bytes",
              "kame_engine_step_seconds_sum": "step_sum", "kame_engine_step_seconds_count": "step_count",
              "kame_frames_stepped_total": "frames_stepped", "kame_event_loop_lag_seconds_sum": "lag_sum",
              "kame_event_loop_lag_seconds_count": "lag_count"}
    figures: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^(\w+)(?:\{([^}]*)\})? ([0-9.e+-]+)$", line)
        if not match:
            continue
        name, value = match.group(1), float(match.group(3))
        labels = {k: v for k, v in re.findall(r'(\w+)="([^"]*)"', match.group(2) or "")
                  if k not in ("front", "replica")}  # one process's among several: summed
        histogram = re.match(r"^kame_(event_loop_lag|frame_latency)_seconds_bucket$", name)
        if name in wanted and not labels:
            key = wanted[name]
        elif histogram and set(labels) == {"le"}:
            key = f"{HISTOGRAMS[histogram.group(1)]}_le_{labels['le']}"
        elif name == "kame_frames_dropped_total" and set(labels) == {"direction"}:
            key = f"dropped_{labels['direction']}"
        else:
            continue
        figures[key] = figures.get(key, 0.0) + value
    return figures


HISTOGRAMS = {"event_loop_lag": "lag", "frame_latency": "latency"}


def bucket_bound_ms(before: dict[str, float], after: dict[str, float], name: str, q: float) -> float | None:
    """The bucket bound under which the share `q` of a histogram's observations over a level fell (ms)."""
    buckets = sorted((float(key.rpartition("_le_")[2]), after[key] - before.get(key, 0))
                     for key in after if key.startswith(f"{name}_le_"))
    count = buckets[-1][1] if buckets else 0
    bound = next((bound for bound, n in buckets if count and n >= q * count), float("inf"))
    return round(1000 * bound, 1) if bound != float("inf") else None


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and all its descendants (the server and its codec processes)."""
    import psutil

    total = 0.0
    server = psutil.Process(pid)
    for process in [server, *server.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = process.cpu_times()
            total += times.user + times.system
    return total


def loop_lag(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """The event loop's lag over a level: mean, and the bucket bound under which 99 % of it fell (ms)."""
    count = after.get("lag_count", 0) - before.get("lag_count", 0)
    if not count:
        return {"mean": None, "p99_under": None}
    return {"mean": round(1000 * (after.get("lag_sum", 0) - before.get("lag_sum", 0)) / count, 2),
            "p99_under": bucket_bound_ms(before, after, "lag", 0.99)}


def wait_for_free_slots(url: str, wanted: int, limit_s: float = 10.0) -> None:
    """The previous level's sessions release their slots asynchronously: wait for them."""
    health_url = f"{http_base(url)}/healthz"
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        health = json.loads(urllib.request.urlopen(health_url, timeout=5).read())
        if health.get("free_slots", 0) >= wanted:
            return
        time.sleep(0.1)


def measure(url: str, sessions: int, seconds: float, transport: str = "moshi",
            speech: np.ndarray | None = None, processes: int = 1, server_pid: int | None = None,
            sip: str | None = None) -> dict:
    wait_for_free_slots(url, sessions, limit_s=30)  # a loaded server releases the last level's slots late
    before, started = scrape(url), time.monotonic()
    tree_before = tree_cpu_s(server_pid) if server_pid else None
    target = sip_target(url, sip) if transport == "sip" else url
    if processes > 1:
        run, client_cpu = load_level_in_processes(target, sessions, seconds, processes, transport, speech)
    else:
        run, client_cpu = load_level_timed(target, sessions, seconds, transport=transport, speech=speech)
    after, wall = scrape(url), time.monotonic() - started
    tree_cores = None if tree_before is None else round((tree_cpu_s(server_pid) - tree_before) / wall, 3)
    steps = after.get("step_count", 0) - before.get("step_count", 0)
    step_ms = 1000 * (after.get("step_sum", 0) - before.get("step_sum", 0)) / steps if steps else None
    p50, p99 = percentile_ms(run.round_trips, 50), percentile_ms(run.round_trips, 99)
    late = sum(1 for t in run.round_trips if t * 1000 > FRAME_MS)
    row = {
        "transport": transport, "sessions": sessions, "refused": run.refused, "frames_sent": run.frames_sent,
        "frames_dropped": run.frames_sent - run.frames_received, "frames_late": late,
        "frames_untimed": run.frames_unmatched,
        "round_trip_ms": {"p50": p50, "p95": percentile_ms(run.round_trips, 95), "p99": p99},
        "engine_step_ms": None if step_ms is None else round(step_ms, 2),
        "batch_mean": round((after.get("frames_stepped", 0) - before.get("frames_stepped", 0)) / steps, 2)
        if steps else None,
        "real_time_factor": None if step_ms is None else round(step_ms / FRAME_MS, 3),
        "overhead_ms": {"p50": None if p50 is None or step_ms is None else round(p50 - step_ms, 2),
                        "p99": None if p99 is None or step_ms is None else round(p99 - step_ms, 2)},
        "server_cpu_cores": round((after.get("cpu_s", 0) - before.get("cpu_s", 0)) / wall, 2),
        "server_tree_cpu_cores": tree_cores,  # with its children (the Opus processes), by psutil
        "server_tree_cpu_per_session": None if tree_cores is None else round(tree_cores / sessions, 3),
        "server_frame_latency_ms": {"p50_under": bucket_bound_ms(before, after, "latency", 0.5),
                                    "p99_under": bucket_bound_ms(before, after, "latency", 0.99)},
        "server_frames_dropped": {d: after.get(f"dropped_{d}", 0) - before.get(f"dropped_{d}", 0)
                                  for d in ("in", "out")},
        "client_cpu_cores": round(client_cpu / wall, 2),  # the load generator's own, beside the server's
        "loop_lag_ms": loop_lag(before, after),
        "server_rss_mb": round(after.get("rss_bytes", 0) / 2**20),
    }
    if transport in CARRIERS:  # the audio the carrier held unplayed as each piece came (the pacer keeps it small)
        row["lead_ms"] = {"p99": percentile_ms(run.leads, 99),
                          "max": round(1000 * max(run.leads), 2) if run.leads else None}
    if transport == "sip":  # the server's RTP packets off their 20 ms beat, as they arrived at the phones
        jitter = np.array(run.rtp_jitter_ms)
        row["rtp_send_jitter_ms"] = {"p99": round(float(np.percentile(jitter, 99)), 2) if len(jitter) else None,
                                     "max": round(float(jitter.max()), 2) if len(jitter) else None}
    return row


def sip_target(url: str, sip: str | None) -> str:
    """sip://HOST:PORT: --sip, else the server URL's host on 5060."""
    return f"sip://{sip}" if sip else f"sip://{urlsplit(url).hostname or '127.0.0.1'}:5060"


def run_load(args: argparse.Namespace) -> int:
    url = args.url + (("&" if "?" in args.url else "?") + f"token={args.token}" if args.token else "")
    levels = [int(x) for x in args.levels.split(",")] if args.levels else _doubling(args.sessions)
    transports = args.transport
    speech = None
    if args.input:
        from kame.audio import read_audio
        speech = read_audio(args.input)
    if args.warmup > 0:  # a fresh server's first-use costs (its first session, first frames) out of the levels
        for transport in transports:
            wait_for_free_slots(url, 1, limit_s=30)
            print(f"warm-up: one {transport} session for {args.warmup:g} s, unmeasured", file=sys.stderr,
                  flush=True)
            target = sip_target(url, args.sip) if transport == "sip" else url
            load_level_timed(target, 1, args.warmup, transport=transport, speech=speech)
    rows = []
    for sessions in levels:
        for transport in transports:  # side by side: each level on each transport, one after the other
            row = measure(url, sessions, args.seconds, transport, speech, args.processes, args.server_pid, args.sip)
            rows.append(row)
            print(json.dumps(row), flush=True)
    fitting = [r["sessions"] for r in rows if r["round_trip_ms"]["p99"] is not None
               and r["round_trip_ms"]["p99"] <= FRAME_MS and not r["refused"] and r["transport"] == transports[0]]
    result = {"url": args.url.split("?")[0], "seconds_per_level": args.seconds, "levels": rows,
              "max_sessions_p99_under_80ms": max(fitting) if fitting else 0}
    print(markdown(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _doubling(limit: int) -> list[int]:
    levels, n = [], 1
    while n < limit:
        levels.append(n)
        n *= 2
    return [*levels, limit]


def markdown(result: dict) -> str:
    phone = any("lead_ms" in r or "rtp_send_jitter_ms" in r for r in result["levels"])  # carriers' lead, SIP jitter
    lines = ["| transport | sessions | round trip p50 / p95 / p99 ms | engine step ms | overhead p50 / p99 ms | "
             "mean batch | not back | untimed | late (>80 ms) | server CPU cores | server RSS MB | "
             "with children cores per session | server frame latency p50 / p99 <= ms |"
             + (" carrier lead p99 / max ms (sip: RTP send jitter p99 / max ms) |" if phone else ""),
             "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|" + ("---|" if phone else "")]
    for r in result["levels"]:
        rt, oh, lat = r["round_trip_ms"], r["overhead_ms"], r.get("server_frame_latency_ms", {})
        lead = r.get("lead_ms") or r.get("rtp_send_jitter_ms") or {}
        lines.append(f"| {r.get('transport', 'moshi')} | {r['sessions']} | {rt['p50']} / {rt['p95']} / {rt['p99']} | "
                     f"{r['engine_step_ms']} | "
                     f"{oh['p50']} / {oh['p99']} | {r['batch_mean']} | {r['frames_dropped']} | "
                     f"{r.get('frames_untimed', 0)} | {r['frames_late']} | "
                     f"{r['server_cpu_cores']} | {r['server_rss_mb']} | {r.get('server_tree_cpu_per_session')} | "
                     f"{lat.get('p50_under')} / {lat.get('p99_under')} |"
                     + (f" {lead.get('p99', '-')} / {lead.get('max', '-')} |" if phone else ""))
    lines.append(f"\nlargest N with p99 round trip <= 80 ms: {result['max_sessions_p99_under_80ms']}")
    return "\n".join(lines)
