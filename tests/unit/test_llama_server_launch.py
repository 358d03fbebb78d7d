"""How a lease becomes llama-server's argv and environment."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from supervisor.manifests import LlamaServerManifest
from workers.base import ChildKey, Endpoint, GpuPlacement, LaunchError
from workers.llama_server import LlamaServerWorker, find_binary, http_threads

KEY = ChildKey("the-childs-own-key", Path("/state/keys/abc.key"))
PORT = Endpoint(port=8080)


def manifest(tmp_path: Path, **fields: object) -> LlamaServerManifest:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    return LlamaServerManifest.model_validate(
        {"name": "m", "engine": "llama-server", "model": model, **fields}
    )


def lease(mib_by_gpu: dict[int, int]) -> GpuPlacement:
    return GpuPlacement(mib_by_gpu, dict.fromkeys(range(4), 1000))


def test_a_one_gpu_lease_shows_the_child_that_gpu_only(tmp_path: Path) -> None:
    spec = LlamaServerWorker().launch_spec(manifest(tmp_path), PORT, lease({3: 100}), KEY)
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "3"
    assert "--tensor-split" not in spec.argv


def test_a_tensor_parallel_lease_splits_the_layers_evenly(tmp_path: Path) -> None:
    spec = LlamaServerWorker().launch_spec(
        manifest(tmp_path, tensor_parallel_size=2), PORT, lease({1: 50, 2: 50}), KEY
    )
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "1,2"
    split = spec.argv.index("--tensor-split")
    assert spec.argv[split + 1] == "1,1"
    assert spec.argv[spec.argv.index("--split-mode") + 1] == "layer"


def test_manifest_args_come_last_so_they_can_override(tmp_path: Path) -> None:
    spec = LlamaServerWorker().launch_spec(
        manifest(tmp_path, args=["--tensor-split", "3,1"]), PORT, lease({0: 1, 1: 1}), KEY
    )
    assert spec.argv[-2:] == ["--tensor-split", "3,1"]


def test_the_childs_key_comes_from_a_file_that_argv_names_but_does_not_hold(tmp_path: Path) -> None:
    spec = LlamaServerWorker().launch_spec(manifest(tmp_path), PORT, lease({0: 1}), KEY)
    assert spec.argv[spec.argv.index("--api-key-file") + 1] == "/state/keys/abc.key"
    assert not any(KEY.value in arg for arg in spec.argv)  # argv is what `ps` shows every local user
    assert spec.files == {KEY.file: KEY.value + "\n"}
    assert spec.api_key == KEY.value
    assert KEY.value not in repr(spec)
    assert KEY.value not in repr(KEY)


def test_an_engine_key_in_the_daemons_environment_does_not_reach_the_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("LLAMA_API_KEY", "LLAMA_ARG_API_KEY_FILE", "VLLM_API_KEY"):
        monkeypatch.setenv(name, "known-to-others")
    spec = LlamaServerWorker().launch_spec(manifest(tmp_path), PORT, lease({0: 1}), KEY)
    assert "known-to-others" not in spec.env.values()


def test_on_a_socket_the_child_gets_its_path_for_host_and_no_port(tmp_path: Path) -> None:
    socket = Path("/tmp/llmsup-sockets-x/0123456789abcdef.sock")
    spec = LlamaServerWorker().launch_spec(manifest(tmp_path), Endpoint(socket=socket), lease({0: 1}), KEY)
    assert spec.argv[spec.argv.index("--host") + 1] == str(socket)  # cpp-httplib: `.sock` is a socket
    assert "--port" not in spec.argv
    assert spec.leaves == (socket,)  # removed with the child: llama-server leaves it behind


def test_on_a_port_the_child_gets_loopback_and_that_port(tmp_path: Path) -> None:
    spec = LlamaServerWorker().launch_spec(manifest(tmp_path), PORT, lease({0: 1}), KEY)
    assert spec.argv[spec.argv.index("--host") + 1] == "127.0.0.1"
    assert spec.argv[spec.argv.index("--port") + 1] == "8080"
    assert spec.leaves == ()


def test_listen_tcp_is_a_loopback_port_for_a_build_without_unix_sockets(tmp_path: Path) -> None:
    worker = LlamaServerWorker()
    assert worker.endpoint(manifest(tmp_path, listen="tcp")).port is not None
    assert worker.endpoint(manifest(tmp_path, listen="tcp")).socket is None


def test_a_new_key_is_random_and_lives_in_the_state_directory(tmp_path: Path) -> None:
    first, second = ChildKey.new(tmp_path), ChildKey.new(tmp_path)
    assert first.value != second.value
    assert len(first.value) >= 32
    assert first.file.parent == tmp_path / "keys"
    assert first.file != second.file


def test_a_failed_assertion_starts_no_gdb(tmp_path: Path) -> None:
    """ggml attached gdb to a crashing engine for a backtrace; the gdb outlived the stop (a fleet test's
    teardown found it). Set unless the manifest's environment says otherwise."""
    spec = LlamaServerWorker().launch_spec(manifest(tmp_path), PORT, lease({0: 1}), KEY)
    assert spec.env["GGML_NO_BACKTRACE"] == "1"


def test_llama_server_is_killed_outright_when_the_daemon_dies(tmp_path: Path) -> None:
    """It starts no process of its own, so a graceful stop after the daemon's death serves nobody, and a
    SIGTERM can leave it running: CI once found it alive 20 s after its daemon was SIGKILLed."""
    spec = LlamaServerWorker().launch_spec(manifest(tmp_path), PORT, lease({0: 1}), KEY)
    assert spec.death_signal == signal.SIGKILL


def test_llama_server_gets_a_thread_for_every_connection_the_daemon_may_open(tmp_path: Path) -> None:
    """A connection beyond llama-server's HTTP thread pool waits unserved until another closes."""
    spec = LlamaServerWorker().launch_spec(
        manifest(tmp_path, parallel=8, max_inflight=16), PORT, lease({0: 1}), KEY
    )
    threads = int(spec.argv[spec.argv.index("--threads-http") + 1])
    assert threads >= 2 * 16 + 2
    assert http_threads(100_000) == 1024  # not a hundred thousand threads
    chosen = manifest(tmp_path, args=["--threads-http", "3"])  # the manifest's own word stands
    assert LlamaServerWorker().launch_spec(chosen, PORT, lease({0: 1}), KEY).argv.count("--threads-http") == 1
    # also as the variable llama-server reads the flag from, which a flag of ours would override
    by_env = manifest(tmp_path, env={"LLAMA_ARG_THREADS_HTTP": "3"})
    assert "--threads-http" not in LlamaServerWorker().launch_spec(by_env, PORT, lease({0: 1}), KEY).argv


def test_a_binary_that_is_not_executable_is_named_with_the_fix(tmp_path: Path) -> None:
    """The load failed with the kernel's `[Errno 13] Permission denied` only, naming neither the file nor
    what to do, where a missing binary says which one."""
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o644)
    with pytest.raises(
        LaunchError, match=r"llama-server binary .*llama-server is not executable \(chmod \+x it\)"
    ):
        find_binary(manifest(tmp_path, binary=binary))
