"""The registry of `kame serve --ray` against what Ray already has, on one local Ray instance started
as `kame serve --ray` starts it (no dashboard), with one Serve replica that holds KAME's own metrics
(server.metrics.Metrics, prometheus_client) and reports them like a KAME replica does:

- how soon a changed figure shows in /metrics' source (the registry, fed every REPORT_S) and in
  Ray's per-node export (the same figure as a `ray.serve.metrics.Gauge`, through Ray's metrics agent),
  and which of KAME's prometheus_client families reach Ray's export at all;
- whether Ray wrote its Prometheus service-discovery file, and what it lists (with --dashboard: Ray
  starts the dashboard, whose reporter module writes it, as on KubeRay's head; `kame serve --ray`
  starts none);
- how long `serve.status()`, the controller's `get_serve_instance_details` (what readiness reads),
  the registry's snapshot and metrics text, and a scrape of Ray's export take, interleaved.

    python scripts/bench_ray_status.py --changes 4 --rounds 40 [--dashboard]

Prints the figures and a markdown table; --json-out keeps them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from ray import serve  # noqa: E402
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE  # noqa: E402

from server.ray_serve import NAMESPACE, REGISTRY, REPORT_S, Registry  # noqa: E402

GAUGE = "kame_active_sessions"


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class Probe:
    """A replica with KAME's metrics that reports them to the registry every REPORT_S, as
    server/ray_serve.py's `_report` does, and sets one figure both there and in Ray's own gauge."""

    def __init__(self) -> None:
        from ray.serve import metrics as serve_metrics

        from server.metrics import Metrics

        self.metrics = Metrics()
        self.ray_gauge = serve_metrics.Gauge(GAUGE, description="sessions connected now")
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.registry = ray.get_actor(REGISTRY, namespace=NAMESPACE)
        threading.Thread(target=self._report, daemon=True).start()

    def _report(self) -> None:
        while True:
            ray.get(self.registry.report.remote(self.replica, {"sessions": 0},
                                                list(self.metrics.registry.collect())))
            time.sleep(REPORT_S)

    def set(self, value: float) -> str:
        self.metrics.active_sessions.set(value)
        self.ray_gauge.set(value)
        return self.replica


def samples(text: str, name: str) -> list:
    return [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def scrape(url: str) -> str:
    return urllib.request.urlopen(url, timeout=10).read().decode()


def timed(call, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        started = time.perf_counter()
        call()
        out.append((time.perf_counter() - started) * 1000)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--changes", type=int, default=4, help="figure changes whose delay is measured")
    parser.add_argument("--rounds", type=int, default=40, help="calls of each kind timed")
    parser.add_argument("--dashboard", action="store_true", help="start Ray's dashboard (it writes the "
                        "service-discovery file); by default none, as `kame serve --ray` starts Ray")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()

    started = time.time()
    # as server/ray_serve.start does (but for --dashboard)
    ray.init(num_cpus=2, include_dashboard=args.dashboard, log_to_driver=False)
    node = ray._private.worker.global_worker.node
    export = f"http://{node.node_ip_address}:{node.metrics_export_port}/metrics"
    registry = ray.remote(num_cpus=0)(Registry).options(name=REGISTRY, namespace=NAMESPACE).remote()
    with socket.socket() as free:  # Serve's proxy on a free port (the probe needs no HTTP)
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)  # serve.start made it
    serve.run(Probe.bind(), name="probe", route_prefix=None)
    handle = serve.get_app_handle("probe")
    replica = handle.set.remote(0).result()
    figures: dict = {"ray": ray.__version__, "export": export, "dashboard": args.dashboard,
                     "metrics_report_interval_ms": ray._raylet.Config.metrics_report_interval_ms()}

    # how soon a change shows, in the registry (what /metrics answers) and in Ray's export
    delays: dict[str, list[float]] = {"registry": [], "ray_export": []}
    ray_line = None
    for change in range(args.changes):
        value = float(10 + change)
        at = time.monotonic()
        handle.set.remote(value).result()
        seen: dict[str, float] = {}
        while len(seen) < 2 and time.monotonic() - at < 40:
            now = time.monotonic() - at
            if "registry" not in seen:
                text = ray.get(registry.metrics_text.remote([replica])).decode()
                if any(s.value == value for s in samples(text, GAUGE)):
                    seen["registry"] = now
            if "ray_export" not in seen:
                found = [s for s in samples(scrape(export), f"ray_{GAUGE}") if s.value == value]
                if found:
                    seen["ray_export"], ray_line = now, found[0]
            time.sleep(0.05)
        for key in delays:
            delays[key].append(seen.get(key, float("inf")))
        print(f"change {change}: registry {seen.get('registry')}, Ray's export {seen.get('ray_export')} s",
              flush=True)
    figures["delay_s"] = delays
    figures["ray_sample"] = None if ray_line is None else {"name": ray_line.name, "labels": ray_line.labels}

    # which of KAME's own (prometheus_client) families reach Ray's export: those named kame_* (but the
    # one figure also set through ray.serve.metrics), and whether Ray's process_* families are the
    # replica's (its process start time) or another process's of the same names (Ray's metrics agent)
    ours_text = ray.get(registry.metrics_text.remote([replica])).decode()
    theirs_text = scrape(export)
    from server.metrics import Metrics

    ours = {f.name for f in Metrics().registry.collect()}  # the families, as the replica's registry names them
    theirs = {f.name for f in text_string_to_metric_families(theirs_text)}
    figures["kame_families"] = len(ours)
    figures["kame_families_in_ray_export"] = sorted(
        n for n in ours if n.startswith("kame_") and n != GAUGE and (n in theirs or f"ray_{n}" in theirs))
    started_at = {s.value for s in samples(ours_text, "process_start_time_seconds")}
    figures["process_families_of_the_same_name"] = sorted(n for n in ours if n.startswith("process_") and n in theirs)
    figures["those_are_the_replicas"] = bool(started_at & {s.value for s in samples(theirs_text,
                                                                                      "process_start_time_seconds")})
    figures["ray_families"] = len(theirs)
    figures["ray_serve_families"] = sorted(n for n in theirs if n.startswith("ray_serve"))

    # Ray's Prometheus service discovery: written only by the dashboard's reporter module (every 5 s),
    # into Ray's temp dir; what it lists is each live node's export address (and the autoscaler's and
    # dashboard's, where they export)
    discovery = Path(node.get_temp_dir_path()) / "prom_metrics_service_discovery.json"
    waited = time.monotonic()
    while args.dashboard and time.monotonic() - waited < 30 and not (
            discovery.exists() and discovery.stat().st_mtime >= started):
        time.sleep(0.5)
    written = discovery.exists() and discovery.stat().st_mtime >= started
    figures["service_discovery_written"] = written
    figures["service_discovery"] = json.loads(discovery.read_text()) if written else None
    figures["node_exports"] = [f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}" for n in ray.nodes() if n["alive"]]

    calls = {
        "serve.status()": lambda: serve.status(),
        "controller.get_serve_instance_details": lambda: ray.get(controller.get_serve_instance_details.remote()),
        "registry.snapshot": lambda: ray.get(registry.snapshot.remote([replica])),
        "registry.metrics_text": lambda: ray.get(registry.metrics_text.remote([replica])),
        "scrape of Ray's export": lambda: scrape(export),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.rounds):  # interleaved: the machine's load falls on all alike
        for name, call in calls.items():
            times[name] += timed(call, 1)
    figures["ms"] = {name: {"p50": statistics.median(v), "p90": sorted(v)[int(0.9 * len(v))]}
                     for name, v in times.items()}
    figures["bytes"] = {"registry.metrics_text": len(ray.get(registry.metrics_text.remote([replica]))),
                        "scrape of Ray's export": len(scrape(export).encode())}
    serve.shutdown()
    ray.shutdown()

    print(json.dumps(figures, indent=1, default=str))
    base = figures["ms"]["controller.get_serve_instance_details"]["p50"]
    print("\n| call | p50 ms | p90 ms | p50 / details |\n|---|---:|---:|---:|")
    for name, t in figures["ms"].items():
        print(f"| {name} | {t['p50']:.2f} | {t['p90']:.2f} | {t['p50'] / base:.2f} |")
    for key, values in delays.items():
        print(f"{key}: a change shows in {min(values):.2f}-{max(values):.2f} s "
              f"(median {statistics.median(values):.2f})")
    if args.json_out:
        args.json_out.write_text(json.dumps(figures, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
