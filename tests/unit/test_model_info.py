"""supervisor.model_info: what a model is, read from a real GGUF header or a Hugging Face directory."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import struct
import threading
from pathlib import Path

import pytest

from supervisor import model_info
from supervisor.demo_model import N_CTX_TRAIN, N_EMBD, N_FF, N_LAYER, _vocabulary
from supervisor.model_info import ModelCatalog, human_parameters
from tests.integration.harness import eventually


@pytest.fixture
def gguf_copy(demo_gguf: Path, tmp_path: Path) -> Path:
    """A private copy of the demo model: these tests touch and replace it."""
    return Path(shutil.copy(demo_gguf, tmp_path / "demo.gguf"))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def demo_parameter_count() -> int:
    vocab = len(_vocabulary()[0])
    per_layer = 2 * N_EMBD + 4 * N_EMBD * N_EMBD + 3 * N_FF * N_EMBD  # 2 norms, q k v o, gate up down
    return 2 * vocab * N_EMBD + N_LAYER * per_layer + N_EMBD  # embeddings, output, layers, output norm


async def test_a_gguf_is_described_from_its_header(gguf_copy: Path, tmp_path: Path) -> None:
    info = await ModelCatalog(tmp_path / "state").describe(gguf_copy)
    assert info.error == ""
    assert (info.format, info.family, info.families) == ("gguf", "llama", ("llama",))
    assert info.quantization_level == "F32"  # the demo writes general.file_type ALL_F32
    assert info.parameter_count == demo_parameter_count()
    assert info.parameter_size == human_parameters(demo_parameter_count())
    assert info.context_length == N_CTX_TRAIN
    meta = info.model_info
    assert meta["general.architecture"] == "llama"
    assert meta["general.parameter_count"] == demo_parameter_count()
    assert meta["llama.context_length"] == N_CTX_TRAIN
    assert meta["llama.embedding_length"] == N_EMBD
    assert meta["llama.attention.layer_norm_rms_epsilon"] == 1e-5  # not float32's 9.99999974e-06
    assert meta["tokenizer.ggml.tokens"] is None  # long arrays are left out, as Ollama's show does
    assert not any(key.startswith("GGUF.") for key in meta)
    assert "add_generation_prompt" in info.template
    assert info.stop == (_vocabulary()[0][2],)  # the EOS token's text
    assert info.size == os.stat(gguf_copy).st_size
    assert info.modified_at == pytest.approx(os.stat(gguf_copy).st_mtime)
    assert info.digest == sha256(gguf_copy)
    assert info.details() == {
        "parent_model": "",
        "format": "gguf",
        "family": "llama",
        "families": ["llama"],
        "parameter_size": info.parameter_size,
        "quantization_level": "F32",
    }


async def test_weights_are_read_and_hashed_once_and_the_digest_survives_a_restart(
    gguf_copy: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    catalog = ModelCatalog(state)
    first = await catalog.describe(gguf_copy)
    again = await asyncio.gather(*(catalog.describe(gguf_copy) for _ in range(5)))
    assert all(info == first for info in again)
    assert (catalog.reads, catalog.digests.hashed) == (1, 1)

    await eventually(lambda: (state / "digests.json").exists(), 10, "digests.json to be written")
    restarted = ModelCatalog(state)
    assert (await restarted.describe(gguf_copy)).digest == first.digest
    assert restarted.digests.hashed == 0


async def test_concurrent_requests_share_one_read(gguf_copy: Path, tmp_path: Path) -> None:
    catalog = ModelCatalog(tmp_path / "state")
    infos = await asyncio.gather(*(catalog.describe(gguf_copy) for _ in range(8)))
    assert catalog.reads == 1
    assert len({info.digest for info in infos}) == 1


async def test_a_replaced_file_is_read_and_hashed_again(gguf_copy: Path, tmp_path: Path) -> None:
    catalog = ModelCatalog(tmp_path / "state")
    before = await catalog.describe(gguf_copy)
    with gguf_copy.open("ab") as f:
        f.write(b"\0" * 32)  # GGUF readers ignore trailing bytes; size and content change
    after = await catalog.describe(gguf_copy)
    assert catalog.reads == 2
    assert after.size == before.size + 32
    assert after.digest == sha256(gguf_copy) != before.digest


async def test_a_file_in_a_hugging_face_cache_is_named_by_its_blob_and_never_hashed(
    gguf_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    digest = sha256(gguf_copy)
    repo = tmp_path / "hub" / "models--someone--demo-GGUF"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    shutil.move(gguf_copy, repo / "blobs" / digest)
    link = repo / "snapshots" / "abc123" / "demo-Q4.gguf"
    link.symlink_to(Path("../../blobs") / digest)

    def no_hashing(path: Path) -> str:
        raise AssertionError(f"hashed {path}")

    monkeypatch.setattr(model_info, "sha256_file", no_hashing)
    info = await ModelCatalog(None).describe(link)
    assert info.digest == digest
    assert info.family == "llama"
    assert info.size == (repo / "blobs" / digest).stat().st_size


async def test_a_slow_hash_answers_without_the_digest_until_it_is_done(
    gguf_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    real = model_info.sha256_file

    def slow(path: Path) -> str:
        release.wait(10)
        return real(path)

    monkeypatch.setattr(model_info, "sha256_file", slow)
    catalog = ModelCatalog(tmp_path / "state", hash_wait_s=0.01)
    first = await catalog.describe(gguf_copy)
    assert first.digest == ""
    assert first.family == "llama"  # everything else is there already
    release.set()

    async def hashed() -> bool:
        return (await catalog.describe(gguf_copy)).digest == sha256(gguf_copy)

    await eventually(hashed, 10, "the background hash to finish")
    assert catalog.digests.hashed == 1


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """The format by hand: 8-byte little-endian header length, a JSON header, then the raw data."""
    sizes = {"F16": 2, "BF16": 2, "F32": 4}
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        length = sizes[dtype]
        for dim in shape:
            length *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + length]}
        offset += length
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)  # the spec pads the header to 8 bytes
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"\0" * offset)


@pytest.fixture
def hf_directory(tmp_path: Path) -> Path:
    directory = tmp_path / "tiny-llama"
    directory.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "vocab_size": 100,
        "torch_dtype": "float16",
    }
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{% if tools %}{{ tools }}{% endif %}", "eos_token": "</s>"})
    )
    write_safetensors(
        directory / "model-00001-of-00002.safetensors",
        {"model.embed_tokens.weight": ("F16", [100, 32]), "model.norm.weight": ("F16", [32])},
    )
    write_safetensors(directory / "model-00002-of-00002.safetensors", {"lm_head.weight": ("F16", [100, 32])})
    return directory


async def test_a_hugging_face_directory_is_described_from_config_and_safetensors_headers(
    hf_directory: Path, tmp_path: Path
) -> None:
    info = await ModelCatalog(tmp_path / "state").describe(hf_directory)
    assert info.error == ""
    assert (info.format, info.family, info.families) == ("safetensors", "llama", ("llama",))
    assert info.parameter_count == 100 * 32 + 32 + 100 * 32
    assert info.parameter_size == "6.4K"
    assert info.quantization_level == "F16"
    assert info.context_length == 1024
    assert info.model_info["general.architecture"] == "llama"
    assert info.model_info["llama.block_count"] == 2
    assert info.model_info["llama.attention.head_count_kv"] == 2
    assert info.model_info["llama.context_length"] == 1024
    assert "tools" in info.template
    assert info.stop == ("</s>",)
    assert info.size == sum(os.stat(hf_directory / name).st_size for name in os.listdir(hf_directory))
    assert len(info.digest) == 64


async def test_a_quantized_directory_reports_its_method(hf_directory: Path, tmp_path: Path) -> None:
    config = json.loads((hf_directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (hf_directory / "config.json").write_text(json.dumps(config))
    info = await ModelCatalog(tmp_path / "state").describe(hf_directory)
    assert info.quantization_level == "AWQ-4bit"


async def test_unreadable_or_missing_weights_give_empty_details_not_an_error(
    tmp_path: Path, hf_directory: Path
) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + os.urandom(2000))
    catalog = ModelCatalog(tmp_path / "state")
    info = await catalog.describe(garbage)
    assert info.error
    assert (info.format, info.family, info.parameter_count) == ("", "", None)
    assert info.size == 2004
    await catalog.describe(garbage)
    assert catalog.reads == 1  # the failure is remembered too: logged once, not on every listing

    assert await catalog.describe(tmp_path / "nowhere.gguf") == model_info.ModelInfo()
    assert await catalog.describe(None, repo_id="nobody/never-downloaded-here") == model_info.ModelInfo()

    (hf_directory / "config.json").write_text("{not json")
    assert (await catalog.describe(hf_directory)).error


def test_parameter_counts_read_as_ollama_writes_them() -> None:
    assert human_parameters(7_615_616_512) == "7.6B"
    assert human_parameters(8_000_000_000) == "8B"
    assert human_parameters(1_234_567) == "1.2M"
    assert human_parameters(153_280) == "153.3K"
    assert human_parameters(999) == "999"


def test_file_types_are_named_as_ollama_names_quantization_levels() -> None:
    assert model_info._gguf_file_type(15) == "Q4_K_M"
    assert model_info._gguf_file_type(1) == "F16"
    assert model_info._gguf_file_type(0) == "F32"
    assert model_info._gguf_file_type(7) == "Q8_0"
    assert model_info._gguf_file_type(9999) == ""
    assert model_info._gguf_file_type(None) == ""
