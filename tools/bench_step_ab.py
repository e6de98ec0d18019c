"""The decode step under several kernel choices, interleaved in one process on one GPU:
`python -m tools.bench_step_ab --model DIR [--modes pdl untuned noepi nopdl cublas] [--out FILE]`.

Same-run ratios are the only fair ones on lent machines whose hosts differ by 10-40%, and
even within a run clocks drift; so every mode's executor (graphs captured with that mode's
kernels) lives at once, and the modes take turns: in each of `--rounds` rounds every mode
runs 8 executor steps (host work included, as a rank runs them) and 20 replays of its graph
alone (CUDA events). Reported: the median over rounds of each, and how far each mode's logits
of the first decode step (the same inputs in every mode) are from the first mode's: on a
random checkpoint a change of rounding alone moves the top-8 logprobs by up to ~1 nat. Modes:
  pdl     the default: skinny kernels (TUNED tiles) up to 64 rows, programmatic dependent launch
  untuned the same without the TUNED tiles (the general rule alone)
  even_splits  the default with the split rule before one_wave: K split in 3, 4 or 2 parts that
          divide its blocks, 3 stages, up to 32 rows (more: cuBLAS, but for the TUNED shapes)
  noepi   the same, but gate_up's kernel does not make the MLP's activation (silu_and_mul's kernel)
  parts1  the default with decode attention aiming at one program per SM (else 2): no context
          split, and no merge kernel, from 33 requests on (4 KV heads)
  nosum   the default with split-K products summed by their own kernel before the norm
  o64, o64s8, o_cublas  out_proj / o_proj at 33-64 rows with K split in 4 (64x128 tiles) or 8
          (64x64), or on cuBLAS (else K in 3 uneven parts, 64x128 tiles; the parts added by the
          norm)
  gu_cublas  the default with cuBLAS for gate_up at 33-64 rows (its TUNED tile removed)
  gu_64x128, gu_32x128, gu_128x64  the default with that gate_up tile (rows x K) at 33-64 rows
  loop1   the default with in_proj's and gate_up's GEMVs looping over K (their rows not read
          whole before the wait)
  late    the default with every kernel waiting before its first load (no `read_ahead` of
          slots, conv windows, positions before the wait); late_conv, late_attn: the conv
          update's or attention's kernels wait first
  o_whole, o_whole4  the default with out_proj's / o_proj's GEMV reading its rows whole before
          the wait (2 rows and 4 warps, or 4 and 8, per program)
  d9_rule32  the default with the 9B's down at 2-32 rows by the general rule (K in 2 parts; else
          3, 64x128 tiles, 4 stages)
  d_whole, qkv_whole, all_whole  the default with the 4B's down, attention qkv, or both and
          out/o_proj (4 rows, 8 warps) reading their rows whole before the wait at one row
  lm_cublas  the default with one row's logits by cuBLAS (else the whole-row GEMV)
  conv_apart  the default with one row's DeltaNet conv by the conv update kernel (else made
          by in_proj's GEMV as it writes)
  trigger_after  the default with every kernel letting the next launch after its wait (else the
          projections' kernels, and on one row every kernel, before it)
  early, early_o_whole4, early_d_whole, early_all_whole  the default, or that mode, with every
          kernel letting the next launch before its wait; early_other, early_proj, early_nodot:
          only the kernels other than projections', only the projections', or all but the
          tensor-core kernel's
  rule_ahead, rule_plain  the default with the general rule's one-row GEMVs reading their first
          K block before the wait, or not; before_ahead: rule_plain with the 4B's down and
          out/o_proj at one row on their tiles before (4 rows, 8 warps, first block after the wait)
  --tile-modes NAME=...  more modes, each the default with TUNED entries of its own (see
          `parse_tile_mode`), e.g. o2x512=1,2560,4096:2,512,1,4,2,a
  nopdl   the default kernels launched plainly (DELTASERVE_PDL=0)
  cublas  cuBLAS for every projection (the skinny kernels off), PDL for the rest
  conv64, conv256, conv1024  the default with the conv update's programs on that many channels
          (conv256w1, conv512, conv128: 256 channels on 1 warp, 512 on 2, 128 on 1; else 256 on 2)
  norm4, norm16  the default with 4 or 16 warps per RMSNorm row of the hidden size (else 8)
  dv32, dv64w2, dv64w8, dv128w8  the default with the DeltaNet decode's programs on that many value
          columns and warps (else by its rule: 64 and 4 above 256 programs)
  att16s5, att16s7, att32s5, att32s5w8, att32s3  the default with decode attention's kernel on
          tiles of 16 or 32 positions, 4 or 8 warps, that many pipeline stages (else 32, 4, and
          2 stages from 256 programs, 3 below; Triton gives K and V two buffers from 5 stages)
  fp8_keep, fp8_rows1  on an FP8 release, the default with the projections kept FP8 and read so by
          the skinny kernels (else widened to bf16 as they load); fp8_rows1, fp8_rows4, fp8_rows8
          with the GEMVs on that many times the bf16 tiles' rows (else 4 times, FP8_GEMV_ROWS)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from dataclasses import dataclass

import torch

import deltaserve.kernels.causal_conv1d as conv
import deltaserve.kernels.gated_delta as gated_delta
import deltaserve.kernels.paged_attention as paged_attention
import deltaserve.kernels.rmsnorm as rmsnorm
import deltaserve.kernels.skinny_linear as skinny
import deltaserve.kernels.triton_compat as triton_compat
from deltaserve.ipc.messages import NewRequest, SamplingSpec, StepItem
from deltaserve.tools.bench_decode import time_events, write_report
from deltaserve.tools.golden import compare_logprobs
from deltaserve.tools.step_anatomy import CONTEXT, step_executor


@dataclass(frozen=True)
class Mode:
    """The module switches that choose a decode step's kernels; the defaults are the engine's
    on Hopper (PDL on even under DELTASERVE_PDL=0, so that "pdl" is always the baseline)."""

    max_rows: int = 64  # the skinny kernels up to this many rows (0: cuBLAS for all)
    pdl: bool = True
    silu_epilogue: bool = True  # gate_up's kernel makes the MLP's activation
    sum_in_norm: bool = True  # split-K partial sums added by the next norm
    parts_per_sm: int = paged_attention.PARTS_PER_SM  # decode attention's split target
    tuned: bool = True  # the TUNED tiles
    # K splits filling one wave of one program per SM (else dividing K's blocks)
    one_wave: bool = True
    # ((rows class, N, K), SkinnyConfig or None) TUNED entries set (None: removed)
    tiles: tuple = ()
    conv_tile: tuple[int, int] = conv.UPDATE_TILE  # the conv update's (channels, warps) per program
    norm_warps: int = rmsnorm.WIDE_ROW_WARPS  # per RMSNorm row of the hidden size
    # the DeltaNet decode's (block_v, warps)
    decode_tile: tuple[int, int] | None = gated_delta.DECODE_TILE
    # (block_n, warps, stages)
    attention_launch: tuple[int, int, int] | None = paged_attention.DECODE_LAUNCH
    # kernels loading slots, positions before the wait
    read_ahead: frozenset[str] = triton_compat.READ_AHEAD
    lm_head_gemv: bool = True  # one row's logits by our GEMV
    conv_epilogue: bool = True  # one row's DeltaNet conv in in_proj's GEMV
    # kernel kinds letting the next launch before their wait
    early_trigger: frozenset[str] = triton_compat.EARLY_TRIGGER
    # the rule's one-row GEMVs read their first block before the wait
    rule_first_ahead: bool = skinny.RULE_FIRST_AHEAD
    # an FP8 checkpoint's projections widened as they load, or kept FP8 ("keep")
    fp8_weights: str = "widen"
    fp8_gemv_rows: int = skinny.FP8_GEMV_ROWS  # an FP8 GEMV tile's rows over the bf16 tile's


MODES = {
    "pdl": Mode(),
    "untuned": Mode(tuned=False),
    "noepi": Mode(silu_epilogue=False),
    "nopdl": Mode(pdl=False),
    "even_splits": Mode(one_wave=False),
    "cublas": Mode(max_rows=0),
    "nosum": Mode(sum_in_norm=False),
    "parts1": Mode(parts_per_sm=1),
    "o64": Mode(tiles=(((64, 2560, 4096), skinny.SkinnyConfig(64, 128, 4, 4, 4)),)),
    "o64s8": Mode(tiles=(((64, 2560, 4096), skinny.SkinnyConfig(64, 64, 8, 4, 4)),)),
    "o_cublas": Mode(tiles=(((64, 2560, 4096), None),)),
    "gu_cublas": Mode(tiles=(((64, 18432, 2560), None),)),
    "loop1": Mode(
        tiles=(((1, 12352, 2560), skinny.SkinnyConfig(2, 512, 1, 4, 3)), ((1, 18432, 2560), None))
    ),
    "gu_64x128": Mode(tiles=(((64, 18432, 2560), skinny.SkinnyConfig(64, 128, 1, 4, 3)),)),
    "gu_32x128": Mode(tiles=(((64, 18432, 2560), skinny.SkinnyConfig(32, 128, 1, 4, 3)),)),
    "gu_128x64": Mode(tiles=(((64, 18432, 2560), skinny.SkinnyConfig(128, 64, 1, 8, 4)),)),
    "conv64": Mode(conv_tile=(64, 1)),
    "conv256": Mode(conv_tile=(256, 2)),
    "conv1024": Mode(conv_tile=(1024, 4)),
    "conv256w1": Mode(conv_tile=(256, 1)),
    "conv512": Mode(conv_tile=(512, 2)),
    "conv128": Mode(conv_tile=(128, 1)),
    "dv32": Mode(decode_tile=(32, 2)),
    "dv64w2": Mode(decode_tile=(64, 2)),
    "dv64w8": Mode(decode_tile=(64, 8)),
    "dv128w8": Mode(decode_tile=(128, 8)),
    "att16s5": Mode(attention_launch=(16, 4, 5)),
    "att16s7": Mode(attention_launch=(16, 4, 7)),
    "att32s5": Mode(attention_launch=(32, 4, 5)),
    "att32s5w8": Mode(attention_launch=(32, 8, 5)),
    "att32s3": Mode(attention_launch=(32, 4, 3)),
    "norm4": Mode(norm_warps=4),
    "norm16": Mode(norm_warps=16),
    "late": Mode(read_ahead=frozenset()),
    "lm_cublas": Mode(lm_head_gemv=False),
    "conv_apart": Mode(conv_epilogue=False),
    "late_conv": Mode(read_ahead=frozenset({"attention"})),
    "late_attn": Mode(read_ahead=frozenset({"conv"})),
    "o_whole": Mode(
        tiles=(((1, 2560, 4096), skinny.SkinnyConfig(2, 4096, 1, 4, 1, whole_rows=True)),)
    ),
    "o_whole4": Mode(
        tiles=(((1, 2560, 4096), skinny.SkinnyConfig(4, 4096, 1, 8, 1, whole_rows=True)),)
    ),
    "d_whole": Mode(
        tiles=(((1, 2560, 9216), skinny.SkinnyConfig(2, 9216, 1, 4, 1, whole_rows=True)),)
    ),
    "qkv_whole": Mode(
        tiles=(((1, 10240, 2560), skinny.SkinnyConfig(2, 2560, 1, 4, 1, whole_rows=True)),)
    ),
    "all_whole": Mode(
        tiles=(
            ((1, 2560, 9216), skinny.SkinnyConfig(2, 9216, 1, 4, 1, whole_rows=True)),
            ((1, 10240, 2560), skinny.SkinnyConfig(2, 2560, 1, 4, 1, whole_rows=True)),
            ((1, 2560, 4096), skinny.SkinnyConfig(4, 4096, 1, 8, 1, whole_rows=True)),
        )
    ),
    "d9_rule32": Mode(tiles=(((32, 4096, 12288), None),)),
    "fp8_keep": Mode(fp8_weights="keep"),
    "fp8_rows1": Mode(fp8_weights="keep", fp8_gemv_rows=1),
    "fp8_rows4": Mode(fp8_weights="keep", fp8_gemv_rows=4),
    "fp8_rows8": Mode(fp8_weights="keep", fp8_gemv_rows=8),
}
ALL_KINDS = frozenset({"gemv", "dot", "other"})
MODES |= {
    "trigger_after": Mode(early_trigger=frozenset()),
    "early": Mode(early_trigger=ALL_KINDS),
    "early_other": Mode(early_trigger=frozenset({"other"})),
    "early_proj": Mode(early_trigger=frozenset({"gemv", "dot"})),
    "early_nodot": Mode(early_trigger=frozenset({"gemv", "other"})),
} | {
    f"early_{name}": dataclasses.replace(MODES[name], early_trigger=ALL_KINDS)
    for name in ("o_whole4", "d_whole", "all_whole")
}
MODES |= {
    "rule_ahead": Mode(rule_first_ahead=True),
    "rule_plain": Mode(rule_first_ahead=False),
    "before_ahead": Mode(
        # rule_plain with the 4B's down and out/o_proj on their tiles before
        rule_first_ahead=False,
        tiles=(
            ((1, 2560, 9216), skinny.SkinnyConfig(4, 1024, 1, 8, 2, evict_first=True)),
            ((1, 2560, 4096), None),
        ),
    ),
}


def parse_tile_mode(text: str) -> tuple[str, Mode]:
    """ "o2x512=1,2560,4096:2,512,1,4,2,ea" -> ("o2x512", the default with that TUNED entry): rows
    class, N, K, then block_n, block_k, split_k, warps, stages and flags (e: evict_first, w:
    whole rows, a: first block read ahead); several entries joined by '+'."""
    name, _, spec = text.partition("=")
    tiles = []
    try:
        for entry in spec.split("+"):
            key, _, tile = entry.partition(":")
            *sizes, flags = tile.split(",")
            config = skinny.SkinnyConfig(
                *(int(f) for f in sizes),
                evict_first="e" in flags,
                whole_rows="w" in flags,
                first_ahead="a" in flags,
            )
            tiles.append((tuple(int(f) for f in key.split(",")), config))
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(
            f"a tile mode is NAME=ROWS,N,K:BN,BK,SPLIT,WARPS,STAGES,FLAGS[+...]; got {text!r} ({e})"
        ) from e
    if not name or name in MODES:
        raise argparse.ArgumentTypeError(f"a tile mode needs a new name; got {name!r}")
    return name, Mode(tiles=tuple(tiles))


DEFAULT_TUNED = dict(skinny.TUNED)


def use_mode(name: str) -> None:
    """Set the module switches that choose a decode step's kernels."""
    mode = MODES[name]
    skinny.MAX_ROWS, triton_compat.PDL, triton_compat.READ_AHEAD = (
        mode.max_rows,
        mode.pdl,
        mode.read_ahead,
    )
    skinny.SILU_EPILOGUE, skinny.USE_TUNED, skinny.SUM_IN_NORM = (
        mode.silu_epilogue,
        mode.tuned,
        mode.sum_in_norm,
    )
    skinny.ONE_WAVE, triton_compat.EARLY_TRIGGER = mode.one_wave, mode.early_trigger
    skinny.LM_HEAD_GEMV, skinny.CONV_EPILOGUE = mode.lm_head_gemv, mode.conv_epilogue
    skinny.RULE_FIRST_AHEAD, skinny.FP8_GEMV_ROWS = mode.rule_first_ahead, mode.fp8_gemv_rows
    paged_attention.PARTS_PER_SM = mode.parts_per_sm
    skinny.TUNED.clear()
    skinny.TUNED.update(DEFAULT_TUNED)
    for key, tile in mode.tiles:
        if tile is None:
            skinny.TUNED.pop(key, None)
        else:
            skinny.TUNED[key] = tile
    conv.UPDATE_TILE, rmsnorm.WIDE_ROW_WARPS = mode.conv_tile, mode.norm_warps
    gated_delta.DECODE_TILE = mode.decode_tile
    paged_attention.DECODE_LAUNCH = mode.attention_launch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--modes", nargs="+", default=["pdl", "untuned", "nopdl", "cublas"])
    parser.add_argument(
        "--tile-modes",
        nargs="+",
        type=parse_tile_mode,
        default=[],
        metavar="NAME=ROWS,N,K:BN,BK,SPLIT,WARPS,STAGES,FLAGS",
        help="more modes, named in --modes",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    MODES.update(args.tile_modes)
    modes = list(dict.fromkeys(args.modes))
    if unknown := [m for m in modes if m not in MODES]:
        parser.error(f"unknown modes {unknown}; known: {', '.join(sorted(MODES))}")
    executors = {}
    for mode in modes:  # each captures its graphs under its own kernel choices
        use_mode(mode)
        executors[mode] = step_executor(args.model, max(args.batches), MODES[mode].fp8_weights)
    use_mode("pdl")
    results = []
    next_id = 0
    for batch in args.batches:
        ids = list(range(next_id, next_id + batch))
        next_id += batch
        position, first_logits = {}, {}
        for mode, ex in executors.items():
            gen = torch.Generator().manual_seed(0)  # the same prompts for every mode
            for i in range(0, batch, 8):
                ex.forward(
                    [
                        StepItem(
                            r,
                            0,
                            torch.randint(0, 240000, (CONTEXT,), generator=gen).tolist(),
                            True,
                            NewRequest(CONTEXT + 260, SamplingSpec(seed=0)),
                        )
                        for r in ids[i : i + 8]
                    ]
                )
            position[mode] = CONTEXT + 1
            first_logits[mode] = ex.forward(
                [StepItem(r, CONTEXT, [7], True, None) for r in ids]
            ).float()
        numerics = {
            m: compare_logprobs(first_logits[m], first_logits[modes[0]]).as_dict()
            for m in modes[1:]
        }
        step_ms: dict[str, list[float]] = {m: [] for m in modes}
        replay_ms: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.rounds):
            for mode, ex in executors.items():
                times = []
                for _ in range(8):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    ex.forward([StepItem(r, position[mode], [7], True, None) for r in ids])
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                    position[mode] += 1
                step_ms[mode].append(statistics.median(times) * 1e3)
                graph = ex.graphs.graphs[min(b for b in ex.graphs.graphs if b >= batch)][0]
                # the last step's inputs again
                replay_ms[mode].append(time_events(graph.replay, reps=20) * 1e3)
        for mode, ex in executors.items():
            ex.drop(ids)
            row = {
                "mode": mode,
                "batch": batch,
                "step_ms": round(statistics.median(step_ms[mode]), 4),
                "replay_ms": round(statistics.median(replay_ms[mode]), 4),
                "replay_ms_rounds": [round(t, 4) for t in replay_ms[mode]],
                f"first_step_vs_{modes[0]}": numerics.get(mode),
            }
            results.append(row)
            gap = numerics[mode]["max_abs_diff"] if mode in numerics else 0.0
            print(
                f"{mode:7s} b={batch:3d} step {row['step_ms']:6.3f} ms  replay "
                f"{row['replay_ms']:6.3f} ms  "
                f"rounds {row['replay_ms_rounds']}  top-8 logprob gap {gap:.4f}",
                flush=True,
            )
    write_report(args.out, "bench_step_ab", results=results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
