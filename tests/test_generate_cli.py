"""`deltaserve generate`, the engine (AsyncEngine) from the shell: `--json`'s shape that other
checks and users rely on, the engine's EOS and refusals, generation_config.json's defaults as
serve takes them; the tokens are the plain path's (tests/engine_helpers.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from engine_helpers import reference_tokens
from transformers import AutoTokenizer


def test_generate_json_lines(tiny_model_dir):
    cmd = [
        sys.executable,
        "-m",
        "deltaserve.tools.cli",
        "generate",
        "--model",
        str(tiny_model_dir),
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--logprobs",
        "3",
        "--json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 6
    for row in rows:
        assert set(row) == {"token_id", "text", "logprob", "top_logprobs"}
        assert len(row["top_logprobs"]) == 3
        logprobs = [lp for _, lp in row["top_logprobs"]]
        assert logprobs == sorted(logprobs, reverse=True)
        # greedy: the chosen token is the best alternative
        assert row["top_logprobs"][0][0] == row["token_id"]
        assert abs(row["top_logprobs"][0][1] - row["logprob"]) < 1e-6
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = [row["token_id"] for row in rows]
    assert "".join(row["text"] for row in rows) == tokenizer.decode(ids)


def test_generate_refuses_out_of_vocab_ids(tiny_model_dir):
    cmd = [
        sys.executable,
        "-m",
        "deltaserve.tools.cli",
        "generate",
        "--model",
        str(tiny_model_dir),
        "--prompt-ids",
        "1,999999999",
        "--max-tokens",
        "2",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "prompt token 1 is 999999999: ids must be integers in [0, " in result.stderr


def test_generate_stops_at_the_engines_eos_ids(tiny_model_dir, tmp_path, capsys):
    """It stops where the engine does: at any id of the model config's EOS set joined with
    generation_config.json's (a second engine's own check read generation_config.json alone)."""
    for f in tiny_model_dir.iterdir():
        (tmp_path / f.name).symlink_to(f)
    tokens = [s.token_id for s in reference_tokens(tiny_model_dir, [5, 6, 7], 8)]
    assert _tokens(capsys, tiny_model_dir, "--temperature", "0") == tokens
    config = json.loads((tiny_model_dir / "config.json").read_text())
    text = config.get("text_config", config)
    eos = text.get("eos_token_id", config.get("eos_token_id"))
    text["eos_token_id"] = [*(eos if isinstance(eos, list) else [eos]), tokens[2]]
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert tokens[2] not in tokens[:2], "pick a prompt whose third token is new"
    stopped = _tokens(capsys, tmp_path, "--temperature", "0", eos=True)
    assert stopped == tokens[:3]


@pytest.mark.parametrize(
    "bad",
    [
        ["--temperature", "nan"],
        ["--temperature", "inf"],
        ["--seed", str(-(2**63) - 1)],
        ["--seed", str(2**64)],
        ["--max-tokens", "0"],
        ["--logprobs", "-1"],
        ["--top-p", "0"],
        ["--top-k", "-2"],
        ["--repetition-penalty", "0"],
    ],
)
def test_generate_refuses_what_the_engine_refuses(tiny_model_dir, capsys, bad):
    """A NaN or infinite temperature and seeds outside int64 were taken (and sampled
    with) where the engine refuses them; now the engine's checks name the option."""
    from deltaserve.engine.generate import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--model", str(tiny_model_dir), "--prompt", "hi", *bad])
    assert exit_info.value.code == 2 and f"error: {bad[0]} must be" in capsys.readouterr().err
    assert (
        parse_args(
            [
                "--model",
                str(tiny_model_dir),
                "--prompt",
                "hi",
                "--temperature",
                "0.5",
                "--seed",
                "3",
            ]
        ).seed
        == 3
    )


