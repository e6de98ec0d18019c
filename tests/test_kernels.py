"""Every Triton kernel against its plain-torch reference (kernels/*.py), and the GPU model path
against the CPU one.

Inputs are drawn fresh for every check; outputs are poisoned with NaN before the kernel runs,
so an unwritten element fails. Shapes are small and awkward (head dims 12/20/24/100, a
partial last tile, permuted rows and slots, padding rows) plus, on CUDA only, the real
Qwen3.5-4B shapes. Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1)
when triton is installed, else these tests skip.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest
import torch
from kernel_checks import CUDA, DTYPES, assert_close, needs_cuda, pick, poisoned

DELTA_SHAPES = [  # (key heads, value heads, dk, dv, tokens, decodes, slots)
    (2, 4, 16, 32, 5, 3, 6),
    (1, 3, 20, 12, 4, 4, 5),
    pytest.param(16, 32, 128, 128, 64, 64, 70, marks=needs_cuda),  # Qwen3.5-4B, batch 64
]


@pytest.mark.parametrize("state_dtype", DTYPES, ids=["fp32_state", "bf16_state"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nk,nv,dk,dv,tokens,decodes,slots", DELTA_SHAPES)
def test_gated_delta_decode(
    kernels, device, dtype, state_dtype, nk, nv, dk, dv, tokens, decodes, slots
):
    """Two decode steps in a row: outputs, every request's state (kept fp32 or bf16: read and
    written in its dtype, computed in fp32), untouched other slots, and a padding row (slot -1)
    that writes nothing."""
    mod = kernels["gated_delta"]
    width = 2 * nk * dk + nv * dv
    state = torch.randn(slots, nv, dk, dv, device=device).to(state_dtype)
    want_state = state.clone()
    a_log = torch.randn(nv, device=device).to(dtype)
    dt_bias = torch.randn(nv, device=device).to(dtype)
    slot_ids = pick(slots, decodes, device)
    for step in range(2):
        mixed = torch.randn(tokens, width, device=device).to(dtype)
        a = torch.randn(tokens, nv, device=device).to(dtype)
        b = torch.randn(tokens, nv, device=device).to(dtype)
        rows = pick(tokens, decodes, device)
        got = poisoned((tokens, nv, dv), dtype, device)
        want = poisoned((tokens, nv, dv), dtype, device)
        mod.gated_delta_decode_reference(
            mixed, a, b, a_log, dt_bias, want_state, rows, slot_ids, want, nk
        )
        mod.gated_delta_decode(mixed, a, b, a_log, dt_bias, state, rows, slot_ids, got, nk)
        r = rows.long()
        # a bf16 state's rounding of a last-bit difference is a bf16 step
        loosest = torch.bfloat16 if torch.bfloat16 in (dtype, state_dtype) else dtype
        assert_close(got[r].float(), want[r].float(), loosest, f"output, step {step}")
        assert state.dtype == state_dtype
        assert_close(state.float(), want_state.float(), loosest, f"state, step {step}")
    # a padding row: nothing read or written
    before = state.clone()
    out = poisoned((tokens, nv, dv), dtype, device)
    one = torch.tensor([0], dtype=torch.int32, device=device)
    mod.gated_delta_decode(mixed, a, b, a_log, dt_bias, state, one, -one - 1, out, nk)
    assert torch.equal(state, before) and torch.isnan(out).all(), "a slot -1 row changed something"


CONV_SHAPES = [  # (channels, width, tokens, decodes, slots)
    (37, 4, 5, 3, 4),
    (260, 3, 3, 2, 2),
    pytest.param(8192, 4, 64, 64, 66, marks=needs_cuda),  # 4B: q, k (16 x 128), v (32 x 128)
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels,width,tokens,decodes,slots", CONV_SHAPES)
def test_causal_conv1d_update(kernels, device, dtype, channels, width, tokens, decodes, slots):
    """Reference in fp32 on the same (rounded) inputs: the CPU's bf16 depthwise conv is very
    slow, and the window update is a copy either way."""
    mod = kernels["causal_conv1d"]
    weight = torch.randn(channels, width, device=device).to(dtype)
    state = torch.randn(slots, channels, width - 1, device=device).to(dtype)
    want_state = state.to(torch.float32, copy=True)
    slot_ids = pick(slots, decodes, device)
    for step in range(width):  # long enough for every state column to be replaced
        x = torch.randn(tokens, channels, device=device).to(dtype)
        rows = pick(tokens, decodes, device)
        got = poisoned((tokens, channels), dtype, device)
        want = poisoned((tokens, channels), torch.float32, device)
        mod.causal_conv1d_update_reference(
            x.float(), weight.float(), want_state, rows, slot_ids, want
        )
        mod.causal_conv1d_update(x, weight, state, rows, slot_ids, got)
        r = rows.long()
        assert_close(got[r].float(), want[r], dtype, f"output, step {step}")
        assert torch.equal(state.float(), want_state), f"state differs at step {step}"


PREFILL_CONV_SHAPES = [  # (channels, width, span lengths, slots, block, padding entries)
    (37, 4, [5, 2, 40, 3], 6, 16, 0),  # 2 < width - 1; 40 spans three token blocks of 16
    (260, 3, [2, 70], 3, 64, 3),  # a prompt graph's table: entries naming an empty last span
    pytest.param(8192, 4, [1024, 700, 2, 300], 8, 64, 0, marks=needs_cuda),  # 4B channels
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels,width,lengths,slots,block,padding", PREFILL_CONV_SHAPES)
def test_causal_conv1d_prefill(
    kernels, device, dtype, channels, width, lengths, slots, block, padding
):
    """Spans at scattered offsets with rows between them (left untouched, as a step's decode
    rows are), slots out of order, carried states; two chunks in a row, so the second reads
    states the first wrote. Reference in fp32 on the same rounded inputs, as above."""
    mod = kernels["causal_conv1d"]
    weight = torch.randn(channels, width, device=device).to(dtype)
    state = torch.randn(slots, channels, width - 1, device=device).to(dtype)
    want_state = state.to(torch.float32, copy=True)
    slot_ids = pick(slots, len(lengths), device)
    row, offsets = 0, []
    for gap, length in zip([1, 0, 2, 3], lengths, strict=False):  # rows before each span
        offsets.append(row + gap)
        row += gap + length
    tokens = row + 1
    sizes = lengths + [0] * bool(padding)  # the empty span padding entries name (slot -1)
    table = mod.span_blocks(
        sizes, block, len(mod.span_blocks(lengths, block)) + padding if padding else None
    )
    blocks = torch.tensor(table, dtype=torch.int32, device=device)
    if padding:
        offsets.append(0)
        slot_ids = torch.cat((slot_ids, torch.tensor([-1], dtype=torch.int32, device=device)))
    offsets = torch.tensor(offsets, dtype=torch.int32, device=device)
    lens = torch.tensor(sizes, dtype=torch.int32, device=device)
    inside = torch.zeros(tokens, dtype=torch.bool, device=device)
    for offset, length in zip(offsets.tolist(), sizes, strict=True):
        inside[offset : offset + length] = True
    for chunk in range(2):
        x = torch.randn(tokens, channels, device=device).to(dtype)
        got = poisoned((tokens, channels), dtype, device)
        want = poisoned((tokens, channels), torch.float32, device)
        n = len(lengths)  # the reference takes the real spans only
        mod.causal_conv1d_prefill_reference(
            x.float(), weight.float(), want_state, offsets[:n], lens[:n], slot_ids[:n], want
        )
        mod.causal_conv1d_prefill(x, weight, state, offsets, lens, slot_ids, blocks, block, got)
        assert_close(got[inside].float(), want[inside], dtype, f"output, chunk {chunk}")
        assert torch.isnan(got[~inside]).all(), (
            f"a row outside the spans was written, chunk {chunk}"
        )
        assert torch.equal(state.float(), want_state), f"state differs after chunk {chunk}"


ATTENTION_SHAPES = [  # (heads, kv heads, head dim, block size, blocks, context lengths)
    (4, 2, 24, 4, 40, [1, 7, 33]),
    (8, 2, 32, 16, 24, [100, 3, 17]),
    (2, 1, 16, 8, 50, [300]),
    pytest.param(16, 4, 256, 16, 8400, [1000 + 17 * i for i in range(64)], marks=needs_cuda),  # 4B
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nh,nkv,hd,block_size,blocks,lengths", ATTENTION_SHAPES)
def test_paged_decode_attention(kernels, device, dtype, nh, nkv, hd, block_size, blocks, lengths):
    """Block tables scattered over the cache; a padding row (context 0) gets zeros; with a gate
    (strided), the bits `sigmoid_gate` after it gives."""
    mod = kernels["paged_attention"]
    num = len(lengths)
    tokens = num + 2
    q = torch.randn(tokens, nh, hd, device=device).to(dtype)
    k_cache = torch.randn(blocks * block_size, nkv, hd, device=device).to(dtype)
    v_cache = torch.randn_like(k_cache)
    width = max(-(-n // block_size) for n in lengths) + 1
    tables = torch.randperm(blocks)[: num * width].view(num, width).to(device)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    rows = pick(tokens, num, device)
    scale = hd**-0.5
    got, want = poisoned(q.shape, dtype, device), poisoned(q.shape, dtype, device)
    mod.paged_decode_attention_reference(
        q, k_cache, v_cache, tables, seq_lens, rows, block_size, scale, want
    )
    mod.paged_decode_attention(
        q, k_cache, v_cache, tables, seq_lens, rows, block_size, scale, got, max(lengths)
    )
    r = rows.long()
    assert_close(got[r].float(), want[r].float(), dtype, "attention output")
    gate, gated = (
        torch.randn(tokens, nh, 2 * hd, device=device).to(dtype)[..., hd:],
        poisoned(q.shape, dtype, device),
    )
    mod.paged_decode_attention(
        q,
        k_cache,
        v_cache,
        tables,
        seq_lens,
        rows,
        block_size,
        scale,
        gated,
        max(lengths),
        gate=gate,
    )
    assert torch.equal(gated[r], kernels["activation"].sigmoid_gate_triton(got, gate)[r]), (
        "gated output"
    )
    # the same with a looser length bound (as a CUDA graph runs it) and a padding row
    spare = next(i for i in range(tokens) if i not in set(rows.tolist()))
    pad_rows = torch.cat([rows, rows.new_tensor([spare])])
    pad_lens = torch.cat([seq_lens, seq_lens.new_zeros(1)])
    pad_tables = torch.cat([tables, tables[:1]])
    got = poisoned(q.shape, dtype, device)
    mod.paged_decode_attention(
        q,
        k_cache,
        v_cache,
        pad_tables,
        pad_lens,
        pad_rows,
        block_size,
        scale,
        got,
        width * block_size,
    )
    assert_close(got[r].float(), want[r].float(), dtype, "attention output, graph-style bound")
    assert (got[spare] == 0).all(), "a padding row did not get zeros"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "nh,nkv,hd,start,length",
    [
        (4, 2, 24, 0, 9),
        (6, 3, 20, 13, 7),
        pytest.param(16, 4, 256, 1000, 3000, marks=needs_cuda),
        pytest.param(16, 4, 256, 0, 2048, marks=needs_cuda),
    ],
)
def test_paged_prefill_attention(kernels, device, dtype, nh, nkv, hd, start, length):
    """A chunk after `start` cached positions (bottom-right causal mask), blocks out of order."""
    mod = kernels["paged_attention"]
    block_size = 16
    blocks = -(-(start + length) // block_size)
    k_cache = torch.randn(blocks + 5, block_size, nkv, hd, device=device).to(dtype).flatten(0, 1)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(blocks + 5)[:blocks].to(device)
    q = torch.randn(length, nh, hd, device=device).to(dtype)
    want = mod.paged_attention(q, k_cache, v_cache, table, block_size, start, hd**-0.5)
    got = mod.paged_prefill_attention(q, k_cache, v_cache, table, block_size, start, hd**-0.5)
    assert_close(got.float(), want.float(), dtype, "prefill attention")


NORM_SHAPES = [  # (leading shape, dim)
    ((5, 3), 24),
    ((7,), 100),
    pytest.param((64,), 2560, marks=needs_cuda),  # 4B hidden
    pytest.param((64, 16), 256, marks=needs_cuda),  # 4B q_norm over heads
]


def set_interpreter_rows(monkeypatch, rows: int) -> None:
    """Run the norms' kernels with `rows` rows per program under the interpreter (the GPU's
    one, or a part-filled last program); on CUDA only one (the GPU always runs one)."""
    if CUDA and rows != 1:
        pytest.skip("the GPU runs one row per program")
    monkeypatch.setattr("deltaserve.kernels.triton_compat.INTERPRETER_ROWS", rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,dim", NORM_SHAPES)
@pytest.mark.parametrize("rows", [1, 4])
def test_rms_norm(kernels, device, dtype, lead, dim, rows, monkeypatch):
    """Zero-centred norm on a strided view (q of [T, heads, 2 hd]) and the gated norm."""
    mod = kernels["rmsnorm"]
    set_interpreter_rows(monkeypatch, rows)
    x = torch.randn(*lead, 2 * dim, device=device).to(dtype)[..., :dim]  # rows strided by 2 dim
    w = torch.randn(dim, device=device).to(dtype)
    assert_close(
        mod.rms_norm_triton(x, w, 1e-6).float(),
        mod.rms_norm_reference(x, w, 1e-6).float(),
        dtype,
        "rms_norm",
    )
    x = torch.randn(*lead, dim, device=device).to(dtype)
    z = torch.randn(*lead, dim, device=device).to(dtype)
    assert_close(
        mod.gated_rms_norm_triton(x, z, w, 1e-6).float(),
        mod.gated_rms_norm_reference(x, z, w, 1e-6).float(),
        dtype,
        "gated_rms_norm",
    )
    if (
        len(lead) == 2
    ):  # the DeltaNet's gate: [T, heads, dv] heads of a wider projection row, read in place
        wide = torch.randn(lead[0], 3 * lead[1] * dim + 5, device=device).to(dtype)
        z = wide[:, 7 : 7 + lead[1] * dim].view(lead[0], lead[1], dim)
        assert_close(
            mod.gated_rms_norm_triton(x, z, w, 1e-6).float(),
            mod.gated_rms_norm_reference(x, z, w, 1e-6).float(),
            dtype,
            "gated_rms_norm, strided gate",
        )
    residual = torch.randn(*lead, dim, device=device).to(dtype)
    got_norm, got_sum = mod.add_rms_norm_triton(x, residual, w, 1e-6)
    want_norm, want_sum = mod.add_rms_norm_reference(x, residual, w, 1e-6)
    if CUDA or dtype == torch.float32:  # the interpreter truncates bf16 where the GPU rounds
        assert torch.equal(got_sum, want_sum), (
            "add_rms_norm: the sum is one rounding of x + residual"
        )
    assert_close(got_sum.float(), want_sum.float(), dtype, "add_rms_norm sum")
    assert_close(got_norm.float(), want_norm.float(), dtype, "add_rms_norm")


@pytest.mark.parametrize(
    "rows,n,k",
    [
        (3, 40, 384),
        (17, 70, 256),
        pytest.param(64, 2560, 9216, marks=needs_cuda),
        pytest.param(8, 2560, 4096, marks=needs_cuda),
        pytest.param(64, 2560, 4096, marks=needs_cuda),
    ],
)  # 4B down, out_proj
def test_add_rms_norm_of_split_sum(kernels, device, rows, n, k, monkeypatch):
    """A K-split projection left unsummed (`linear(unsummed=True)`) and added by the next
    norm gives, bit for bit, what the projection summed by its own kernel then the norm give."""
    mod, norm = kernels["skinny_linear"], kernels["rmsnorm"]
    dtype = torch.bfloat16
    x = torch.randn(rows, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    residual, weight = (
        torch.randn(rows, n, device=device).to(dtype),
        torch.randn(n, device=device).to(dtype),
    )
    cfg, gemv = mod.decode_config(rows, n, k)
    assert cfg.split_k > 1, "a shape the rule splits"
    parts = mod.skinny_linear(x, w, cfg, gemv, unsummed=True)
    assert isinstance(parts, mod.SplitSum) and parts.parts.shape == (cfg.split_k, rows, n)
    got = norm.add_rms_norm(parts, residual, weight, 1e-6)
    want = norm.add_rms_norm_triton(mod.skinny_linear(x, w, cfg, gemv), residual, weight, 1e-6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (
        "the parts were not added as the sum kernel adds them"
    )
    from deltaserve.kernels import triton_compat

    # `linear`'s GPU routing, on CPU too
    monkeypatch.setattr(triton_compat, "GPU_PATH_ON_CPU", True)
    assert isinstance(mod.linear(x, w, unsummed=True), mod.SplitSum)
    assert torch.equal(mod.linear(x, w), mod.skinny_linear(x, w, cfg, gemv)), "summed unless asked"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "tokens,width", [(3, 40), (5, 1500), pytest.param(64, 9216, marks=needs_cuda)]
)
def test_silu_and_mul(kernels, device, dtype, tokens, width):
    """Over the merged [gate | up] output; 1500 is not a multiple of the kernel's block."""
    mod = kernels["activation"]
    gate_up = (2 * torch.randn(tokens, 2 * width, device=device)).to(dtype)
    assert_close(
        mod.silu_and_mul_triton(gate_up).float(),
        mod.silu_and_mul_reference(gate_up).float(),
        dtype,
        "silu_and_mul",
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "tokens,heads,dim", [(3, 2, 40), pytest.param(64, 16, 256, marks=needs_cuda)]
)
def test_sigmoid_gate(kernels, device, dtype, tokens, heads, dim):
    """attention's output gate, read from the gate half of [query | gate] rows (strided)."""
    mod = kernels["activation"]
    x = torch.randn(tokens, heads, dim, device=device).to(dtype)
    q_and_gate = (3 * torch.randn(tokens, heads, 2 * dim, device=device)).to(dtype)
    gate = q_and_gate[..., dim:]
    got = mod.sigmoid_gate_triton(x, gate, out=poisoned(x.shape, dtype, device))
    assert_close(got.float(), mod.sigmoid_gate_reference(x, gate).float(), dtype, "sigmoid_gate")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "vocab,first,rows,hidden,tokens",
    [
        (50, 0, 50, 40, 7),
        (90, 30, 30, 24, 9),
        pytest.param(248320, 0, 248320, 2560, 64, marks=needs_cuda),
    ],
)
def test_embedding(kernels, device, dtype, vocab, first, rows, hidden, tokens):
    """Rows by token id; a -1 takes its slot's last sample (a padding row's slot is -1); at a
    vocabulary shard (rows first .. first + rows - 1 of vocab), other tokens get zeros. A
    copy: the same bits as the reference."""
    mod = kernels["embedding"]
    weight = torch.randn(rows, hidden, device=device).to(dtype)
    last_tokens = torch.randint(0, vocab, (11,), device=device)
    ids = torch.randint(0, vocab, (tokens,), device=device)
    slots = (
        pick(11, tokens, device)
        if tokens <= 11
        else torch.randint(0, 11, (tokens,), device=device, dtype=torch.int32)
    )
    ids[::3] = -1
    slots[-1] = -1  # a padding row: its own token, whatever the slot
    ids[-1] = first + rows - 1
    got = mod.embedding_triton(ids, weight, first, slots, last_tokens)
    resolved = torch.where(ids >= 0, ids, last_tokens[slots.clamp(min=0).long()])
    inside = (resolved >= first) & (resolved < first + rows)
    want = torch.zeros(tokens, hidden, dtype=dtype, device=device)
    want[inside] = weight[resolved[inside] - first]
    assert torch.equal(got, want), "embedding: not the rows of the resolved tokens"
    assert torch.equal(mod.embedding_reference(ids, weight, first, slots, last_tokens), want)
    assert bool((~inside).any()) == (rows < vocab), "a shard case without tokens outside it"
    plain = resolved.flip(0)  # every id given: no last samples read
    assert torch.equal(
        mod.embedding_triton(plain, weight, first), mod.embedding_reference(plain, weight, first)
    )


