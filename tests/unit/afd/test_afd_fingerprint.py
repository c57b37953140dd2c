"""The handshake fingerprint names the model: the checkpoint identity
(vllm.afd.checkpoint), the FFN block map, the expert count and the MLP sizes
(vllm.afd.model_split.ffn_fingerprint). Checkpoints are tiny safetensors files written
here byte by byte (the format: u64 header length, JSON header, tensor data)."""

from __future__ import annotations

import json
import shutil
import struct
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm.afd import checkpoint as ck

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 512}
# name -> number of float32 values; the FFN tensor is larger than three samples
TENSORS = {"model.layers.0.mlp.down_proj.weight": 1024, "model.norm.weight": 8}
FFN = "model.layers.0.mlp.down_proj.weight"


def write_safetensors(path: Path, tensors: dict[str, list[float]]) -> None:
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for name, values in tensors.items():
        blob = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": [len(values)],
                        "data_offsets": [len(data), len(data) + len(blob)]}  # fmt: skip
        data += blob
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


def make_checkpoint(folder: Path, config: dict | None = None, tensors=None) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config or CONFIG, indent=2))
    tensors = tensors or {n: [i * 0.001 + 1 for i in range(k)] for n, k in TENSORS.items()}
    write_safetensors(folder / "model.safetensors", tensors)
    return folder


def set_value(folder: Path, tensor: str, index: int, value: float) -> None:
    """Overwrite one float32 of ``tensor`` in place (the header stays as it is)."""
    path = folder / "model.safetensors"
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        begin = json.loads(f.read(n))[tensor]["data_offsets"][0]
        f.seek(8 + n + begin + 4 * index)
        f.write(struct.pack("<f", value))


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return make_checkpoint(tmp_path / "a")


def ident(folder: Path, sampled: bool = False, **kw) -> str:
    return ck.identity(folder, full_max_bytes=0 if sampled else ck.FULL_HASH_MAX_BYTES, **kw)


# ------------------------------------------------------------------- same / different
@pytest.mark.parametrize("sampled", [False, True])
def test_same_files_same_identity_wherever_they_are(ckpt, tmp_path, sampled):
    copy = tmp_path / "elsewhere" / "b"
    shutil.copytree(ckpt, copy)
    # config.json written with other whitespace and key order is the same config
    (copy / "config.json").write_text(json.dumps(dict(reversed(CONFIG.items()))))
    assert ident(ckpt, sampled) == ident(copy, sampled) == ident(ckpt, sampled)


def test_description_says_what_was_hashed(ckpt):
    full, sampled = ident(ckpt), ident(ckpt, sampled=True)
    digest, what = full.split(" ", 1)
    assert len(digest) == ck.DIGEST_CHARS and int(digest, 16) >= 0
    assert what.startswith("(config.json + 1 safetensors file, ") and "every byte" in what
    assert f"headers + 3 x {ck.SAMPLE_BYTES} B of each tensor" in sampled
    assert full.split(" ", 1)[0] != sampled.split(" ", 1)[0]


