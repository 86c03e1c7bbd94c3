"""Cost in predicted time: each worker's TTFT and TPOT, learned online from what its answers took.

Beside the block cost (core/scheduling/block_cost_scorer.py, the default): with `--cost-model time` (the
`predicted-time-scorer`, core/scheduling/predicted_time_scorer.py) the pick minimises the predicted
time to first token (plus a TPOT term once a worker's decode speed is learned), and, when the request carries
llm-d's SLO headers (`x-slo-ttft-ms`, `x-slo-tpot-ms`, parsed at the edge into `Slo`), only among the workers
predicted to meet them. When none can, a sheddable request (its objective's priority < 0, as flow control
reads it) is refused (PickError SLO_UNMET, a 429 at the edge) and any other is routed best effort.

The model, per worker, in plain numbers (no sample is kept, so memory is a few floats per worker):

    TTFT = overhead + a * prefill_tokens + b * decode_tokens
      prefill_tokens = block size * prefill_load_scale * max(booked prefill blocks ahead + this prompt's blocks
                       - overlap_credit * cached blocks, 0)    (the queue ahead and the request's own work)
      decode_tokens  = block size * (decode blocks in flight + unbooked blocks)   (decode interference, and
                       the load this picker did not book, from the worker's scraped queue/running)
    TPOT = d0 + d1 * batch       (batch = requests in flight on the worker, this one included)

Each is an exponentially weighted least-squares fit (`Fit`) pulled towards a prior worth `PRIOR_SAMPLES`
samples. Before a worker has samples its TTFT prediction, the prior with a = b, is
`overhead + k * block_size * block cost` (the features are the block cost's own terms), an
increasing affine map of the block cost with the same constants on every worker, so a cold pool picks
exactly what the block cost picks (ties included); the decode term joins the cost only in proportion to what
was learned (`Fit.confidence`), for the same reason. A sample is the picker's own stopwatch: commit -> first
non-empty response chunk (the same instant `booking.prefill_done` is taken), and first chunk -> stream end
over the usage's completion tokens. Image encoder time and prefill/decode transfer time are not modelled
terms: they land in the fitted overhead and rate (docs/time-cost.md).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from epp_extproc.core.load import EndpointLoad

TTFT_HEADER = "x-slo-ttft-ms"  # llm-d-inference-scheduler @520af47: predictedlatency/plugin.go TTFTSLOHeaderKey
TPOT_HEADER = "x-slo-tpot-ms"  # same file, TPOTSLOHeaderKey; also admitter/latencyslo/plugin.go
# Priors (seconds): what a cold worker is assumed to cost. Only their ratios matter for a cold pick (it equals
# the block cost's); their size sets how soon samples outweigh them.
PRIOR_OVERHEAD_S = 0.010
PRIOR_S_PER_TOKEN = 5e-5  # 20k prefill tokens/s
PRIOR_TPOT_S = 0.010
PRIOR_TPOT_PER_REQUEST_S = 0.0005
PRIOR_SAMPLES = 2.0  # the prior weighs as much as this many samples (then fades: ~1% of a full memory)
DECAY = 0.995  # each new sample multiplies the old ones' weight by this: ~200 samples of memory
TPOT_TOKENS = 16.0  # the TPOT term of the cost: this many output tokens' worth of predicted TPOT
MAX_WORKERS = 4096  # models kept (least recently used dropped): addresses come from discovery, bounded anyway


@dataclass(frozen=True, slots=True)
class Slo:
    """A request's latency objectives in milliseconds, None where not asked (llm-d: <= 0 means not set)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def any(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None


def parse_slo(headers: Mapping[str, list[str]]) -> tuple[Slo | None, tuple[str, ...]]:
    """The SLO headers as numbers, and the names of the malformed ones. Like llm-d (predictedlatency
    plugin.go `parseFloatHeader`: a non-float is logged and read as 0), a malformed value is ignored, not
    a 400; here it is also counted. A value <= 0 or not finite means no objective (llm-d: `ttftSLO > 0`)."""
    values: dict[str, float | None] = {}
    bad: list[str] = []
    for name in (TTFT_HEADER, TPOT_HEADER):
        raw = headers.get(name)
        if not raw:
            values[name] = None
            continue
        try:
            v = float(raw[-1].strip()[:64])
        except ValueError:
            bad.append(name)
            values[name] = None
            continue
        if not math.isfinite(v):
            bad.append(name)
            v = 0.0
        values[name] = v if v > 0 else None
    slo = Slo(values[TTFT_HEADER], values[TPOT_HEADER])
    return (slo if slo.any else None), tuple(bad)


