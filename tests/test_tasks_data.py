"""Task generators, verifiers, and user data loading with file:line errors."""
from __future__ import annotations

import json
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loongsage.tasks import DataError, DataSchema, TaskRow, get_task, load_rows, write_jsonl
from loongsage.tasks.calculator import evaluate_expression
from loongsage.tasks.config import TaskConfig
from loongsage.tasks.prepare import prepare_data


def test_generators_are_seeded_and_verifiers_score_the_answer():
    for name in ["arithmetic", "calculator", "reverse", "count"]:
        spec = get_task(name)
        a, b = spec.generate(20, seed=3), spec.generate(20, seed=3)
        assert [r.to_json() for r in a] == [r.to_json() for r in b]
        row = a[0]
        good = f"The answer is {row.answer}" if name == "calculator" else row.answer
        assert spec.reward(good, row) == 1.0
        assert spec.reward("nonsense", row) == 0.0
    row = get_task("arithmetic").generate(1, seed=0)[0]
    a, b = row.prompt.rstrip("=").split("+")
    assert int(row.answer) == int(a) + int(b)
    calc = get_task("calculator").generate(1, seed=0)[0]
    assert calc.tools[0]["function"]["name"] == "calculator" and calc.prompt[0]["role"] == "user"
    assert evaluate_expression(calc.meta["expression"]) == calc.answer


def test_count_outputs_spread_from_a_few_tokens_to_over_a_hundred():
    """The long workload (benchmarks/vs_trl.py --workload long): outputs of very uneven length."""
    spec = get_task("count")
    rows = spec.generate(2000, seed=0)
    assert len({r.prompt for r in rows}) == 2000  # enough distinct problems for train + eval
    lengths = sorted(len(r.answer) for r in rows)
    assert lengths[0] <= 8 and lengths[-1] >= 110 and lengths[len(lengths) // 2] >= 40
    row = next(r for r in rows if r.prompt.startswith("count:9"))
    a, b = (int(x) for x in row.prompt[len("count:"):-1].split(".."))
    assert row.answer.split() == [str(i) for i in range(a, b + 1)]
    assert spec.reward(row.answer + " " + str(b + 1), row) == 0.0  # counting past the end earns nothing


def test_calculator_refuses_anything_but_arithmetic():
    assert evaluate_expression("(2+3)*4-6/3") == "18"
    for bad in ["__import__('os')", "2**1000", "a+1", "1/0", "1" * 300]:
        with pytest.raises(ValueError):
            evaluate_expression(bad)
    with warnings.catch_warnings(record=True) as caught:  # refused without a SyntaxWarning in the log
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="not an arithmetic expression"):
            evaluate_expression("2if 3")
    assert not caught, [str(w.message) for w in caught]


def test_prepared_eval_rows_are_disjoint_from_train(tmp_path):
    cfg = TaskConfig(name="arithmetic", params={"digits": 2}, train_size=300, eval_size=100, data_dir=str(tmp_path))
    train, evals = prepare_data(cfg)
    assert len(train) == 300 and len(evals) == 100
    assert not {r.prompt for r in train} & {r.prompt for r in evals}
    again_train, _ = prepare_data(cfg)  # cached files are reloaded, identical
    assert [r.prompt for r in again_train] == [r.prompt for r in train]


def test_jsonl_and_parquet_with_a_declared_schema(tmp_path):
    rows = [TaskRow(prompt="1+1=", answer="2", tag="arith"), TaskRow(prompt=[{"role": "user", "content": "hi"}], answer="x")]
    write_jsonl(rows, tmp_path / "d.jsonl")
    assert [r.to_json() for r in load_rows(tmp_path / "d.jsonl")] == [r.to_json() for r in rows]
    table = pa.Table.from_pylist([{"question": "2+2=", "solution": 4, "source": "web"}])
    pq.write_table(table, tmp_path / "d.parquet")
    got = load_rows(tmp_path / "d.parquet", DataSchema(prompt_key="question", answer_key="solution"))
    assert got[0].prompt == "2+2=" and got[0].answer == "4" and got[0].meta == {"source": "web"}


