"""deploy/: the Serve config and the KubeRay manifest build the application they name (no cluster
here: what can be checked without one is that the import path, args and settings make the app)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray.serve", reason="needs the ray extra: pip install -e '.[ray]'")

from server import ray_serve

ROOT = Path(__file__).resolve().parents[1]


def built(application: dict):
    module, name = application["import_path"].split(":")
    assert module == "server.ray_serve" and getattr(ray_serve, name) is ray_serve.app
    args = dict(application["args"]) | {"config": str(ROOT / "configs" / "default.toml")}
    return ray_serve.app(args)._bound_deployment


def test_the_serve_config_builds_two_fixed_replicas_with_their_slots_and_headroom():
    config = yaml.safe_load((ROOT / "deploy" / "ray" / "serve.yaml").read_text())
    assert "request_timeout_s" not in config["http_options"]  # it would end websocket sessions
    (application,) = config["applications"]
    assert application["route_prefix"] == "/"
    deployment = built(application)
    assert deployment.num_replicas == 2
    assert deployment.max_ongoing_requests == 4 + ray_serve.HEADROOM  # a CPU's 4 slots per replica


def test_the_kuberay_manifest_autoscales_gpu_workers_on_the_same_application():
    manifest = yaml.safe_load((ROOT / "deploy" / "kuberay" / "rayservice.yaml").read_text())
    assert manifest["kind"] == "RayService"
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    (application,) = serve_config["applications"]
    deployment = built(application)
    scaling = deployment._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas) == (1, 4)
    assert (scaling.upscale_delay_s, scaling.downscale_delay_s) == (30.0, 600.0)  # Serve's defaults
    # and our router places the sessions
    router = deployment._deployment_config.request_router_config.request_router_class
    assert router == "server.ray_router.FewestSessionsRouter"

    (workers,) = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    container = workers["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    # a downscaled worker waits for its sessions: at least the longest session
    assert workers["template"]["spec"]["terminationGracePeriodSeconds"] >= 3600


def test_the_autoscaling_delays_come_from_the_application_args():
    application = {"import_path": "server.ray_serve:app",
                   "args": {"autoscale": [1, 3], "upscale_delay_s": 5, "downscale_delay_s": 120}}
    scaling = built(application)._deployment_config.autoscaling_config
    assert (scaling.max_replicas, scaling.upscale_delay_s, scaling.downscale_delay_s) == (3, 5.0, 120.0)
