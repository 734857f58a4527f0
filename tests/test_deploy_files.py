"""The deployment files: Kubernetes manifests against the API schemas, their TOML, the image.

Every manifest under ``deploy/kubernetes/`` is validated with
kubernetes-validate (strict: unknown fields are errors) against the schemas of
the oldest Kubernetes release the files are meant for; the router's TOML in
the ConfigMap is read by the router's own loader; the worker Deployments carry
the vLLM flags ``docs/deployment.md`` lists per role; and the image is built
where a container engine runs (skipped, saying so, where none does).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from epd_actors.discovery import KubernetesSettings
from epd_actors.discovery.kubernetes_settings import ROLE_LABEL
from epd_actors.program.check_config import check_topology
from epd_actors.program.config_file import parse_config

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.30"  # terminating endpoints in EndpointSlices are GA since 1.26
ROLES = ("encode", "prefill", "decode")


def documents() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(MANIFESTS.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                found.append((str(path.relative_to(ROOT)), doc))
    return found


def by_kind(kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [
        d
        for _, d in documents()
        if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]


def one(kind: str, name: str) -> dict[str, Any]:
    (doc,) = by_kind(kind, name)
    return doc


def router_toml() -> str:
    return one("ConfigMap", "epd-router-config")["data"]["epd.toml"]


def test_there_are_manifests_of_every_kind_the_deployment_needs() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for _, d in documents()}
    expected = {
        ("Namespace", "epd"),
        ("ServiceAccount", "epd-router"),
        ("Role", "epd-router-endpointslices"),
        ("RoleBinding", "epd-router-endpointslices"),
        ("ConfigMap", "epd-router-config"),
        ("Deployment", "epd-router"),
        ("Service", "epd-router"),
        ("PodDisruptionBudget", "epd-router"),
        ("Deployment", "epd-redis"),
        ("Service", "epd-redis"),
        ("PersistentVolumeClaim", "epd-ec-cache"),
    } | {(kind, f"epd-{role}") for role in ROLES for kind in ("Deployment", "Service")}
    assert expected <= kinds


@pytest.mark.parametrize(
    ("where", "doc"), documents(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_each_manifest_is_valid_against_the_kubernetes_schemas(
    where: str, doc: dict[str, Any]
) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    if doc["kind"] != "Namespace":
        assert doc["metadata"]["namespace"] == "epd", where


def test_the_schema_check_catches_a_misspelt_field() -> None:
    doc = json.loads(json.dumps(one("Deployment", "epd-router")))
    doc["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_configmap_toml_is_a_valid_router_configuration() -> None:
    import tomllib

    config = parse_config(tomllib.loads(router_toml()), environ={})
    check_topology(config)
    assert config.server.http_listen == "0.0.0.0:8000"
    discovery = config.discovery
    assert isinstance(discovery, KubernetesSettings)
    assert [p.stage for p in discovery.pools] == list(ROLES)
    assert all(dict(p.selector) == {ROLE_LABEL: p.stage} for p in discovery.pools)
    # Each pool's selector finds its role's Service (whose labels the
    # EndpointSlice controller copies onto the slices), on the port it names.
    for pool in discovery.pools:
        service = one("Service", f"epd-{pool.stage}")
        assert pool.selector.items() <= service["metadata"]["labels"].items()
        assert pool.port in {port["name"] for port in service["spec"]["ports"]}
        assert pool.backend == "openai_http"


def test_the_router_deployment_probes_mounts_and_permissions() -> None:
    deployment = one("Deployment", "epd-router")
    assert deployment["spec"]["replicas"] >= 2
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert container["args"][:3] == ["serve", "--config", "/etc/epd/epd.toml"]
    (mount,) = container["volumeMounts"]
    assert mount["mountPath"] == "/etc/epd"
    (volume,) = pod["volumes"]
    assert volume["configMap"]["name"] == "epd-router-config"
    # The grace period covers the router's own drain (notice + timeout).
    config = parse_config(__import__("tomllib").loads(router_toml()), environ={})
    assert (
        pod["terminationGracePeriodSeconds"]
        > config.server.drain_notice_s + config.server.drain_timeout_s
    )
    # Its service account may read EndpointSlices, and nothing more.
    assert pod["serviceAccountName"] == "epd-router"
    binding = one("RoleBinding", "epd-router-endpointslices")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "epd-router", "namespace": "epd"}
    ]
    assert binding["roleRef"]["name"] == "epd-router-endpointslices"
    (rule,) = one("Role", "epd-router-endpointslices")["rules"]
    assert rule == {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["get", "list", "watch"],
    }
    labels = deployment["spec"]["selector"]["matchLabels"]
    assert one("Service", "epd-router")["spec"]["selector"] == labels
    assert one("PodDisruptionBudget", "epd-router")["spec"]["selector"]["matchLabels"] == labels
    assert labels.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def documented_flags() -> dict[str, list[str]]:
    """The "vLLM flags per role" table of docs/deployment.md, by role."""
    text = (ROOT / "docs" / "deployment.md").read_text()
    rows = {}
    for name, role in (("E", "encode"), ("P", "prefill"), ("D", "decode")):
        match = re.search(rf"^\| {name} \| `([^`]+)` \|", text, re.MULTILINE)
        assert match, f"no row for {name} in docs/deployment.md"
        rows[role] = shlex.split(match.group(1).replace("DIR", "/ec-cache"))
    return rows


def contains_run(args: list[str], run: list[str]) -> bool:
    return any(args[i : i + len(run)] == run for i in range(len(args) - len(run) + 1))


@pytest.mark.parametrize("role", ROLES)
def test_worker_deployments_carry_the_documented_vllm_flags_and_labels(role: str) -> None:
    deployment = one("Deployment", f"epd-{role}")
    template = deployment["spec"]["template"]
    assert template["metadata"]["labels"][ROLE_LABEL] == role
    (container,) = template["spec"]["containers"]
    args = container["args"]
    assert contains_run(args, documented_flags()[role]), args
    assert contains_run(args, ["--served-model-name", "epd-model"])
    assert "--enable-request-id-headers" in args
    config = parse_config(__import__("tomllib").loads(router_toml()), environ={})
    assert config.router.model == "epd-model"
    service = one("Service", f"epd-{role}")
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    # EC producers and consumers share one volume.
    mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
    assert ("/ec-cache" in mounts) == (role in ("encode", "prefill"))


def test_the_dockerfile_runs_the_package_for_router_and_worker() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["python", "-m", "epd_actors"]' in text
    assert 'CMD ["serve", "--config", "/etc/epd/epd.toml"]' in text
    assert "'.[kubernetes]'" in text
    router = one("Deployment", "epd-router")["spec"]["template"]["spec"]
    assert router["securityContext"]["runAsUser"] == 10001
    assert "USER 10001:10001" in text


def _container_engine() -> str | None:
    for engine in ("docker", "podman"):
        path = shutil.which(engine)
        if path is None:
            continue
        probe = subprocess.run([path, "info"], capture_output=True, check=False, timeout=30)
        if probe.returncode == 0:
            return path
    return None


def test_the_image_builds_and_starts() -> None:
    engine = _container_engine()
    if engine is None:
        pytest.skip(
            "NOT TESTED: no working container engine (docker or podman with a running daemon) "
            "here, so the Dockerfile was not built"
        )
    tag = "epd-actors:test"
    subprocess.run([engine, "build", "-t", tag, str(ROOT)], check=True, timeout=900)
    version = subprocess.run(
        [engine, "run", "--rm", tag, "--version"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert version.stdout.startswith("epd_actors ")
    worker = subprocess.run(
        [engine, "run", "--rm", tag, "worker", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert "--role" in worker.stdout
