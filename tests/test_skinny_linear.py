"""The decode projections' kernels (kernels/skinny_linear.py) against fp32 and float64
products of the same inputs: the GEMV (K-looping and whole-row), the tensor-core kernel with K
split, the MLP's silu epilogue, and `linear`'s routing between them. Small shapes under the
interpreter; the Qwen3.5-4B shapes on CUDA only."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from kernel_checks import CUDA, assert_close, needs_cuda, pick, poisoned

LINEAR_SHAPES = [  # (rows, N, K): the GEMV (narrow, wide), split K in 3 and 2, 17 rows in a 32 tile
    (1, 42, 1024),
    (1, 4100, 512),
    (3, 42, 384),
    (17, 70, 256),
    pytest.param(1, 18432, 2560, marks=needs_cuda),  # 4B gate_up
    pytest.param(5, 2560, 9216, marks=needs_cuda),  # 4B down
    pytest.param(32, 12352, 2560, marks=needs_cuda),  # 4B DeltaNet in_proj
    pytest.param(1, 12352, 2560, marks=needs_cuda),  # the TUNED tiles: in_proj's GEMV
    # ... down's and out/o_proj's, first block before the wait
    pytest.param(1, 2560, 9216, marks=needs_cuda),
    pytest.param(1, 2560, 4096, marks=needs_cuda),
    # the rule's one-row GEMV (0.8B down), first block so
    pytest.param(1, 1024, 3584, marks=needs_cuda),
    pytest.param(40, 12352, 2560, marks=needs_cuda),  # ... in_proj at 33-64 rows
    pytest.param(64, 2560, 9216, marks=needs_cuda),  # ... down at 33-64 rows, K split in 3
    # ... out/o_proj, K in 3 uneven parts: at 9-32 rows
    pytest.param(16, 2560, 4096, marks=needs_cuda),
    pytest.param(48, 2560, 4096, marks=needs_cuda),  # ... and at 33-64
    pytest.param(1, 4096, 12288, marks=needs_cuda),  # 9B down's GEMV: rows of 12288 read whole
    pytest.param(1, 24576, 4096, marks=needs_cuda),  # ... gate_up's: 4 whole rows a program
    pytest.param(20, 4096, 12288, marks=needs_cuda),  # ... down at 9-32 rows, K in 3 parts
    pytest.param(64, 4096, 4096, marks=needs_cuda),  # ... out/o_proj at 33-64, K in 2
]


@pytest.mark.parametrize("rows,n,k", LINEAR_SHAPES)
def test_skinny_linear(kernels, device, rows, n, k):
    """The decode GEMMs as `linear` picks them, against an fp32 product of the same bf16
    inputs; split-K sums in a fixed order, so a second run gives the same bits."""
    mod = kernels["skinny_linear"]
    dtype = torch.bfloat16
    x = torch.randn(rows, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    cfg, gemv = mod.decode_config(rows, n, k)
    assert gemv == (rows == 1)
    got = mod.skinny_linear(x, w, cfg, gemv, out=poisoned((rows, n), dtype, device))
    assert not torch.isnan(got).any(), "skinny_linear left an output unwritten"
    want = x.float() @ w.float().t()
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    bound = 4e-3 if CUDA else 8e-3  # one bf16 rounding is ~1e-3; the interpreter truncates instead
    assert err < bound, f"skinny_linear {cfg}: relative error {err:.1e}"
    assert torch.equal(mod.skinny_linear(x, w, cfg, gemv), got), (
        "skinny_linear is not deterministic"
    )


FP8_BLOCK = (128, 128)
FP8_CASES = [  # (rows, N, K, silu_mul, tile): None for `decode_config`'s
    (
        1,
        300,
        512,
        False,
        None,
    ),  # the rule's K-looping GEMV (first block before the wait), a partial row block
    (1, 4100, 512, False, None),  # the wide rule: 8 rows a program
    (1, 300, 640, False, "whole"),  # whole rows of 512 + 128
    (3, 260, 384, False, None),  # the tensor-core kernel, K split in 3
    (
        1,
        512,
        256,
        True,
        None,
    ),  # gate_up's silu epilogue on the GEMV: the tile's halves in two row blocks
    (5, 512, 256, True, None),  # ... and on the tensor-core kernel
    pytest.param(1, 18432, 2560, True, None, marks=needs_cuda),  # the 4B's TUNED tiles: gate_up
    pytest.param(1, 2560, 9216, False, None, marks=needs_cuda),  # ... down
    pytest.param(1, 2560, 4096, False, None, marks=needs_cuda),  # ... out/o_proj
    pytest.param(32, 2560, 4096, False, None, marks=needs_cuda),  # ... at 9-32 rows, K split
    pytest.param(64, 18432, 2560, True, None, marks=needs_cuda),  # ... gate_up at 33-64 rows
]


@pytest.mark.parametrize("rows,n,k,silu_mul,tile", FP8_CASES)
def test_fp8_weights(kernels, device, rows, n, k, silu_mul, tile):
    """FP8 weights with block scales read as they are, against the fp32 product with the
    widened weight (kernels/fp8_scales.py's `dequantize`, which transformers matches)."""
    from deltaserve.kernels.fp8_scales import dequantize
    from deltaserve.tools.make_model import quantize_fp8

    mod = kernels["skinny_linear"]
    q, scale = (t.to(device) for t in quantize_fp8(torch.randn(n, k) / k**0.5, FP8_BLOCK[0]))
    x = torch.randn(rows, k, device=device).to(torch.bfloat16)
    if tile == "whole":
        cfg, gemv = mod.SkinnyConfig(2, k, 1, 4, 1, whole_rows=True), True
    else:
        cfg, gemv = mod.decode_config(rows, n, k)
    if (
        silu_mul
    ):  # the epilogue's tile: K unsplit (`linear` runs silu_and_mul after a split product)
        cfg = dataclasses.replace(cfg, split_k=1)
    assert mod.fp8_fits(cfg, gemv, FP8_BLOCK, silu_mul, n), (
        "the kernels take FP8 tiles as the step picks them"
    )
    fp8 = {"scale": scale, "block": FP8_BLOCK}
    out_n = n // 2 if silu_mul else n
    got = mod.skinny_linear(
        x,
        q,
        cfg,
        gemv,
        out=poisoned((rows, out_n), torch.bfloat16, device),
        silu_mul=silu_mul,
        **fp8,
    )
    want = x.float() @ dequantize(q, scale, FP8_BLOCK).t()
    if silu_mul:
        want = torch.nn.functional.silu(want[:, : n // 2]) * want[:, n // 2 :]
    assert_close(got, want, torch.bfloat16, f"FP8 {cfg}")
    assert torch.equal(mod.skinny_linear(x, q, cfg, gemv, silu_mul=silu_mul, **fp8), got), (
        "not deterministic"
    )
    # CPU: widened first
    widened = mod.linear(x.cpu(), q.cpu(), silu_mul=silu_mul, scale=scale.cpu(), block=FP8_BLOCK)
    assert_close(widened, want.cpu(), torch.bfloat16, "the widened path")
    with pytest.raises(ValueError, match="an FP8 weight needs its block scales"):
        mod.skinny_linear(x, q, cfg, gemv, silu_mul=silu_mul)


def published_projection_shapes(tp: int = 1) -> set[tuple[int, int]]:
    """(N, K) of every decode projection of the published Qwen3.5 shapes (tools.make_model),
    as one of `tp` ranks holds it: the column-parallel ones N / tp, the row-parallel K / tp."""
    from deltaserve.tools.make_model import PRESETS

    shapes = set()
    for name, p in PRESETS.items():
        if name.startswith("tiny"):
            continue
        # an MoE: its shared expert
        inter = p.get("intermediate_size") or p["shared_expert_intermediate_size"]
        h, hd = p["hidden_size"], p["head_dim"]
        keys, values = (
            p["linear_num_key_heads"] * p["linear_key_head_dim"],
            p["linear_num_value_heads"] * p["linear_value_head_dim"],
        )
        columns = [
            2 * keys + 2 * values + 2 * p["linear_num_value_heads"],  # in_proj
            2 * p["num_attention_heads"] * hd + 2 * p["num_key_value_heads"] * hd,
            2 * inter,
        ]  # qkv (+ gate), gate_up
        rows = [values, p["num_attention_heads"] * hd, inter]  # out_proj, o_proj, down
        shapes |= {(n // tp, h) for n in columns} | {(h, k // tp) for k in rows}
    return shapes


def test_every_decode_tile_fits_its_shape(kernels):
    """Each TUNED tile and each tile the rule picks for the published shapes (at TP 1, 2, 4), at
    1-64 rows, on GPUs of 108, 132 and 142 SMs (an A100, the H200, an L40S), is one `skinny_linear`
    takes: K in whole blocks, whole rows only for the GEMV and where K is a sum of two powers of
    two. One that is not would fail a model's graph capture at start-up. And the rule's K splits
    make one wave: no more programs than the GPU has SMs."""
    mod = kernels["skinny_linear"]
    assert {(n, k) for _, n, k in mod.TUNED} <= published_projection_shapes(), (
        "a TUNED tile for no published shape"
    )
    shapes = (
        published_projection_shapes(1)
        | published_projection_shapes(2)
        | published_projection_shapes(4)
    )
    for (n, k), rows, sms in itertools.product(shapes, (1, 2, 8, 32, 33, 64), (108, 132, 142)):
        choice = mod.decode_config(rows, n, k, sms)
        # cuBLAS: above 32 rows, or a K our kernels' blocks do not divide (the 0.8B's down at TP 4)
        if choice is None:
            assert rows > 32 or k % (256 if rows == 1 else 128), (
                f"{rows} x [{n}, {k}] left to cuBLAS"
            )
            continue
        cfg, gemv = choice
        assert gemv == (rows == 1)
        assert mod.splits_fit(k, cfg.block_k, cfg.split_k, gemv), f"{rows} x [{n}, {k}]: {cfg}"
        if cfg.whole_rows:
            assert gemv and cfg.block_k == k and mod.whole_row_parts(k), (
                f"{rows} x [{n}, {k}]: {cfg}"
            )
        if cfg.split_k > 1 and (mod.tuned_class(rows), n, k) not in mod.TUNED:
            assert -(-n // cfg.block_n) * cfg.split_k <= sms, (
                f"{rows} x [{n}, {k}] on {sms} SMs: {cfg}"
            )


@pytest.mark.parametrize("rows,k,split", [(5, 512, 3), (17, 1280, 3), (2, 640, 4)])
def test_uneven_k_split(kernels, device, rows, k, split):
    """A K split that does not divide the blocks (4 blocks in 3 parts: 1, 1, 2): each part is
    the product of its own K range, the ranges cover K once, and the parts add to the whole."""
    mod = kernels["skinny_linear"]
    cfg = mod.SkinnyConfig(64, 128, split, 4, 2)
    x = torch.randn(rows, k, device=device).to(torch.bfloat16)
    w = (torch.randn(64, k, device=device) / k**0.5).to(torch.bfloat16)
    parts = mod.skinny_linear(x, w, cfg, unsummed=True).parts
    blocks = k // 128
    edges = [i * blocks // split * 128 for i in range(split + 1)]
    assert edges[-1] == k and len(set(edges)) == split + 1, "the test wants non-empty parts"
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
        want = x[:, lo:hi].float() @ w[:, lo:hi].float().t()
        assert_close(parts[i], want, torch.float32, f"part {i} (K {lo}..{hi})")
    total = mod.skinny_linear(x, w, cfg)
    want = x.float() @ w.float().t()
    assert ((total.float() - want).norm() / want.norm()).item() < 8e-3
    with pytest.raises(ValueError, match="parts"):
        mod.skinny_linear(x, w, dataclasses.replace(cfg, split_k=blocks + 1))


@pytest.mark.parametrize(
    "n,k,silu_mul",
    [
        (42, 1024, False),
        (300, 768, True),
        (300, 768, None),
        *(
            pytest.param(*case, marks=needs_cuda)
            for case in [
                (12352, 2560, False),
                (2560, 9216, False),
                (9216, 2560, True),
                (248320, 2560, None),
            ]
        ),
    ],
)  # 4B: in_proj, down, gate_up, lm_head
def test_gemv_whole_rows(kernels, device, monkeypatch, n, k, silu_mul):
    """A GEMV tile as wide as K reads its rows whole before waiting (K past a power of two in
    a second part): the product of the K-looping tile within rounding, the same bits twice.
    silu_mul None: the lm_head's fp32 logits (`logits`), as exact as fp32 sums are."""
    mod = kernels["skinny_linear"]
    x = torch.randn(1, k, device=device).to(torch.bfloat16)
    w = (torch.randn(2 * n if silu_mul else n, k, device=device) / k**0.5).to(torch.bfloat16)
    want = mod.skinny_linear(
        x, w, mod.SkinnyConfig(4, 256, 1, 4, 2), True, silu_mul=bool(silu_mul)
    ).float()
    cfg = mod.SkinnyConfig(2 if silu_mul is None else 4, k, 1, 4, 1, whole_rows=True)
    dtype = torch.float32 if silu_mul is None else torch.bfloat16
    got = mod.skinny_linear(
        x, w, cfg, True, out=poisoned(want.shape, dtype, device), silu_mul=bool(silu_mul)
    )
    assert not torch.isnan(got).any(), "the whole-row GEMV left an output unwritten"
    if silu_mul is None:
        want = x.double() @ w.double().T
        # on CPU tensors too
        monkeypatch.setattr("deltaserve.kernels.triton_compat.GPU_PATH_ON_CPU", True)
        assert torch.equal(mod.logits(x, w), got), "logits did not come from the whole-row GEMV"
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err < (1e-6 if silu_mul is None else 1e-2), (
        f"whole-row GEMV {cfg}: relative error {err:.1e}"
    )
    again = mod.skinny_linear(x, w, cfg, True, out=torch.empty_like(got), silu_mul=bool(silu_mul))
    assert torch.equal(again, got), "not deterministic"


@pytest.mark.parametrize(
    "n,k", [(42, 1024), pytest.param(2560, 4096, marks=needs_cuda)]
)  # 4B out/o_proj
def test_gemv_first_block_ahead(kernels, device, n, k):
    """The K-looping GEMV reading its first block before the wait: the same bits as reading it
    after, with K whole or split in two (a program that skipped its first block, or read it
    twice, would differ); refused where a kernel would not honour it."""
    mod = kernels["skinny_linear"]
    x = torch.randn(1, k, device=device).to(torch.bfloat16)
    w = (torch.randn(n, k, device=device) / k**0.5).to(torch.bfloat16)
    for split in (1, 2):
        base = mod.SkinnyConfig(4, 256, split, 4, 2)
        want = mod.skinny_linear(x, w, base, True)
        cfg = dataclasses.replace(base, first_ahead=True)
        got = mod.skinny_linear(x, w, cfg, True, out=poisoned(want.shape, want.dtype, device))
        assert torch.equal(got, want), f"{cfg}: not the bits of {base}"
    for kernel_has_none in (
        mod.SkinnyConfig(4, k, 1, 4, 1, whole_rows=True, first_ahead=True),
        mod.SkinnyConfig(64, 128, 1, 4, 3, first_ahead=True),
    ):  # the tensor-core kernel
        with pytest.raises(ValueError, match="first block"):
            mod.skinny_linear(x, w, kernel_has_none, kernel_has_none.whole_rows)


SILU_MUL_SHAPES = [  # (rows, I, K): the GEMV, the tensor-core kernel, a partial last tile
    (1, 42, 1024),
    (1, 2050, 512),
    (3, 42, 384),
    (17, 70, 256),
    pytest.param(1, 9216, 2560, marks=needs_cuda),  # 4B gate_up
    pytest.param(8, 9216, 2560, marks=needs_cuda),
    pytest.param(64, 9216, 2560, marks=needs_cuda),  # ... the TUNED tile at 33-64 rows
]


@pytest.mark.parametrize("rows,inter,k", SILU_MUL_SHAPES)
def test_skinny_linear_silu_mul_epilogue(kernels, device, rows, inter, k, monkeypatch):
    """The MLP's gate_up projection making silu(gate) * up in its epilogue gives, bit for bit
    on the GPU, what the product followed by `silu_and_mul` gives (each checked against its
    reference elsewhere here); `linear` routes decode rows to it, and without SILU_EPILOGUE to the
    two kernels."""
    mod, act = kernels["skinny_linear"], kernels["activation"]
    dtype = torch.bfloat16
    # small integers times 1/64: every sum is exact in fp32 in any order, so the bits must match
    # on the interpreter too (its numpy dot orders a tile's sums by the tile's shape: with
    # normal inputs, one element in about 40 runs flipped by one ulp)
    x = torch.randint(-3, 4, (rows, k), device=device).to(dtype)
    w = (torch.randint(-8, 9, (2 * inter, k), device=device) / 64).to(dtype)
    rule, gemv = mod.decode_config(rows, 2 * inter, k)
    # the epilogue needs whole sums (the 4B gate_up never splits)
    cfg = dataclasses.replace(rule, split_k=1)
    got = mod.skinny_linear(
        x, w, cfg, gemv, out=poisoned((rows, inter), dtype, device), silu_mul=True
    )
    assert not torch.isnan(got).any(), "skinny_linear(silu_mul) left an output unwritten"
    unfused = act.silu_and_mul_triton(mod.skinny_linear(x, w, cfg, gemv))
    # `linear` without the epilogue
    two_kernels = act.silu_and_mul_triton(mod.skinny_linear(x, w, rule, gemv))
    assert torch.equal(got, unfused), (
        f"silu_mul epilogue {cfg}: max diff {(got.float() - unfused.float()).abs().max()}"
    )
    with pytest.raises(ValueError, match="even"):
        mod.skinny_linear(x, w[:-1], cfg, gemv, silu_mul=True)
    from deltaserve.kernels import triton_compat

    # `linear`'s GPU routing, on CPU too
    monkeypatch.setattr(triton_compat, "GPU_PATH_ON_CPU", True)
    # the epilogue needs whole sums: a product the rule splits is summed, then silu_and_mul'd
    assert torch.equal(mod.linear(x, w, silu_mul=True), got if rule.split_k == 1 else two_kernels)
    monkeypatch.setattr(mod, "SILU_EPILOGUE", False)
    assert torch.equal(mod.linear(x, w, silu_mul=True), two_kernels)


# (rows, conv channels, N, K): a partial last program; the 4B in_proj; more rows: two kernels
CONV_SHAPES = [
    (1, 41, 72, 256),
    (1, 64, 96, 512),
    (3, 64, 96, 128),
    pytest.param(1, 8192, 12352, 2560, marks=needs_cuda),
    pytest.param(64, 8192, 12352, 2560, marks=needs_cuda),
    # the 9B in_proj (its TUNED GEMV evicts the weights)
    pytest.param(1, 8192, 12352, 4096, marks=needs_cuda),
]


@pytest.mark.parametrize("rows,channels,n,k", CONV_SHAPES)
def test_conv_epilogue(kernels, device, rows, channels, n, k, monkeypatch):
    """One row's in_proj GEMV making the DeltaNet conv as it writes (`ConvEpilogue`) gives what
    the product then `causal_conv1d_update` give: every window bit for bit, the conv channels
    within rounding, the other columns bit for bit; `linear` routes one row to it, and more
    rows (a padding row, slot -1, among them), or any without CONV_EPILOGUE, to the two."""
    mod, conv1d = kernels["skinny_linear"], kernels["causal_conv1d"]
    dtype = torch.bfloat16
    x = torch.randn(rows, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    taps = (0.5 * torch.randn(channels, 4, device=device)).to(dtype)
    state = torch.randn(rows + 3, channels, 3, device=device).to(dtype)
    slots = pick(rows + 3, rows, device)
    slots[-1] = -1 if rows > 1 else slots[-1]  # a padding row
    real = slots >= 0
    step_rows = torch.arange(rows, dtype=torch.int32, device=device)
    cfg, gemv = mod.decode_config(rows, n, k)
    product = mod.skinny_linear(x, w, cfg, gemv)
    want, want_state = product.clone(), state.clone()
    conv1d.causal_conv1d_update(
        product[:, :channels], taps, want_state, step_rows, slots, want[:, :channels]
    )
    got_state = state.clone()
    epilogue = mod.ConvEpilogue(taps, got_state, step_rows, slots)
    whole = mod.SkinnyConfig(2, k, 1, 4, 1, whole_rows=True)  # the 4B in_proj's (TUNED)
    got = want
    if rows == 1:
        got = mod.skinny_linear(
            x, w, whole, True, out=poisoned((rows, n), dtype, device), conv=epilogue
        )
        assert not torch.isnan(got).any(), "the conv epilogue left an output unwritten"
        assert torch.equal(got_state, want_state), "the windows differ from causal_conv1d_update's"
        assert torch.equal(got[:, channels:], product[:, channels:]), (
            "columns past the conv channels changed"
        )
        assert_close(got[:, :channels].float(), want[:, :channels].float(), dtype, "conv epilogue")
    else:  # the whole-row GEMV's alone
        with pytest.raises(ValueError, match="whole-row GEMV"):
            mod.skinny_linear(x, w, cfg, gemv, conv=epilogue)
    from deltaserve.kernels import triton_compat

    # `linear`'s GPU routing, on CPU too
    monkeypatch.setattr(triton_compat, "GPU_PATH_ON_CPU", True)
    monkeypatch.setitem(mod.TUNED, (1, n, k), whole)  # one row on whole rows, as the 4B in_proj
    conv_launches = []  # the conv kernel's launches by `linear` (the same results either way)
    conv_kernel = mod.causal_conv1d_update
    monkeypatch.setattr(
        mod, "causal_conv1d_update", lambda *args: conv_launches.append(1) or conv_kernel(*args)
    )
    routed_state = state.clone()
    routed = mod.linear(x, w, conv=mod.ConvEpilogue(taps, routed_state, step_rows, slots))
    assert torch.equal(routed_state, want_state)
    assert torch.equal(routed, got) if rows == 1 else torch.equal(routed[real], want[real])
    assert len(conv_launches) == (rows > 1), (
        "one row's conv is the GEMV's, more rows' the conv kernel's"
    )
    monkeypatch.setattr(mod, "CONV_EPILOGUE", False)
    two_kernels_state = state.clone()
    two_kernels = mod.linear(x, w, conv=mod.ConvEpilogue(taps, two_kernels_state, step_rows, slots))
    assert torch.equal(two_kernels[real], want[real]) and torch.equal(two_kernels_state, want_state)
    assert len(conv_launches) == 1 + (rows > 1), "without CONV_EPILOGUE the conv kernel runs"
