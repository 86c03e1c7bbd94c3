"""Reading the engines' own gauges: the text parser on each engine's names, and the scraper against a real
mock worker (real HTTP) whose gauges follow its real queue."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from epp_extproc.adapters.worker_metrics import WorkerMetricsScraper, parse_gauges
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from epp_extproc.core.load import LoadTracker
from epp_extproc.core.saturation import SaturationDetector, Thresholds
from tests.mock.test_mock_support import chat_body, running_worker

TRTLLM = """# HELP trtllm_num_requests_waiting Requests waiting for admission
# TYPE trtllm_num_requests_waiting gauge
trtllm_num_requests_waiting 3.0
trtllm_num_requests_running 8.0
trtllm_kv_cache_utilization 0.5
trtllm_max_num_active_requests 8.0
"""

VLLM = """vllm:num_requests_running{engine="0",model_name="m"} 4.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 5.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
vllm:request_queue_time_seconds_bucket{le="0.3",model_name="m"} 9.0
"""


def test_trtllm_gauges_are_read() -> None:
    g = parse_gauges(TRTLLM)
    assert (g.waiting, g.running, g.kv_utilization, g.max_running) == (3.0, 8.0, 0.5, 8.0)


def test_vllm_series_are_summed_for_requests_and_maxed_for_kv() -> None:
    g = parse_gauges(VLLM)
    assert (g.waiting, g.running, g.kv_utilization) == (6.0, 6.0, 0.75)


def test_older_vllm_kv_name_is_read() -> None:
    assert parse_gauges('vllm:gpu_cache_usage_perc{model_name="m"} 0.4\n').kv_utilization == 0.4


def test_sglang_gauges_are_read_with_either_separator() -> None:
    g = parse_gauges('sglang:num_queue_reqs{tp_rank="0"} 7\nsglang_num_running_reqs 3\nsglang:token_usage 0.9\n')
    assert (g.waiting, g.running, g.kv_utilization) == (7.0, 3.0, 0.9)


def test_names_sharing_a_prefix_and_bad_values_are_ignored() -> None:
    text = ("trtllm_num_requests_waiting_total 99\ntrtllm_num_requests_waiting NaN\n"
            "trtllm_num_requests_running -3\ntrtllm_num_requests_running{a=\"}\" 1\n")
    g = parse_gauges(text)
    assert g.waiting is None and g.running is None


def test_kv_utilization_given_as_a_percentage_is_scaled() -> None:
    assert parse_gauges("trtllm_kv_cache_utilization 85\n").kv_utilization == 0.85


# ------------------------------------------------------------------------------------------- the scraper
def setup(address: str, thresholds: Thresholds | None = None, **kw: object) \
        -> tuple[WorkerMetricsScraper, SaturationDetector, LoadTracker]:
    reg = EndpointRegistry()
    reg.replace([Endpoint("w", address)])
    load = LoadTracker()
    det = SaturationDetector(thresholds or Thresholds(queue_depth=1), load.loads, block_size=32)
    return WorkerMetricsScraper(reg, load, det, **kw), det, load  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def session(scraper: WorkerMetricsScraper) -> AsyncIterator[None]:
    try:
        yield
    finally:
        await scraper.close()  # its kept-alive connections


async def test_mock_worker_saturated_by_its_own_queue_is_seen_saturated() -> None:
    async with running_worker(kv_events=False, max_batch_size=1, decode_ms_per_token=50.0) as w, \
            aiohttp.ClientSession() as client:
        address = w.url.removeprefix("http://")
        scraper, det, _ = setup(address)
        async with session(scraper):
            assert await scraper.scrape_once(address)
            assert not det.state(address).saturated and det.samples[address].max_running == 1
            body = chat_body("hi") | {"max_tokens": 20}
            reqs = [asyncio.create_task(client.post(w.url + "/v1/chat/completions", json=body)) for _ in range(3)]
            while len(w.engine.waiting) < 2:
                await asyncio.sleep(0.01)
            assert await scraper.scrape_once(address)
            assert det.samples[address].waiting == 2 and det.state(address).saturated
            for r in reqs:
                r.cancel()
            await asyncio.gather(*reqs, return_exceptions=True)


async def serve(handler: web.RequestHandler) -> tuple[web.AppRunner, str]:  # type: ignore[name-defined]
    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"127.0.0.1:{runner.addresses[0][1]}"


async def test_answer_above_the_size_cap_is_refused_even_when_gzipped() -> None:
    big = (TRTLLM + "# padding " + "x" * 200_000 + "\n").encode()

    async def handler(_: web.Request) -> web.Response:
        return web.Response(body=gzip.compress(big), headers={"Content-Encoding": "gzip"},
                            content_type="text/plain")

    runner, address = await serve(handler)
    try:
        errors: list[str] = []
        scraper, det, _ = setup(address, max_bytes=64 * 1024, on_error=lambda a, why: errors.append(why))
        async with session(scraper):
            assert not await scraper.scrape_once(address)
        assert address not in det.samples and "larger than" in errors[0]
    finally:
        await runner.cleanup()


async def test_unbooked_load_is_what_the_engine_runs_beyond_this_pickers_bookings() -> None:
    async def handler(_: web.Request) -> web.Response:
        return web.Response(text="trtllm_num_requests_waiting 0\ntrtllm_num_requests_running 5\n")

    runner, address = await serve(handler)
    try:
        scraper, _, load = setup(address)
        for _ in range(2):
            load.book(address, 4.0)  # this picker's 2 requests, 4 blocks each
        scraper._update_mean()
        async with session(scraper):
            assert await scraper.scrape_once(address)
        assert load.load(address).unbooked_blocks == 3 * 4.0
    finally:
        await runner.cleanup()


async def test_failed_scrape_zeroes_the_unbooked_load() -> None:
    async def handler(_: web.Request) -> web.Response:
        return web.Response(status=404)

    runner, address = await serve(handler)
    try:
        scraper, _, load = setup(address)
        load.book(address, 1.0)
        load.load(address).unbooked_blocks = 7.0
        async with session(scraper):
            assert not await scraper.scrape_once(address)
        assert load.load(address).unbooked_blocks == 0.0
    finally:
        await runner.cleanup()


async def test_mock_kv_utilization_counts_only_blocks_running_requests_hold() -> None:
    async with running_worker(kv_events=False, num_blocks=64) as w, aiohttp.ClientSession() as client:
        async with client.post(w.url + "/v1/chat/completions", json=chat_body("warm the cache " * 80)) as r:
            assert r.status == 200
        assert w.cache.utilization > 0  # blocks stay cached after the request ...
        async with client.get(w.url + "/metrics") as r:
            g = parse_gauges(await r.text())
        assert g.kv_utilization == 0.0 and g.running == 0  # ... but nothing holds them: not "in use"


# ------------------------------------------------------------------------------------------- idle workers
def gauges_text(running: int) -> str:
    return TRTLLM.replace("trtllm_num_requests_running 8.0", f"trtllm_num_requests_running {running}") \
        .replace("trtllm_num_requests_waiting 3.0", "trtllm_num_requests_waiting 0")


async def scrapes_in(scraper: WorkerMetricsScraper, seconds: float) -> int:
    before = scraper.scrapes
    await asyncio.sleep(seconds)
    return scraper.scrapes - before


@contextlib.asynccontextmanager
async def scraping(running: int) -> AsyncIterator[tuple[WorkerMetricsScraper, SaturationDetector, LoadTracker, str]]:
    """A worker whose /metrics report `running` requests (none waiting), scraped every 20 ms, idle up to 320."""
    async def handler(_: web.Request) -> web.Response:
        return web.Response(text=gauges_text(running=running), content_type="text/plain")

    runner, address = await serve(handler)
    scraper, det, load = setup(address, interval_s=0.02, idle_interval_s=0.32)
    task = asyncio.create_task(scraper.run())
    try:
        yield scraper, det, load, address
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await runner.cleanup()


async def test_an_idle_worker_is_scraped_less_often_until_this_picker_books_on_it() -> None:
    async with scraping(running=0) as (scraper, _, load, address):
        await asyncio.sleep(0.7)  # 2 idle samples, then 40, 80, 160, 320 ms apart
        idle = await scrapes_in(scraper, 1.0)
        assert 2 <= idle <= 6, idle  # at the 20 ms interval this would be ~50
        booking = load.book(address, 4)
        busy = await scrapes_in(scraper, 0.5)
        assert busy >= 12, busy  # back to the interval at the next tick
        booking.free()


async def test_a_worker_running_other_gateways_requests_is_scraped_at_the_interval() -> None:
    async with scraping(running=1) as (scraper, det, _, address):
        await asyncio.sleep(0.2)
        assert await scrapes_in(scraper, 1.0) >= 25
        assert det.fresh(address) is not None


def _reference_parse(text: str) -> tuple[float | None, ...]:
    """The line-by-line reading the find-based parser replaced: every line, prefix test, then the value."""
    from epp_extproc.adapters.worker_metrics import _KIND, _sample_value

    sums: dict[str, float] = {}
    for line in text.splitlines():
        for name, kind in _KIND.items():
            if line.startswith(name):
                v = _sample_value(line[len(name):])
                if v is not None:
                    sums[kind] = max(sums.get(kind, 0.0), v) if kind in ("kv", "max_running") \
                        else sums.get(kind, 0.0) + v
    kv = sums.get("kv")
    if kv is not None and kv > 1.0:
        kv = min(kv / 100.0, 1.0)
    return sums.get("waiting"), sums.get("running"), kv, sums.get("max_running")


def test_the_parser_agrees_with_a_line_by_line_reading_of_any_exposition() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from epp_extproc.adapters.worker_metrics import _KIND

    names = sorted(_KIND) + ["vllm:num_requests_waiting_total", "trtllm_other", "# HELP vllm:num_requests_running x"]
    line = st.tuples(st.sampled_from(names), st.sampled_from(["", '{engine="0"}', '{a="}"}', "{"]),
                     st.sampled_from([" ", "\t", ""]),
                     st.sampled_from(["1", "0", "2.5", "-1", "NaN", "+Inf", "x", "150", ""]),
                     st.sampled_from(["", " 1700000000"])).map(lambda t: "".join(t))
    doc = st.lists(line, max_size=12).map(lambda ls: "\n".join(ls)) | \
        st.lists(line, max_size=12).map(lambda ls: "\r\n".join(ls) + "\r\n")

    @settings(max_examples=400, deadline=None)
    @given(doc)
    def check(text: str) -> None:
        g = parse_gauges(text)
        assert (g.waiting, g.running, g.kv_utilization, g.max_running) == _reference_parse(text)

    check()
