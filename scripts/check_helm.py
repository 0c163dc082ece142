#!/usr/bin/env python3
"""Lint and render the Helm chart helm/sluice with the real Helm engine, validate every rendered
manifest against the Kubernetes schemas, check the facts each value set must produce, and show
that bad values are rejected by values.schema.json.

    python3 -m pip install helm-python-sdk kubernetes-validate
    python3 scripts/check_helm.py            # exit 0 when everything holds
    python3 scripts/check_helm.py -v         # also print every rendered manifest

The Helm engine is helm-python-sdk (module `helm_python`): ctypes bindings over libhelm_c, Helm's
Go SDK (v4) compiled into a shared library shipped inside the wheel, so no `helm` binary, Go
toolchain or cluster is needed. Manifests are validated with kubernetes-validate, strict mode
(unknown fields are errors), against the Kubernetes schemas that package ships for
KUBE_VERSION. Nothing is downloaded at run time: Python-level network access is blocked while the
checks run (only loopback is allowed, for the optional binary smoke test), and the checks also
pass in a network namespace with nothing but loopback:
`unshare -rn sh -c 'ip link set lo up && python3 scripts/check_helm.py'`.

The ServiceMonitor and PrometheusRule (monitoring.coreos.com/v1) are CRDs that kubernetes-validate
has no schema for: they are checked structurally here instead (ServiceMonitor: apiVersion, kind,
selector, endpoints[0] = port `http`, path `/metrics`; PrometheusRule: groups of named rules,
each an alert or a record with a string `expr`, string labels and annotations, a Prometheus
duration in `for`). The Grafana dashboard ConfigMap must carry files/grafana-dashboard.json
unchanged and the PrometheusRule files/prometheus-rules.yaml's groups (their PromQL is checked
against a live /metrics by `cargo test --test it dashboards`).

When a built sluice binary is found (target/release/sluice or target/debug/sluice, or
--sluice-bin), the rendered domain files are also checked with `sluice check`, and the binary is
started once with the environment the chart renders for the memory store and the ConfigMap laid
out the way kubelet mounts it (`..data` symlink), and must answer /healthcheck and /rlconfig.
--no-binary skips that.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "sluice"
KUBE_VERSION = "1.30.0"
RELEASE = "edge"
NAMESPACE = "ingress"
FULLNAME = "edge-sluice"  # <release>-<chart>
REDIS_NAME = f"{FULLNAME}-redis"
SVC_DNS = f"{FULLNAME}.{NAMESPACE}.svc.cluster.local"
IMAGE = "ghcr.io/sluice-rs/sluice:0.1.0"

try:
    import yaml
    import helm_python as helm
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError
    from kubernetes_validate.utils import ValidationError as KubeValidationError
except ImportError as exc:  # pragma: no cover - environment problem, not a check failure
    sys.exit(
        f"check_helm: missing Python package ({exc}).\n"
        "Install them with: python3 -m pip install helm-python-sdk kubernetes-validate"
    )


# --------------------------------------------------------------------------- offline guard


def block_network() -> None:
    """Make any non-loopback connection from Python fail loudly: the checks must run offline."""

    def loopback(host: Any) -> bool:
        return str(host) in ("localhost", "::1") or str(host).startswith("127.")

    real_connect = socket.socket.connect
    real_getaddrinfo = socket.getaddrinfo

    def guarded_connect(self: socket.socket, address: Any) -> Any:
        if self.family in (socket.AF_INET, socket.AF_INET6) and not loopback(address[0]):
            raise RuntimeError(f"check_helm must run offline, but something connected to {address}")
        return real_connect(self, address)

    def guarded_getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host is not None and not loopback(host):
            raise RuntimeError(f"check_helm must run offline, but something resolved {host!r}")
        return real_getaddrinfo(host, *args, **kwargs)

    socket.socket.connect = guarded_connect  # type: ignore[method-assign]
    socket.getaddrinfo = guarded_getaddrinfo  # type: ignore[assignment]


# --------------------------------------------------------------------------- bookkeeping


class Checks:
    def __init__(self) -> None:
        self.failures: list[str] = []
        self.passed = 0
        self.context = ""

    def expect(self, cond: bool, what: str) -> bool:
        if cond:
            self.passed += 1
        else:
            self.failures.append(f"[{self.context}] {what}")
            print(f"  FAIL {what}")
        return cond

    def equal(self, got: Any, want: Any, what: str) -> bool:
        return self.expect(got == want, f"{what}: got {got!r}, want {want!r}")


C = Checks()


# --------------------------------------------------------------------------- helpers


def render(values: dict[str, Any] | None) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        return chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)


def split_documents(rendered: dict[str, str]) -> tuple[list[tuple[str, dict[str, Any]]], str]:
    """The manifests (template path, object) and the rendered NOTES.txt."""
    docs: list[tuple[str, dict[str, Any]]] = []
    notes = ""
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                docs.append((path, doc))
    return docs, notes


def by_kind(docs: list[tuple[str, dict[str, Any]]], kind: str) -> list[dict[str, Any]]:
    return [d for _, d in docs if d.get("kind") == kind]


def one(docs: list[tuple[str, dict[str, Any]]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in by_kind(docs, kind) if d["metadata"]["name"] == name]
    C.equal(len(found), 1, f"number of {kind} named {name}")
    return found[0] if found else {}


def env_map(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    env = container.get("env", [])
    names = [e["name"] for e in env]
    C.equal(sorted(n for n in set(names) if names.count(n) > 1), [], "duplicate env names")
    return {e["name"]: e for e in env}


def env_value(env: dict[str, dict[str, Any]], name: str) -> Any:
    return env.get(name, {}).get("value")


def seconds(duration: str) -> int:
    assert duration.endswith("s") and duration[:-1].isdigit(), duration
    return int(duration[:-1])


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# --------------------------------------------------------------------------- validation


def validate_manifests(docs: list[tuple[str, dict[str, Any]]]) -> int:
    """kubernetes-validate (strict) for built-in kinds; structural checks for ServiceMonitor."""
    count = 0
    for path, doc in docs:
        name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')} ({path})"
        if doc.get("kind") == "ServiceMonitor":
            check_service_monitor(doc)
            count += 1
            continue
        if doc.get("kind") == "PrometheusRule":
            check_prometheus_rule(doc)
            count += 1
            continue
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
            count += 1
        except KubeValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            C.expect(False, f"{name} is not a valid Kubernetes {KUBE_VERSION} object: {where}: {exc.message}")
        except SchemaNotFoundError as exc:
            C.expect(False, f"{name}: {exc.message}")
    return count


def check_service_monitor(sm: dict[str, Any]) -> None:
    """No schema ships for this CRD, so check the fields Prometheus Operator needs by hand."""
    C.equal(sm.get("apiVersion"), "monitoring.coreos.com/v1", "ServiceMonitor apiVersion")
    C.expect(set(sm) <= {"apiVersion", "kind", "metadata", "spec"}, f"ServiceMonitor top-level keys {sorted(sm)}")
    spec = sm.get("spec", {})
    C.expect(set(spec) <= {"selector", "namespaceSelector", "endpoints", "jobLabel"}, f"ServiceMonitor spec keys {sorted(spec)}")
    C.expect(bool(spec.get("selector", {}).get("matchLabels")), "ServiceMonitor selects by matchLabels")
    endpoints = spec.get("endpoints") or [{}]
    ep = endpoints[0]
    C.equal(ep.get("port"), "http", "ServiceMonitor endpoints[0].port")
    C.equal(ep.get("path"), "/metrics", "ServiceMonitor endpoints[0].path")
    for key in ("interval", "scrapeTimeout"):
        value = str(ep.get(key, ""))
        C.expect(value[:-1].isdigit() and value[-1] in "smh", f"ServiceMonitor {key} {value!r} is a Prometheus duration")


def is_duration(value: Any) -> bool:
    import re
    return isinstance(value, str) and re.fullmatch(r"([0-9]+(ms|s|m|h|d|w|y))+", value) is not None


def check_prometheus_rule(pr: dict[str, Any]) -> None:
    """No schema ships for this CRD: the fields the Prometheus Operator's own validation requires."""
    C.equal(pr.get("apiVersion"), "monitoring.coreos.com/v1", "PrometheusRule apiVersion")
    C.expect(set(pr) <= {"apiVersion", "kind", "metadata", "spec"}, f"PrometheusRule top-level keys {sorted(pr)}")
    groups = pr.get("spec", {}).get("groups")
    C.expect(isinstance(groups, list) and len(groups) > 0, "PrometheusRule has groups")
    names = [g.get("name") for g in groups or []]
    C.expect(len(names) == len(set(names)) and all(isinstance(n, str) and n for n in names), f"group names unique and set: {names}")
    for g in groups or []:
        C.expect(set(g) <= {"name", "interval", "rules", "limit", "partial_response_strategy"}, f"group {g.get('name')} keys {sorted(g)}")
        C.expect(isinstance(g.get("rules"), list) and len(g["rules"]) > 0, f"group {g.get('name')} has rules")
        for r in g.get("rules") or []:
            what = f"rule {r.get('alert') or r.get('record')}"
            C.expect(("alert" in r) != ("record" in r), f"{what}: exactly one of alert/record")
            C.expect(set(r) <= {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}, f"{what} keys {sorted(r)}")
            C.expect(isinstance(r.get("expr"), str) and r["expr"].strip() != "", f"{what}: expr is a string")
            if "for" in r:
                C.expect(is_duration(r["for"]), f"{what}: for {r['for']!r} is a Prometheus duration")
            for key in ("labels", "annotations"):
                C.expect(all(isinstance(k, str) and isinstance(v, str) for k, v in r.get(key, {}).items()), f"{what}: {key} are strings")


