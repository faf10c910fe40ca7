"""The math task's reward (GSM8K / DAPO-Math answer extraction) and user data as chat prompts."""
from __future__ import annotations

import json

import pytest

from loongsage.config import ConfigError, load_config
from loongsage.tasks.base import TaskRow, get_task
from loongsage.tasks.config import TaskConfig
from loongsage.tasks.math_answer import final_answer, reward
from loongsage.tasks.prepare import prepare_data

GSM8K = TaskRow("q", "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nIn all she sold 48+24 = <<48+24=72>>72.\n#### 72")


@pytest.mark.parametrize("response, expected", [
    ("48/2 = 24, 48 + 24 = 72, so \\boxed{72}.", 1.0),
    ("She sold 72 in all.\n#### 72", 1.0),
    ("The answer is $72.00.", 1.0),
    ("24 in May, 72 altogether", 1.0),  # the last number
    ("\\boxed{72} ... wait, 73", 1.0),  # boxed wins over a later number
    ("\\boxed{\\frac{144}{2}}", 1.0),
    ("The answer is 71", 0.0),
    ("#### 70", 0.0),
    ("I do not know", 0.0),
    ("\\boxed{71 then the last number 72", 1.0),  # an unclosed box is no answer: the last number is
])
def test_the_final_answer_is_extracted_as_gsm8k_and_dapo_math_evaluate_it(response, expected):
    assert reward(response, GSM8K) == expected, final_answer(response)


def test_numbers_compare_as_numbers_and_other_answers_as_text():
    assert reward("\\boxed{0.75}", TaskRow("q", "3/4")) == 1.0
    assert reward("\\boxed{1,000}", TaskRow("q", "1000")) == 1.0
    assert reward("\\boxed{x+1}", TaskRow("q", "x + 1")) == 1.0 and reward("\\boxed{x+2}", TaskRow("q", "x+1")) == 0.0


def test_user_data_becomes_chat_prompts_in_the_configured_format(tmp_path):
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text(json.dumps({"question": "2+3?", "answer": "5 #### 5"}) + "\n")
    cfg = TaskConfig(name="math", train_path=str(tmp_path / "train.jsonl"), eval_path=str(tmp_path / "test.jsonl"),
                     prompt_key="question", prompt_format="{prompt}\nPut the answer in \\boxed{}.")
    train, held_out = prepare_data(cfg)
    assert train[0].prompt == [{"role": "user", "content": "2+3?\nPut the answer in \\boxed{}."}]
    assert get_task("math").reward("so \\boxed{5}", held_out[0]) == 1.0
    raw, _ = prepare_data(cfg.model_copy(update={"prompt_format": None}))
    assert raw[0].prompt == "2+3?"
    with pytest.raises(ConfigError, match="task: prompt_format must contain"):
        load_config(None, ["task.prompt_format=no placeholder"])
    with pytest.raises(ValueError, match="task math has no generator: set task.train_path"):
        prepare_data(TaskConfig(name="math", data_dir=str(tmp_path / "gen")))
