r"""How far bf16 rounding alone moves a random checkpoint's logprobs, point by point.

    python -m tools.bf16_floor --preset 0.8b [--layers N] [--device cuda] \
        [--out bench/results/X.json]

The bf16 gate (GPU issue: mean <= 0.03, p99 <= 0.12 nat over the top-8 logprob differences
against transformers in fp32) was set for trained checkpoints. On our random ones even HF in
bf16 misses it by 20x (gate_bf16_h200_4b_*.json), so the gate cannot tell a good bf16 engine
from a bad one there. This measures why: HF's model in fp32 with bf16-valued weights (so the
weights are the same in every run), and bf16 rounding injected at one kind of point at a time
through nn.Linear:
- body_inputs: the activations entering every projection of the layers (what any engine
  whose GEMMs take bf16 operands must round), outputs kept in fp32;
- body_inputs_outputs: the same plus each projection's output (a bf16 GEMM's result);
- logits_output: only the logits rounded to bf16 (HF's bf16 model returns bf16 logits);
- lm_head_input: only the final hidden state entering lm_head.
Each is compared with the unrounded run by tools/golden.py's metrics on the last positions.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from deltaserve.tools.golden import compare_logprobs
from deltaserve.tools.hardware import host_info
from deltaserve.tools.make_model import checkpoint_layout, init_tensor, text_config_dict

MODES = {  # name: (round body inputs, round body outputs, round lm_head input, round logits)
    "body_inputs": (True, False, False, False),
    "body_inputs_outputs": (True, True, False, False),
    "logits_output": (False, False, False, True),
    "lm_head_input": (False, False, True, False),
}


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().to(x.dtype)


def build(preset: str, layers: int | None, device: str) -> torch.nn.Module:
    """HF's model of the preset, in fp32, holding make_model's values rounded to bf16."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    text = text_config_dict(preset, None if layers is None else {"num_hidden_layers": layers})
    with torch.device(device):
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text)).eval()
    _, entries = checkpoint_layout(text, vlm_names=False)
    state = {
        name: _bf16(init_tensor(text_name, shape, text, seed=0, device=device))
        for name, text_name, shape in entries
    }
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"state mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model


def logits(
    model: torch.nn.Module, ids: torch.Tensor, positions: int, mode: tuple | None
) -> torch.Tensor:
    """The last `positions` rows of logits, with the rounding of `mode` (None: none)."""
    plain = torch.nn.Linear.forward

    def rounded(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        body_in, body_out, head_in, head_out = mode
        head = self is model.lm_head
        y = F.linear(_bf16(x) if (head_in if head else body_in) else x, self.weight, self.bias)
        return _bf16(y) if (head_out if head else body_out) else y

    torch.nn.Linear.forward = plain if mode is None else rounded
    try:
        with torch.inference_mode():
            return model(input_ids=ids).logits[0, -positions:].float().cpu()
    finally:
        torch.nn.Linear.forward = plain


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.bf16_floor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", default="0.8b")
    p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--positions", type=int, default=64, help="last positions compared")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    started = time.monotonic()
    model = build(args.preset, args.layers, args.device)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 248000, (1, args.prompt_len), generator=gen).to(args.device)
    reference = logits(model, ids, args.positions, None)
    results = {}
    for name, mode in MODES.items():
        report = compare_logprobs(logits(model, ids, args.positions, mode), reference).as_dict()
        results[name] = report
        print(
            f"{name:20s} mean {report['mean_abs_diff']:.4f}  p99 {report['p99_abs_diff']:.4f}  "
            f"regret {report['max_regret']:.3f}  argmax mismatches {report['argmax_mismatches']}"
        )
    if args.out:
        record = {
            "command": " ".join(
                [sys.executable, "-m", "tools.bf16_floor", *(argv or sys.argv[1:])]
            ),
            "hardware": host_info(),
            "preset": args.preset,
            "layers": model.config.num_hidden_layers,
            "prompt_len": args.prompt_len,
            "positions": args.positions,
            "gate": {"mean_abs_diff": 0.03, "p99_abs_diff": 0.12, "max_regret": 0.20},
            "results": results,
            "seconds": round(time.monotonic() - started, 1),
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
