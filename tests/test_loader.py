"""Checkpoint loading: both naming schemes and sharding give the same model; broken folders
are refused with an error that names the tensor or the setting."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve.engine.checkpoint_files import (
    CheckpointError,
    SafetensorsError,
    checkpoint_files,
    read_header,
)
from deltaserve.engine.model_config import ConfigError, ModelConfig
from deltaserve.engine.rank.checkpoint_reader import CheckpointReader
from deltaserve.engine.rank.executor import Executor, ExecutorConfig
from deltaserve.ipc.messages import NewRequest, SamplingSpec, StepItem
from deltaserve.tools.golden import compare_logprobs
from deltaserve.tools.make_model import make_model

PROMPT = [(i * 7919) % 248044 for i in range(70)]


def logits_of(model_dir) -> torch.Tensor:
    ex = Executor(ExecutorConfig(str(model_dir), max_num_seqs=1, num_kv_blocks=8))
    item = StepItem(1, 0, PROMPT, True, NewRequest(len(PROMPT), SamplingSpec(seed=0)))
    return ex.forward([item], every_position=True)


def test_naming_schemes_and_shards_give_the_same_logits(tiny_model_dir, tmp_path):
    text = logits_of(tiny_model_dir)
    vlm = make_model(tmp_path / "vlm", preset="tiny", dtype="fp32", seed=0, vlm_names=True)
    sharded = make_model(
        tmp_path / "sharded", preset="tiny", dtype="fp32", seed=0, shard_size="20MB"
    )
    assert json.loads((vlm / "config.json").read_text())["model_type"] == "qwen3_5"
    assert len(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    assert torch.equal(logits_of(vlm), text)
    assert torch.equal(logits_of(sharded), text)


@pytest.fixture
def broken_copy(tiny_model_dir, tmp_path):
    target = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, target)
    return target


def test_wrong_model_type_is_refused(broken_copy):
    path = broken_copy / "config.json"
    config = json.loads(path.read_text())
    config["model_type"] = "llama"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        logits_of(broken_copy)


@pytest.mark.parametrize("variant", ["no rope_theta", "rope_scaling beside rope_parameters"])
def test_rope_theta_read_as_transformers_reads_it(tiny_model_dir, variant):
    """Configs off the published format still give HF's theta: its default (10k) when none is
    given, and rope_scaling's over rope_parameters' (we read 1e7 and rope_parameters)."""
    from transformers import AutoConfig

    raw = json.loads((tiny_model_dir / "config.json").read_text())
    text = raw.get("text_config", raw)
    if variant == "no rope_theta":
        text["rope_parameters"].pop("rope_theta")
        text.pop("rope_theta", None)
    else:
        text["rope_scaling"] = {"rope_type": "default", "rope_theta": 1e6}
    hf = AutoConfig.for_model(**json.loads(json.dumps(raw)))
    want = getattr(hf, "text_config", hf).rope_parameters["rope_theta"]
    assert (
        ModelConfig.from_dict(raw).rope_theta
        == want
        == (1e4 if variant == "no rope_theta" else 1e6)
    )


SHAPE_KEYS = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "rms_norm_eps",
    "max_position_embeddings",
]


@pytest.mark.parametrize(
    "dropped", ["head_dim", "vocab_size", "num_hidden_layers", "linear_num_value_heads", "all"]
)
@pytest.mark.parametrize("layout", ["text", "vlm"])
def test_absent_config_keys_take_transformers_defaults(
    tiny_model_dir, tiny_vlm_model_dir, dropped, layout
):
    """A config.json that leaves keys out is read with Qwen3_5TextConfig's defaults, as HF
    reads it (head_dim 256, not hidden_size // heads), never a KeyError; the VLM ties by its
    top-level flag only, as Qwen3_5ForConditionalGeneration does."""
    from transformers import AutoConfig

    raw = json.loads(
        ((tiny_model_dir if layout == "text" else tiny_vlm_model_dir) / "config.json").read_text()
    )
    text = raw.get("text_config", raw)
    for key in SHAPE_KEYS if dropped == "all" else [dropped]:
        text.pop(key)
    if dropped in ("num_hidden_layers", "all"):
        text.pop("layer_types")  # else HF refuses the count mismatch
    if layout == "vlm":  # no top-level flag: the text config's does not count
        raw.pop("tie_word_embeddings")
        text["tie_word_embeddings"] = True
    hf = AutoConfig.for_model(**json.loads(json.dumps(raw)))
    hf_text = getattr(hf, "text_config", hf)
    ours = ModelConfig.from_dict(raw)
    for name in [*SHAPE_KEYS, "layer_types"]:
        want = getattr(hf_text, name)
        assert getattr(ours, name) == (tuple(want) if isinstance(want, list) else want), name
    assert ours.tie_word_embeddings == hf.tie_word_embeddings


def test_checkpoint_without_head_dim_in_its_config_matches_hf(tmp_path):
    """head_dim 256 left out of config.json, as HF's default: loads and gives HF's logits."""
    from transformers import Qwen3_5ForCausalLM

    model_dir = make_model(
        tmp_path / "hd", preset="tiny", dtype="fp32", seed=1, overrides={"head_dim": 256}
    )
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.pop("head_dim")
    path.write_text(json.dumps(config))
    # with fla installed (the GPU image), HF's DeltaNet runs fla's Triton kernels, which take
    # CUDA tensors only, and whose chunks multiply in tf32: a looser test there (a wrong
    # head_dim is off by whole nats)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    with torch.inference_mode():
        reference = hf(torch.tensor([PROMPT], device=device)).logits[0].float().cpu()
    ours = logits_of(model_dir)
    if device == "cpu":
        assert (ours.log_softmax(-1) - reference.log_softmax(-1)).abs().max() <= 1e-3
    else:  # fla's tf32 chunks over 70 positions: top-8 mean 0.014, max 0.17 on the H200
        report = compare_logprobs(ours, reference)
        assert report.argmax_mismatches == 0 and report.mean_abs_diff <= 0.03, report


def rewrite_tensors(model_dir, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_missing_tensor_is_named(broken_copy):
    name = "model.layers.1.linear_attn.A_log"
    rewrite_tensors(broken_copy, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match="lacks tensors: model.layers.1.linear_attn.A_log"):
        logits_of(broken_copy)


def test_wrong_shape_is_named_with_its_file(broken_copy):
    name = "model.layers.3.self_attn.k_proj.weight"

    def shrink(tensors):
        tensors[name] = tensors[name][:-1].clone()

    rewrite_tensors(broken_copy, shrink)
    with pytest.raises(CheckpointError, match=rf"{name}.*model.safetensors.*shape"):
        logits_of(broken_copy)


def test_unexpected_text_tensor_is_named(broken_copy):
    def add(tensors):
        tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)

    rewrite_tensors(broken_copy, add)
    with pytest.raises(
        CheckpointError, match="unexpected tensor 'model.layers.0.mlp.extra_proj.weight'"
    ):
        logits_of(broken_copy)


@pytest.mark.parametrize(
    "index", ['{"metadata": {"total_size": 1}, "weight_', '{"metadata": {}}', '{"weight_map": [1]}']
)
def test_malformed_index_is_named(tiny_vlm_model_dir, tmp_path, index):
    """A truncated or malformed model.safetensors.index.json is refused naming the file, not a
    bare KeyError or JSON error from inside the loader."""
    target = tmp_path / "bad_index"
    shutil.copytree(tiny_vlm_model_dir, target)
    (target / "model.safetensors.index.json").write_text(index)
    with pytest.raises(
        CheckpointError, match=r"model.safetensors.index.json is not a safetensors index"
    ):
        logits_of(target)


@pytest.mark.parametrize(
    "shard,rule",
    [
        ("../secret.safetensors", "not a plain file name"),
        ("/tmp/secret.safetensors", "not a plain file name"),
        ("sub/model.safetensors", "not a plain file name"),
        ("..", "not a plain file name"),
        ("", "not a plain file name"),
        ("out.safetensors", "resolves outside the checkpoint folder"),  # a link out
    ],
)
def test_shards_only_from_inside_the_folder(tiny_vlm_model_dir, tmp_path, shard, rule):
    """An index names plain file names of the folder; a file that resolves (links followed)
    outside it is refused before a byte of it is read."""
    target = tmp_path / "ckpt"
    shutil.copytree(tiny_vlm_model_dir, target)
    outside = tmp_path / "secret.safetensors"
    shutil.copy(target / "model-00001-of-00002.safetensors", outside)
    (target / "out.safetensors").symlink_to(outside)
    index = target / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = sorted(data["weight_map"])[0]
    data["weight_map"][first] = shard
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=rule):
        checkpoint_files(target, confined=True)


def test_links_out_of_a_single_file_checkpoint_are_refused_for_new_weights(broken_copy, tmp_path):
    """For new weights (confined); the folder served from start may link anywhere (its
    operator's: a custom config beside linked weights)."""
    outside = tmp_path / "elsewhere.safetensors"
    (broken_copy / "model.safetensors").rename(outside)
    (broken_copy / "model.safetensors").symlink_to(outside)
    with pytest.raises(CheckpointError, match="model.safetensors in .* resolves outside"):
        checkpoint_files(broken_copy, confined=True)
    assert checkpoint_files(broken_copy) == [broken_copy / "model.safetensors"]
    (broken_copy / "model.safetensors").unlink()
    (broken_copy / "a.safetensors").symlink_to(outside)  # found by the *.safetensors glob
    with pytest.raises(CheckpointError, match="a.safetensors in .* resolves outside"):
        checkpoint_files(broken_copy, confined=True)


def test_a_hub_snapshot_links_into_its_blobs(tiny_vlm_model_dir, tmp_path):
    """Hugging Face's cache: snapshots/REV/<file> links to ../../blobs/<sha>, outside the
    snapshot folder but inside its repository's blobs: served, and its logits are the
    checkpoint's; a link past the blobs is still refused."""
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, path in enumerate(sorted(tiny_vlm_model_dir.iterdir())):
        shutil.copy(path, blobs / f"blob{i}")
        (snapshot / path.name).symlink_to(f"../../blobs/blob{i}")
    files = checkpoint_files(snapshot, confined=True)
    assert [f.name for f in files] == sorted(
        set(
            json.loads((tiny_vlm_model_dir / "model.safetensors.index.json").read_text())[
                "weight_map"
            ].values()
        )
    )
    assert torch.equal(logits_of(snapshot), logits_of(tiny_vlm_model_dir))
    shard = snapshot / files[0].name
    shard.unlink()
    shard.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="resolves outside"):
        checkpoint_files(snapshot, confined=True)


def test_truncated_file_is_named(broken_copy):
    path = broken_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(
        CheckpointError, match=r"model.safetensors: not a safetensors file \(incomplete metadata\)"
    ):
        logits_of(broken_copy)


SECRET = "TOPSECRET"


@pytest.mark.parametrize(
    "edit,error",
    [
        (lambda header: header["a"].pop("data_offsets"), r"\(invalid JSON in header\)"),
        (lambda header: header["a"].update(shape=SECRET), r"\(invalid JSON in header\)"),
        (lambda header: header["a"].update(shape=[-1, -7]), r"\(invalid JSON in header\)"),
        (lambda header: header["a"].update(dtype=SECRET), r"\(invalid JSON in header\)"),
        (lambda header: header["a"].update(data_offsets=[4, 32]), r"\(invalid offset\)"),
        (
            lambda header: header["a"].update(dtype="U16", shape=[14]),
            "tensor 'a' has unsupported dtype 'U16'",
        ),
    ],
)
def test_malformed_header_is_named(tmp_path, edit, error):
    """A header the safetensors library refuses is refused naming the file and the fault, and
    never repeating the library's message, which can quote the file's bytes (here SECRET); a
    dtype it knows and the loader does not is named."""
    path = tmp_path / "bad.safetensors"
    save_file({"a": torch.zeros(7), "b": torch.ones(3)}, str(path))
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()  # offsets count from the data's start
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length :])
    with pytest.raises(SafetensorsError, match=f"bad.safetensors: .*{error}") as info:
        list(CheckpointReader(torch.device("cpu")).tensors(path, lambda name: True))
    assert SECRET not in str(info.value)