class Fit:
    """y ~ theta . x (x[0] = 1, the intercept) by exponentially weighted least squares, pulled towards a prior
    theta0 worth `prior_samples` samples (scaled per feature by the samples' own spread: units do not matter).
    Coefficients are kept >= 0: a worker does not get faster with more work."""

    __slots__ = ("prior", "prior_samples", "decay", "n", "xx", "xy", "_theta")

    def __init__(self, prior: Sequence[float], prior_samples: float = PRIOR_SAMPLES, decay: float = DECAY) -> None:
        k = len(prior)
        self.prior = tuple(float(p) for p in prior)
        self.prior_samples = prior_samples
        self.decay = decay
        self.n = 0.0  # effective sample count
        self.xx = [[0.0] * k for _ in range(k)]
        self.xy = [0.0] * k
        self._theta: tuple[float, ...] | None = None

    def add(self, x: Sequence[float], y: float) -> None:
        if not math.isfinite(y) or any(not math.isfinite(v) for v in x):
            return
        d = self.decay
        k = len(self.prior)
        self.n = self.n * d + 1.0
        for i in range(k):
            row = self.xx[i]
            for j in range(k):
                row[j] = row[j] * d + x[i] * x[j]
            self.xy[i] = self.xy[i] * d + x[i] * y
        self._theta = None

    @property
    def confidence(self) -> float:
        """0 with no samples, towards 1 as they outweigh the prior."""
        return self.n / (self.n + self.prior_samples)

    def theta(self) -> tuple[float, ...]:
        if self._theta is None:
            self._theta = self._solve() if self.n > 0 else self.prior
        return self._theta

    def _solve(self) -> tuple[float, ...]:
        k = len(self.prior)
        a = [row[:] for row in self.xx]
        b = self.xy[:]
        for i in range(k):
            # feature 0 is the constant 1; the others are weighed by their spread around their mean, so a
            # feature that never varied keeps its prior and the intercept is not bent to pay for it. The pull
            # fades as samples come (x prior / (n + prior)): intercept and slopes are correlated, and a fixed
            # pull on the intercept would bias the slopes for ever
            mean = self.xx[0][i] / self.n
            spread = self.xx[i][i] / self.n - (mean * mean if i else 0.0)
            fade = self.prior_samples / (self.n + self.prior_samples)
            w = self.prior_samples * fade * max(spread, 0.0) + 1e-12
            a[i][i] += w
            b[i] += w * self.prior[i]
        theta = _solve(a, b)
        if theta is None:
            return self.prior
        return tuple(max(t, 0.0) for t in theta)

    def predict(self, x: Sequence[float]) -> float:
        return max(sum(t * v for t, v in zip(self.theta(), x, strict=True)), 0.0)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting on a k x k system (k <= 3); None when singular."""
    k = len(b)
    for col in range(k):
        piv = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-300:
            return None
        a[col], a[piv] = a[piv], a[col]
        b[col], b[piv] = b[piv], b[col]
        for r in range(col + 1, k):
            f = a[r][col] / a[col][col]
            for c in range(col, k):
                a[r][c] -= f * a[col][c]
            b[r] -= f * b[col]
    x = [0.0] * k
    for r in range(k - 1, -1, -1):
        x[r] = (b[r] - sum(a[r][c] * x[c] for c in range(r + 1, k))) / a[r][r]
    return x if all(math.isfinite(v) for v in x) else None


@dataclass(frozen=True, slots=True)
class Features:
    """What the prediction was made from, kept until the answer says how long it took."""

    prefill_tokens: float
    decode_tokens: float
    batch: float

    def ttft_x(self) -> tuple[float, float, float]:
        return 1.0, self.prefill_tokens, self.decode_tokens


class WorkerModel:
    """One worker's TTFT and TPOT fits."""

    __slots__ = ("ttft", "tpot")

    def __init__(self) -> None:
        self.ttft = Fit((PRIOR_OVERHEAD_S, PRIOR_S_PER_TOKEN, PRIOR_S_PER_TOKEN))
        self.tpot = Fit((PRIOR_TPOT_S, PRIOR_TPOT_PER_REQUEST_S))

    def predict_ttft(self, f: Features) -> float:
        """Cold (the prior, same rate for both token kinds): overhead + rate * block size * block cost, an
        increasing affine map of the block cost, the same on every worker of one block size."""
        return self.ttft.predict(f.ttft_x())

    def predict_tpot(self, f: Features) -> float:
        return self.tpot.predict((1.0, f.batch))


