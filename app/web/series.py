"""Bounded per-step series for the run page's charts, however long the run.

A `Series` holds consecutive items (a trainer step, or a time) in at most `most` buckets of `per` items
each, the last bucket possibly fewer: when an item would make one bucket too many, neighbouring buckets
merge in pairs and `per` doubles. Each bucket keeps its first and last label, how many items it holds,
and for each of an item's values (None where the item has none) how many it has, their sum, max and
min: what a chart draws for a run of steps (their mean, a tick at their max) and says on hover. So a
chart of a 100,000-batch run costs `most` buckets, not 100,000 rows, and its marks are exact: a bar
of k steps is their true mean and max. Until a series holds `most` items, each bucket is one item.

`BatchTrend` is the run page's four per-step series (collection time, tokens/s, reward with its
learning-signal share, the rolling idle fraction), folded one delivered batch at a time.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

MOST_BUCKETS = 200  # twice a chart's bars (charts.MAX_BARS), so a chart's bar is two buckets at most
IDLE_WINDOW_BATCHES = 10  # the idle chart's window: the whole run's fraction hid a change made late in it


@dataclass(frozen=True, slots=True)
class Stat:
    """One value over a bucket's items that have it."""

    n: int = 0
    total: float = 0.0
    most: float = -math.inf
    least: float = math.inf

    @property
    def mean(self) -> float | None:
        return self.total / self.n if self.n else None

    def plus(self, other: Stat) -> Stat:
        most, least = max(self.most, other.most), min(self.least, other.least)
        return Stat(self.n + other.n, self.total + other.total, most, least)


def _stat(value: float | None) -> Stat:
    return Stat() if value is None else Stat(1, value, value, value)


@dataclass(frozen=True, slots=True)
class Bucket:
    """Consecutive items: the first's and the last's labels, how many, and a `Stat` a value."""

    first: Any
    last: Any
    n: int
    stats: tuple[Stat, ...]

    def plus(self, other: Bucket) -> Bucket:
        stats = tuple(a.plus(b) for a, b in zip(self.stats, other.stats, strict=True))
        return Bucket(self.first, other.last, self.n + other.n, stats)


def merged(buckets: Sequence[Bucket]) -> Bucket:
    out = buckets[0]
    for b in buckets[1:]:
        out = out.plus(b)
    return out


class Series:
    """Items in at most `most` buckets of `per` items (the last may hold fewer); see the module."""

    def __init__(self, most: int = MOST_BUCKETS) -> None:
        if most < 2 or most % 2:
            raise ValueError(f"most: an even number of buckets from 2, got {most}")
        self.most = most
        self.per = 1
        self.items = 0
        self.buckets: list[Bucket] = []

    def add(self, label: Any, *values: float | None) -> None:
        item = Bucket(label, label, 1, tuple(_stat(v) for v in values))
        self.items += 1
        if self.buckets and self.buckets[-1].n < self.per:
            self.buckets[-1] = self.buckets[-1].plus(item)
            return
        self.buckets.append(item)
        if len(self.buckets) > self.most:
            pairs = self.buckets[:-1]  # `most` full buckets; the new one stays alone
            self.buckets = [a.plus(b) for a, b in zip(pairs[::2], pairs[1::2], strict=True)]
            self.buckets.append(item)
            self.per *= 2

    def copy(self) -> Series:
        """A snapshot (buckets are immutable: the list is copied, not them)."""
        out = Series(self.most)
        out.per, out.items, out.buckets = self.per, self.items, list(self.buckets)
        return out

    def marks(self, most: int) -> tuple[int, list[Bucket]]:
        """At most `most` marks for a chart: k items a mark (the last may hold fewer), k as small as
        the buckets allow; k and the marks."""
        group = max(1, math.ceil(len(self.buckets) / most))
        marks = [merged(self.buckets[i : i + group]) for i in range(0, len(self.buckets), group)]
        return group * self.per, marks

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Series):
            return NotImplemented
        return (self.most, self.per, self.items, self.buckets) == (
            other.most,
            other.per,
            other.items,
            other.buckets,
        )

    __hash__ = None  # type: ignore[assignment]

    def __iter__(self) -> Iterator[Bucket]:
        return iter(self.buckets)

    def __len__(self) -> int:
        return self.items


def idle_percent(recent: Sequence[tuple[float, float, float]]) -> float | None:
    """The percentage of the time since the first of `recent` batches (requested, delivered, wait) was
    asked for that the trainer spent waiting for them, at the last one's delivery; None for no time."""
    span = recent[-1][1] - recent[0][0]
    if span <= 0:
        return None
    return min(100.0, 100 * math.fsum(w for _, _, w in recent) / span)


class BatchTrend:
    """The run page's per-step series, folded a delivered batch at a time (see the module)."""

    def __init__(self, most: int = MOST_BUCKETS) -> None:
        self.collection = Series(most)  # step → (wait,)
        self.tokens = Series(most)  # step → (tokens/s,), steps with turns only
        self.reward = Series(most)  # step → (mean reward, share with a learning signal), steps with rewards
        self.idle = Series(most)  # time → (time, idle % over the last IDLE_WINDOW_BATCHES batches)
        self._recent: deque[tuple[float, float, float]] = deque(maxlen=IDLE_WINDOW_BATCHES)

    def add(
        self,
        index: int,
        requested: float,
        delivered: float,
        tokens_per_s: float | None = None,
        mean_reward: float | None = None,
        trainable: float | None = None,
    ) -> None:
        wait = delivered - requested
        self.collection.add(str(index), wait)
        if tokens_per_s is not None:
            self.tokens.add(str(index), tokens_per_s)
        if mean_reward is not None:
            self.reward.add(str(index), mean_reward, trainable)
        self._recent.append((requested, delivered, wait))
        if (pct := idle_percent(self._recent)) is not None:
            self.idle.add(delivered, delivered, pct)

    def _key(self) -> tuple[object, ...]:
        return (self.collection, self.tokens, self.reward, self.idle, list(self._recent))

    def __eq__(self, other: object) -> bool:
        return self._key() == other._key() if isinstance(other, BatchTrend) else NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def copy(self) -> BatchTrend:
        out = BatchTrend()
        out.collection, out.tokens = self.collection.copy(), self.tokens.copy()
        out.reward, out.idle = self.reward.copy(), self.idle.copy()
        out._recent = deque(self._recent, maxlen=IDLE_WINDOW_BATCHES)
        return out
