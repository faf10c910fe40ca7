"""The SGLang path checked against SGLang's own code, without a GPU: scripts/setup.sh downloads
SGLang's wheel (not installed: it needs CUDA to import), and these tests read its source. Every
request body LoongSage's client sends goes to the route SGLang serves with the request class that
route parses: no field SGLang lacks, none it requires missing. A flattened bucket as the mesh sends
it goes through SGLang's restricted unpickler and its weight updater's reconstruction (their code,
taken from the wheel) and comes out as the exact tensors."""
from __future__ import annotations

import ast
import asyncio
import io
import pickle
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

from loongsage.rollout import protocol as P
from loongsage.rollout.client import EngineClient
from loongsage.transfer.tensor_handles import flat_layout

WHEELS = Path(__file__).parents[1] / ".cache" / "wheels"


@pytest.fixture(scope="module")
def sglang_src():
    wheels = sorted(WHEELS.glob("sglang-*.whl"))
    if not wheels:
        pytest.skip(f"SGLang's wheel is not in {WHEELS} (scripts/setup.sh downloads it)")
    with zipfile.ZipFile(wheels[-1]) as z:
        wanted = ["srt/managers/io_struct.py", "srt/entrypoints/http_server.py", "srt/weight_sync/tensor_bucket.py",
                  "srt/utils/common.py", "srt/model_executor/model_runner_components/weight_updater.py"]
        files = {path: z.read(f"sglang/{path}").decode() for path in wanted}
    return files.__getitem__


def _request_classes(io_struct: str) -> dict[str, tuple[set[str], set[str]]]:
    """class name -> (fields, fields without a default), base classes of the module included."""
    tree = ast.parse(io_struct)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}

    def fields(name: str) -> tuple[set[str], set[str]]:
        node = classes.get(name)
        if node is None:
            return set(), set()
        every, required = set(), set()
        for base in node.bases:
            if isinstance(base, ast.Name):
                b_every, b_required = fields(base.id)
                every |= b_every
                required |= b_required
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                every.add(stmt.target.id)
                if stmt.value is None:
                    required.add(stmt.target.id)
        return every, required

    return {name: fields(name) for name in classes}


def _routes(http_server: str) -> dict[str, str]:
    """route path -> the request class its handler's first parameter is parsed as."""
    out = {}
    for node in ast.walk(ast.parse(http_server)):
        if not isinstance(node, ast.AsyncFunctionDef) or not node.args.args:
            continue
        paths = [d.args[0].value for d in node.decorator_list if isinstance(d, ast.Call) and d.args
                 and isinstance(d.args[0], ast.Constant) and isinstance(d.args[0].value, str)]
        ann = node.args.args[0].annotation
        if isinstance(ann, ast.Subscript) and getattr(ann.value, "id", "") == "Annotated":
            ann = ann.slice.elts[0]
        if paths and isinstance(ann, ast.Name):
            for path in paths:
                out[path] = ann.id
    return out


def _sent_bodies() -> list[tuple[str, dict]]:
    """What the client's methods put on the wire, recorded instead of sent."""
    sent: list[tuple[str, dict]] = []
    client = EngineClient("http://127.0.0.1:1")

    async def record(path, body=None, **_):
        sent.append((path, dict(body or {})))
        return {"success": True}

    client._post = record

    async def calls():
        await client.generate([1, 2, 3], {"max_new_tokens": 4}, top_logprobs_num=2, rid="x")
        await client.generate([1, 2, 3], {"max_new_tokens": 0}, logprob_start_len=1)  # a teacher's score
        await client.pause(mode="retract")
        await client.resume()
        await client.abort(rid="r1")
        await client.abort(abort_all=True)
        await client.flush_cache()
        await client.release_memory()
        await client.resume_memory()
        await client.update_weight_version(7)
        await client.update_weights_from_disk("/m", weight_version=3)
        await client.update_weights_from_tensor("HANDLE", weight_version=3, load_format="flattened_bucket")
        await client.init_weights_update_group(master_address="10.0.0.1", master_port=29500, rank_offset=1,
                                               world_size=2, backend="nccl")
        await client.update_weights_from_distributed(names=["w"], dtypes=["float32"], shapes=[[2, 2]],
                                                     weight_version=3, flattened=True)
        await client.destroy_weights_update_group()

    client.generate = lambda ids, sp=None, **kw: record("/generate", P.build_generate(ids, sp, **kw))
    asyncio.run(calls())
    return sent


def test_every_request_matches_the_class_sglangs_route_parses(sglang_src):
    classes = _request_classes(sglang_src("srt/managers/io_struct.py"))
    routes = _routes(sglang_src("srt/entrypoints/http_server.py"))
    sent = _sent_bodies()
    checked = set()
    for path, body in sent:
        assert path in routes, f"SGLang serves no {path}"
        checked.add(path)
        if routes[path] not in classes:  # a route of query parameters only (e.g. /flush_cache?timeout=)
            assert not body, f"{path} takes no body in SGLang, we send {body}"
            continue
        every, required = classes[routes[path]]
        assert set(body) <= every, f"{path}: fields SGLang's {routes[path]} lacks: {sorted(set(body) - every)}"
        assert required <= set(body), f"{path}: fields SGLang requires but we omit: {sorted(required - set(body))}"
    # the whole weight-sync and control surface of the SGLang path is covered
    assert {"/generate", "/update_weights_from_tensor", "/update_weights_from_distributed",
            "/init_weights_update_group", "/destroy_weights_update_group", "/update_weight_version",
            "/update_weights_from_disk", "/abort_request", "/pause_generation", "/continue_generation",
            "/release_memory_occupation", "/resume_memory_occupation"} <= checked, sorted(checked)


