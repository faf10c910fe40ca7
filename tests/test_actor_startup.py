"""What a run's actors pay before they work: every second here is paid again by each actor (three
or four processes on two cores at a run's start), so the lean paths are pinned by a test."""
from __future__ import annotations

import pytest

from helpers import fresh_python


@pytest.mark.slow
def test_a_local_rays_actors_start_lean_with_the_workers_environment():
    """A local Ray passes its workers' variables through the environment its processes start with,
    not a runtime_env (that routes every actor through Ray's setup_worker and env agent, ~1.3 s
    each), the driver's own environment is left as it was, and an engine actor (it only launches
    a server process) loads no torch."""
    facts = fresh_python("""
        import json, os, sys
        import ray
        from loongsage.cluster.config import RayConfig
        from loongsage.cluster.ray_setup import WORKER_ENV, init_ray
        init_ray(RayConfig(num_cpus=1))
        @ray.remote(num_cpus=0)
        class A:
            def facts(self):
                import loongsage.rollout.engine_group  # the engine actor's module, what its worker imports
                return {"env": {k: os.environ.get(k) for k in WORKER_ENV},
                        "runtime_env": dict(ray.get_runtime_context().runtime_env),
                        "torch": "torch" in sys.modules}
        facts = ray.get(A.remote().facts.remote())
        facts["driver_env"] = {k: os.environ.get(k) for k in WORKER_ENV}
        facts["ray_processes"] = sorted(ray._private.worker._global_node.all_processes)
        ray.shutdown()
        print(json.dumps(facts))
    """, without_env=("TOKENIZERS_PARALLELISM",))
    assert facts["env"] == {"TOKENIZERS_PARALLELISM": "false"}, facts
    assert facts["driver_env"] == {"TOKENIZERS_PARALLELISM": None}, facts
    assert not facts["runtime_env"].get("env_vars"), facts
    assert facts["torch"] is False, facts
    # the head runs what a run uses (GCS, raylet and its agents), not the autoscaler monitor, the
    # log monitor (log_to_driver is off) or the API server: each another process importing Ray
    assert {"gcs_server", "raylet"} <= set(facts["ray_processes"]), facts
    assert not {"monitor", "log_monitor", "dashboard"} & set(facts["ray_processes"]), facts


def test_the_lean_head_keeps_the_log_monitor_for_logs_to_the_driver_and_restores_ray():
    """With `log_to_driver` the log monitor stays (it streams worker logs to the driver); outside
    the call Ray's node parameters and API-server start are its own again."""
    from ray._private import node as ray_node
    from ray._private.parameter import RayParams

    from loongsage.cluster.ray_setup import _lean_local_head

    before = ray_node.Node.start_api_server
    for log_to_driver in (True, False):
        with _lean_local_head(log_to_driver):
            params = RayParams()
            assert (params.no_monitor, params.include_log_monitor) == (True, log_to_driver)
    params = RayParams()
    assert (params.no_monitor, params.include_log_monitor) == (False, None)
    assert ray_node.Node.start_api_server is before


def test_the_engine_command_starts_without_the_run_config():
    """`loongsage engine` (every engine process) imports the engine's own config, not the run's
    (`loongsage.config` pulls in every component's schema: ~0.4 s per engine)."""
    loaded = fresh_python("""
        import json, sys
        import loongsage.engine.launch as launch
        from loongsage.cli import main
        launch.serve = lambda *a, **k: print(json.dumps({"run config loaded": "loongsage.config" in sys.modules}))
        sys.exit(main(["engine", "--model", "/nonexistent", "--port", "1"]))
    """, timeout=120)
    assert loaded == {"run config loaded": False}