def test_nested_fields_are_read_by_dotted_keys_as_dapo_math_stores_them(tmp_path):
    """DAPO-Math-17k: the prompt is a message list, the answer sits in reward_model.ground_truth."""
    rec = {"data_source": "math_dapo", "prompt": [{"role": "user", "content": "Solve 2+2. Answer: $Answer"}],
           "ability": "MATH", "reward_model": {"ground_truth": "4", "style": "rule"}, "extra_info": {"index": "a1"}}
    pq.write_table(pa.Table.from_pylist([rec]), tmp_path / "dapo.parquet")
    row, = load_rows(tmp_path / "dapo.parquet", DataSchema(answer_key="reward_model.ground_truth"))
    assert row.prompt == rec["prompt"] and row.answer == "4"
    assert row.meta == {"data_source": "math_dapo", "ability": "MATH", "extra_info": {"index": "a1"}}
    with pytest.raises(DataError, match=r"dapo.parquet: row 1: missing key 'reward_model.truth' "
                                        r"\(reward_model has \['ground_truth', 'style'\]\)"):
        load_rows(tmp_path / "dapo.parquet", DataSchema(answer_key="reward_model.truth"))


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "a", "answer": "b"}', "{oops"], "d.jsonl:2: invalid JSON"),
    (['{"prompt": "a", "answer": "b"}', "", '{"prompt": "a"}'], "d.jsonl:3: missing key 'answer'"),
    (['[1, 2]'], "d.jsonl:1: expected a JSON object"),
    (['{"prompt": "", "answer": "b"}'], "d.jsonl:1: 'prompt' must be a non-empty string"),
    (['{"prompt": [{"role": "user"}], "answer": "b"}'], "d.jsonl:1: 'prompt' as a list must hold messages"),
    (['{"prompt": "a", "answer": true}'], "d.jsonl:1: 'answer' must be a string or a number"),
])
def test_malformed_rows_name_file_and_line(tmp_path, lines, message):
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as info:
        load_rows(tmp_path / "d.jsonl")
    assert message in str(info.value)


def test_malformed_rows_can_be_skipped_each_named_in_the_warning(tmp_path, caplog):
    lines = ['{"prompt": "a", "answer": "b"}', "{oops", '{"prompt": "c"}', "\udcff not text", '[1]',
             '{"prompt": "d", "answer": 4}']
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n", errors="surrogateescape")
    with caplog.at_level("WARNING", logger="loongsage.data"):
        rows = load_rows(tmp_path / "d.jsonl", bad_rows="skip")
    assert [(r.prompt, r.answer) for r in rows] == [("a", "b"), ("d", "4")]
    assert "skipped 4 malformed rows" in caplog.text
    for where in ("d.jsonl:2: invalid JSON", "d.jsonl:3: missing key 'answer'", "d.jsonl:4: invalid JSON",
                  "d.jsonl:5: expected a JSON object"):
        assert where in caplog.text
    (tmp_path / "bad.jsonl").write_text("{oops\n[2]\n")
    with pytest.raises(DataError, match="every row is malformed; the first: .*bad.jsonl:1: invalid JSON"):
        load_rows(tmp_path / "bad.jsonl", bad_rows="skip")


def test_parquet_rows_are_numbered_and_formats_checked(tmp_path):
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": "b"}, {"prompt": "c", "answer": None}]),
                   tmp_path / "p.parquet")
    with pytest.raises(DataError, match="p.parquet: row 2: 'answer' must be a string or a number"):
        load_rows(tmp_path / "p.parquet")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported format"):
        load_rows(tmp_path / "x.csv")
    with pytest.raises(DataError, match="no such file"):
        load_rows(tmp_path / "missing.jsonl")
    json.dumps({})


def test_generators_refuse_impossible_sizes():
    with pytest.raises(ValueError, match="cannot draw 100 distinct problems"):
        get_task("arithmetic").generate(100, digits=1)