# --------------------------------------------------------------------------- facts


def check_common(values: dict[str, Any], docs: list[tuple[str, dict[str, Any]]], notes: str) -> dict[str, Any]:
    """Facts every value set must produce. Returns the sluice container's env for per-set checks."""
    for _, doc in docs:
        labels = doc["metadata"].get("labels", {})
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/managed-by", "helm.sh/chart"):
            C.expect(key in labels, f"{doc['kind']}/{doc['metadata']['name']} has label {key}")

    dep = one(docs, "Deployment", FULLNAME)
    pod = dep["spec"]["template"]["spec"]
    selector = dep["spec"]["selector"]["matchLabels"]
    C.equal(selector, {"app.kubernetes.io/name": "sluice", "app.kubernetes.io/instance": RELEASE}, "Deployment selector")
    C.expect(matches(selector, dep["spec"]["template"]["metadata"]["labels"]), "pod labels match the Deployment selector")
    annotations = dep["spec"]["template"]["metadata"].get("annotations", {})
    C.expect(not any("checksum" in k for k in annotations), "no ConfigMap checksum annotation (config reloads live)")

    # Security context.
    psc = pod["securityContext"]
    C.equal(psc.get("runAsNonRoot"), True, "pod runAsNonRoot")
    C.equal(psc.get("runAsUser"), 65532, "pod runAsUser")
    C.expect(isinstance(psc.get("fsGroup"), int), "pod fsGroup set")
    C.equal(psc.get("seccompProfile"), {"type": "RuntimeDefault"}, "pod seccompProfile")
    containers = {c["name"]: c for c in pod["containers"]}
    C.equal(sorted(containers), ["sluice"], "containers")
    ctr = containers.get("sluice", {})
    csc = ctr.get("securityContext", {})
    C.equal(csc.get("readOnlyRootFilesystem"), True, "container readOnlyRootFilesystem")
    C.equal(csc.get("allowPrivilegeEscalation"), False, "container allowPrivilegeEscalation")
    C.equal(csc.get("capabilities"), {"drop": ["ALL"]}, "container capabilities")
    C.equal(ctr.get("image"), IMAGE, "image")

    # Ports and env.
    admin_ports = ({"admin": values["admin"].get("port", 8083)}
                   if values.get("admin", {}).get("expose") else {})
    C.equal({p["name"]: p["containerPort"] for p in ctr.get("ports", [])}, {"grpc": 8081, "http": 8080, **admin_ports},
            "container ports (admin only when exposed)")
    env = env_map(ctr)
    for name, want in {
        "GRPC_PORT": "8081", "PORT": "8080", "RUNTIME_ROOT": "/data", "RUNTIME_SUBDIRECTORY": "ratelimit",
        "RUNTIME_APPDIRECTORY": "config", "RUNTIME_IGNOREDOTFILES": "true", "RUNTIME_WATCH_ROOT": "false",
    }.items():
        C.equal(env_value(env, name), want, f"env {name}")
    for name in ("LOG_LEVEL", "LOG_FORMAT", "SHADOW_MODE", "COUNTING", "NEAR_LIMIT_RATIO", "LIMIT_RESPONSE_HEADERS_ENABLED",
                 "LOCAL_CACHE_SIZE_IN_BYTES", "TRACING_ENABLED", "SHUTDOWN_GRACE_PERIOD", "SHUTDOWN_DRAIN_DELAY"):
        C.expect(isinstance(env_value(env, name), str), f"env {name} is set (a string)")
    for name, var in env.items():
        C.expect(isinstance(var.get("value"), str) or "valueFrom" in var, f"env {name} has a string value or valueFrom")
    grace = seconds(env_value(env, "SHUTDOWN_GRACE_PERIOD") or "0s")
    delay = seconds(env_value(env, "SHUTDOWN_DRAIN_DELAY") or "0s")
    C.expect(pod["terminationGracePeriodSeconds"] > grace + delay,
             f"terminationGracePeriodSeconds {pod['terminationGracePeriodSeconds']} > SHUTDOWN_DRAIN_DELAY {delay}s + SHUTDOWN_GRACE_PERIOD {grace}s")

    # Probes.
    probes = values.get("probes", {})
    probe_type = probes.get("type", "grpc")
    liveness_type = probes.get("liveness", {}).get("type", "live") or probe_type
    for probe, kind in (("readinessProbe", probe_type), ("livenessProbe", liveness_type)):
        p = ctr.get(probe, {})
        want = {
            "live": ("httpGet", {"path": "/livez", "port": "http"}),
            "grpc": ("grpc", {"port": 8081, "service": "ratelimit"}),
            "http": ("httpGet", {"path": "/healthcheck", "port": "http"}),
            "tcp": ("tcpSocket", {"port": "grpc"}),
        }[kind]
        C.equal(p.get(want[0]), want[1], f"{probe} ({kind})")
    if "liveness" not in probes:
        # The default liveness probe never depends on Redis (readiness does).
        C.equal(ctr.get("livenessProbe", {}).get("httpGet"), {"path": "/livez", "port": "http"},
                "default livenessProbe is GET /livez, independent of Redis")
    startup = values.get("probes", {}).get("startup", {}).get("enabled", False)
    C.equal("startupProbe" in ctr, startup, "startupProbe present iff probes.startup.enabled")

    # The ConfigMap mount: the whole map as a directory (kubelet's ..data symlink swap).
    mounts = {m["name"]: m for m in ctr.get("volumeMounts", [])}
    C.equal(mounts.get("config", {}).get("mountPath"), "/data/ratelimit/config", "config mount path")
    C.expect("subPath" not in mounts.get("config", {}), "config mounted without subPath (live updates)")
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    C.equal(volumes.get("config", {}).get("configMap", {}).get("name"), FULLNAME, "config volume's ConfigMap")

    # Topology spread: zone and hostname, best effort, this release's sluice pods.
    tsc = pod.get("topologySpreadConstraints", [])
    C.equal(sorted(t["topologyKey"] for t in tsc), ["kubernetes.io/hostname", "topology.kubernetes.io/zone"], "topology keys")
    for t in tsc:
        C.equal(t.get("whenUnsatisfiable"), "ScheduleAnyway", "topology whenUnsatisfiable")
        C.equal(t.get("labelSelector", {}).get("matchLabels"), selector, "topology labelSelector = pod selector")

    # ServiceAccount.
    sa = one(docs, "ServiceAccount", FULLNAME)
    C.equal(pod.get("serviceAccountName"), sa.get("metadata", {}).get("name"), "pod uses the chart's ServiceAccount")

    # Service: ports grpc/http, selecting exactly the sluice pods.
    svc = one(docs, "Service", FULLNAME)
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    C.equal(sorted(ports), sorted(["grpc", "http", *admin_ports]), "Service port names")
    C.equal((ports["grpc"]["port"], ports["grpc"].get("appProtocol")), (8081, "grpc"), "Service grpc port")
    C.equal(ports["http"]["port"], 8080, "Service http port")
    C.equal(svc["spec"]["selector"], selector, "Service selector")
    C.equal(svc["spec"]["type"], "ClusterIP", "Service type")

    # ConfigMap: one key per domain file, each a YAML document with its domain.
    cm = one(docs, "ConfigMap", FULLNAME)
    config = {"example": {"domain": "example"}, **values.get("config", {})}  # Helm merges with the default
    want_files = {}
    for name, cfg in config.items():
        if cfg is None:  # `name: null` removes a default entry
            continue
        domain = (yaml.safe_load(cfg) if isinstance(cfg, str) else cfg)["domain"]
        want_files[name if name.endswith((".yaml", ".yml")) else f"{name}.yaml"] = domain
    data = cm.get("data", {})
    C.equal(sorted(data), sorted(want_files), "ConfigMap keys (one per domain file)")
    for key, text in data.items():
        doc = yaml.safe_load(text)
        C.equal(doc.get("domain"), want_files.get(key), f"ConfigMap {key} domain")

    # HPA / PDB / ServiceMonitor only when enabled.
    hpa_on = values.get("autoscaling", {}).get("enabled", False)
    C.equal(len(by_kind(docs, "HorizontalPodAutoscaler")), int(hpa_on), "HPA present iff autoscaling.enabled")
    C.equal("replicas" in dep["spec"], not hpa_on, "Deployment.replicas set iff no HPA")
    C.equal(len(by_kind(docs, "PodDisruptionBudget")), int(values.get("pdb", {}).get("enabled", False)), "PDB present iff pdb.enabled")
    C.equal(len(by_kind(docs, "ServiceMonitor")), int(values.get("serviceMonitor", {}).get("enabled", False)),
            "ServiceMonitor present iff serviceMonitor.enabled")
    np_on = values.get("networkPolicy", {}).get("enabled", False)
    C.equal(len(by_kind(docs, "NetworkPolicy")), int(np_on), "NetworkPolicy present iff networkPolicy.enabled")
    for np in by_kind(docs, "NetworkPolicy"):
        C.equal(np["spec"]["podSelector"]["matchLabels"], selector, "NetworkPolicy selects sluice's pods")
        C.equal(np["spec"]["policyTypes"], ["Ingress"], "NetworkPolicy on ingress")
        rules = np["spec"]["ingress"]
        C.equal(rules[0]["ports"], [{"port": "grpc", "protocol": "TCP"}], "gRPC rule's port")
        C.expect(len(rules[0]["from"]) > 0, "the gRPC rule names its peers (an empty from allows all)")
        http_from = values["networkPolicy"].get("httpFrom", [])
        admin = values.get("admin", {})
        admin_rule = bool(admin.get("expose") and values["networkPolicy"].get("adminFrom"))
        C.equal(len(rules), 1 + int(bool(http_from)) + int(admin_rule),
                "an HTTP rule iff httpFrom, an admin rule iff admin.expose and adminFrom")
    for pdb in by_kind(docs, "PodDisruptionBudget"):
        C.equal(pdb["spec"]["selector"]["matchLabels"], selector, "PDB selector")
    for hpa in by_kind(docs, "HorizontalPodAutoscaler"):
        C.equal(hpa["spec"]["scaleTargetRef"], {"apiVersion": "apps/v1", "kind": "Deployment", "name": FULLNAME}, "HPA target")
    dash_on = values.get("grafanaDashboard", {}).get("enabled", False)
    dashboards = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"] == f"{FULLNAME}-dashboard"]
    C.equal(len(dashboards), int(dash_on), "dashboard ConfigMap present iff grafanaDashboard.enabled")
    rules_on = values.get("prometheusRule", {}).get("enabled", False)
    C.equal(len(by_kind(docs, "PrometheusRule")), int(rules_on), "PrometheusRule present iff prometheusRule.enabled")
    for sm in by_kind(docs, "ServiceMonitor"):
        C.equal(sm["spec"]["selector"]["matchLabels"], selector, "ServiceMonitor selector")
        C.expect(matches(sm["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"]), "ServiceMonitor selects the Service")

    # Evaluation Redis objects only when enabled.
    redis_on = values.get("redis", {}).get("enabled", False)
    redis_objs = [d for _, d in docs if d["metadata"]["name"] == REDIS_NAME]
    C.equal(sorted(d["kind"] for d in redis_objs), ["Deployment", "Service"] if redis_on else [], "evaluation Redis objects")

    check_notes(notes, redis_on)
    memory = values.get("store", {}).get("type", "memory") == "memory"
    several = hpa_on or values.get("replicaCount", 1) > 1
    C.equal("each pod keeps its own counters" in notes, memory and several,
            "NOTES warn about per-pod counters iff memory store with several replicas")
    return env