def test_a_file_that_is_not_safetensors_is_never_quoted(tmp_path):
    """Its first 8 bytes were read as a header length and echoed in the error."""
    path = tmp_path / "secret.safetensors"
    path.write_bytes(f"{SECRET} {SECRET} and more of it".encode())
    with pytest.raises(
        SafetensorsError, match=r"secret.safetensors: not a safetensors file"
    ) as info:
        read_header(path)
    message = str(info.value)
    assert (
        SECRET not in message
        and str(int.from_bytes(path.read_bytes()[:8], "little")) not in message
    )


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
        ),
    ],
)
@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "library"])
def test_reader_gives_every_tensor_as_safetensors_does(tmp_path, device, parallel):
    """Both paths (the parallel one on the CPU too). The parallel one with small chunks, so
    that tensors span chunks and chunks hold several tensors, read by more threads than
    buffers; mixed dtypes, empty tensors, a scalar, skipped tensors between read ones."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.bf16": torch.randn(37, 19, generator=g).bfloat16(),
        "b.f32": torch.randn(300, generator=g),
        "c.skip": torch.randn(50, generator=g),
        "d.i64": torch.randint(-(2**40), 2**40, (13, 3), generator=g),
        "e.empty": torch.empty(0, 4),
        "f.bool": torch.rand(33, generator=g) > 0.5,
        "g.scalar": torch.tensor(3.25, dtype=torch.float64),
        "h.f16": torch.randn(2, 3, 5, generator=g).half(),
        "i.skip": torch.randn(7, generator=g),
        "z.empty": torch.empty(0, dtype=torch.uint8),
    }
    path = tmp_path / "mixed.safetensors"
    save_file(tensors, str(path))
    reader = CheckpointReader(
        torch.device(device), chunk_bytes=256, buffers=2, readers=3, parallel=parallel
    )
    got = dict(reader.tensors(path, lambda name: not name.endswith("skip")))
    expected = {name: t for name, t in load_file(str(path)).items() if not name.endswith("skip")}
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].device.type == device
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].cpu(), tensor), name


@pytest.mark.parametrize(
    "dtype",
    [torch.int8, torch.uint8, torch.int32, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2],
    ids=str,
)
def test_non_float_tensor_is_refused_with_its_dtype(broken_copy, dtype):
    """A tensor of the right shape but an integer, bool or FP8 dtype (a quantized checkpoint
    without its quantization_config) is refused naming it, its dtype and its file, never
    converted to the model's dtype and served as garbage."""
    name = "model.layers.0.mlp.down_proj.weight"

    def cast(tensors):
        tensors[name] = tensors[name].to(dtype)

    rewrite_tensors(broken_copy, cast)
    dtype_name = str(dtype).removeprefix("torch.")
    with pytest.raises(
        CheckpointError, match=rf"tensor '{name}' in model.safetensors has dtype {dtype_name}"
    ):
        logits_of(broken_copy)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_float_tensors_of_another_dtype_are_converted(broken_copy, tiny_model_dir, dtype):
    """Floating dtypes other than the model's still load, converted (fp64, which holds the
    fp32 values exactly, gives the same logits)."""
    name = "model.layers.0.mlp.down_proj.weight"

    def cast(tensors):
        tensors[name] = tensors[name].to(dtype)

    rewrite_tensors(broken_copy, cast)
    ours = logits_of(broken_copy)
    assert torch.isfinite(ours).all()
    if dtype == torch.float64:
        assert torch.equal(ours, logits_of(tiny_model_dir))


