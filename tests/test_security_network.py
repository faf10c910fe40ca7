"""Network exposure and control-route authorization: a local Ray stays on loopback whatever is
imported first; an engine's every route but /health needs its key; weights load only from allowed
folders and shared memory under the run's prefix; a non-loopback engine without a key is warned about."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler

import httpx
import pytest
import torch

from helpers import fresh_python, run
from loongsage.cluster.network import is_loopback
from loongsage.rollout.client import EngineClient, EngineError
from loongsage.rollout.launcher import launch_engine
from loongsage.transfer.tensor_handles import serialize_flattened_bucket

KEY = "k-" + os.urandom(8).hex()


@pytest.fixture(scope="module")
def keyed_engine(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("weights-root")
    args = ["--max-running", "8", "--context-length", "64", "--weight-roots", str(root), "--shm-prefix", "loongsage-run1-"]
    with launch_engine(tiny_model, extra_args=args, api_key=KEY) as ep:
        yield ep, root


def test_every_route_but_health_needs_the_key(keyed_engine):
    ep, _ = keyed_engine
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(ep.url + "/health", timeout=10).status_code == 200
    spec = httpx.get(ep.url + "/openapi.json", headers=auth, timeout=10).json()
    routes = [(m.upper(), path) for path, ops in spec["paths"].items() for m in ops if not path.startswith("/health")]
    assert len(routes) >= 20 and ("POST", "/update_weights_from_disk") in routes
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, ep.url + path, headers=headers, json={}, timeout=10)
            assert r.status_code == 401, (method, path, headers, r.status_code)
    ok = httpx.post(ep.url + "/generate", headers=auth, timeout=30,
                    json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2


def test_the_client_sends_the_key(keyed_engine):
    ep, _ = keyed_engine

    async def go(key):
        c = EngineClient(ep.url, key)
        try:
            return await c.model_info()
        finally:
            await c.aclose()
    assert run(go(KEY))["weight_version"]
    with pytest.raises(EngineError, match="401"):
        run(go(None))


def test_weights_load_only_from_allowed_folders(keyed_engine, tiny_model_b, tmp_path):
    ep, root = keyed_engine
    link = root / "elsewhere"
    link.symlink_to(tiny_model_b)  # inside the root by name, outside by its real path

    async def go(path):
        c = EngineClient(ep.url, KEY)
        try:
            return await c.update_weights_from_disk(str(path), weight_version=5)
        finally:
            await c.aclose()
    for outside in ("/etc", tiny_model_b, link, root / ".." / "x"):
        with pytest.raises(EngineError, match="403.*outside the folders"):
            run(go(outside))
    inside = root / "copy"
    shutil.copytree(tiny_model_b, inside)
    assert run(go(inside))["success"]


def _torch_named_handle(t: torch.Tensor) -> str:
    """A handle as torch makes it by itself: a /dev/shm file named /torch_<pid>_..."""
    import base64
    import io
    import pickle

    import torch.multiprocessing as tmp

    tmp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump({"flattened_tensor": t.share_memory_(), "metadata": []})
    return base64.b64encode(buf.getvalue()).decode()


def test_shared_memory_handles_only_under_the_run_prefix(keyed_engine):
    ep, _ = keyed_engine

    async def go(handle):
        c = EngineClient(ep.url, KEY)
        try:
            return await c.update_weights_from_tensor(handle, 6, "flattened_bucket")
        finally:
            await c.aclose()
    x = torch.zeros(4)
    for handle in (_torch_named_handle(x.clone()), serialize_flattened_bucket({"w": x}, prefix="loongsage-run2-"),
                   serialize_flattened_bucket({"w": x}, prefix="loongsage-")):
        with pytest.raises(EngineError, match="outside this receiver's prefix"):
            run(go(handle))
    with pytest.raises(EngineError, match="unknown|not a parameter|no parameter"):  # the name passes: the content is judged
        run(go(serialize_flattened_bucket({"not.a.weight": x}, prefix="loongsage-run1-")))


def test_engine_warns_when_it_listens_beyond_loopback_without_a_key():
    cli = [sys.executable, "-m", "loongsage.cli", "engine", "--model", "/nonexistent-model", "--port", "1"]
    env = {k: v for k, v in os.environ.items() if k != "LOONGSAGE_ENGINE_API_KEY"}
    warned = subprocess.run(cli + ["--host", "0.0.0.0"], capture_output=True, text=True, timeout=120, env=env)
    assert "warning: the engine listens on 0.0.0.0 without an API key" in warned.stderr
    quiet = subprocess.run(cli + ["--host", "0.0.0.0", "--api-key", "x"], capture_output=True, text=True, timeout=120,
                           env=env)
    local = subprocess.run(cli, capture_output=True, text=True, timeout=120, env=env)
    assert "warning: the engine listens" not in quiet.stderr + local.stderr
    assert warned.returncode and quiet.returncode  # the model does not exist: nothing was ever served


@pytest.mark.slow
def test_local_ray_listens_on_loopback_only_even_when_ray_was_imported_first():
    seen = fresh_python("""
        import json, os
        os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        import ray  # before LoongSage: Ray reads its cluster switch now
        import psutil
        from loongsage.cluster.ray_setup import init_ray
        from loongsage.cluster.config import RayConfig
        init_ray(RayConfig(num_cpus=1))
        @ray.remote(num_cpus=0)
        class A:
            def pid(self):
                return os.getpid()
        a = A.remote(); ray.get(a.pid.remote())
        me = psutil.Process(); seen = []
        for p in [me, *me.children(recursive=True)]:
            seen += [c.laddr.ip for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        ray.shutdown()
        print(json.dumps(seen))
    """, without_env=("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",))
    assert len(seen) >= 5 and all(is_loopback(ip) for ip in seen), seen