def check_notes(notes: str, redis_on: bool) -> None:
    """NOTES.txt is part of the engine's output: it names the service and holds a valid Envoy snippet."""
    C.expect(f"{SVC_DNS}:8081" in notes, f"NOTES mention {SVC_DNS}:8081")
    start = notes.find("http_filters:")
    end = notes.find("\n\n", notes.find("clusters:"))
    try:
        snippet = yaml.safe_load(notes[start:end])
    except yaml.YAMLError as exc:
        C.expect(False, f"the Envoy snippet in NOTES is not YAML: {exc}")
        return
    flt = snippet["http_filters"][0]
    C.equal(flt["name"], "envoy.filters.http.ratelimit", "NOTES filter name")
    rls = flt["typed_config"]["rate_limit_service"]
    C.equal(rls["transport_api_version"], "V3", "NOTES transport_api_version")
    cluster = snippet["clusters"][0]
    C.equal(rls["grpc_service"]["envoy_grpc"]["cluster_name"], cluster["name"], "NOTES filter -> cluster name")
    C.equal(cluster["type"], "STRICT_DNS", "NOTES cluster type")
    opts = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    C.equal(opts["@type"], "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions", "NOTES protocol options type")
    C.equal(opts["explicit_http_config"], {"http2_protocol_options": {}}, "NOTES HTTP/2")
    sock = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    C.equal((sock["address"], sock["port_value"]), (SVC_DNS, 8081), "NOTES cluster address")
    C.equal("EVALUATION ONLY" in notes, redis_on, "NOTES evaluation-Redis warning iff redis.enabled")