def test_missing_tensor_is_named_as_the_vlm_checkpoint_names_it(tiny_vlm_model_dir, tmp_path):
    """In the released layout a missing tensor is named `model.language_model.*`, the name
    the user's files and index use, not our text name."""
    target = tmp_path / "vlm_missing"
    shutil.copytree(tiny_vlm_model_dir, target)
    name = "model.language_model.layers.1.linear_attn.A_log"
    index_path = target / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = target / index["weight_map"].pop(name)
    index_path.write_text(json.dumps(index))
    tensors = load_file(str(shard))
    tensors.pop(name)
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError, match=rf"lacks tensors: {name}$"):
        logits_of(target)


def edit_config(model_dir, edit) -> None:
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def text_of(raw: dict) -> dict:
    return raw.get("text_config", raw)


# (edit of config.json, what the error names); every edit is one a hand-written or
# half-converted config.json could plausibly carry
CONFIG_FAULTS = {
    "text_config null": (lambda c: c.update(text_config=None), "text_config"),
    "text_config a list": (lambda c: c.update(text_config=[c["text_config"]]), "text_config"),
    "text_config a string": (lambda c: c.update(text_config="qwen3_5_text"), "text_config"),
    "top level a list": ('[{"model_type": "qwen3_5"}]', "not a JSON object"),
    "top level null": ("null", "not a JSON object"),
    "not JSON": ('{"model_type": "qwen3_5",', "not valid JSON"),
    "rope_parameters a string": (
        lambda c: text_of(c).update(rope_parameters="default"),
        "rope_parameters",
    ),
    "rope_scaling a list": (lambda c: text_of(c).update(rope_scaling=["linear"]), "rope_scaling"),
    "rope_theta a string": (
        lambda c: text_of(c)["rope_parameters"].update(rope_theta="1e7x"),
        "rope_theta",
    ),
    "layer_types a number": (lambda c: text_of(c).update(layer_types=4), "layer_types"),
    "full_attention_interval 0": (
        lambda c: (text_of(c).pop("layer_types"), text_of(c).update(full_attention_interval=0)),
        "full_attention_interval",
    ),
    "num_key_value_heads 0": (
        lambda c: text_of(c).update(num_key_value_heads=0),
        "num_key_value_heads",
    ),
    "linear_num_key_heads 0": (
        lambda c: text_of(c).update(linear_num_key_heads=0),
        "linear_num_key_heads",
    ),
    "vocab_size a list": (lambda c: text_of(c).update(vocab_size=[248320]), "vocab_size"),
    "hidden_size a word": (lambda c: text_of(c).update(hidden_size="sixty-four"), "hidden_size"),
    "rms_norm_eps a word": (lambda c: text_of(c).update(rms_norm_eps="tiny"), "rms_norm_eps"),
    "eos_token_id an object": (lambda c: text_of(c).update(eos_token_id={"id": 1}), "eos_token_id"),
    "eos_token_id strings": (
        lambda c: text_of(c).update(eos_token_id=["<|im_end|>"]),
        "eos_token_id",
    ),
}