ROPE_SHAPES = [  # (query heads, kv heads, head dim, rotary dim)
    (4, 2, 24, 6),
    (3, 1, 40, 40),
    pytest.param(16, 4, 256, 64, marks=needs_cuda),  # 4B: rotary on a quarter of 256
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nh,nkv,hd,rotary", ROPE_SHAPES)
@pytest.mark.parametrize("rows", [1, 4])
def test_norm_rope(kernels, device, dtype, nh, nkv, hd, rotary, rows, monkeypatch):
    """q read from the [q | gate] layout of q_proj (strided rows), positions up to 300k; k as
    returned and v (strided) written to the cache rows named, a negative one skipped."""
    mod = kernels["rope"]
    set_interpreter_rows(monkeypatch, rows)
    tokens = 7
    q = torch.randn(tokens, nh, 2 * hd, device=device).to(dtype)[..., :hd]
    k = torch.randn(tokens, nkv, hd, device=device).to(dtype)
    v = torch.randn(tokens, 2 * nkv, hd, device=device).to(dtype)[:, nkv:]
    qw, kw = torch.randn(hd, device=device).to(dtype), torch.randn(hd, device=device).to(dtype)
    positions = torch.randint(0, 300_000, (tokens,), device=device)
    exponents = torch.arange(0, rotary, 2, dtype=torch.float32, device=device) / rotary
    inv_freq = 1.0 / (1e7**exponents)
    k_cache, v_cache = (torch.randn(30, nkv, hd, device=device).to(dtype) for _ in range(2))
    index = torch.tensor([7, -1, 0, 29, 12, 3, -1], device=device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    got_q, got_k = mod.norm_rope(
        q, k, qw, kw, positions, inv_freq, 1e-6, mod.KVStore(v, k_cache, v_cache, index)
    )
    assert_close(
        got_q.float(), mod.norm_rope_reference(q, qw, positions, inv_freq, 1e-6).float(), dtype, "q"
    )
    assert_close(
        got_k.float(), mod.norm_rope_reference(k, kw, positions, inv_freq, 1e-6).float(), dtype, "k"
    )
    keep = index >= 0
    want_k[index[keep]], want_v[index[keep]] = got_k[keep], v[keep]
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    # without the store
    assert torch.equal(mod.norm_rope(q, k, qw, kw, positions, inv_freq, 1e-6)[1], got_k)


def skip_without_fla(gated_delta) -> None:
    """Skip when fla-core is absent; fail when it is installed and still not found (a
    broken lazy import would otherwise fall back to the slow reference, silently)."""
    if importlib.util.find_spec("fla") is None:
        pytest.skip("fla-core is not installed")
    assert gated_delta.fla_chunk_kernel() is not None, (
        "fla-core is installed, but its prefill kernel did not import"
    )


def test_import_lazily_defers_the_package_init(tmp_path, monkeypatch):
    """A lazily imported package's submodule loads without its __init__; the first name
    asked of the package runs the __init__ once, into the same module."""
    from deltaserve.kernels.gated_delta import import_lazily

    top = tmp_path / "lazypkg"
    (top / "inner").mkdir(parents=True)
    (top / "__init__.py").write_text("")
    (top / "inner" / "__init__.py").write_text(
        "import sys\nsys.inits = getattr(sys, 'inits', 0) + 1\nfrom .leaf import X\nY = 2\n"
    )
    (top / "inner" / "leaf.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "inits", 0, raising=False)
    for name in ("lazypkg", "lazypkg.inner", "lazypkg.inner.leaf"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import lazypkg  # noqa: F401  the parent must exist

    import_lazily(["lazypkg.inner"])
    from lazypkg.inner.leaf import X

    assert X == 1 and sys.inits == 0, "the package __init__ ran during the lazy import"
    from lazypkg.inner import Y

    assert Y == 2 and sys.inits == 1
    from lazypkg.inner import X as again

    assert again is X and sys.inits == 1, "the __init__ ran twice or reloaded its submodule"


@pytest.mark.parametrize(
    "nk,nv,dk,dv,tokens",
    [(2, 4, 24, 20, 5), (1, 1, 16, 16, 1), pytest.param(16, 32, 128, 128, 1000, marks=needs_cuda)],
)
def test_fla_inputs(kernels, device, nk, nv, dk, dv, tokens):
    """fla's inputs from strided views of in_proj's output, as the layer passes them: q and k
    L2-normalised as fla's l2norm does, v, g = a and beta = sigmoid(b) bit for bit."""
    mod = kernels["gated_delta"]
    bf16 = torch.bfloat16
    width = 2 * nk * dk + nv * dv
    # [qkv | b | a | rest]
    packed = (3 * torch.randn(tokens, width + 2 * nv + 7, device=device)).to(bf16)
    mixed, b, a = (
        packed[:, :width],
        packed[:, width : width + nv],
        packed[:, width + nv : width + 2 * nv],
    )
    q, k, v, g, beta = mod.fla_inputs(mixed, a, b, nk, dk)
    ulp = 2**-8 if CUDA else 1.5 * 2**-7  # one rounding to bf16; the interpreter truncates instead
    for got, x in ((q, mixed[:, : nk * dk]), (k, mixed[:, nk * dk : 2 * nk * dk])):
        x = x.reshape(tokens, nk, dk).float()
        want = x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)
        assert got.shape == (tokens, nk, dk) and got.is_contiguous()
        assert_close(got.float(), want, bf16, "fla_inputs q/k")
        assert ((got.float() - want).abs() <= want.abs() * ulp + 1e-7).all(), (
            "q/k: more than one rounding off"
        )
    assert torch.equal(v, mixed[:, 2 * nk * dk :].reshape(tokens, nv, dv)), "v"
    assert torch.equal(g, a), "g is a as it came"
    assert_close(beta.float(), b.float().sigmoid(), bf16, "beta")
    want = b.float().sigmoid()
    assert ((beta.float() - want).abs() <= want * ulp).all(), "beta is sigmoid(b), one rounding"


@needs_cuda
def test_fla_chunk_matches_reference(kernels):
    """Packed prefill of several sequences (fla's varlen kernel, bf16 inputs, L2 norms and
    decay inside fla) equals the reference sequence by sequence, states included."""
    mod = kernels["gated_delta"]
    skip_without_fla(mod)
    nk, nv, dk, dv, lengths = 2, 4, 64, 64, [63, 130, 2]
    total = sum(lengths)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    a_log, dt_bias = torch.rand(nv, device=dev).to(bf16), torch.randn(nv, device=dev).to(bf16)
    state = torch.randn(5, nv, dk, dv, device=dev) * 0.1
    want_state = state.clone()
    for padded in (False, True):  # as a step's own, or as a prompt CUDA graph's fixed-size buffers
        rows = total + 7 * padded
        i32 = {"dtype": torch.int32, "device": dev}
        slots = torch.tensor([3, 0, 4] + [-1, -1] * padded, **i32)
        sizes = lengths + [0, 0] * padded
        bounds = torch.tensor([0, *sizes], **i32).cumsum(0, dtype=torch.int32)
        chunks = torch.tensor(
            kernels["causal_conv1d"].span_blocks(sizes, mod.CHUNK_SIZE, 9 if padded else None),
            **i32,
        )
        mixed = torch.randn(rows, 2 * nk * dk + nv * dv, device=dev).to(bf16)
        a, b = (
            torch.randn(rows, nv, device=dev).to(bf16),
            torch.randn(rows, nv, device=dev).to(bf16),
        )
        args = (a_log, dt_bias)
        got = mod.gated_delta_prefill(mixed, a, b, *args, state, slots, bounds, chunks, nk)
        want = mod.gated_delta_prefill_reference(mixed, a, b, *args, want_state, slots, bounds, nk)
        assert got.dtype == bf16
        assert_close(
            got[:total].float(),
            want[:total].float(),
            bf16,
            f"fla chunk output (bf16 inputs), padded {padded}",
        )
        assert_close(state, want_state, bf16, f"fla chunk final states, padded {padded}")
        assert torch.equal(state[[1, 2]], want_state[[1, 2]]), "slots of no sequence changed"


def test_store_states(kernels, device):
    """state[slots[i]] = final[i] for each slot >= 0; a prompt graph's padding sequence (slot
    -1) writes nowhere, whatever its final state holds."""
    mod = kernels["gated_delta"]
    state = torch.randn(6, 3, 5, 7, device=device)
    final = torch.randn(4, 3, 5, 7, device=device)
    slots = torch.tensor([4, -1, 0, -1], dtype=torch.int32, device=device)
    want = state.clone()
    want[4], want[0] = final[0], final[2]
    mod.store_states(state, slots, final)
    assert torch.equal(state, want)


def test_every_pdl_kernel_waits_before_touching_memory():
    """A kernel launched with PDL (`pdl_options`, kernels/triton_compat.py) may start while the
    kernel before it still runs: one that loads or stores before `wait_for_previous_grid(GDC)`
    (GDC_LATE where it takes that) races it, silently and only sometimes. Every Triton kernel
    with a GDC parameter must wait there, on every branch, before any load, store or helper
    making one, but `_load_weights` and `read_ahead`. Every PDL launch must be of one."""
    import ast
    from pathlib import Path

    import deltaserve.kernels as kernels_pkg

    def name_of(call: ast.Call) -> str:
        return getattr(call.func, "attr", getattr(call.func, "id", ""))

    trees = {
        path: ast.parse(path.read_text()) for path in Path(kernels_pkg.__file__).parent.glob("*.py")
    }
    functions = [
        fn for tree in trees.values() for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef)
    ]
    memory_ops, early_reads = {"load", "store", "atomic_add"}, {"_load_weights", "read_ahead"}
    touching = {
        fn.name
        for fn in functions
        if fn.name not in early_reads
        and {name_of(n) for n in ast.walk(fn) if isinstance(n, ast.Call)} & memory_ops
    }
    assert early_reads <= {fn.name for fn in functions}

    def first_before_wait(body: list[ast.stmt], waited: bool, gate: str) -> tuple[bool, str | None]:
        """(whether every path through `body` waited at `gate`, a memory call met before)."""
        for stmt in body:
            if isinstance(stmt, ast.If):
                then, early = first_before_wait(stmt.body, waited, gate)
                other, early_else = first_before_wait(stmt.orelse, waited, gate)
                if early or early_else:
                    return waited, early or early_else
                waited = then and other
                continue
            calls = [n for n in ast.walk(stmt) if isinstance(n, ast.Call)]
            if any(
                name_of(c) == "wait_for_previous_grid" and ast.unparse(c.args[0]) == gate
                for c in calls
            ):
                waited = True
            elif not waited and {name_of(c) for c in calls} & (memory_ops | touching):
                return waited, min({name_of(c) for c in calls} & (memory_ops | touching))
        return waited, None

    waiting, launched = set(), set()
    for path, tree in trees.items():
        for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            params = [a.arg for a in fn.args.args]
            if "GDC" not in params or fn.name == "wait_for_previous_grid":
                continue
            gate = "GDC_LATE" if "GDC_LATE" in params else "GDC"
            waited, early = first_before_wait(fn.body, False, gate)
            assert early is None, f"{path.name}:{fn.name} calls {early} before it waits at {gate}"
            assert waited, (
                f"{path.name}:{fn.name} takes {gate} but does not wait there on every path"
            )
            if gate == "GDC_LATE":  # and GDC's wait, for launches without read-ahead, comes first
                assert "wait_for_previous_grid(GDC)" in ast.unparse(fn.body[0]), (
                    f"{fn.name}: GDC's wait not first"
                )
            waiting.add(fn.name)
        for call in (
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)
        ):
            # kernel[grid](..., **pdl_options(x)), or
            # kernel[grid](..., **pdl) with pdl = pdl_options(x)
            spread = [k.value for k in call.keywords if k.arg is None]
            if any(
                ast.unparse(v) in ("pdl", "pdl_options")
                or ast.unparse(v).startswith("pdl_options(")
                for v in spread
            ):
                launched.add(call.func.value.id)
    assert len(launched) >= 10, f"the check found only {sorted(launched)}"
    assert launched <= waiting, f"launched with PDL but no GDC wait: {sorted(launched - waiting)}"


GLOBAL_OPS = ("ld.global", "st.global", "atom.global", "red.global")


def hopper_ptx(
    kernel: str, signature: dict[str, str], constants: dict
) -> tuple[list[str], list[str]]:
    """A skinny_linear kernel compiled for sm_90 (Triton's own ptxas, no GPU needed; in a process
    of its own, as the interpreter replaces `triton.jit` in this one): its PTX lines, and the
    griddepcontrol instructions in their order."""
    import os
    import subprocess

    pytest.importorskip("triton.backends.nvidia")
    compile_ptx = f"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from deltaserve.kernels.skinny_linear import {kernel} as kernel
constants = {constants!r}
signature = {signature!r} | {{name: "constexpr" for name in constants}}
constexprs = {{(kernel.arg_names.index(k),): v for k, v in constants.items()}}
source = ASTSource(kernel, signature, constexprs=constexprs)
print(triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"])
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    ptx = subprocess.run(
        [sys.executable, "-c", compile_ptx], env=env, capture_output=True, text=True, timeout=120
    )
    assert ptx.returncode == 0, ptx.stderr[-2000:]
    lines = [line.strip() for line in ptx.stdout.splitlines()]
    order = [line.split()[0].rstrip(";") for line in lines if line.startswith("griddepcontrol")]
    return lines, order


def global_ops_around_wait(lines: list[str]) -> tuple[list[str], list[str]]:
    """The instructions touching global memory before `griddepcontrol.wait`, and after it
    (predicated or not)."""
    wait = next(i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait"))
    touching = [
        (i, line)
        for i, line in enumerate(lines)
        if any(token.startswith(GLOBAL_OPS) for token in line.split())
    ]
    return [line for i, line in touching if i < wait], [line for i, line in touching if i > wait]


@pytest.mark.parametrize("gdc", [1, 2])
def test_pdl_wait_keeps_its_place_in_hopper_code(gdc: int):
    """The source-order check above holds only if the compiler keeps every load and store after
    `griddepcontrol.wait`. Compiled for sm_90, a kernel launched either way (`EARLY_TRIGGER`:
    the next kernel let launch after its wait, or before it) must touch no global memory
    before its wait."""
    signature = {"part_ptr": "*fp32", "out_ptr": "*bf16", "total": "i32"}
    lines, order = hopper_ptx(
        "_sum_splits_kernel", signature, {"SPLIT_K": 3, "BLOCK": 1024, "GDC": gdc}
    )
    want = ["griddepcontrol.wait", "griddepcontrol.launch_dependents"]
    assert order == (want if gdc == 1 else want[::-1]), order
    early, late = global_ops_around_wait(lines)
    assert not early, f"global memory touched before the wait: {early}"
    late = " ".join(late)
    assert "ld.global" in late and "st.global" in late  # the kernel's loads and stores were found


@pytest.mark.parametrize(("first_ahead", "fp8"), [(False, False), (True, False), (True, True)])
def test_gemv_read_ahead_stays_ahead_in_hopper_code(first_ahead: bool, fp8: bool):
    """The K-looping GEMV with its first block read ahead: compiled for sm_90, loads (only)
    come before the wait, so the compiler did not sink the early reads after it (a silent loss
    of the overlap) and stores nothing early; without it, nothing comes before the wait. FP8
    weights alike (their scales are read after the wait, with x)."""
    signature = {
        name: "*bf16" for name in ("x_ptr", "w_ptr", "out_ptr", "conv_w_ptr", "conv_state_ptr")
    }
    signature |= {"conv_slots_ptr": "*i32", "s_ptr": "*fp32"} | (
        {"w_ptr": "*fp8e4nv"} if fp8 else {}
    )
    signature |= {
        name: "i32"
        for name in (
            "N",
            "k_per_split",
            "up",
            "stride_wn",
            "stride_split",
            "conv_channels",
            "stride_conv_slot",
            "stride_s",
        )
    }
    constants = {
        "BLOCK_N": 2,
        "BLOCK_K": 1024,
        "EVICT": True,
        "SILU_MUL": False,
        "TAIL_K": -1,
        "CONV": False,
        "GDC": 2,
        "FIRST_AHEAD": first_ahead,
        "FP8": fp8,
        "BM": 128,
        "BN": 128,
    }
    lines, order = hopper_ptx("_gemv_kernel", signature, constants)
    assert order == ["griddepcontrol.launch_dependents", "griddepcontrol.wait"], order
    early, _ = global_ops_around_wait(lines)
    assert all("ld.global" in line for line in early), f"more than loads before the wait: {early}"
    assert bool(early) == first_ahead, f"loads before the wait: {early}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nh,nkv,hd,rotary", ROPE_SHAPES)
def test_norm_rope_stores_fp8(kernels, device, dtype, nh, nkv, hd, rotary):
    """An FP8 cache: the rows written are k (as returned) and v divided by each head's scale,
    saturated at e4m3's largest value, in FP8, bit for bit as `kv_quant.quantize` makes them
    (ties to even: bf16 inputs tie often)."""
    mod, quant = kernels["rope"], importlib.import_module("deltaserve.kernels.kv_quant")
    tokens = 6
    q = torch.randn(tokens, nh, hd, device=device).to(dtype)
    k = torch.randn(tokens, nkv, hd, device=device).to(dtype)
    v = (torch.randn(tokens, nkv, hd, device=device) * 300).to(dtype)  # some past 448 * scale
    qw, kw = torch.randn(hd, device=device).to(dtype), torch.randn(hd, device=device).to(dtype)
    positions = torch.randint(0, 5000, (tokens,), device=device)
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, rotary, 2, device=device).float() / rotary))
    k_cache, v_cache = (torch.zeros(20, nkv, hd, device=device, dtype=quant.FP8) for _ in "kv")
    kv_scale = torch.rand(2, nkv, device=device) + 0.25
    index = torch.tensor([3, 19, -1, 0, 7, 11], device=device)
    _, got_k = mod.norm_rope(
        q, k, qw, kw, positions, inv_freq, 1e-6, mod.KVStore(v, k_cache, v_cache, index, kv_scale)
    )
    keep = index >= 0
    want_k, want_v = quant.quantize(got_k, kv_scale[0]), quant.quantize(v, kv_scale[1])
    for got, want in ((k_cache, want_k), (v_cache, want_v)):
        assert torch.equal(got[index[keep]].float(), want[keep].float())
    assert k_cache[[1, 2]].float().abs().sum() == 0, "a row of no token written"
    assert v_cache.float().abs().max() == quant.FP8_MAX, "large values saturate"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nh,nkv,hd,block_size,blocks,lengths", ATTENTION_SHAPES)
