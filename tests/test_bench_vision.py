"""`python -m tools.bench_vision` on the CPU (tiny VLM, small images, a few requests): every
figure is measured, the JSON carries the command, commit and hardware, and our tower's output
is HF's."""

from __future__ import annotations

import json

from deltaserve.tools.bench_vision import run


def test_measures_the_tower_ttft_and_decodes_under_images(tiny_vlm_model_dir, tmp_path):
    out = tmp_path / "vision.json"
    record = run(
        [
            *("--model", str(tiny_vlm_model_dir), "--device", "cpu", "--image-size", "64"),
            *("--prompt-len", "8", "--tower-batch", "2", "--repeats", "2", "--decoders", "1"),
            *("--image-requests", "2", "--window-s", "4", "--max-model-len", "512"),
            *("--num-kv-blocks", "256", "--out", str(out)),
        ]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(record))
    assert record["command"].startswith("python -m tools.bench_vision --model")
    assert record["commit"] and record["hardware"]["cores"]
    tower = record["tower"]
    assert tower["ours_images_per_s"] > 0 and tower["hf_images_per_s"] > 0
    assert tower["max_abs_diff_vs_hf"] < 1e-4
    assert record["ttft_ms"]["ours_median"] > 0 and record["ttft_ms"]["hf_median"] > 0
    decode = record["decode_under_images"]
    assert decode["alone"]["tokens"] > 0 and decode["while_images"]["tokens"] > 0
