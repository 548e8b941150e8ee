"""The GPU benchmark's report: rounds merged, the sampling loop's bandwidth bound, ratios with their range.

The benchmark itself needs a GPU and TRL; what it computes from the runners' JSON lines is
checked here on made-up lines whose answers are worked out by hand.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu  # noqa: E402


def _line(name, update_s, reserved, phases, gpu_name="NVIDIA H100 80GB HBM3", round_=1):
    return {
        "bench": name, "round": round_, "gpu": gpu_name, "update_s": update_s, "sec_per_update": sorted(update_s[1:])[len(update_s[1:]) // 2],
        "tokens_per_update": 64 * 128, "gpu_peak_reserved_gib": reserved, "gpu_peak_allocated_gib": reserved / 2,
        "phase_median_s": phases, "setup_s": 20.0, "prompt_mean_tokens": 96.0,
        "config": {"n_layer": 16, "n_embd": 1024, "batch": 64, "response_length": 128},
        "params_matmul": {"policy": 238e6}, "flops_per_update": {"train": 100e12, "total": 200e12},
    }


def test_rounds_are_merged_over_their_timed_updates_only():
    merged = gpu.merge_rounds([
        _line("a", [9.0, 1.0, 2.0, 3.0], 10.0, {"sampling": 0.5, "update": 1.0}),
        _line("a", [9.0, 4.0, 5.0, 6.0], 12.0, {"sampling": 0.7, "update": 3.0}, round_=2),
    ])
    assert merged["timed_update_s"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # each round's warm-up left out
    assert merged["sec_per_update"] == 3.5 and (merged["sec_per_update_min"], merged["sec_per_update_max"]) == (1.0, 6.0)
    assert merged["gpu_peak_reserved_gib"] == 12.0 and merged["round_gpu_peak_reserved_gib"] == {1: 10.0, 2: 12.0}
    assert merged["round_sec_per_update"] == {1: 2.0, 2: 5.0}
    assert merged["phase_median_s"] == {"sampling": 0.6, "update": 2.0}
    assert merged["tokens_per_s"] == pytest.approx(64 * 128 / 3.5, abs=0.1)


def test_the_sampling_bound_reads_the_weights_once_per_step_and_every_cached_token():
    r = _line("a", [1.0, 1.0], 1.0, {})
    r["config"] = {"n_layer": 1, "n_embd": 1, "batch": 1, "response_length": 2}
    r["params_matmul"], r["prompt_mean_tokens"] = {"policy": 1}, 3
    # 2 steps x 2 bytes x 1 weight = 4 bytes; cached tokens read: 3 + 4 = 7, each 1 layer x
    # (keys and values) x 1 x 2 bytes = 4 bytes: 28; so 32 bytes at 1 byte/s
    assert gpu.sampling_bound_s(r, 1.0) == 32.0
    assert gpu.sampling_bound_s(r, None) is None
    assert gpu.bandwidth_for("NVIDIA H200") == 4.8e12 and gpu.bandwidth_for("NVIDIA GH200 480GB") == 4.0e12
    assert gpu.bandwidth_for("NVIDIA H100 80GB HBM3") == 3.35e12 and gpu.bandwidth_for("Quadro") is None
    assert gpu.peak_for("NVIDIA H200 NVL")[0] == 835.0 and gpu.peak_for("NVIDIA H200")[0] == 989.0


def test_the_table_shows_reserved_memory_first_and_each_ratio_with_its_range_over_rounds():
    results = {
        "ppo_lab_graph": gpu.merge_rounds([_line("ppo_lab_graph", [9, 2.0, 2.0], 10.0, {"sampling": 0.4, "update": 1.0}),
                                           _line("ppo_lab_graph", [9, 3.0, 3.0], 10.0, {"sampling": 0.4, "update": 1.0}, round_=2)]),
        # TRL's rounds listed in the other order: they are paired by their round number
        "trl": gpu.merge_rounds([_line("trl", [9, 6.0, 6.0], 20.0, {"generate": 3.0, "optimise": 2.0}, round_=2),
                                 _line("trl", [9, 4.0, 4.0], 20.0, {"generate": 3.0, "optimise": 2.0})]),
    }
    text = gpu.table(results, {}, {"peak_tflops": 989.0, "peak_note": "H100 dense bf16", "bandwidth": 3.35e12, "rounds": 2})
    header = next(line for line in text.splitlines() if line.startswith("| runner"))
    assert header.split("|")[2].strip() == "peak reserved (GiB)"
    # medians 2.5 and 5.0 over all timed updates; per round 2/4 and 3/6
    assert "| time: ppo_lab CUDA-graph decode / TRL | 0.500 (0.500 - 0.500 over 2 rounds) |" in text
    assert "| peak reserved: ppo_lab CUDA-graph decode / TRL | 0.500 (0.500 - 0.500 over 2 rounds) |" in text
    row = next(line for line in text.splitlines() if line.startswith("| TRL 1.12.0 PPOTrainer"))
    assert "2.000 (" in row  # TRL's "optimise" phase is its update phase: 100 TFLOP / 2 s / 989 TFLOP/s
    assert f"{100 * 100 / 2 / 989:.1f}%" in row