@pytest.mark.parametrize("sampled", [False, True])
def test_one_ffn_weight_value_changed_is_another_checkpoint(ckpt, tmp_path, sampled):
    other = tmp_path / "b"
    shutil.copytree(ckpt, other)
    set_value(other, FFN, TENSORS[FFN] // 2, 42.0)  # the middle value (a sampled one)
    assert ident(ckpt, sampled) != ident(other, sampled)


def test_a_fine_tune_of_the_same_base_is_another_checkpoint(ckpt, tmp_path):
    """Every value of a trained tensor moves a little: the sampled form sees it."""
    tuned = {n: [i * 0.001 + 1 + (1e-4 if n == FFN else 0) for i in range(k)]
             for n, k in TENSORS.items()}  # fmt: skip
    other = make_checkpoint(tmp_path / "tuned", tensors=tuned)
    assert ident(ckpt, sampled=True) != ident(other, sampled=True)


def test_sampled_form_does_not_see_a_value_between_samples(ckpt, tmp_path):
    """The documented limit of the sampled form (docs/security.md): one value away from
    the start, middle and end of its tensor. Every byte is hashed up to
    FULL_HASH_MAX_BYTES, which catches it."""
    other = tmp_path / "b"
    shutil.copytree(ckpt, other)
    set_value(other, FFN, TENSORS[FFN] // 4, 42.0)
    assert ident(ckpt, sampled=True) == ident(other, sampled=True)
    assert ident(ckpt) != ident(other)


def test_tensor_names_and_shapes_count_in_the_sampled_form(ckpt, tmp_path):
    values = {n: [i * 0.001 + 1 for i in range(k)] for n, k in TENSORS.items()}
    renamed = make_checkpoint(tmp_path / "renamed", tensors={
        ("model.layers.0.mlp.up_proj.weight" if n == FFN else n): v for n, v in values.items()
    })  # fmt: skip
    assert ident(ckpt, sampled=True) != ident(renamed, sampled=True)


def test_config_change_is_another_checkpoint(ckpt, tmp_path):
    other = tmp_path / "b"
    shutil.copytree(ckpt, other)
    (other / "config.json").write_text(json.dumps({**CONFIG, "rms_norm_eps": 1e-5}))
    assert ident(ckpt) != ident(other)
    assert ident(ckpt, sampled=True) != ident(other, sampled=True)


# ------------------------------------------------------------------- dummy and not found
def test_dummy_weights_identity_is_the_config_and_the_load_format(ckpt, tmp_path):
    other = tmp_path / "b"
    shutil.copytree(ckpt, other)
    set_value(other, FFN, 3, 42.0)
    dummy = ident(ckpt, load_format="dummy")
    # the weights are not read: both sides agree whatever the files hold
    assert dummy == ident(other, load_format="dummy")
    assert dummy.endswith("(config.json, load_format dummy: no weights)")
    assert dummy != ident(ckpt)  # dummy weights on one side, real ones on the other
    (other / "config.json").write_text(json.dumps({**CONFIG, "intermediate_size": 256}))
    assert ident(other, load_format="dummy") != dummy
    # a config-only folder (a hub model's config with dummy weights) is the same identity
    cfg_only = tmp_path / "cfg_only"
    cfg_only.mkdir()
    shutil.copy(ckpt / "config.json", cfg_only / "config.json")
    assert ident(cfg_only, load_format="dummy") == dummy


def test_no_weight_files_compares_the_config_only(tmp_path):
    folder = tmp_path / "cfg_only"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    got = ident(folder, load_format="tensorizer")
    assert "config.json only: no weight files found, load_format tensorizer" in got
    # without a folder the config vLLM parsed stands in
    assert "config (as loaded) only" in ck.identity(None, "auto", config=CONFIG)
    assert ck.identity(None, "auto", config=CONFIG) != ck.identity(None, "auto", config={})


# ------------------------------------------------------------------- which files
def test_files_the_index_does_not_name_are_not_loaded_and_not_hashed(ckpt):
    before = ident(ckpt)
    write_safetensors(ckpt / "consolidated.safetensors", {"x": [1.0]})
    index = {"weight_map": {n: "model.safetensors" for n in TENSORS}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    assert ck.weight_files(ckpt) == [ckpt / "model.safetensors"]
    assert ident(ckpt) == before


def test_other_weight_files_are_hashed_by_samples(tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    blob = bytearray(range(256)) * 2048  # 512 KiB
    (folder / "pytorch_model.bin").write_bytes(bytes(blob))
    first = ident(folder, sampled=True)
    assert "1 bin file" in first
    blob[len(blob) // 2] ^= 0xFF
    (folder / "pytorch_model.bin").write_bytes(bytes(blob))
    assert ident(folder, sampled=True) != first


def test_a_broken_safetensors_file_is_hashed_as_a_plain_file(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"x" * 100)
    assert ident(folder, sampled=True) == ident(folder, sampled=True)


def test_hub_model_resolves_to_the_cached_snapshot(ckpt, tmp_path):
    """A hub name is looked up in the Hugging Face cache vLLM downloaded into (offline)."""
    cache = tmp_path / "hf"
    commit = "0" * 40
    repo = cache / "models--org--tiny"
    shutil.copytree(ckpt, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    model_config = SimpleNamespace(model="org/tiny", model_weights="", revision=None,
                                   hf_config=SimpleNamespace(to_dict=lambda: {}))  # fmt: skip
    load_config = SimpleNamespace(load_format="auto", download_dir=str(cache))
    assert ck.resolve_folder("org/tiny", None, str(cache)) == repo / "snapshots" / commit
    assert ck.checkpoint_identity(model_config, load_config) == ident(ckpt)
    # not in the cache: the config vLLM parsed (without where and with what it was read),
    # weights not found
    model_config.model = "org/absent"
    got = ck.checkpoint_identity(model_config, load_config)
    assert "config (as loaded) only: no weight files found" in got
    parsed = {"hidden_size": 8, "_name_or_path": "/host/a", "transformers_version": "5.0"}
    model_config.hf_config = SimpleNamespace(to_dict=lambda: dict(parsed))
    first = ck.checkpoint_identity(model_config, load_config)
    parsed.update(_name_or_path="/host/b", transformers_version="5.1")
    assert ck.checkpoint_identity(model_config, load_config) == first
    parsed["hidden_size"] = 16
    assert ck.checkpoint_identity(model_config, load_config) != first


def test_identity_of_the_tiny_checkpoints_is_fast():
    """Every byte of the test checkpoints is hashed; each takes milliseconds."""
    models = Path(__file__).resolve().parents[3] / "build" / "models"
    if not models.is_dir():
        pytest.fail(f"{models} is missing: run `make models` first", pytrace=False)
    for folder in sorted(p for p in models.iterdir() if p.is_dir()):
        t0 = time.perf_counter()
        got = ck.identity(folder)
        took = time.perf_counter() - t0
        assert "every byte" in got and took < 1.0, (folder.name, got, took)


# ------------------------------------------------------------------- the fingerprint
def qwen3_moe_vllm_config(folder: Path, role: str = "ffn", **hf_changes):
    from vllm.config.afd import AFDConfig

    hf = SimpleNamespace(
        num_hidden_layers=3,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_experts_per_tok=2,
        num_local_experts=8,
        mlp_only_layers=[0],
        decoder_sparse_step=1,
        norm_topk_prob=True,
        hidden_act="silu",
    )
    for key, value in hf_changes.items():
        setattr(hf, key, value)
    model_config = SimpleNamespace(
        model=str(folder), model_weights="", revision=None, hf_text_config=hf, dtype="float32",
        hf_config=SimpleNamespace(architectures=["Qwen3MoeForCausalLM"], to_dict=lambda: {}),
        get_hidden_size=lambda: 128,
    )  # fmt: skip
    return SimpleNamespace(
        afd_config=AFDConfig.from_dict({"role": role}), model_config=model_config,
        load_config=SimpleNamespace(load_format="auto", download_dir=None),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=512),
    )  # fmt: skip


@pytest.fixture
def split(monkeypatch):
    """vllm.afd.model_split with a clean layer map."""
    from vllm.afd import model_split

    monkeypatch.setattr(model_split.STATE, "block_classes", {})
    return model_split


def build_blocks(split, monkeypatch, role: str, classes: dict[int, type]) -> None:
    """What a model's constructor does: one afd_ffn_module call per layer."""
    from vllm.config.afd import AFDConfig

    monkeypatch.setattr(split, "afd_config", lambda *a: AFDConfig.from_dict({"role": role}))
    monkeypatch.setattr(split.STATE, "real_device", None)
    monkeypatch.setattr(split.STATE, "ffn_modules", {})
    monkeypatch.setattr(split, "_build_remote", lambda cls, *a: None)  # no op registration
    for i, cls in classes.items():
        split.afd_ffn_module(cls)(prefix=f"model.layers.{i}.mlp")


def test_both_roles_record_the_block_class_of_each_layer(split, monkeypatch):
    import torch

    class DenseMLP(torch.nn.Module):
        def __init__(self, prefix=""):
            super().__init__()

    class SparseMoeBlock(DenseMLP):
        pass

    layers = {0: DenseMLP, 1: SparseMoeBlock, 2: SparseMoeBlock, 4: SparseMoeBlock}
    maps = {}
    for role in ("attention", "ffn"):
        split.STATE.block_classes.clear()
        build_blocks(split, monkeypatch, role, layers)
        maps[role] = split.ffn_block_map(list(layers), split.STATE.block_classes)
    assert maps["attention"] == maps["ffn"] == "0:DenseMLP 1-2:SparseMoeBlock 4:SparseMoeBlock"
    assert split.ffn_block_map([0, 1], {}) == "0-1:?"


def test_fingerprint_has_every_key_and_names_the_model(split, ckpt):
    from vllm.afd.protocol import FINGERPRINT_KEYS

    split.STATE.block_classes.update({0: "Qwen3MoeMLP", 1: "Qwen3MoeSparseMoeBlock",
                                      2: "Qwen3MoeSparseMoeBlock"})  # fmt: skip
    fp = split.ffn_fingerprint(qwen3_moe_vllm_config(ckpt), [0, 1, 2])
    assert set(fp) == set(FINGERPRINT_KEYS)
    assert fp["ffn_blocks"] == "0:Qwen3MoeMLP 1-2:Qwen3MoeSparseMoeBlock"
    assert fp["num_experts"] == 8
    assert fp["mlp_config"] == (
        'hidden_act="silu",intermediate_size=256,moe_intermediate_size=64,'
        "num_experts_per_tok=2,decoder_sparse_step=1,mlp_only_layers=[0],norm_topk_prob=true"
    )
    assert fp["checkpoint"] == ident(ckpt)
    json.dumps(fp)  # a valid hello: plain values only


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"num_local_experts": 16}, "num_experts"),
        ({"moe_intermediate_size": 32}, "mlp_config"),
        ({"num_experts_per_tok": 4}, "mlp_config"),
        ({"mlp_only_layers": []}, "mlp_config"),
    ],
)
def test_fingerprint_sizes_and_experts_mismatch_by_name(split, ckpt, change, key):
    from vllm.afd.protocol import fingerprint_mismatch

    split.STATE.block_classes.update({0: "Qwen3MoeMLP", 1: "Qwen3MoeSparseMoeBlock"})
    local = split.ffn_fingerprint(qwen3_moe_vllm_config(ckpt), [0, 1])
    remote = split.ffn_fingerprint(qwen3_moe_vllm_config(ckpt, **change), [0, 1])
    assert fingerprint_mismatch(local, remote).startswith(f"AFD fingerprint mismatch on '{key}'")


def test_fingerprint_checkpoint_mismatch_names_both_identities(split, ckpt, tmp_path):
    from vllm.afd.protocol import fingerprint_mismatch

    other = tmp_path / "b"
    shutil.copytree(ckpt, other)
    set_value(other, FFN, 0, 42.0)
    local = split.ffn_fingerprint(qwen3_moe_vllm_config(ckpt), [0])
    remote = split.ffn_fingerprint(qwen3_moe_vllm_config(other, role="attention"), [0])
    assert fingerprint_mismatch(local, remote) == (
        f"AFD fingerprint mismatch on 'checkpoint': this side has {ident(ckpt)!r}, "
        f"the peer has {ident(other)!r}"
    )
