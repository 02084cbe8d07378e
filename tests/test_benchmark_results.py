"""``benchmarks/results.py``: a benchmark's raw result kept as a dated JSON file named by the CPU,
never overwriting an earlier run's."""

from __future__ import annotations

import json
import re
import sys
from datetime import datetime

from benchmarks.results import cpu_slug, isa_class, save, slug


def test_save_writes_a_dated_file_named_by_the_cpu_and_never_overwrites(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["benchmarks/kv_int8.py", "--json"])
    result = {"accuracy": {"int8": 0.99}, "rows": {1: [0.5, 0.25]}}

    first = save("kv_int8", result, folder=tmp_path / "results")
    second = save("kv_int8", {"other": 1}, folder=tmp_path / "results")

    assert first.parent == second.parent == tmp_path / "results"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+-kv-int8\.json", first.name), first.name
    assert second.name == first.name.removesuffix(".json") + "-2.json"
    assert first.name.startswith(datetime.now().astimezone().strftime("%Y-%m-%d"))

    record = json.loads(first.read_text())
    assert record["benchmark"] == "kv_int8"
    assert record["command"] == ["benchmarks/kv_int8.py", "--json"]
    assert record["result"] == {"accuracy": {"int8": 0.99}, "rows": {"1": [0.5, 0.25]}}
    assert datetime.fromisoformat(record["date"]).tzinfo is not None
    cpu = record["cpu"]
    assert {"model_name", "isa", "flags", "logical_cpus", "usable_cpus"} <= set(cpu)
    assert cpu_slug(cpu) in first.name
    assert json.loads(second.read_text())["result"] == {"other": 1}  # the first file kept its result


def test_cpu_slug_drops_trademarks_and_clock_and_adds_the_isa_class():
    cpu = {"model_name": "Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.00GHz", "isa": "amx"}
    assert cpu_slug(cpu) == "intel-xeon-platinum-8480-amx"
    assert cpu_slug({"model_name": "AMD EPYC 7B13 64-Core Processor", "isa": "avx2"}) == (
        "amd-epyc-7b13-64-core-processor-avx2"
    )
    assert slug("  Intel(R) Xeon(R) Processor ") == "intel-r-xeon-r-processor"


def test_isa_class_takes_the_best_unit_the_flags_show():
    assert isa_class(frozenset({"avx2", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"})) == "amx"
    assert isa_class(frozenset({"avx2", "avx512f", "avx512_vnni"})) == "avx512-vnni"
    assert isa_class(frozenset({"avx2", "avx512f"})) == "avx512"
    assert isa_class(frozenset({"avx2", "fma"})) == "avx2"
    assert isa_class(frozenset()) == "other"