@pytest.mark.parametrize("fault", list(CONFIG_FAULTS))
def test_malformed_config_is_named(tiny_vlm_model_dir, tmp_path, fault):
    """A config.json with a key of the wrong kind is refused naming config.json and the key,
    never an AttributeError, TypeError or ZeroDivisionError from inside the reader."""
    target = tmp_path / "cfg"
    target.mkdir()
    shutil.copy(tiny_vlm_model_dir / "config.json", target / "config.json")
    edit, key = CONFIG_FAULTS[fault]
    if isinstance(edit, str):  # the whole file
        (target / "config.json").write_text(edit)
    else:
        edit_config(target, edit)
    with pytest.raises(ConfigError, match=rf"config.json: .*{key}"):
        ModelConfig.from_model_dir(target)


@pytest.mark.parametrize(
    "text",
    [
        '{"eos_token_id": 1,',
        "[1, 2]",
        '{"eos_token_id": {"id": 1}}',
        '{"eos_token_id": ["<|im_end|>"]}',
    ],
)
def test_malformed_generation_config_is_named(tiny_vlm_model_dir, tmp_path, text):
    """generation_config.json is read for its EOS ids at start: a broken one is refused naming
    the file and the key, not a bare JSONDecodeError, AttributeError or TypeError (strings
    were kept as EOS "ids" that no token ever equals)."""
    from deltaserve.engine.tokenizer import eos_token_ids

    (tmp_path / "generation_config.json").write_text(text)
    config = ModelConfig.from_model_dir(tiny_vlm_model_dir)
    with pytest.raises(ConfigError, match=r"generation_config.json: .*(JSON|eos_token_id)"):
        eos_token_ids(tmp_path, config)