def _sglang_namespace(sglang_src) -> dict:
    """SGLang's FlattenedTensorBucket module, its SafeUnpickler (with the helper it uses) and its
    weight updater's flattened-bucket loader, executed from the wheel's source."""
    bucket_mod = types.ModuleType("sglang_tensor_bucket")
    sys.modules[bucket_mod.__name__] = bucket_mod  # its dataclass looks its module up
    exec(compile(sglang_src("srt/weight_sync/tensor_bucket.py"), "tensor_bucket.py", "exec"), bucket_mod.__dict__)
    common = ast.parse(sglang_src("srt/utils/common.py"))
    wanted = {"SafeUnpickler", "_safe_load_torch_storage"}
    picked = [n for n in common.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name in wanted]
    updater = ast.parse(sglang_src("srt/model_executor/model_runner_components/weight_updater.py"))
    loader = [n for n in ast.walk(updater) if isinstance(n, ast.FunctionDef)
              and n.name == "_update_weights_from_flattened_bucket"]
    assert len(picked) == 2 and len(loader) == 1, "SGLang's code moved: update this contract test"
    for fn in loader:  # its `self: WeightUpdater` annotation names a class we do not load
        for a in fn.args.args:
            a.annotation = None
    ns = {"pickle": pickle, "io": io, "torch": torch, "FlattenedTensorMetadata": bucket_mod.FlattenedTensorMetadata,
          "FlattenedTensorBucket": bucket_mod.FlattenedTensorBucket}
    module = ast.Module(body=picked + loader, type_ignores=[])
    exec(compile(ast.fix_missing_locations(module), "sglang_extract", "exec"), ns)
    return ns


def test_a_flattened_bucket_is_rebuilt_exactly_by_sglangs_own_code(sglang_src):
    ns = _sglang_namespace(sglang_src)
    named = [("model.embed_tokens.weight", torch.randn(8, 4)), ("model.norm.weight", torch.randn(4)),
             ("lm_head.weight", torch.randn(8, 4))]
    flat = torch.cat([t.reshape(-1) for _, t in named])
    payload = pickle.dumps({"flattened_tensor": flat, "metadata": flat_layout(named)})  # on a GPU: a CUDA IPC handle
    loaded = ns["SafeUnpickler"](io.BytesIO(payload)).load()  # SGLang's restricted unpickler admits it

    got = []

    class Runner:  # the weight updater's `self`: only its model's load_weights is used
        def get_model(self):
            return types.SimpleNamespace(load_weights=got.extend)

    assert ns["_update_weights_from_flattened_bucket"](Runner(), loaded) == (True, "Success")
    assert [n for n, _ in got] == [n for n, _ in named]
    for (_, want), (_, have) in zip(named, got):
        assert have.dtype == want.dtype and torch.equal(have, want)


def test_the_old_metadata_form_is_what_sglang_rejected(sglang_src):
    """The check has teeth: the {name, shape, start, end} dicts sent before fail SGLang's loader."""
    ns = _sglang_namespace(sglang_src)
    flat = torch.arange(6.0)
    old = {"flattened_tensor": flat, "metadata": [{"name": "w", "shape": [2, 3], "start": 0, "end": 6}]}
    loaded = ns["SafeUnpickler"](io.BytesIO(pickle.dumps(old))).load()
    with pytest.raises(AttributeError):
        ns["_update_weights_from_flattened_bucket"](types.SimpleNamespace(get_model=lambda: None), loaded)


def test_a_broadcast_bucket_is_the_byte_tensor_sglang_receives(sglang_src):
    """/update_weights_from_distributed with flattened_bucket: SGLang allocates the bucket's bytes
    (FlattenedTensorBucket.empty) and broadcasts into them; the trainer sends exactly such a tensor
    (a collective needs the same dtype and count on every rank), which SGLang rebuilds exactly."""
    from loongsage.transfer.broadcast import wire_bucket

    ns = _sglang_namespace(sglang_src)
    named = [("a", torch.randn(3, 5)), ("b", torch.randn(7))]
    for dtype in (torch.float32, torch.bfloat16):
        wire = wire_bucket([t for _, t in named], dtype, "cpu")
        body = P.build_update_from_distributed([n for n, _ in named], [str(dtype).removeprefix("torch.")] * 2,
                                               [list(t.shape) for _, t in named], 1, flattened=True)
        bucket = ns["FlattenedTensorBucket"].empty(body["names"], body["dtypes"], body["shapes"], "cpu")
        into = bucket.get_flattened_tensor()
        assert (into.dtype, into.numel()) == (wire.dtype, wire.numel())  # what the collective requires
        into.copy_(wire)  # what the broadcast does
        for (name, want), (got_name, got) in zip(named, bucket.reconstruct_tensors()):
            assert got_name == name and torch.equal(got, want.to(dtype))
