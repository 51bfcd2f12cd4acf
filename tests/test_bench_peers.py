"""The peer benchmarks' own logic: unpacking llama.cpp from an sdist, reusing a build, pooling the alternating
passes, and the ratios and targets computed only from what was measured in the run."""
from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
import tarfile
import time

import numpy as np
import psutil
import pytest

from benchmarks import bench_peers, llama_cpp_build
from benchmarks.process_cpu import CpuMeter
from benchmarks.serving_peer import pooled, ratio
from benchmarks.serving_report import targets
from benchmarks.serving_stats import RequestRecord


def _add(tar: tarfile.TarFile, name: str, text: str) -> None:
    data = text.encode()
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def test_unpack_takes_only_the_vendored_llama_cpp_tree(tmp_path):
    archive = tmp_path / "llama_cpp_python-9.9.9.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        _add(tar, "llama_cpp_python-9.9.9/pyproject.toml", "[project]\n")
        _add(tar, "llama_cpp_python-9.9.9/vendor/llama.cpp/CMakeLists.txt", "project(llama.cpp)\n")
        _add(tar, "llama_cpp_python-9.9.9/vendor/llama.cpp/tools/server/server.cpp", "int main(){}\n")
    tree = llama_cpp_build._unpack_llama_cpp(archive, tmp_path / "src")
    assert tree == tmp_path / "src" / "llama_cpp_python-9.9.9" / "vendor" / "llama.cpp"
    assert (tree / "tools" / "server" / "server.cpp").read_text() == "int main(){}\n"
    assert not (tmp_path / "src" / "llama_cpp_python-9.9.9" / "pyproject.toml").exists()


def test_unpack_refuses_an_archive_without_llama_cpp(tmp_path):
    archive = tmp_path / "other-1.0.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        _add(tar, "other-1.0/setup.py", "")
    with pytest.raises(SystemExit, match="no vendor/llama.cpp"):
        llama_cpp_build._unpack_llama_cpp(archive, tmp_path / "src")


def test_unpack_refuses_members_that_would_land_outside_the_tree(tmp_path):
    archive = tmp_path / "llama_cpp_python-9.9.9.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        _add(tar, "llama_cpp_python-9.9.9/vendor/llama.cpp/CMakeLists.txt", "project(llama.cpp)\n")
        _add(tar, "llama_cpp_python-9.9.9/vendor/llama.cpp/../../../../escaped.txt", "out\n")
    with pytest.raises(SystemExit, match="not plain files, directories or links inside"):
        llama_cpp_build._unpack_llama_cpp(archive, tmp_path / "src")
    assert not (tmp_path / "escaped.txt").exists()
    link = tarfile.TarInfo("llama_cpp_python-9.9.9/vendor/llama.cpp/passwd")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    with tarfile.open(archive, "w:gz") as tar:
        _add(tar, "llama_cpp_python-9.9.9/vendor/llama.cpp/CMakeLists.txt", "project(llama.cpp)\n")
        tar.addfile(link)
    with pytest.raises(SystemExit, match="not plain files"):
        llama_cpp_build._unpack_llama_cpp(archive, tmp_path / "src")