def test_auto_dtype_names_the_config_dtype_it_cannot_run(tiny_vlm_model_dir):
    """--dtype auto on a GPU takes config.json's torch_dtype; one we do not run is named as
    the config's, not as if the user had passed it."""
    import dataclasses

    from deltaserve.engine.rank.executor import resolve_dtype

    config = dataclasses.replace(
        ModelConfig.from_model_dir(tiny_vlm_model_dir), torch_dtype="float8_e4m3fn"
    )
    with pytest.raises(
        ValueError, match=r"config.json's torch_dtype 'float8_e4m3fn'.*pass a dtype"
    ):
        resolve_dtype("auto", torch.device("cuda"), config)


def test_chat_template_only_in_the_processors_file_is_used(tiny_vlm_model_dir, tmp_path):
    """A VLM release may carry its chat template only in chat_template.json (the processor's
    {"chat_template": ...}), none in tokenizer_config.json: vLLM chats with it; every chat here
    got 400 "the model has no chat template". The tokenizer's own template, when it has one,
    is kept."""
    from deltaserve.engine.tokenizer import load_tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_vlm_model_dir / name, tmp_path / name)
    tok_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    own = tok_config.pop("chat_template")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    template = (
        "{% for m in messages %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}"
    )
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.chat_template == template
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"
    # both files: the tokenizer's wins (a fine-tune edits that one)
    tok_config["chat_template"] = own
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    assert load_tokenizer(tmp_path).chat_template == own
