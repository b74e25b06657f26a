"""The engines' own prefill cost teaches the TTFT model: vLLM's per-request prefill records (read from its
/metrics, differenced between scrapes) fit a per-token cost, which becomes the prior the first-byte fit is
pulled toward. Against a real HTTP peer serving a body rendered by prometheus_client with vLLM's names.

Here the tests that start a server or bind a socket; the rest, in process:
tests/unit/picker/pool/test_calibration_engine_fit.py."""

from __future__ import annotations

from picker.pool.engine_signals import EngineSignalScraper
from picker.pool.pool import Pool
from tests.support.engine_metrics import VllmPrefillRecords, engines, pool_config


async def test_the_scraper_differences_the_engines_records_into_the_pools_fit() -> None:
    async with engines(1) as [(engine, address)]:
        pool = Pool(pool_config({"e0": address}))
        scraper = EngineSignalScraper(pool, None, clock=lambda: 1000.0)
        rec = VllmPrefillRecords()
        rec.finish(9.0, 100)  # before the picker started: never observed (the first scrape is a baseline)
        try:
            engine.body = rec.body()
            await scraper.scrape_round()
            assert pool.calibrator.engine.requests == 0
            rec.finish(0.6, 1600)
            rec.finish(0.05, 100)
            engine.body = rec.body()
            await scraper.scrape_round()
            fit = pool.calibrator.engine
            assert fit.requests == 2 and abs(fit.sy / fit.sw - 325.0) < 1e-6  # mean prefill ms of the two
            await scraper.scrape_round()  # nothing finished since: nothing observed
            assert pool.calibrator.engine.requests == 2
            # a reading taken mid-update (one histogram counts a request the other does not yet): no totals, and
            # the base stays the last good reading, so the requests finished around it are all counted next
            rec.finish(0.1, 100)
            rec.time.labels("m", "0").observe(0.2)  # the next request's time, its tokens not yet recorded
            engine.body = rec.body()
            await scraper.scrape_round()
            assert pool.calibrator.engine.requests == 2
            rec.tokens.labels("m", "0").observe(300)
            rec.finish(0.3, 300)
            engine.body = rec.body()
            await scraper.scrape_round()
            assert pool.calibrator.engine.requests == 5  # the three finished since the last good reading
            fresh = VllmPrefillRecords()  # the engine restarted: its counters start again
            fresh.finish(0.1, 200)
            engine.body = fresh.body()
            await scraper.scrape_round()
            assert pool.calibrator.engine.requests == 5  # a new baseline, nothing negative observed
            fresh.finish(0.2, 500)
            engine.body = fresh.body()
            await scraper.scrape_round()
            assert pool.calibrator.engine.requests == 6
        finally:
            await scraper.close()