def no_redis_env(env: dict[str, Any]) -> None:
    C.equal(sorted(n for n in env if n.startswith("REDIS_") or n == "CACHE_KEY_PREFIX"), [], "no Redis env with the memory store")


# --------------------------------------------------------------------------- value sets

SECRET = {"existingSecret": "redis-credentials", "existingSecretKey": "password"}
SEEDS = ["rc-0.rc.infra:6379", "rc-1.rc.infra:6379", "rc-2.rc.infra:6379"]


def facts_default(values: dict[str, Any], docs: Any, env: dict[str, Any]) -> None:
    no_redis_env(env)
    C.equal(env_value(env, "SHUTDOWN_GRACE_PERIOD"), "15s", "default SHUTDOWN_GRACE_PERIOD")
    C.equal(env_value(env, "MEMORY_MAX_COUNTERS"), "500000", "memory store: MEMORY_MAX_COUNTERS default")
    C.expect("WORKER_THREADS" not in env, "default: no WORKER_THREADS (one serving thread per CPU)")
    C.equal(env_value(env, "ADMIN_HOST"), "127.0.0.1", "default: the admin API on loopback only")
    C.expect("ADMIN_TOKENS_FILE" not in env, "default: no admin tokens")
    C.expect("GLOBAL_REDIS_URL" not in env and "REGION" not in env, "default: no home store, no region")
    C.expect("GLOBAL_UNREACHABLE" not in env, "default: no home store, no partition setting")
    C.expect("DECISION_LOG" not in env, "default: no decision log")
    C.expect("CANDIDATE_CONFIG" not in env, "default: no candidate limits")
    C.equal([d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-candidates")], [],
            "default: no candidates ConfigMap")
    ports = [p["name"] for p in one(docs, "Service", FULLNAME)["spec"]["ports"]]
    C.equal(ports, ["grpc", "http"], "default: the admin port is not in the Service")


def facts_admin(values: dict[str, Any], docs: Any, env: dict[str, Any]) -> None:
    C.equal(env_value(env, "ADMIN_HOST"), "0.0.0.0", "exposed admin API on every interface")
    C.equal(env_value(env, "ADMIN_PORT"), "9443", "ADMIN_PORT")
    C.equal(env_value(env, "ADMIN_TOKENS_FILE"), "/etc/sluice/admin/tokens", "ADMIN_TOKENS_FILE")
    svc = one(docs, "Service", FULLNAME)["spec"]["ports"]
    C.equal([(p["name"], p["port"]) for p in svc], [("grpc", 8081), ("http", 8080), ("admin", 9443)],
            "the Service carries the admin port")
    pod = one(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]
    secret = [v for v in pod["volumes"] if v["name"] == "admin-tokens"]
    C.equal(secret[0]["secret"]["secretName"] if secret else None, "sluice-admin-tokens", "tokens Secret volume")
    rules = one(docs, "NetworkPolicy", FULLNAME)["spec"]["ingress"]
    C.equal(rules[-1]["ports"], [{"port": "admin", "protocol": "TCP"}], "the admin rule's port")


def facts_headless(values: dict[str, Any], docs: Any, env: dict[str, Any]) -> None:
    no_redis_env(env)
    C.equal(one(docs, "Service", FULLNAME)["spec"].get("clusterIP"), "None", "headless Service")
    C.equal(one(docs, "Deployment", FULLNAME)["spec"].get("replicas"), 2, "replicas")


def facts_memory(values: dict[str, Any], docs: Any, env: dict[str, Any]) -> None:
    no_redis_env(env)
    cm = one(docs, "ConfigMap", FULLNAME)["data"]
    C.expect("requests_per_unit: 10000000" in cm.get("big.yaml", ""), "large integers render as integers (not 1e+07)")
    C.expect('value: "1.10"' in cm.get("raw.yml", "") and "# kept verbatim" in cm.get("raw.yml", ""),
             "a string config entry is rendered verbatim")
    for name, want in {"TRACING_ENABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel-collector.observability:4317",
                       "OTEL_SERVICE_NAME": "sluice-edge", "TRACING_SAMPLING_RATE": "0.1", "LOG_LEVEL": "debug",
                       "LOG_FORMAT": "text", "SHADOW_MODE": "true", "NEAR_LIMIT_RATIO": "0.9",
                       "LIMIT_RESPONSE_HEADERS_ENABLED": "true", "RATELIMIT_HEADERS_DRAFT": "ietf",
                       "CONFIG_RELOAD_INTERVAL": "2s", "WORKER_THREADS": "4"}.items():
        C.equal(env_value(env, name), want, f"env {name}")
    pod = one(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]
    C.equal([v["name"] for v in pod["volumes"]], ["config", "tls"], "extraVolumes appended")
    C.equal([m["mountPath"] for m in pod["containers"][0]["volumeMounts"]], ["/data/ratelimit/config", "/etc/sluice/tls"],
            "extraVolumeMounts appended")


def facts_redis(values: dict[str, Any], docs: Any, env: dict[str, Any]) -> None:
    C.equal(env_value(env, "REDIS_URL"), "redis.infra.svc:6379", "REDIS_URL")
    C.equal(env_value(env, "REDIS_TYPE"), "single", "REDIS_TYPE")
    auth = env.get("REDIS_AUTH", {})
    C.expect("value" not in auth, "REDIS_AUTH has no plain value")
    C.equal(auth.get("valueFrom", {}).get("secretKeyRef"), {"name": "redis-credentials", "key": "password"}, "REDIS_AUTH secretKeyRef")
    for name, want in {"REDIS_TLS": "true", "REDIS_POOL_SIZE": "16", "REDIS_TIMEOUT": "250ms",
                       "CACHE_KEY_PREFIX": "edge_", "FAILURE_MODE": "allow", "LOCAL_CACHE_SIZE_IN_BYTES": "16777216"}.items():
        C.equal(env_value(env, name), want, f"env {name}")
    C.expect("MEMORY_MAX_COUNTERS" not in env, "Redis store: no MEMORY_MAX_COUNTERS")


def facts_cluster(values: dict[str, Any], docs: Any, env: dict[str, Any]) -> None:
    C.equal(env_value(env, "REDIS_URL"), ",".join(SEEDS), "REDIS_URL (comma-joined seeds)")
    C.equal(env_value(env, "REDIS_TYPE"), "cluster", "REDIS_TYPE")
    C.equal(env.get("REDIS_AUTH", {}).get("valueFrom", {}).get("secretKeyRef"),
            {"name": "redis-credentials", "key": "password"}, "REDIS_AUTH secretKeyRef")
    C.expect("REDIS_TLS" not in env, "no REDIS_TLS when store.redis.tls is false")
    hpa = one(docs, "HorizontalPodAutoscaler", FULLNAME)["spec"]
    C.equal((hpa["minReplicas"], hpa["maxReplicas"]), (3, 12), "HPA min/max")
    C.equal(hpa["metrics"][0]["resource"]["target"], {"type": "Utilization", "averageUtilization": 60}, "HPA CPU target")
    C.equal(one(docs, "PodDisruptionBudget", FULLNAME)["spec"].get("minAvailable"), 2, "PDB minAvailable")
    np = one(docs, "NetworkPolicy", FULLNAME)["spec"]["ingress"]
    C.equal(np[0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/managed-by"], "envoy-gateway",
            "NetworkPolicy: the gateway pods by default")
    C.equal(np[1]["ports"], [{"port": "http", "protocol": "TCP"}], "NetworkPolicy: the HTTP rule's port")
    sm = one(docs, "ServiceMonitor", FULLNAME)
    C.equal(sm["metadata"]["labels"].get("release"), "kube-prometheus-stack", "ServiceMonitor extra label")
    C.equal(sm["spec"]["endpoints"][0].get("interval"), "15s", "ServiceMonitor interval")


def facts_eval_redis(values: dict[str, Any], docs: Any, env: dict[str, Any]) -> None:
    C.equal(env_value(env, "REDIS_URL"), f"{REDIS_NAME}:6379", "REDIS_URL points at the evaluation Redis")
    C.equal(env_value(env, "REDIS_TYPE"), "single", "REDIS_TYPE")
    dep = one(docs, "Deployment", REDIS_NAME)
    svc = one(docs, "Service", REDIS_NAME)
    sluice = one(docs, "Deployment", FULLNAME)
    if not (dep and svc and sluice):
        return
    pod = dep["spec"]["template"]["spec"]
    ctr = pod["containers"][0]
    C.equal(ctr["image"], "redis:7-alpine", "evaluation Redis image")
    C.equal(pod["securityContext"].get("runAsNonRoot"), True, "evaluation Redis runAsNonRoot")
    C.expect(isinstance(pod["securityContext"].get("runAsUser"), int) and pod["securityContext"]["runAsUser"] > 0,
             "evaluation Redis runs as a non-root uid")
    C.equal(ctr["securityContext"].get("readOnlyRootFilesystem"), True, "evaluation Redis readOnlyRootFilesystem")
    C.equal(ctr["securityContext"].get("capabilities"), {"drop": ["ALL"]}, "evaluation Redis capabilities")
    C.expect("--requirepass" in ctr["args"] and "$(REDIS_PASSWORD)" in ctr["args"], "evaluation Redis requires the Secret's password")
    C.expect(all(v.get("emptyDir") is not None for v in pod.get("volumes", [])), "evaluation Redis has no persistent volume")
    redis_pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    sluice_pod_labels = sluice["spec"]["template"]["metadata"]["labels"]
    C.expect(matches(svc["spec"]["selector"], redis_pod_labels), "Redis Service selects the Redis pod")
    C.expect(not matches(svc["spec"]["selector"], sluice_pod_labels), "Redis Service does not select sluice pods")
    C.expect(not matches(sluice["spec"]["selector"]["matchLabels"], redis_pod_labels), "sluice selector does not match the Redis pod")
    C.equal(svc["spec"]["ports"][0]["port"], 6379, "Redis Service port")


def facts_dashboards(values: dict[str, Any], docs: Any, env: dict[str, Any]) -> None:
    """The dashboard ConfigMap carries the JSON file unchanged under the sidecar's label; the
    PrometheusRule carries the rules file's groups (templates untouched) plus the extra ones."""
    import json
    cm = one(docs, "ConfigMap", f"{FULLNAME}-dashboard")
    C.equal(cm["metadata"]["namespace"], "monitoring", "dashboard ConfigMap namespace")
    C.equal(cm["metadata"]["labels"].get("grafana_dashboard"), "1", "dashboard sidecar label")
    C.equal(cm["metadata"].get("annotations"), {"grafana_folder": "Rate limits"}, "dashboard annotations")
    shipped = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    C.equal(json.loads(cm["data"]["sluice.json"]), shipped, "dashboard JSON as shipped")
    C.equal(shipped.get("uid"), "sluice-overview", "dashboard uid (stable for links)")
    C.expect(any(v.get("type") == "datasource" for v in shipped["templating"]["list"]), "dashboard picks its data source")
    pr = one(docs, "PrometheusRule", FULLNAME)
    C.equal(pr["metadata"]["labels"].get("release"), "kube-prometheus-stack", "PrometheusRule extra label")
    rules_file = yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text())
    groups = pr["spec"]["groups"]
    C.equal(groups[:-1], rules_file["groups"], "PrometheusRule groups = the rules file's")
    C.equal(groups[-1]["name"], "site", "additionalGroups appended")
    text = yaml.safe_dump(pr)
    C.expect("{{ $labels.pod }}" in text, "alert annotations keep their {{ $labels }} templates")


def facts_multi_region(values: dict[str, Any], docs: Any, env: dict[str, Any]) -> None:
    home = values["multiRegion"]["home"]
    C.equal(env_value(env, "REGION"), values["multiRegion"]["region"], "REGION")
    C.equal(env_value(env, "GLOBAL_REDIS_URL"), home["url"], "GLOBAL_REDIS_URL")
    C.equal(env_value(env, "GLOBAL_REDIS_TYPE"), home["type"], "GLOBAL_REDIS_TYPE")
    C.equal(env_value(env, "GLOBAL_REDIS_TIMEOUT"), home["timeout"], "GLOBAL_REDIS_TIMEOUT")
    C.equal(env.get("GLOBAL_REDIS_AUTH", {}).get("valueFrom", {}).get("secretKeyRef"),
            {"name": home["existingSecret"], "key": home["existingSecretKey"]}, "GLOBAL_REDIS_AUTH secretKeyRef")
    C.equal(env_value(env, "REDIS_URL"), values["store"]["redis"]["url"], "the region's own store stays REDIS_URL")
    C.equal(env_value(env, "GLOBAL_UNREACHABLE"), values["multiRegion"]["unreachable"], "GLOBAL_UNREACHABLE")
    C.equal(env_value(env, "GLOBAL_UNREACHABLE_SHARE"), values["multiRegion"]["unreachableShare"],
            "GLOBAL_UNREACHABLE_SHARE")


def facts_decision_log(values: dict[str, Any], docs: Any, env: dict[str, Any]) -> None:
    log = values["decisionLog"]
    C.equal(env_value(env, "DECISION_LOG"), log["path"], "DECISION_LOG")
    C.equal(env_value(env, "DECISION_LOG_MAX_BYTES"), log["maxBytes"], "DECISION_LOG_MAX_BYTES")
    C.equal(env_value(env, "DECISION_LOG_FILES"), str(log["files"]), "DECISION_LOG_FILES")
    C.equal(env_value(env, "DECISION_LOG_SAMPLE"), log["sample"], "DECISION_LOG_SAMPLE")
    C.equal(env_value(env, "DECISION_LOG_QUEUE"), str(log["queue"]), "DECISION_LOG_QUEUE")
    C.equal(env_value(env, "DECISION_LOG_REDACT"), log["redact"], "DECISION_LOG_REDACT")
    C.equal(env.get("DECISION_LOG_REDACT_SALT", {}).get("valueFrom", {}).get("secretKeyRef"),
            {"name": log["redactSaltSecret"], "key": log["redactSaltSecretKey"]}, "DECISION_LOG_REDACT_SALT secretKeyRef")
    pod = one(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    C.equal(mounts.get("decision-log", {}).get("mountPath"), "/var/log/sluice", "the log's directory is mounted")
    vols = {v["name"]: v for v in pod["volumes"]}
    # 256M and a tenth, in bytes (K, M, G are powers of 1024, as sluice reads them).
    C.equal(vols.get("decision-log", {}).get("emptyDir"), {"sizeLimit": str(256 * 2**20 * 11 // 10)},
            "an emptyDir of the cap plus a tenth")


def facts_decision_log_claim(values: dict[str, Any], docs: Any, env: dict[str, Any]) -> None:
    C.expect("DECISION_LOG_REDACT" not in env and "DECISION_LOG_REDACT_SALT" not in env, "no redaction unless asked")
    pod = one(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod["volumes"]}
    C.equal(vols.get("decision-log", {}).get("persistentVolumeClaim"), {"claimName": "decisions"}, "the claim")
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    C.equal(mounts.get("decision-log", {}).get("mountPath"), "/data/log", "the claim at the path's directory")
    C.equal(env.get("POD_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath"), "metadata.name",
            "POD_NAME from the pod's name")
    names = [e["name"] for e in pod["containers"][0]["env"]]
    C.expect(names.index("POD_NAME") < names.index("DECISION_LOG"), "POD_NAME before the DECISION_LOG that names it")
    C.equal(env_value(env, "DECISION_LOG"), "/data/log/$(POD_NAME)-d.jsonl", "one log per pod on the claim")


def facts_candidates(values: dict[str, Any], docs: Any, env: dict[str, Any]) -> None:
    C.equal(env_value(env, "CANDIDATE_CONFIG"), "/data/candidates", "CANDIDATE_CONFIG")
    cm = one(docs, "ConfigMap", f"{FULLNAME}-candidates")
    C.expect("domain: edge" in cm.get("data", {}).get("edge.yaml", ""), "the candidate file in its ConfigMap")
    pod = one(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    C.equal(mounts.get("candidates", {}).get("mountPath"), "/data/candidates", "the candidates mounted")
    vols = {v["name"]: v for v in pod["volumes"]}
    C.equal(vols.get("candidates", {}).get("configMap", {}).get("name"), f"{FULLNAME}-candidates",
            "from their own ConfigMap")


def facts_candidates_existing(values: dict[str, Any], docs: Any, env: dict[str, Any]) -> None:
    C.equal(env_value(env, "CANDIDATE_CONFIG"), "/data/candidates", "CANDIDATE_CONFIG")
    C.equal([d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-candidates")], [],
            "no ConfigMap built beside an existing one")
    pod = one(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod["volumes"]}
    C.equal(vols.get("candidates", {}).get("configMap", {}).get("name"), "my-candidates", "the existing ConfigMap")


VALUE_SETS: list[tuple[str, dict[str, Any], Callable[..., None]]] = [
    ("default", {}, facts_default),
    ("memory", {
        "store": {"type": "memory"},
        "probes": {"type": "http", "startup": {"enabled": True}},
        "settings": {"logLevel": "debug", "logFormat": "text", "shadowMode": True, "nearLimitRatio": 0.9,
                     "limitResponseHeadersEnabled": True, "workerThreads": 4},
        "tracing": {"enabled": True, "endpoint": "http://otel-collector.observability:4317",
                    "serviceName": "sluice-edge", "samplingRate": 0.1},
        "extraEnv": [{"name": "RATELIMIT_HEADERS_DRAFT", "value": "ietf"},
                     {"name": "CONFIG_RELOAD_INTERVAL", "value": "2s"}],
        "extraVolumes": [{"name": "tls", "secret": {"secretName": "sluice-tls"}}],
        "extraVolumeMounts": [{"name": "tls", "mountPath": "/etc/sluice/tls", "readOnly": True}],
        "config": {
            "example": None,  # drop the chart's example domain
            "api": {"domain": "api", "descriptors": [{"key": "remote_address",
                                                      "rate_limit": {"unit": "second", "requests_per_unit": 10}}]},
            "big": {"domain": "big", "descriptors": [{"key": "tenant",
                                                      "rate_limit": {"unit": "day", "requests_per_unit": 10000000}}]},
            "raw.yml": "# kept verbatim\ndomain: raw\ndescriptors:\n  - key: version\n    value: \"1.10\"\n"
                       "    rate_limit: {unit: minute, requests_per_unit: 5}\n",
        },
    }, facts_memory),
    ("memory, 2 replicas, headless", {
        "replicaCount": 2,
        "service": {"clusterIP": "None"},
    }, facts_headless),
    ("redis", {
        "store": {"type": "redis", "failureMode": "allow", "localCacheSizeInBytes": 16777216,
                  "redis": {"url": "redis.infra.svc:6379", **SECRET, "tls": True, "poolSize": 16,
                            "timeout": "250ms", "cacheKeyPrefix": "edge_"}},
        "replicaCount": 3,
        "probes": {"liveness": {"type": "tcp"}},
    }, facts_redis),
    ("cluster+hpa+pdb+servicemonitor", {
        "store": {"type": "cluster", "redis": dict(SECRET), "cluster": {"seeds": SEEDS}},
        "autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 12, "targetCPUUtilizationPercentage": 60},
        "pdb": {"enabled": True, "minAvailable": 2},
        "serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "kube-prometheus-stack"}},
        "networkPolicy": {"enabled": True, "httpFrom": [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": "monitoring"}}}]},
    }, facts_cluster),
    ("dashboard+alerts", {
        "grafanaDashboard": {"enabled": True, "namespace": "monitoring",
                             "annotations": {"grafana_folder": "Rate limits"}},
        "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"},
                           "additionalGroups": [{"name": "site", "rules": [
                               {"alert": "SluiceDenyingMuch", "expr": "sum(rate(sluice_rate_limit_over_limit[5m])) > 100",
                                "for": "10m", "labels": {"severity": "info"}}]}]},
    }, facts_dashboards),
    ("admin exposed with tokens", {
        "admin": {"expose": True, "port": 9443, "tokensSecret": "sluice-admin-tokens"},
        "networkPolicy": {"enabled": True, "adminFrom": [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": "ops"}}}]},
    }, facts_admin),
    ("multi-region", {
        "store": {"type": "redis", "redis": {"url": "redis.eu-west.svc:6379"}},
        "multiRegion": {"region": "eu-west", "unreachable": "share", "unreachableShare": "0.33", "home": {"url": "home-redis.global.example:6379", "type": "sentinel",
                                                      "existingSecret": "home-redis", "existingSecretKey": "pw",
                                                      "timeout": "750ms"}},
    }, facts_multi_region),
    ("evaluation-redis", {
        "store": {"type": "redis", "redis": dict(SECRET)},
        "redis": {"enabled": True},
    }, facts_eval_redis),
    ("decision log, redacted", {
        "decisionLog": {"enabled": True, "path": "/var/log/sluice/decisions.jsonl", "maxBytes": "256M", "files": 4, "sample": "0.25", "queue": 10000,
                        "redact": "api_key,user", "redactSaltSecret": "sluice-log-salt", "redactSaltSecretKey": "k"},
    }, facts_decision_log),
    ("decision log on a claim", {
        "decisionLog": {"enabled": True, "path": "/data/log/d.jsonl", "existingClaim": "decisions"},
    }, facts_decision_log_claim),
    ("candidate limits", {
        "candidates": {"config": {"edge": "domain: edge\ndescriptors:\n  - key: tenant\n"
                                          "    rate_limit: {name: t-50, unit: minute, requests_per_unit: 50}\n"}},
    }, facts_candidates),
    ("candidate limits from an existing ConfigMap", {
        "candidates": {"existingConfigMap": "my-candidates"},
    }, facts_candidates_existing),
]

def facts_istio(values: dict[str, Any], docs: Any, env: dict[str, Any]) -> None:
    C.equal(env_value(env, "REDIS_URL"), values["store"]["redis"]["url"], "REDIS_URL")
    C.equal(env_value(env, "REDIS_TYPE"), "single", "REDIS_TYPE")
    C.equal(env_value(env, "LOG_LEVEL"), values["settings"]["logLevel"], "LOG_LEVEL")


# The values file the Istio example and the migration guide install with, when present: the
# docs must keep working with the chart.
ISTIO_VALUES = ROOT / "config" / "istio" / "values-istio.yaml"
if ISTIO_VALUES.is_file():
    VALUE_SETS.append((f"{ISTIO_VALUES.relative_to(ROOT)}", yaml.safe_load(ISTIO_VALUES.read_text()), facts_istio))

# Values the schema must reject: (name, values, fragments the error must contain).
BAD_VALUES: list[tuple[str, dict[str, Any], list[str]]] = [
    ("wrong type", {"replicaCount": "two"}, ["/replicaCount", "want integer"]),
    ("negative worker threads", {"settings": {"workerThreads": -1}}, ["/settings/workerThreads", "minimum"]),
    ("unknown top-level key", {"replicaCont": 2}, ["additional properties 'replicaCont' not allowed"]),
    ("unknown nested key", {"store": {"redis": {"passwrd": "x"}}}, ["/store/redis", "'passwrd' not allowed"]),
    ("invalid enum", {"store": {"type": "mongo"}}, ["/store/type", "memory", "redis", "cluster"]),
    ("cluster without seeds", {"store": {"type": "cluster"}}, ["/store/cluster/seeds", "minItems"]),
    ("redis without url", {"store": {"type": "redis"}}, ["/store/redis/url", "minLength"]),
    ("evaluation Redis with cluster", {"store": {"type": "cluster", "cluster": {"seeds": SEEDS}}, "redis": {"enabled": True}},
     ["/store/type", "'redis'"]),
    ("bad seed", {"store": {"type": "cluster", "cluster": {"seeds": ["no-port"]}}}, ["/store/cluster/seeds/0"]),
    ("bad probe type", {"probes": {"type": "tcp"}}, ["/probes/type"]),
    ("headless NodePort", {"service": {"type": "NodePort", "clusterIP": "None"}}, ["/service/type", "'ClusterIP'"]),
    ("tracing without endpoint", {"tracing": {"enabled": True}}, ["/tracing/endpoint"]),
    ("ratio above 1", {"settings": {"nearLimitRatio": 1.5}}, ["/settings/nearLimitRatio", "maximum"]),
    ("NetworkPolicy allowing everyone", {"networkPolicy": {"enabled": True, "grpcFrom": []}},
     ["/networkPolicy/grpcFrom", "minItems"]),
    ("PDB with both bounds", {"pdb": {"enabled": True, "minAvailable": 1, "maxUnavailable": 1}}, ["/pdb/maxUnavailable"]),
    ("extra rule group without rules", {"prometheusRule": {"enabled": True, "additionalGroups": [{"name": "x"}]}},
     ["/prometheusRule/additionalGroups/0", "rules"]),
    ("config file name with a leading dot", {"config": {".hidden": {"domain": "h"}}}, ["'.hidden'"]),
    ("a share of nothing", {"multiRegion": {"unreachable": "share", "unreachableShare": "0.0"}},
     ["/multiRegion/unreachableShare"]),
    ("a share above the limit", {"multiRegion": {"unreachable": "share", "unreachableShare": "1.5"}},
     ["/multiRegion/unreachableShare"]),
    ("a home store without a region", {"multiRegion": {"home": {"url": "home:6379"}}}, ["/multiRegion/region"]),
    ("a region that is not a name", {"multiRegion": {"region": "eu west"}}, ["/multiRegion/region"]),
    ("a redacted log without its salt", {"decisionLog": {"enabled": True, "redact": "*"}},
     ["/decisionLog/redactSaltSecret"]),
    ("a relative log path", {"decisionLog": {"enabled": True, "path": "d.jsonl"}}, ["/decisionLog/path"]),
    ("a log sample above 1", {"decisionLog": {"sample": "1.5"}}, ["/decisionLog/sample"]),
    ("a log file at the root", {"decisionLog": {"enabled": True, "path": "/d.jsonl"}}, ["/decisionLog/path"]),
    ("a log cap with a unit sluice does not read", {"decisionLog": {"maxBytes": "1T"}}, ["/decisionLog/maxBytes"]),
]

# Values the templates must refuse (cross-field rules the schema cannot express).
BAD_RENDER: list[tuple[str, dict[str, Any], str]] = [
    ("termination grace not above the drain", {"terminationGracePeriodSeconds": 15}, "must be greater than settings.shutdownGracePeriodSeconds"),
    ("termination grace not above drain delay + drain", {"terminationGracePeriodSeconds": 20}, "shutdownDrainDelaySeconds"),
    ("one domain in two files", {"config": {"a": {"domain": "example"}}}, 'domain "example" is defined twice'),
    ("admin exposed without tokens", {"admin": {"expose": True}}, "admin.expose needs admin.tokensSecret"),
    ("log files under 64K", {"decisionLog": {"enabled": True, "maxBytes": "200K", "files": 5}}, "at least 64K"),
    ("log files under 64K, in bytes", {"decisionLog": {"enabled": True, "maxBytes": "0100000", "files": 2}}, "at least 64K"),
]


# --------------------------------------------------------------------------- steps


def step_lint() -> None:
    C.context = "lint"
    print(f"==> helm lint {CHART} (Helm SDK {helm.helm_sdk_version()}, kube {KUBE_VERSION})")
    for name, values, _ in VALUE_SETS:
        report = helm.lint(CHART, values or None, kube_version=f"v{KUBE_VERSION}")
        messages = report.get("messages", [])
        for m in messages:
            level = {1: "INFO", 2: "WARNING", 3: "ERROR"}.get(m["severity"], "UNKNOWN")
            if name == "default" or m["severity"] >= 2:
                print(f"  [{name}] {level} {m['path']}: {m['error'].strip()}")
        errors = [m for m in messages if m["severity"] >= 3] + [{"error": e} for e in report.get("errors", [])]
        C.expect(not errors, f"lint of value set {name!r} has errors: {[e['error'].strip() for e in errors]}")


def step_render(verbose: bool) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name, values, facts in VALUE_SETS:
        C.context = f"render {name}"
        print(f"==> render {name!r} and validate against Kubernetes {KUBE_VERSION} (strict)")
        try:
            rendered = render(values or None)
        except helm.HelmError as exc:
            C.expect(False, f"render failed: {exc}")
            continue
        docs, notes = split_documents(rendered)
        if verbose:
            for path, text in sorted(rendered.items()):
                print(f"# ---- {path}\n{text}")
        counts[name] = validate_manifests(docs)
        kinds = ", ".join(f"{d['kind']}/{d['metadata']['name']}" for _, d in docs)
        print(f"  {counts[name]} documents: {kinds}")
        try:
            env = check_common(values, docs, notes)
            facts(values, docs, env)
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            # A missing field is a failed check, reported with the others, not a crash.
            C.expect(False, f"the rendered output lacks an expected field ({type(exc).__name__}: {exc})")
    return counts


def step_rejections() -> int:
    rejected = 0
    for name, values, fragments in BAD_VALUES:
        C.context = f"reject {name}"
        try:
            render(values)
            C.expect(False, f"values {values} rendered, but the schema must reject them")
            continue
        except helm.HelmValuesError as exc:
            message = str(exc)
        except helm.HelmError as exc:
            C.expect(False, f"values {values} failed, but not with a schema error: {type(exc).__name__}: {exc}")
            continue
        ok = C.expect("don't meet the specifications of the schema" in message, f"render error is a schema error: {message}")
        ok &= C.expect(all(f in message for f in fragments), f"schema error names {fragments}: {message}")
        report = helm.lint(CHART, values)
        lint_errors = [m["error"] for m in report.get("messages", []) if m["severity"] >= 3] + report.get("errors", [])
        ok &= C.expect(any(all(f in e for f in fragments) for e in lint_errors), f"lint reports the schema error: {lint_errors}")
        if ok:
            rejected += 1
            print(f"  rejected ({name}): {message.splitlines()[-1].strip()}")
    for name, values, fragment in BAD_RENDER:
        C.context = f"reject {name}"
        try:
            render(values)
            C.expect(False, f"values {values} rendered, but the chart must refuse them")
        except helm.HelmRenderError as exc:
            if C.expect(fragment in str(exc), f"render error names the rule ({fragment!r}): {exc}"):
                rejected += 1
                print(f"  refused ({name}): {str(exc).split('): ', 1)[-1]}")
        except helm.HelmError as exc:
            C.expect(False, f"values {values} failed with an unexpected error: {type(exc).__name__}: {exc}")
    return rejected


def find_binary(explicit: str | None) -> Path | None:
    if explicit:
        return Path(explicit)
    found = [p for p in (ROOT / "target" / "release" / "sluice", ROOT / "target" / "debug" / "sluice") if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def step_binary(binary: Path) -> None:
    """The rendered config passes `sluice check`; the memory-store env starts the real binary."""
    C.context = f"binary {binary.relative_to(ROOT) if binary.is_relative_to(ROOT) else binary}"
    print(f"==> {C.context}: `sluice check` on the rendered domain files, then a start with the chart's env")
    for name, values, _ in VALUE_SETS:
        docs, _ = split_documents(render(values or None))
        data = one(docs, "ConfigMap", FULLNAME).get("data", {})
        with tempfile.TemporaryDirectory() as tmp:
            for key, text in data.items():
                Path(tmp, key).write_text(text)
            run = subprocess.run([str(binary), "check", tmp], capture_output=True, text=True, timeout=60)
            if C.expect(run.returncode == 0, f"`sluice check` of the {name!r} ConfigMap: {run.stdout}{run.stderr}"):
                print(f"  sluice check: the {len(data)} domain file(s) of {name!r} are valid")

    docs, _ = split_documents(render(None))
    data = one(docs, "ConfigMap", FULLNAME)["data"]
    ctr = one(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in ctr["env"]}
    with tempfile.TemporaryDirectory() as root:
        # kubelet's layout: files in a timestamped dir, `..data` -> it, and each key -> ..data/key.
        config = Path(root, "ratelimit", "config")
        stamped = config / "..2030_01_01_00_00_00.000000001"
        stamped.mkdir(parents=True)
        for key, text in data.items():
            (stamped / key).write_text(text)
        (config / "..data").symlink_to(stamped.name)
        for key in data:
            (config / key).symlink_to(Path("..data", key))
        grpc, http = free_port(), free_port()
        env.update({"RUNTIME_ROOT": root, "GRPC_PORT": str(grpc), "PORT": str(http), "GRPC_HOST": "127.0.0.1",
                    "HOST": "127.0.0.1", "SHUTDOWN_GRACE_PERIOD": "2s"})
        proc = subprocess.Popen([str(binary)], env={"PATH": os.environ.get("PATH", "")} | env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            health = rlconfig = ""
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{http}/healthcheck", timeout=1) as r:
                        health = r.read().decode()
                    with urllib.request.urlopen(f"http://127.0.0.1:{http}/rlconfig", timeout=1) as r:
                        rlconfig = r.read().decode()
                    break
                except OSError:
                    time.sleep(0.1)
            C.expect(health.strip() == "OK", f"/healthcheck with the chart's env answers OK (got {health!r})")
            C.expect("example." in rlconfig, f"/rlconfig lists the example domain from the mounted ConfigMap: {rlconfig!r}")
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                out, _ = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
        if C.equal(proc.returncode, 0, f"exit code after SIGTERM (output: {out[-2000:]!r})") and health:
            print("  sluice serve with the chart's env and a kubelet-style mount: /healthcheck OK, "
                  "/rlconfig lists the domain, exit 0 on SIGTERM")


def main() -> int:
    global CHART
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="print every rendered manifest")
    parser.add_argument("--chart", type=Path, default=CHART, help="chart directory (default: helm/sluice)")
    parser.add_argument("--sluice-bin", help="sluice binary for the smoke test (default: target/{release,debug}/sluice)")
    parser.add_argument("--no-binary", action="store_true", help="skip the checks with the sluice binary")
    args = parser.parse_args()

    CHART = args.chart.resolve()
    started = time.monotonic()
    block_network()
    step_lint()
    counts = step_render(args.verbose)
    rejected = step_rejections()
    binary = None if args.no_binary else find_binary(args.sluice_bin)
    if binary:
        step_binary(binary)

    print("\n==> summary")
    for name, n in counts.items():
        print(f"  {name:32} {n} documents validated")
    print(f"  bad value sets rejected: {rejected} of {len(BAD_VALUES) + len(BAD_RENDER)}")
    print(f"  sluice binary checks: {'ran with ' + str(binary) if binary else 'skipped (no binary)'}")
    print(f"  {C.passed} checks passed, {len(C.failures)} failed, in {time.monotonic() - started:.1f}s")
    if C.failures:
        print("\ncheck_helm: FAILED", file=sys.stderr)
        for failure in C.failures:
            print(f"  {failure}", file=sys.stderr)
        return 1
    print("check_helm: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
