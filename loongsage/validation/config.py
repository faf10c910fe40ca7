"""What a recipe promises (`expect:`) and its short form (`quick:`), checked by `loongsage validate`.

A bound is on one number measured from the run directory: a statistic of a `metrics.jsonl` key over
the steps that logged it (`eval/accuracy` rises by >= 0.25), or a value of `summary.json`
(`summary.sources.calc.eval_after`), optionally as a ratio to another (the student's score over its
teacher's). Recipes state their goals here instead of in comments, so a run either meets them or
says which it missed.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Stat = Literal["last", "first", "max", "min", "mean", "rise"]
SUMMARY = "summary."


class Expectation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    metric: str = Field(min_length=1, description="a metrics.jsonl key (e.g. eval/accuracy), or summary.<dotted "
                        "path> into summary.json (e.g. summary.sources.calc.eval_after, summary.train_seconds)")
    stat: Stat = Field("last", description="over the steps that logged the metric: last, first, max, min, mean, or "
                       "rise (last - first); a summary value is one number (last)")
    window: int = Field(1, ge=1, description="last / first / rise over the mean of this many values at each end "
                        "(a per-step metric is noisy: a rise of reward/mean over windows of 20 steps)")
    over: str | None = Field(None, description="divide by this metric (the same stat): a ratio, e.g. to a teacher")
    min: float | None = Field(None, description="the measured number must be >= this")
    max: float | None = Field(None, description="the measured number must be <= this")
    why: str = Field("", description="what the bound stands for (e.g. the machine class of a wall-clock bound)")

    @model_validator(mode="after")
    def _bounded(self) -> Expectation:
        if self.min is None and self.max is None:
            raise ValueError(f"expectation on {self.metric!r} has neither min nor max")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"expectation on {self.metric!r}: min {self.min} is above max {self.max}")
        summary = [m for m in (self.metric, self.over) if m and m.startswith(SUMMARY)]
        if summary and self.stat != "last":
            raise ValueError(f"expectation on {self.metric!r}: {summary[0]} is one number; stat {self.stat!r} "
                             "applies to metrics.jsonl keys only")
        return self

    @property
    def label(self) -> str:
        stat = self.stat if self.window == 1 or self.stat not in ("last", "first", "rise") else \
            f"{self.stat}[{self.window}]"
        of = self.metric if stat == "last" else f"{stat}({self.metric})"
        return f"{of} / {self.over}" if self.over else of

    @property
    def bound(self) -> str:
        if self.min is not None and self.max is not None:
            return f"in [{self.min:g}, {self.max:g}]"
        return f">= {self.min:g}" if self.min is not None else f"<= {self.max:g}"


class QuickConfig(BaseModel):
    """`loongsage validate --quick`: the recipe shortened (overrides applied before the user's) and what
    the short run must still show (default: `expect`)."""
    model_config = ConfigDict(extra="forbid")
    overrides: list[str] = Field(default_factory=list, description="dotted overrides, e.g. train.steps=40")
    expect: list[Expectation] | None = Field(None, description="bounds for the short run (default: expect)")