def test_generate_refuses_positions_past_the_models_context(tiny_model_dir, capsys):
    """prompt + max_tokens past max_position_embeddings: the engine refuses it, exit 2."""
    from deltaserve.engine.generate import main

    context = json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"]
    argv = ["--model", str(tiny_model_dir), "--prompt-ids", "1,2", "--max-tokens", str(context)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"max_model_len {context + 2} exceeds the model's max_position_embeddings" in err


def test_generate_names_a_missing_model_or_device(tmp_path, capsys):
    """No folder, a folder without tokenizer.json, or --device cuda on a torch without CUDA:
    one line and exit 2 (a FileNotFoundError or AssertionError traceback before)."""
    from deltaserve.engine.generate import main

    assert main(["--model", str(tmp_path / "nowhere"), "--prompt", "hi"]) == 2
    assert "no tokenizer.json in model folder" in capsys.readouterr().err
    (tmp_path / "tokenizer.json").write_text("{}")
    assert main(["--model", str(tmp_path), "--prompt", "hi"]) == 2
    assert "error: cannot load the tokenizer in" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exit_info:
            main(["--model", str(tmp_path), "--prompt", "hi", "--device", "cuda"])
        assert exit_info.value.code == 2 and "sees no CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(tmp_path), "--prompt", "hi", "--device", "cpu:1"])
    assert exit_info.value.code == 2 and "cpu, cuda or cuda:N" in capsys.readouterr().err


def _tokens(capsys, model, *flags: str, eos: bool = False) -> list[int]:
    """`deltaserve generate` after 5,6,7: 8 tokens (seed 3), or up to an EOS with `eos`."""
    from deltaserve.engine.generate import main

    argv = ["--model", str(model), "--prompt-ids", "5,6,7", "--max-tokens", "8", "--seed", "3"]
    assert main([*argv, "--json", *([] if eos else ["--ignore-eos"]), *flags]) == 0
    return [json.loads(line)["token_id"] for line in capsys.readouterr().out.splitlines()]


def test_generate_samples_with_generation_config_defaults(tiny_model_dir, tmp_path, capsys):
    """As `deltaserve serve` does, generation_config.json's sampling settings are the defaults
    of those no flag gives (`--generation-config vllm`: ignored, as serve's); generate read
    greedily whatever the file said, so it sampled unlike the server it is compared against."""
    from deltaserve.engine.sampling_params import wire_seed

    for f in tiny_model_dir.iterdir():
        if f.name != "generation_config.json":
            (tmp_path / f.name).symlink_to(f)
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    prompt, seed = [5, 6, 7], wire_seed(3)
    greedy = [s.token_id for s in reference_tokens(tiny_model_dir, prompt, 8)]
    hot = [
        s.token_id for s in reference_tokens(tiny_model_dir, prompt, 8, temperature=1.5, seed=seed)
    ]
    assert hot != greedy

    (tmp_path / "generation_config.json").write_text(json.dumps({**gen, "temperature": 1.5}))
    assert _tokens(capsys, tmp_path) == hot  # the file's temperature
    assert _tokens(capsys, tmp_path, "--temperature", "0") == greedy  # the flag wins
    assert _tokens(capsys, tmp_path, "--generation-config", "vllm") == greedy  # the file ignored
    (tmp_path / "generation_config.json").write_text(
        json.dumps({**gen, "temperature": 1.5, "top_k": 1})
    )
    assert _tokens(capsys, tmp_path) == greedy  # top_k 1: the best token, sampled at 1.5
    # the flag wins, the file's temperature stays
    assert _tokens(capsys, tmp_path, "--top-k", "0") == hot
    from deltaserve.engine.generate import main

    assert main(["--model", str(tmp_path), "--prompt-ids", "5", "--max-tokens", "1"]) == 0
    assert (
        "defaults from the model's generation_config.json: temperature=1.5, top_k=1"
        in capsys.readouterr().err
    )
    # as serve, refused
    (tmp_path / "generation_config.json").write_text(json.dumps({**gen, "top_p": 2}))
    with pytest.raises(SystemExit) as info:
        main(["--model", str(tmp_path), "--prompt-ids", "5"])
    assert (
        info.value.code == 2
        and "generation_config.json: top_p must be in (0.0, 1.0]" in capsys.readouterr().err
    )