@dataclass(slots=True)
class Observation:
    """One routed request's stopwatch: the pipeline makes it at commit, the exchange reports to it."""

    model: TimeCost
    address: str
    features: Features
    predicted_ttft_s: float
    started: float
    first_at: float | None = None

    def first_chunk(self, now: float | None = None) -> None:
        if self.first_at is not None:
            return
        self.first_at = time.monotonic() if now is None else now
        self.model.observe_ttft(self, self.first_at - self.started)

    def finished(self, completion_tokens: int | None, now: float | None = None) -> None:
        """The stream ended; with at least two output tokens, the mean inter-token time is a TPOT sample."""
        if self.first_at is None or completion_tokens is None or completion_tokens < 2:
            return
        end = time.monotonic() if now is None else now
        self.model.observe_tpot(self, (end - self.first_at) / (completion_tokens - 1))


class TimeCost:
    """Every worker's model, the time-based choice, and the metrics hooks (plain callables)."""

    def __init__(self, *, on_error: Callable[[str, float, float], None] | None = None,
                 max_workers: int = MAX_WORKERS) -> None:
        self._models: OrderedDict[str, WorkerModel] = OrderedDict()
        self._waiting: dict[str, Observation] = {}  # booking id -> its stopwatch, until the first chunk or the end
        self._on_error = on_error  # (address, observed s, predicted s) for the prediction error metric
        self.max_workers = max_workers

    def model(self, address: str) -> WorkerModel:
        m = self._models.get(address)
        if m is None:
            m = self._models[address] = WorkerModel()
            if len(self._models) > self.max_workers:
                self._models.popitem(last=False)
        else:
            self._models.move_to_end(address)
        return m

    def forget(self, address: str) -> None:
        self._models.pop(address, None)

    @staticmethod
    def features(load: EndpointLoad, prompt_blocks: float, overlap_blocks: int, block_size: float,
                 overlap_credit: float, prefill_load_scale: float) -> Features:
        prefill = max(load.prefill_blocks + prompt_blocks - overlap_credit * overlap_blocks, 0.0)
        return Features(prefill_tokens=block_size * prefill_load_scale * prefill,
                        decode_tokens=block_size * (load.decode_blocks + load.unbooked_blocks),
                        batch=load.inflight + 1.0)

    def predict(self, address: str, f: Features) -> tuple[float, float, float]:
        """(TTFT s, TPOT s, time cost) of a request with features `f` on `address`."""
        m = self.model(address)
        ttft, tpot = m.predict_ttft(f), m.predict_tpot(f)
        return ttft, tpot, ttft + TPOT_TOKENS * m.tpot.confidence * tpot

    def observe(self, address: str, f: Features, predicted_ttft_s: float,
                booking_id: str | None = None) -> Observation:
        """Start the stopwatch of a committed pick. With `booking_id`, the booking's own `prefill_done`
        (seen through `on_booking`) stops it: that works in lean mode too, where no response chunk crosses
        the picker and only the first-chunk signal does."""
        o = Observation(self, address, f, predicted_ttft_s, time.monotonic())
        if booking_id is not None:
            self._waiting[booking_id] = o
        return o

    def on_booking(self, kind: str, booking_id: str, address: str) -> None:
        """A local booking changed (core/load.LoadTracker listener): `prefill_done` is the first chunk;
        `free` ends the wait (a request that failed before its first chunk teaches nothing); `move` means the
        gateway served it elsewhere, so the sample is that worker's."""
        if kind == "prefill_done":
            o = self._waiting.pop(booking_id, None)
            if o is not None:
                o.first_chunk()
        elif kind == "free":
            self._waiting.pop(booking_id, None)
        elif kind == "move":
            o = self._waiting.get(booking_id)
            if o is not None:
                o.address = address

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def observe_ttft(self, o: Observation, seconds: float) -> None:
        if seconds < 0:
            return
        if self._on_error is not None:
            self._on_error(o.address, seconds, o.predicted_ttft_s)
        self.model(o.address).ttft.add(o.features.ttft_x(), seconds)

    def observe_tpot(self, o: Observation, seconds: float) -> None:
        if seconds >= 0:
            self.model(o.address).tpot.add((1.0, o.features.batch), seconds)

    def snapshot(self) -> dict[str, dict[str, object]]:
        """Per worker: the fitted coefficients and how much they weigh (GET /debug/score shows predictions)."""
        return {a: {"ttft_theta": [round(t, 9) for t in m.ttft.theta()], "ttft_samples": round(m.ttft.n, 2),
                    "tpot_theta": [round(t, 9) for t in m.tpot.theta()], "tpot_samples": round(m.tpot.n, 2)}
                for a, m in self._models.items()}


def meets(ttft_s: float | None, tpot_s: float | None, slo: Slo) -> bool:
    if slo.ttft_ms is not None and (ttft_s is None or ttft_s * 1000.0 > slo.ttft_ms):
        return False
    return not (slo.tpot_ms is not None and (tpot_s is None or tpot_s * 1000.0 > slo.tpot_ms))