def test_paged_decode_attention_reads_fp8(
    kernels, device, dtype, nh, nkv, hd, block_size, blocks, lengths
):
    """An FP8 cache with a scale per KV head: the kernel gives what the reference gives over
    the rows multiplied back (`kv_quant.dequantize`)."""
    mod, quant = kernels["paged_attention"], importlib.import_module("deltaserve.kernels.kv_quant")
    num = len(lengths)
    q = torch.randn(num, nh, hd, device=device).to(dtype)
    kv_scale = torch.rand(2, nkv, device=device) * 0.05 + 0.01
    k_cache, v_cache = (
        quant.quantize(torch.randn(blocks * block_size, nkv, hd, device=device), s)
        for s in kv_scale
    )
    width = max(-(-n // block_size) for n in lengths)
    tables = torch.randperm(blocks)[: num * width].view(num, width).to(device)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    rows = torch.arange(num, dtype=torch.int32, device=device)
    got, want = poisoned(q.shape, dtype, device), poisoned(q.shape, dtype, device)
    args = (tables, seq_lens, rows, block_size, hd**-0.5)
    mod.paged_decode_attention_reference(q, k_cache, v_cache, *args, want, kv_scale=kv_scale)
    mod.paged_decode_attention(q, k_cache, v_cache, *args, got, max(lengths), kv_scale=kv_scale)
    assert_close(got.float(), want.float(), dtype, "attention over an FP8 cache")
    with pytest.raises(ValueError, match="an FP8 cache needs kv_scale"):
        mod.paged_decode_attention(q, k_cache, v_cache, *args, got, max(lengths))
