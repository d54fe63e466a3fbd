"""An in-flight limit the gateway sets itself from the latency it measures: a gradient controller.

After Envoy's ``adaptive_concurrency`` and Netflix's Gradient2. A fixed concurrency limit on an
upstream is too low on a good day and too high on a bad one; this one finds the upstream's
capacity from one signal, its latency, and follows it:

0. **Cold start.** The limit starts at ``initial_limit`` (``max_limit`` by default), not at the
   floor: a healthy upstream's first second is not shed while the gateway learns it. Its
   minimum latency is measured meanwhile from the requests that started while no more than
   ``min_limit`` were in flight (``started``), the latency a cold upstream shows before any
   queue: ``probe_requests`` of them, or those back within the first ``sample_interval`` (a
   cold upstream offered more than it serves queues the rest meanwhile). With none of them
   back in 2 s (the traffic came all at once), the limit is pinned to ``min_limit`` for a
   probe as below. The gradient then takes the limit down from there, a quarter a sample at
   most. Those back within one sample interval are the fastest few (one or two, at an
   upstream of 90 ms), a minimum up to a tenth low with a spread of service times: its
   tolerance can be no higher than the upstream's own mean latency, where the limit stops
   wherever it is (8 of a capacity of 35) until the next probe. So a minimum from fewer than
   ``probe_requests`` latencies is measured again in full at the first sample that the
   demand filled (the interval's peak in flight reached the limit) and that the latency did
   not cut: the cold start's queue is gone by then.
1. **Probe.** The limit is pinned to ``min_limit``; the latency of ``probe_requests`` requests
   started while no more than ``min_limit`` were in flight (their mean, ``trimmed_mean``) is the
   upstream's **minimum latency**: what a request costs it when nothing queues. A probe lasts
   2 s at most (once it has one latency).
2. **Sample.** Every ``sample_interval``, the (trimmed) mean of the latencies measured in it
   gives the gradient ``clamp(tolerated / sample, 0.5, 1 + buffer)``, where ``tolerated`` is
   the minimum plus ``buffer`` of it (plus ``min_buffer`` at least: below a millisecond or so
   latency moves with the event loops, not with a queue at the upstream). While latency stays
   within the tolerance the limit grows; as it rises beyond, the limit shrinks. Each sample
   moves the limit half the way its gradient asks (``limit *= 1 + (gradient - 1) / 2``):
   at most ``1 + buffer / 2`` up and ``0.75`` down a step, within ``min_limit``/``max_limit``.
   From ``min_limit`` (at the start, and after a probe the floor called for) it first
   doubles each sample, until latency first leaves the tolerance (TCP's slow start: an
   upstream of capacity 1000 is found in seconds, not minutes).
   An upstream that queues beyond a capacity ``C`` settles near ``(1 + buffer) * C``, where its
   latency is ``(1 + buffer)`` times the minimum: every request is served at once, plus a short
   queue so that capacity is never left idle.
3. **Probe again** every ``probe_interval``, plus up to ``jitter`` of it at random (so gateways
   and their workers do not all probe at once), at once after five samples in a row that
   left the limit at ``min_limit`` while requests wanted more (the upstream's base latency
   has risen, or the minimum was measured at a lucky moment; a probe costs nothing then),
   and once after a cold start whose minimum came from too few latencies (step 0).

Differences from Envoy's gradient, each for a reason: no ``sqrt(limit)`` headroom added per step
(it lifts the limit of a small upstream far beyond its capacity: about ``1.7 C`` at ``C = 8``);
half steps (Netflix's smoothing: a step's effect on the latency shows only in the next interval,
and whole steps make the limit swing about its level); the limit grows only while the demand
reaches it (the interval's peak in flight at least half the limit), as in Netflix's limiters,
so a quiet hour does not leave it at ``max_limit``. bench/README.md has the simulated curves.

Pure: the caller passes ``now_us`` and a source of random numbers (the jitter); nothing here
reads a clock, sleeps or takes a lock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

# The sharpest cut one sample may ask for: latency twice the tolerated level, half the limit.
MIN_GRADIENT: Final = 0.5
# Latencies kept per sample interval; beyond it every other one is dropped and half as many
# kept from then on (a uniform subsample at any request rate, in bounded memory).
MAX_SAMPLES: Final = 512
# Latencies an interval needs before it moves the limit (a quiet interval is extended).
MIN_SAMPLES: Final = 5
# The tenth of a sample's latencies dropped at each end (``trimmed_mean``).
TRIM: Final = 10
# Each sample moves the limit half the way its gradient asks: a step's effect on the latency
# shows in the next interval, and taking whole steps makes the limit swing around its level.
SMOOTHING: Final = 0.5
# From the floor, the limit doubles each sample until latency first leaves the tolerance.
SLOW_START_STEP: Final = 2.0
# The longest a probe waits for its ``probe_requests``; with one latency at least, it ends then.
MAX_PROBE_US: Final = 2_000_000
# Samples in a row that left the limit at ``min_limit`` with requests waiting for more, before
# the minimum is measured again.
FLOOR_SAMPLES_BEFORE_PROBE: Final = 5


@dataclass(frozen=True, slots=True)
class GradientParams:
    """The controller's settings, times in microseconds (the policy's ``adaptive:`` block
    gives them and documents the defaults)."""

    min_limit: int
    max_limit: int
    initial_limit: int
    buffer: float
    min_buffer_us: int
    sample_interval_us: int
    probe_interval_us: int
    probe_requests: int
    jitter: float

    def __post_init__(self) -> None:
        if not 1 <= self.min_limit <= self.max_limit:
            raise ValueError(
                f"need 1 <= min_limit <= max_limit, got {self.min_limit} and {self.max_limit}"
            )
        if not self.min_limit <= self.initial_limit <= self.max_limit:
            raise ValueError(
                f"need min_limit <= initial_limit <= max_limit, got {self.initial_limit}"
            )
        if not 0 < self.buffer <= 1:
            raise ValueError(f"buffer must be above 0 and at most 1, got {self.buffer}")
        if self.min_buffer_us < 0:
            raise ValueError(f"min_buffer must be 0 or more, got {self.min_buffer_us} us")
        if min(self.sample_interval_us, self.probe_interval_us) < 1:
            raise ValueError("sample_interval and probe_interval must be longer than 0")
        if self.probe_requests < 1:
            raise ValueError(f"probe_requests must be at least 1, got {self.probe_requests}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be between 0 and 1, got {self.jitter}")


def trimmed_mean(samples: list[int]) -> int:
    """The mean of ``samples`` (not empty) without their highest and lowest tenth.

    The mean, not a percentile: at an upstream's capacity the mean latency is its queue over
    its throughput (Little's law), so it rises with every request queued, where a median stays
    at the minimum until half of them queue (a steady upstream then settles near 1.4 C, not
    1.15 C). Trimmed, so that one stray latency (a timeout) cannot move a probe's minimum."""
    ordered = sorted(samples)
    cut = len(ordered) // TRIM
    kept = ordered[cut : len(ordered) - cut] if cut else ordered
    return sum(kept) // len(kept)


class GradientLimit:
    """One upstream's adaptive in-flight limit: ``try_acquire`` before a request goes to the
    upstream, ``release`` with its start time when its response is in (or it failed)."""

    __slots__ = (
        "_at_floor",
        "_cold_starts",
        "_next_probe_us",
        "_peak",
        "_probe_samples",
        "_probe_started_us",
        "_random",
        "_resume_estimate",
        "_rough_minimum",
        "_samples",
        "_seen",
        "_slow_start",
        "_stride",
        "_window_start_us",
        "adjustments",
        "cold",
        "estimate",
        "in_flight",
        "limit",
        "min_latency_us",
        "params",
        "probes",
        "probing",
        "sample_latency_us",
    )

    def __init__(self, params: GradientParams, now_us: int, random: Callable[[], float]) -> None:
        self.params = params
        self._random = random
        # The limit as a real number (it moves by factors); ``limit`` is its whole part.
        self.estimate = float(params.initial_limit)
        self.limit = params.min_limit
        # Measuring the minimum at the cold start, unpinned (above ``min_limit``): only the
        # requests ``started`` while few were in flight count, by start time.
        self.cold = params.initial_limit > params.min_limit
        self._cold_starts: dict[int, int] = {}
        self.in_flight = 0
        # The upstream's latency at low concurrency, and the last interval's (0: none yet).
        self.min_latency_us = 0
        self.sample_latency_us = 0
        self.probes = 0  # minimum-latency measurements started
        self.adjustments = 0  # samples that moved (or held) the limit
        self.probing = False
        self._probe_started_us = now_us
        self._probe_samples: list[int] = []
        self._resume_estimate = self.estimate
        self._window_start_us = now_us
        self._samples: list[int] = []
        self._seen = 0
        self._stride = 1
        self._peak = 0
        self._at_floor = 0
        self._slow_start = False
        # The cold start's minimum, from fewer than ``probe_requests`` latencies: measured again
        # in full once the limit binds and stops falling (``_update``).
        self._rough_minimum = False
        self._next_probe_us = now_us
        self._start_probe(now_us)
        if self.cold:
            self.limit = params.initial_limit

    def try_acquire(self) -> bool:
        """Take a place for one request to the upstream; False when the limit is reached."""
        in_flight = self.in_flight
        if in_flight >= self.limit:
            return False
        in_flight += 1
        self.in_flight = in_flight
        if in_flight > self._peak:
            self._peak = in_flight
        return True

    def started(self, now_us: int) -> None:
        """A request that holds a place goes out at ``now_us`` (its ``started_us``): at the
        cold start, whether few were in flight then decides if its latency is a minimum's."""
        if self.cold and self.in_flight <= self.params.min_limit:
            self._cold_starts[now_us] = self._cold_starts.get(now_us, 0) + 1

    def release(self, started_us: int, now_us: int, *, measured: bool = True) -> None:
        """Give the place back. ``measured``: ``now_us - started_us`` is the upstream's latency
        for it (a response, or a timeout); False for a request that tells nothing of the
        upstream's load (it failed to connect, the client went away first)."""
        self.in_flight -= 1
        if self.cold:
            self._release_cold(started_us, now_us, measured)
            return
        if not measured:
            return
        latency_us = now_us - started_us
        if latency_us < 0:
            latency_us = 0
        if self.probing:
            # Requests started before the probe may have run beside many others.
            if started_us >= self._probe_started_us:
                self._probe_samples.append(latency_us)
            self._maybe_end_probe(now_us)
            return
        self._seen += 1
        if self._seen % self._stride == 0:
            samples = self._samples
            samples.append(latency_us)
            if len(samples) >= MAX_SAMPLES:
                del samples[1::2]
                self._stride *= 2
        if now_us - self._window_start_us >= self.params.sample_interval_us:
            self._update(now_us)

    def _release_cold(self, started_us: int, now_us: int, measured: bool) -> None:
        """At the cold start: the latency of a request started while few were in flight is
        one of the minimum's; none in 2 s, and the limit is pinned for a probe."""
        starts = self._cold_starts
        low = starts.pop(started_us, 0)
        if low > 1:
            starts[started_us] = low - 1
        samples = self._probe_samples
        if low and measured:
            samples.append(max(now_us - started_us, 0))
        elapsed_us = now_us - self._probe_started_us
        if samples:
            # Not the probe's 2 s: while it measures, a cold upstream taking more than it can
            # serve queues them. One sample interval, then the gradient acts on what it has
            # (the next probe measures the minimum again).
            if len(samples) >= self.params.probe_requests or (
                elapsed_us >= self.params.sample_interval_us
            ):
                self._end_probe(now_us)
            return
        if elapsed_us < MAX_PROBE_US:
            return
        self.cold = False  # all at once from the start: measure at the floor, go on from it
        self._cold_starts = {}
        self.estimate = float(self.params.min_limit)
        self._start_probe(now_us)

    def _update(self, now_us: int) -> None:
        samples = self._samples
        if len(samples) < MIN_SAMPLES:
            return  # too few to judge: the interval goes on
        params = self.params
        sample_us = trimmed_mean(samples)
        self.sample_latency_us = sample_us
        self.adjustments += 1
        minimum = self.min_latency_us
        tolerated = minimum * (1.0 + params.buffer)
        if tolerated < minimum + params.min_buffer_us:
            tolerated = float(minimum + params.min_buffer_us)
        gradient = tolerated / sample_us if sample_us > 0 else 1.0 + params.buffer
        if gradient < MIN_GRADIENT:
            gradient = MIN_GRADIENT
        elif gradient > 1.0 + params.buffer:
            gradient = 1.0 + params.buffer
        if gradient > 1.0 and self._peak * 2 < self.estimate:
            gradient = 1.0  # the demand did not reach the limit: no evidence it could be higher
        busy = self._peak >= self.limit
        if self._slow_start and sample_us > tolerated:
            self._slow_start = False
        if self._slow_start:
            step = SLOW_START_STEP if gradient > 1.0 else 1.0
        else:
            step = 1.0 + SMOOTHING * (gradient - 1.0)
        self._set_estimate(self.estimate * step)
        self._reset_window(now_us)
        # Held at the floor while requests wanted more: measuring the minimum again costs
        # nothing then (a probe holds the limit there too), and a minimum measured at a lucky
        # moment, or an upstream whose base latency rose, would keep it there.
        self._at_floor = self._at_floor + 1 if busy and self.limit == params.min_limit else 0
        # A rough minimum from the cold start, and the limit, demanded in full, no longer cut:
        # the cold start's queue is gone; measure the minimum in full. A rough one can be a
        # tenth low, a tolerance no higher than the upstream's own mean latency, which holds
        # the limit wherever it is.
        settled = self._rough_minimum and busy and sample_us <= tolerated
        if now_us >= self._next_probe_us or self._at_floor >= FLOOR_SAMPLES_BEFORE_PROBE or settled:
            self._start_probe(now_us)

    def _set_estimate(self, estimate: float) -> None:
        params = self.params
        if estimate < params.min_limit:
            estimate = float(params.min_limit)
        elif estimate > params.max_limit:
            estimate = float(params.max_limit)
        self.estimate = estimate
        self.limit = int(estimate)

    def _reset_window(self, now_us: int) -> None:
        self._window_start_us = now_us
        self._samples = []
        self._seen = 0
        self._stride = 1
        self._peak = self.in_flight

    def _start_probe(self, now_us: int) -> None:
        self.probing = True
        self.probes += 1
        self._resume_estimate = self.estimate
        self.limit = self.params.min_limit
        self._probe_started_us = now_us
        self._probe_samples = []
        self._at_floor = 0

    def _maybe_end_probe(self, now_us: int) -> None:
        params = self.params
        taken = len(self._probe_samples)
        if taken < params.probe_requests and not (
            taken and now_us - self._probe_started_us >= MAX_PROBE_US
        ):
            return
        self._end_probe(now_us)

    def _end_probe(self, now_us: int) -> None:
        params = self.params
        # At least 1 us: a zero minimum would read any latency as infinitely far above it.
        self.min_latency_us = max(trimmed_mean(self._probe_samples), 1)
        self._rough_minimum = self.cold and len(self._probe_samples) < params.probe_requests
        self.probing = False
        if self.cold:
            self.cold = False
            self._cold_starts = {}
        self._probe_samples = []
        self._set_estimate(self._resume_estimate)
        # From the floor (the start, or a probe the floor called for), find the level fast.
        self._slow_start = self.limit == params.min_limit
        self._reset_window(now_us)
        spread = 1.0 + params.jitter * self._random()
        self._next_probe_us = now_us + int(params.probe_interval_us * spread)