def _executable(path, script: str) -> None:
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_a_build_is_reused_only_when_both_binaries_run(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    assert llama_cpp_build.existing_build(tmp_path, "pkg") is None          # nothing built
    _executable(bin_dir / "llama-server", 'echo "version: 7000 (abc1234)" >&2\necho "built with cc" >&2\n')
    assert llama_cpp_build.existing_build(tmp_path, "pkg") is None          # llama-bench missing
    _executable(bin_dir / "llama-bench", "exit 1\n")
    assert llama_cpp_build.existing_build(tmp_path, "pkg") is None          # llama-bench does not run
    _executable(bin_dir / "llama-bench", 'echo "version: 7000 (abc1234)" >&2\n')
    found = llama_cpp_build.existing_build(tmp_path, "pkg")
    assert found is not None and found.version == "version: 7000 (abc1234)"
    assert found.server == bin_dir / "llama-server" and os.access(found.bench, os.X_OK)


def _record(tokens: int, ttft: float) -> RequestRecord:
    r = RequestRecord("p", "chat", "short", tokens, ok=True, ttft=ttft, e2e=ttft + 0.5, output_tokens=tokens)
    r.token_chunks = tokens
    return r


def test_pooled_passes_divide_all_tokens_by_the_summed_durations():
    first = ([_record(64, 0.1), _record(64, 0.3)], 10.0, 12.0)
    second = ([_record(32, 0.2)], 50.0, 51.0)
    s = pooled([first, second])
    assert s["total_output_tokens"] == 160
    assert s["output_tokens_per_s"] == pytest.approx(160 / 3.0)
    assert s["ttft_s"]["p50"] == pytest.approx(0.2)
    assert ratio(None, 1.0) is None and ratio(1.0, 0.0) is None and ratio(3.0, 2.0) == 1.5


def test_pooled_cpu_is_the_passes_cpu_over_their_summed_time_and_tokens():
    first = ([_record(64, 0.1), _record(64, 0.3)], 10.0, 12.0)
    second = ([_record(32, 0.2)], 50.0, 51.0)
    s = pooled([first, second], [{"server": 3.0, "client": 0.5}, {"server": 1.5, "client": 0.25}])
    assert s["cpu"]["server"]["cpu_s"] == pytest.approx(4.5)
    assert s["cpu"]["server"]["cores"] == pytest.approx(4.5 / 3.0)
    assert s["cpu"]["client"]["ms_per_output_token"] == pytest.approx(750.0 / 160)
    assert "cpu" not in pooled([first, second])


def test_cpu_meter_counts_a_servers_children_and_the_client_alone():
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 5: pass\n"
    server = subprocess.Popen([sys.executable, "-c",
                               f"import subprocess, sys; subprocess.run([sys.executable, '-c', {busy!r}])"])
    try:
        deadline = time.monotonic() + 20
        while not psutil.Process(server.pid).children() and time.monotonic() < deadline:
            time.sleep(0.02)
        meter = CpuMeter({"server": [(server.pid, True)], "client": [(os.getpid(), False)]})
        before = meter.read()
        time.sleep(0.4)   # the grandchild burns CPU meanwhile; this process sleeps
        used = meter.since(before)
    finally:
        for p in psutil.Process(server.pid).children(recursive=True):
            p.kill()
        server.kill()
        server.wait(30)
    assert used["server"] > 0.15            # the grandchild's time, counted with its server
    assert used["client"] < used["server"] / 2   # none of the children's time is this process's own


def _level(c: int, tokens_ratio: float, ttft_ratio: float) -> dict:
    return {"concurrency": c, "output_tokens_per_s_ratio": tokens_ratio, "ttft_p50_ratio": ttft_ratio}


def test_targets_come_from_the_measured_peer_only():
    without = targets({"levels": [], "overhead": []})
    assert not [k for k in without if "peer" in k]                          # no peer run, no peer figure
    result = {"levels": [], "overhead": [], "peer": {"levels": [_level(1, 1.3, 0.8), _level(16, 2.4, 0.9)]}}
    t = targets(result)
    assert t["c1_vs_peer_output_tokens_per_s"] == 1.3 and t["c1_vs_peer_output_tokens_per_s_met"] is True
    assert t["c16_vs_peer_output_tokens_per_s_met"] is False                # 2.4x < 2.5x
    assert t["c16_vs_peer_ttft_p50_met"] is True and "c1_vs_peer_ttft_p50_met" not in t
    t = targets({**result, "peer": {"levels": [_level(16, 2.6, 1.05)]}})
    assert t["c16_vs_peer_output_tokens_per_s_met"] is True and t["c16_vs_peer_ttft_p50_met"] is False


def _round(peer: dict, ours: dict, peer_avx2: dict | None = None) -> dict:
    builds = {"native": peer, "avx2": peer_avx2 or peer}
    return {"llama_bench": {level: {t: {"avg_ts": v} for t, v in p.items()} for level, p in builds.items()},
            "ours": {isa: {"machine": {"cpu_isa": "avx512vnni" if isa == "native" else isa},
                           "results": [{"decode_tok_s": d, "prefill_tok_s": {"128": p1, "512": p5}}]}
                     for isa, (d, p1, p5) in ours.items()}}


def test_engine_table_takes_medians_over_rounds_and_targets_by_level():
    rng = np.random.default_rng()
    peer = [rng.uniform(50, 150, 3) for _ in range(3)]                      # tg128, pp128, pp512 per round
    tests = ("tg128", "pp128", "pp512")
    rounds = [_round(dict(zip(tests, p)),
                     {"native": (2.1 * p[0], 2 * p[1], 0.9 * p[2]), "avx2": (1.4 * p[0], p[1], p[2])},
                     dict(zip(tests, 0.5 * p)))                              # llama.cpp's AVX2 build: half as fast
              for p in peer]
    rows = {(r["isa"], r["llama_bench_test"]): r for r in bench_peers.summarize(rounds, ["native", "avx2"])}
    tg = rows[("avx512vnni", "tg128")]
    assert tg["llama_cpp_tok_s"] == pytest.approx(np.median([p[0] for p in peer]))
    assert tg["ratio"] == pytest.approx(2.1) and tg["target_ratio"] == 2.0 and tg["met"] is True
    assert tg["llama_cpp_build"] == "native"
    assert rows[("avx512vnni", "pp512")]["met"] is False                    # 0.9x < llama.cpp's prefill
    avx2 = rows[("avx2", "tg128")]                                          # against the AVX2 build
    assert avx2["llama_cpp_build"] == "avx2" and avx2["ratio"] == pytest.approx(2.8)
    assert avx2["target_ratio"] == 1.5 and avx2["met"] is True
    assert rows[("avx2", "pp128")]["ratio"] == pytest.approx(2.0)


def test_decode_after_a_depth_of_context_is_compared_without_a_target():
    peer = {"tg128": 100.0, "pp128": 100.0, "pp512": 100.0, "tg128@d1000": 80.0}
    rnd = _round(peer, {"native": (210.0, 200.0, 200.0)})
    rnd["ours"]["native"]["results"][0]["decode_depth_tok_s"] = {"1000": 120.0}
    rows = {r["llama_bench_test"]: r for r in bench_peers.summarize([rnd], ["native"], depths=[1000])}
    deep = rows["tg128@d1000"]
    assert deep["measure"] == "decode b=1 @ 1000" and deep["ratio"] == pytest.approx(1.5)
    assert deep["target_ratio"] is None and deep["met"] is None
    assert rows["tg128"]["target_ratio"] == 2.0                             # the empty context keeps its target


def test_llama_bench_rows_are_named_by_test_and_depth(tmp_path, monkeypatch):
    """llama-bench's JSON rows: tg128, pp128, pp512 from one run, tg128@d<depth> from a second with -d."""
    calls = []

    def fake_run(argv, **_):
        calls.append(argv)
        if "-d" in argv:
            rows = [{"n_prompt": 0, "n_gen": 128, "n_depth": int(d)} for d in argv[argv.index("-d") + 1].split(",")]
        else:
            rows = [{"n_prompt": 128, "n_gen": 0, "n_depth": 0}, {"n_prompt": 512, "n_gen": 0, "n_depth": 0},
                    {"n_prompt": 0, "n_gen": 128, "n_depth": 0}]
        return subprocess.CompletedProcess(argv, 0, json.dumps(rows), "")
    monkeypatch.setattr(bench_peers.subprocess, "run", fake_run)
    rows = bench_peers.run_llama_bench(tmp_path / "llama-bench", tmp_path / "m.gguf", 2, 3, [1000, 2000])
    assert set(rows) == {"pp128", "pp512", "tg128", "tg128@d1000", "tg128@d2000"}
    assert len(calls) == 2 and calls[1][calls[1].index("-d") + 1] == "1000,2000"
    assert set(bench_peers.run_llama_bench(tmp_path / "llama-bench", tmp_path / "m.gguf", 2, 3, [])) == \
        {"pp128", "pp512", "tg128"}


def test_each_level_is_measured_against_the_llama_cpp_build_of_its_instructions():
    assert bench_peers.peer_level("native") == "native" and bench_peers.peer_level("avx2") == "avx2"
    assert bench_peers.peer_level("avxvnni") == "native"                   # no llama.cpp build of that level
    assert "-DGGML_AVX512=OFF" in llama_cpp_build.LEVEL_OPTIONS["avx2"]
    assert llama_cpp_build.build_dir_of("avx2") != llama_cpp_build.build_dir_of("native")
    with pytest.raises(SystemExit, match="no llama.cpp build level"):
        llama_cpp_build.build(level="sse9")


def test_gemma_is_held_to_its_own_targets_at_the_native_level():
    """Issue 23's targets for Gemma 3 (decode 1.5x, prefill 1x) at the level this CPU runs; none for
    another level."""
    peer = {"tg128": 100.0, "pp128": 100.0, "pp512": 100.0}
    rounds = [_round(peer, {"native": (160.0, 95.0, 100.0), "avx2": (120.0, 50.0, 50.0)})]
    rows = {(r["isa"], r["llama_bench_test"]): r for r in bench_peers.summarize(rounds, ["native", "avx2"],
                                                                                 "gemma3")}
    assert rows[("avx512vnni", "tg128")]["target_ratio"] == 1.5 and rows[("avx512vnni", "tg128")]["met"] is True
    assert rows[("avx512vnni", "pp128")]["met"] is False and rows[("avx512vnni", "pp512")]["met"] is True
    assert rows[("avx2", "tg128")]["target_ratio"] is None and rows[("avx2", "tg128")]["met"] is None


def test_levels_the_cpu_cannot_run_are_named_not_run():
    avx512 = {"avx512f", "avx512bw", "avx512vnni", "avx2", "fma"}
    assert bench_peers.levels_to_run(["avx2", "native"], avx512) == (["native", "avx2"], [])
    assert bench_peers.levels_to_run(["native", "avx2"], {"avx2", "fma"}) == (["native"], [])  # avx2 is native
    assert bench_peers.levels_to_run(["native", "avx2"], {"neon", "dotprod"}) == (["native"], ["avx2"])
    with pytest.raises(SystemExit, match="expected native or one of"):
        bench_peers.levels_to_run(["sse9"], avx512)
