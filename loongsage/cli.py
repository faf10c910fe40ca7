"""The `loongsage` command line. Subcommands import their machinery lazily, so `--help` is instant."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _engine(ns: argparse.Namespace) -> None:
    import os

    from loongsage.engine.config import EngineConfig
    from loongsage.engine.launch import serve
    from loongsage.engine.security import API_KEY_ENV, EngineSecurity

    cfg = _validated_args(ns, EngineConfig, "engine")
    security = EngineSecurity(ns.api_key or os.environ.get(API_KEY_ENV) or None, tuple(ns.weight_roots),
                              ns.shm_prefix)
    serve(ns.model, ns.host, ns.port, cfg, log_level=ns.log_level, security=security)


def _serve(ns: argparse.Namespace) -> None:
    from loongsage.agentflow.serve import serve

    serve(ns.model, ns.host, ns.port, ns.record_dir, ns.engine_url, ns.threads, ns.context_length,
          ns.max_new_tokens, ns.served_model_name, ns.engine_api_key)


def _tool_python(ns: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from loongsage.agentflow.sandbox import SandboxLimits, run_python

    code = Path(ns.file).read_text()
    limits = SandboxLimits(timeout_s=ns.timeout_s, memory_mb=ns.memory_mb, max_processes=ns.max_processes)
    res = asyncio.run(run_python(code, limits))
    print(res.as_text(), end="" if res.as_text().endswith("\n") else "\n")
    return 0 if res.ok else 1


def _demo(ns: argparse.Namespace) -> None:
    from loongsage.config import load_config
    from loongsage.demo import run_demo

    config, overrides = _split_config(ns, "recipes/engine_demo.yaml")
    run_demo(load_config(config, overrides))


def _train(ns: argparse.Namespace) -> None:
    import asyncio

    from loongsage.config import ConfigError, load_config
    from loongsage.controller.checkpoint import stopped_message
    from loongsage.controller.train import train
    from loongsage.plot import plot_run
    from loongsage.tasks.dataset import DataError

    if ns.resume:  # the run's own resolved config; overrides (e.g. more train.steps) still apply
        if ns.config is not None and "=" not in ns.config:
            raise SystemExit("loongsage train --resume RUN_DIR: give no CONFIG (the run's config.yaml is used)")
        config, overrides = str(Path(ns.resume) / "config.yaml"), [*_split_config(ns, "")[1], f"run_dir={ns.resume}"]
        if not Path(config).is_file():
            raise SystemExit(f"--resume {ns.resume}: no config.yaml there (not a run directory)")
    else:
        config, overrides = _split_config(ns, "recipes/arith_grpo.yaml")
    cfg = load_config(config, overrides)
    run_dir = cfg.resolve_run_dir()
    try:
        summary = asyncio.run(train(cfg, resume=bool(ns.resume)))
    except (ConfigError, DataError, FileNotFoundError):  # refused before it ran
        raise
    except (Exception, KeyboardInterrupt) as exc:
        print(stopped_message(run_dir, exc), file=sys.stderr)
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise SystemExit(1) from exc
    png = plot_run(summary["run_dir"])
    print(f"held-out accuracy {summary['eval_before']:.3f} -> {summary['eval_after']:.3f}; curves: {png}")


def _sft(ns: argparse.Namespace) -> None:
    import asyncio

    from loongsage.config import load_config
    from loongsage.controller.sft import sft_command

    config, overrides = _split_config(ns, "recipes/arith_grpo.yaml")
    asyncio.run(sft_command(load_config(config, overrides)))


def _bootstrap(ns: argparse.Namespace) -> None:
    import asyncio

    from loongsage.config import load_config
    from loongsage.controller.bootstrap import ensure_base_policy

    config, overrides = _split_config(ns, "recipes/arith_grpo.yaml")
    cfg = load_config(config, overrides + ["bootstrap.enabled=true"])
    print(asyncio.run(ensure_base_policy(cfg)))


def _validate(ns: argparse.Namespace) -> int:
    from loongsage.validate import validate

    config, overrides = _split_config(ns, "recipes/arith_grpo.yaml")
    return validate(config, overrides, ns.quick, ns.run_dir)


def _plot(ns: argparse.Namespace) -> None:
    from loongsage.plot import plot_run

    print(plot_run(ns.run_dir, ns.out))


def _timeline(ns: argparse.Namespace) -> None:
    from loongsage.timeline import render_timeline

    print(render_timeline(ns.run_dir, ns.out, ns.last_s or None))


def _transfer_plan(ns: argparse.Namespace) -> None:
    from loongsage.config import ConfigError, load_config
    from loongsage.transfer.config import endpoints
    from loongsage.transfer.topology import plan

    cfg = load_config(*_split_config(ns, "recipes/arith_grpo.yaml"))
    try:
        sender, receivers = endpoints(cfg.transfer, cfg.trainer.device, cfg.engine.device, cfg.rollout.num_engines)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    print(plan(sender, receivers).format())


def _split_config(ns: argparse.Namespace, default: str) -> tuple[str, list[str]]:
    """`CONFIG key=value ...` where CONFIG may be left out (then the first item is an override)."""
    if ns.config is not None and "=" in ns.config:
        return default, [ns.config, *ns.overrides]
    return ns.config or default, list(ns.overrides)


def _make_model(ns: argparse.Namespace) -> None:
    from loongsage.config import apply_override, parse_override
    from loongsage.models.config import TinyModelSpec
    from loongsage.models.factory import build_tiny_model

    data: dict = {}
    for item in ns.overrides:
        apply_override(data, *parse_override(item))
    spec = _validated(TinyModelSpec, data, "model")
    path = build_tiny_model(ns.out, spec)
    print(f"wrote {spec.arch} model ({spec.hidden_size}x{spec.num_layers}) to {path}")


def _data(ns: argparse.Namespace) -> None:
    from loongsage.config import apply_override, parse_override
    from loongsage.tasks.config import TaskConfig
    from loongsage.tasks.prepare import prepare_data

    data: dict = {"name": ns.task}
    for item in ns.overrides:
        apply_override(data, *parse_override(item))
    cfg = _validated(TaskConfig, data, "task")
    train, evals = prepare_data(cfg)
    print(f"{cfg.name}: {len(train)} train rows, {len(evals)} eval rows under {cfg.data_dir}")


def _validated_args(ns: argparse.Namespace, schema, prefix: str):
    from pydantic import ValidationError

    from loongsage.cliargs import model_from_args

    try:
        return model_from_args(ns, schema)
    except ValidationError as exc:
        from loongsage.config import ConfigError, format_error  # only here: the engine starts without it (~0.4 s)

        raise ConfigError(format_error(exc, schema, prefix)) from None


def _validated(schema, data: dict, prefix: str):
    from pydantic import ValidationError

    from loongsage.config import ConfigError, format_error

    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_error(exc, schema, prefix)) from None


def build_parser() -> argparse.ArgumentParser:
    from loongsage.cliargs import add_model_args
    from loongsage.engine.config import EngineConfig

    p = argparse.ArgumentParser(prog="loongsage", description="Agent-native, fully asynchronous RL for LLMs.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    e = sub.add_parser("engine", help="serve an HF causal LM over SGLang's HTTP protocol (embedded engine)",
                       description="Serve an HF causal-LM folder over the SGLang HTTP protocol "
                                   "(/generate, weight updates, pause/continue, memory release).")
    e.add_argument("--model", required=True, help="HF model folder")
    e.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    e.add_argument("--port", type=int, default=30000)
    add_model_args(e, EngineConfig)  # every `engine` config key, as a flag
    e.add_argument("--log-level", default="warning")
    e.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health "
                   "(SGLang's semantics; default: $LOONGSAGE_ENGINE_API_KEY, else none)")
    e.add_argument("--weight-roots", nargs="*", default=[], metavar="DIR",
                   help="folders /update_weights_from_disk may read below (besides --model)")
    e.add_argument("--shm-prefix", default="loongsage-", help="/dev/shm names that weight handles may map")
    e.set_defaults(fn=_engine)

    sv = sub.add_parser("serve", help="a local model behind the OpenAI chat API (tool calls), every call recorded",
                        description="Start an engine and the AgentFlow gateway: /v1/chat/completions (tools, streaming) "
                                    "and /v1/models. The API key names the session; with --record-dir every model "
                                    "call is one JSON line (exact prompt/output token ids, logprobs, weight version).")
    sv.add_argument("--model", required=True, help="HF model folder")
    sv.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--record-dir", default=None, help="folder for calls.jsonl (default: no recording)")
    sv.add_argument("--engine-url", default=None, help="use a running engine (embedded or SGLang) instead of starting one")
    sv.add_argument("--engine-api-key", default=None, help="the --engine-url engine's API key, if it has one")
    sv.add_argument("--threads", type=int, default=1, help="engine torch threads")
    sv.add_argument("--context-length", type=int, default=None)
    sv.add_argument("--max-new-tokens", type=int, default=512, help="cap per call when the client sets none")
    sv.add_argument("--served-model-name", default=None, help="model id in /v1/models (default: folder name)")
    sv.set_defaults(fn=_serve)

    d = sub.add_parser("demo", help="run the engine demo recipe (tiny model, task data, engine, verifier)",
                       description="Run the embedded-engine demo from a recipe YAML plus key=value overrides.")
    d.add_argument("config", nargs="?", default=None, help="recipe YAML (default recipes/engine_demo.yaml)")
    d.add_argument("overrides", nargs="*", help="dotted overrides, e.g. demo.num_prompts=16")
    d.set_defaults(fn=_demo)

    for name, fn, text in [
        ("train", _train, "RL training run (controller + Ray trainer/engine actors); writes a run directory"),
        ("sft", _sft, "supervised fine-tuning on the config's task with the same trainer backend"),
        ("bootstrap", _bootstrap, "build (or reuse) the recipe's cached base policy: tiny model SFT'd to partial competence"),
    ]:
        c = sub.add_parser(name, help=text, description=text + ". CONFIG is a recipe YAML; key=value overrides follow.")
        c.add_argument("config", nargs="?", default=None, help="recipe YAML (default recipes/arith_grpo.yaml)")
        c.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=50 trainer.lr=1e-4")
        if name == "train":
            c.add_argument("--resume", metavar="RUN_DIR", default=None,
                           help="continue RUN_DIR from its last complete checkpoint (its config.yaml; overrides apply)")
        c.set_defaults(fn=fn)

    v = sub.add_parser("validate", help="run a recipe and check its expect: bounds (table, report, exit 1 on a miss)",
                       description="Run a recipe and check every bound in its expect: section (or quick.expect with "
                                   "--quick); print the table, write RUN_DIR/validation.json and validation.md with the "
                                   "plots, and exit 1 if any bound is missed or the run stopped.")
    v.add_argument("config", nargs="?", default=None, help="recipe YAML (default recipes/arith_grpo.yaml)")
    v.add_argument("overrides", nargs="*", help="dotted overrides, e.g. run_dir=/tmp/run")
    v.add_argument("--quick", action="store_true", help="the recipe's short form (quick.overrides, quick.expect)")
    v.add_argument("--run-dir", default=None, help="check this finished run instead of running the recipe")
    v.set_defaults(fn=_validate)

    pl = sub.add_parser("plot", help="write a PNG of reward, held-out accuracy and train-inference gap",
                        description="Plot a run directory's metrics.jsonl (reward, held-out accuracy, gap).")
    pl.add_argument("run_dir")
    pl.add_argument("--out", default=None, help="PNG path (default RUN_DIR/curves.png)")
    pl.set_defaults(fn=_plot)

    tl = sub.add_parser("timeline", help="render a run's timeline.json as a PNG (idle bubbles are the gaps)",
                        description="Render RUN_DIR/timeline.json (Chrome/Perfetto trace) as a PNG.")
    tl.add_argument("run_dir")
    tl.add_argument("--out", default=None, help="PNG path (default RUN_DIR/timeline.png)")
    tl.add_argument("--last-s", type=float, default=30.0, help="seconds at the end to show (0: all)")
    tl.set_defaults(fn=_timeline)

    tr = sub.add_parser("transfer", help="TransferMesh tools", description="TransferMesh (weight sync) tools.")
    trs = tr.add_subparsers(dest="transfer_cmd", required=True)
    tp = trs.add_parser("plan", help="print the weight-sync route to every receiver for a configuration",
                        description="Print the TransferMesh plan (transport per receiver) a run configuration implies; "
                                    "host ids and transports can be overridden in its `transfer` section.")
    tp.add_argument("config", nargs="?", default=None, help="recipe YAML (default recipes/arith_grpo.yaml)")
    tp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.num_engines=3")
    tp.set_defaults(fn=_transfer_plan)

    to = sub.add_parser("tool", help="run an agent tool by hand", description="Run an agent tool by hand.")
    tos = to.add_subparsers(dest="tool_cmd", required=True)
    tpy = tos.add_parser("python", help="run a Python file through the tool sandbox and print the tool result",
                         description="Run FILE as the `python` tool does (namespace sandbox: no network, no view of "
                                     "the run's files, limits) and print what the model would get back; exit 1 when the "
                                     "call failed. See docs/security.md.")
    tpy.add_argument("file")
    tpy.add_argument("--timeout-s", type=float, default=5.0)
    tpy.add_argument("--memory-mb", type=int, default=256)
    tpy.add_argument("--max-processes", type=int, default=32)
    tpy.set_defaults(fn=_tool_python)

    m = sub.add_parser("make-model", help="build a tiny real-architecture HF model + char tokenizer",
                       description="Build a seeded tiny model (Qwen3/Qwen2/Llama) and save it in HF format.")
    m.add_argument("out", help="output folder")
    m.add_argument("overrides", nargs="*", help="spec overrides, e.g. arch=llama hidden_size=256 num_layers=4")
    m.set_defaults(fn=_make_model)

    t = sub.add_parser("data", help="generate a built-in task's train/eval jsonl files",
                       description="Generate a built-in task's data set (train and disjoint held-out eval).")
    t.add_argument("task", help="arithmetic | calculator | reverse")
    t.add_argument("overrides", nargs="*",
                   help="task overrides, e.g. train_size=500 params.digits=4 data_dir=.cache/loongsage/data")
    t.set_defaults(fn=_data)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    if extra:  # overrides after an option (`validate RECIPE --quick key=value`) land here, not in `overrides`
        if not hasattr(ns, "overrides") or any(x.startswith("-") or "=" not in x for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        ns.overrides = [*ns.overrides, *extra]
    try:
        rc = ns.fn(ns)
    except (ValueError, FileNotFoundError) as exc:
        # ConfigError and DataError are ValueErrors: their modules load only here, so a command that
        # needs neither (the engine, in every engine process) starts without them (~0.4 s)
        from loongsage.config import ConfigError
        from loongsage.tasks.dataset import DataError

        if isinstance(exc, ConfigError):
            print(f"config error: {exc}", file=sys.stderr)
            return 2
        if isinstance(exc, (DataError, FileNotFoundError)):
            print(f"error: {exc}", file=sys.stderr)
            return 2
        raise
    except KeyboardInterrupt:
        return 130
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
