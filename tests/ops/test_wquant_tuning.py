"""The weight-quantized kernels' tuner (`lightspeed.ops.wquant.tuning`): the candidates, the timers, the
pick and its disk cache, the M buckets. The tuner's use by the kernels (plans, tuning on the first call)
is tested in test_wquant_triton.py and test_wquant_grouped.py."""
from __future__ import annotations

import pytest
import torch


def test_autotune_candidates_are_few_valid_and_bounded():
    """The tuner's candidates: <= 20 configs (most in both product forms), distinct, SPLIT_K
    within max_split_k(M) and K-tiles, 8 warps for accumulators of M > 16 at BLOCK_N 128, stream-K only for
    M <= 16 and >= 2 units per program."""
    pytest.importorskip("triton")
    from lightspeed.ops.wquant import tuning as wt

    for m, n, k in [(1, 8192, 8192), (16, 28672, 8192), (64, 8192, 28672), (200, 4096, 4096), (1, 48, 256),
                    (12, 8192, 4096)]:
        cands = wt.candidate_configs(m, n, k, 128, 132)
        assert 1 <= len(cands) <= 20 and len({tuple(c.items()) for c in cands}) == len(cands)
        streams = [c for c in cands if c["STREAM"]]
        assert bool(streams) == (m <= wt.MAX_STREAM_M and n > 64)
        for c in cands:
            bn, sk, w, s = c["BLOCK_N"], c["SPLIT_K"], c["num_warps"], c["num_stages"]
            assert set(c) == {"BLOCK_N", "SPLIT_K", "ONE_DOT", "STREAM", "num_warps", "num_stages"}
            assert bn in wt.BLOCK_NS and s in (3, 4) and c["ONE_DOT"] in (0, 1)
            assert sk in wt.SPLIT_KS or (sk, bn, c["ONE_DOT"]) == (3, 64, 1) and m <= wt.BN64_SPLIT3_MAX_M
            assert sk == 1 or (sk <= wt.max_split_k(m) and wt.num_k_tiles(k, 128) >= 2 * sk)
            assert w == (8 if m > 16 and bn == 128 else 4)
            assert not (n <= 64 and bn == 128)
        for c in streams:
            assert c["SPLIT_K"] == 1 and c["STREAM"] * 132 * 2 <= -(-n // 128) * wt.num_k_tiles(k, 128)
    splits = {c["SPLIT_K"] for c in wt.candidate_configs(1, 8192, 8192, 128, 132)
              if c["BLOCK_N"] == 128 and not c["STREAM"]}
    # 64 N blocks: 384 programs (one wave of 3 per SM), 256 and 512 were the best on the H200
    assert splits == {4, 6, 8}
    for m in (1, 8, 16):
        assert [(c["SPLIT_K"], c["num_stages"]) for c in wt.candidate_configs(m, 8192, 8192, 128, 132)
                if c["BLOCK_N"] == 64 and c["SPLIT_K"] == 3] == [(3, 3), (3, 4)]
    assert not [c for m in (17, 32) for c in wt.candidate_configs(m, 8192, 8192, 128, 132) if c["SPLIT_K"] == 3]
    assert not [c for c in wt.candidate_configs(1, 8192, 640, 128, 132) if c["SPLIT_K"] == 3]  # 5 K-tiles


@pytest.mark.parametrize("timer", ["graph_bench", "rotation_bench"])
def test_timers_refuse_graph_capture(monkeypatch, timer):
    """Tuning (which captures graphs of its own) inside a caller's CUDA-graph capture gets a clear error
    naming the fix, before touching the device."""
    pytest.importorskip("triton")
    from lightspeed.ops.wquant import tuning

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    calls = []
    with pytest.raises(RuntimeError, match="before capturing"):
        if timer == "graph_bench":
            tuning.graph_bench(lambda: calls.append(1))
        else:
            tuning.rotation_bench(lambda i: calls.append(i), 2)
    assert not calls


def test_pick_fastest_skips_what_does_not_compile_and_times_close_ones_twice():
    """`pick_fastest`: configs that fail to compile (OutOfResources) are skipped; those within REFINE of the
    fastest are timed again and ranked by their mean, so a lucky first timing does not decide; far ones
    are timed once; nothing that compiles is an error naming the problem."""
    pytest.importorskip("triton")
    from triton.runtime.errors import OutOfResources

    from lightspeed.ops.wquant import tuning

    times = {1: [1.00, 1.06], 2: [1.01, 1.01], 3: [1.5], 4: None}
    calls = []

    def bench(cfg):
        calls.append(cfg["SPLIT_K"])
        if times[cfg["SPLIT_K"]] is None:
            raise OutOfResources(300000, 232448, "shared memory")
        return times[cfg["SPLIT_K"]][calls.count(cfg["SPLIT_K"]) - 1]

    cands = [tuning.make_config(128, sk, 4, 3) for sk in (1, 2, 3, 4)]
    best, timings = tuning.pick_fastest(cands, bench, "test")
    assert best == cands[1] and sorted(calls) == [1, 1, 2, 2, 3, 4]
    assert timings[tuple(cands[0].items())] == pytest.approx(1.03) and tuple(cands[3].items()) not in timings
    with pytest.raises(RuntimeError, match="test: no kernel config fits"):
        tuning.pick_fastest([cands[3]], bench, "test")


def test_tuning_disk_cache_reuses_validates_and_rewrites(monkeypatch, tmp_path):
    """`cached_pick`: a class tuned once is read back from the cache directory (no timing) by a later
    process (the in-memory picks are gone: the file is all there is); another key or candidate list is
    tuned afresh; a corrupt file or one naming a config outside the candidates is logged, tuned again and
    replaced; the file is JSON, nothing unpickled."""
    pytest.importorskip("triton")
    import json

    from triton.runtime.cache import FileCacheManager

    from lightspeed.ops.wquant import tuning

    monkeypatch.setattr(tuning, "_cache_file", lambda kernel, key, cands: (
        FileCacheManager(str(abs(hash((repr(key), repr(cands)))))), "k.tuning.json"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    cands = [tuning.make_config(128, sk, 4, 3) for sk in (1, 2)]
    tunings = []

    def tune(pick=1):
        tunings.append(pick)
        return cands[pick], {tuple(c.items()): 1.0 for c in cands}

    assert tuning.cached_pick(None, ("a",), cands, tune) == cands[1] and tunings == [1]
    assert tuning.cached_pick(None, ("a",), cands, tune) == cands[1] and tunings == [1]
    assert tuning.cached_pick(None, ("b",), cands, lambda: tune(0)) == cands[0] and tunings == [1, 0]
    path, = [p for p in tmp_path.rglob("k.tuning.json") if json.loads(p.read_text())["config"] == cands[1]]
    for bad in ("{not json", json.dumps({"config": tuning.make_config(64, 16, 4, 3)}), "[]"):
        path.write_text(bad)
        assert tuning.cached_pick(None, ("a",), cands, tune) == cands[1]
        assert json.loads(path.read_text())["config"] == cands[1]
    assert tunings == [1, 0, 1, 1, 1]


def test_tuning_disk_cache_unavailable_is_logged_not_fatal(monkeypatch, ls_caplog):
    """A cache directory that cannot be made (or a file that cannot be written) costs the disk cache only:
    the pick is tuned and returned, one warning says so."""
    pytest.importorskip("triton")
    from lightspeed.ops.wquant import tuning

    class ReadOnly:
        def get_file(self, name):
            return None

        def put(self, data, name):
            raise PermissionError(13, "Permission denied", "/read-only/cache")

    cands = [tuning.make_config(128, sk, 4, 3) for sk in (1, 2)]
    monkeypatch.setattr(tuning, "_cache_warned", False)
    monkeypatch.setattr(tuning, "_cache_file", lambda kernel, key, c: (ReadOnly(), "k.tuning.json"))
    assert tuning.cached_pick(None, ("a",), cands, lambda: (cands[1], {})) == cands[1]

    def unmakeable(kernel, key, c):
        raise PermissionError(13, "Permission denied", "/read-only")

    monkeypatch.setattr(tuning, "_cache_file", unmakeable)
    assert tuning.cached_pick(None, ("b",), cands, lambda: (cands[0], {})) == cands[0]
    warnings = [r for r in ls_caplog.records if "tuning disk cache is unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "Permission denied" in warnings[0].getMessage()


def test_tune_m_buckets_prefill_lengths():
    pytest.importorskip("triton")
    from lightspeed.ops.wquant.tuning import tune_m

    got = [tune_m(m) for m in (1, 2, 17, 63, 64, 65, 100, 128, 129, 511, 512, 513)]
    assert got == [1, 2, 17, 63, 64, 128, 128, 128, 256, 512, 512, 1024]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times CUDA graphs")
@pytest.mark.parametrize("timer", ["graph_bench", "rotation_bench"])
def test_timers_match_event_timing(timer):
    """The tuner's timers (`tuning.graph_bench`: graphs of n x (L2 flush, call) minus n x flush;
    `tuning.rotation_bench`: a graph of calls back to back over copies) agree with events around single
    calls for a kernel long enough that launch gaps do not matter."""
    from lightspeed.ops.wquant import tuning

    src = [torch.empty(1 << 28, dtype=torch.uint8, device="cuda") for _ in range(2)]
    dst = torch.empty_like(src[0])
    if timer == "graph_bench":
        ms = tuning.graph_bench(lambda: dst.copy_(src[0]))
    else:
        ms = tuning.rotation_bench(lambda i: dst.copy_(src[i]), 2)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(11):
        start.record()
        dst.copy_(src[i % 2])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    ref = sorted(times)[5]
    assert 0.85 * ref < ms < 1.15 * ref, (ms, ref)


def test_timings_are_none_after_a_pick_from_the_disk_cache(monkeypatch):
    """`autotune_timings` reports the latest tuning this process timed: after a class whose pick came from
    the disk cache it is None, not the previous class's timings."""
    pytest.importorskip("triton")
    from lightspeed.ops.wquant import quantize, tuning
    from lightspeed.ops.wquant import triton as wt

    from types import SimpleNamespace

    cfg = tuning.make_config(128, 4, 4, 3)
    monkeypatch.setattr(wt, "num_sms", lambda: 132)
    monkeypatch.setattr(wt, "driver", SimpleNamespace(active=SimpleNamespace(get_current_device=lambda: 0)))
    monkeypatch.setattr(wt, "_last_timings", {tuple(cfg.items()): 0.01})
    assert wt.autotune_timings() == {tuning.describe(cfg): 0.01}
    monkeypatch.setattr(wt, "cached_pick", lambda kernel, key, candidates, tune: dict(cfg))
    qw = quantize(torch.randn(256, 512), "int4")
    assert wt._tune(torch.zeros(2, 512, dtype=torch.float16), qw, None, 1) == cfg
    assert wt.autotune_timings() is None
