#!/usr/bin/env python3
"""Proves that the Envoy and Istio examples only use real Envoy v3 API fields, and that they
agree with the sluice configs and the Helm chart's naming.

    pip install xds-protos==1.85.0 pyyaml==6.0.3     # Envoy's generated Python protos
    python3 scripts/check_envoy_examples.py [--sluice target/debug/sluice]

Checks, offline (nothing is fetched once the two packages are installed):

  config/examples/envoy/kubernetes.yaml      parsed as envoy.config.bootstrap.v3.Bootstrap with protobuf's
                               json_format.ParseDict, which rejects unknown fields and unknown
                               enum names, and resolves every `typed_config` Any through the
                               descriptor pool (so an unknown or misspelt @type fails); then a
                               subset of Envoy's protoc-gen-validate rules (required messages and
                               oneofs, non-empty strings and lists, number and duration bounds)
                               and no deprecated field or enum value. Plus: the ratelimit filter
                               comes before the router, its cluster exists, speaks HTTP/2 and
                               points at the Helm Service's gRPC port, and its `domain` and the
                               descriptors the route actions produce exist in
                               config/examples/envoy/kubernetes/sluice.yaml.
  config/istio/*.yaml          every EnvoyFilter: apiVersion, kind, the EnvoyFilter field names
                               (spec, configPatches, match, patch), applyTo/context/operation
                               values, HTTP_FILTER patches matched on the connection manager and
                               inserted before the router, every patch value parsed as the
                               Envoy message it patches (HttpFilter, Cluster, VirtualHost with
                               its RateLimit actions, Route, ...; a MERGE value as a partial one),
                               the rate limit service cluster is Istio's outbound cluster of the
                               Helm Service (or a CLUSTER patch pointing at it), and the domain
                               and descriptors exist in the sluice configs of values-istio.yaml.
  config/istio/values-istio.yaml
                               reproduces Istio's sample deployment (domain `ratelimit`, PATH
                               limits, Redis at redis:6379); every key exists in the chart's
                               helm/sluice/values.yaml when the chart is there; and when
                               helm-python-sdk is installed, the chart renders with it as
                               release `sluice` in `rate-limit` into Service `sluice` with port
                               `grpc` 8081 (the name every example points at), REDIS_URL
                               redis:6379 and a ConfigMap holding exactly these domains.
  self-test                    broken copies made in memory (an unknown field, a misspelt @type,
                               a descriptor key sluice does not know, an unknown field in an
                               Istio patch) must each be rejected, so the checks above cannot
                               pass vacuously.
  sluice check                 when a sluice binary is found (--sluice, or target/release or
                               target/debug), `sluice check` on config/examples/envoy/kubernetes/sluice.yaml and on
                               every config of values-istio.yaml.

Exits 1 with every failure listed, 0 with a short summary.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import pkgutil
import re
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import yaml
    from google.protobuf import descriptor_pool, json_format, message_factory
    from google.protobuf.descriptor import FieldDescriptor
    from envoy.config.bootstrap.v3 import bootstrap_pb2
    from envoy.config.cluster.v3 import cluster_pb2
    from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
    from envoy.config.route.v3 import route_components_pb2, route_pb2
    from envoy.extensions.filters.network.http_connection_manager.v3 import (
        http_connection_manager_pb2 as hcm_pb2,
    )
    from validate import validate_pb2
except ImportError as e:  # pragma: no cover - the message is the point
    sys.exit(
        f"missing Python package ({e.name}): pip install xds-protos==1.85.0 pyyaml==6.0.3\n"
        "(xds-protos is Envoy's generated Python protos; it brings protobuf and grpcio)"
    )

ROOT = Path(__file__).resolve().parent.parent
ENVOY_BOOTSTRAP = ROOT / "config/examples/envoy/kubernetes.yaml"
ENVOY_SLUICE = ROOT / "config/examples/envoy/kubernetes/sluice.yaml"
ISTIO_DIR = ROOT / "config/istio"
ISTIO_VALUES = ISTIO_DIR / "values-istio.yaml"
CHART_VALUES = ROOT / "helm/sluice/values.yaml"

# The Helm chart's naming: release `sluice` in namespace `rate-limit` gives Service `sluice`,
# gRPC port 8081 (named `grpc`, so Istio speaks HTTP/2 to it).
SERVICE_FQDN = "sluice.rate-limit.svc.cluster.local"
GRPC_PORT = 8081
ISTIO_CLUSTER = f"outbound|{GRPC_PORT}||{SERVICE_FQDN}"

RATELIMIT_FILTER = "envoy.filters.http.ratelimit"
RATELIMIT_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit"
ROUTER_FILTER = "envoy.filters.http.router"
HCM_FILTER = "envoy.filters.network.http_connection_manager"
TYPE_PREFIX = "type.googleapis.com/"

# Istio EnvoyFilter enums (networking.istio.io/v1alpha3).
ISTIO_APPLY_TO = {
    "LISTENER", "FILTER_CHAIN", "NETWORK_FILTER", "HTTP_FILTER", "ROUTE_CONFIGURATION",
    "VIRTUAL_HOST", "HTTP_ROUTE", "CLUSTER", "EXTENSION_CONFIG", "BOOTSTRAP", "LISTENER_FILTER",
}
ISTIO_CONTEXTS = {"ANY", "SIDECAR_INBOUND", "SIDECAR_OUTBOUND", "GATEWAY"}
ISTIO_OPERATIONS = {
    "MERGE", "ADD", "REMOVE", "INSERT_BEFORE", "INSERT_AFTER", "INSERT_FIRST", "REPLACE",
}
ISTIO_SPEC_KEYS = {"workloadSelector", "configPatches", "priority", "targetRefs"}
ISTIO_MATCH_KEYS = {"context", "proxy", "listener", "routeConfiguration", "cluster"}
# What each applyTo's patch value is, in Envoy's API.
ISTIO_VALUE_TYPES = {
    "LISTENER": listener_pb2.Listener,
    "FILTER_CHAIN": listener_components_pb2.FilterChain,
    "NETWORK_FILTER": listener_components_pb2.Filter,
    "HTTP_FILTER": hcm_pb2.HttpFilter,
    "ROUTE_CONFIGURATION": route_pb2.RouteConfiguration,
    "VIRTUAL_HOST": route_components_pb2.VirtualHost,
    "HTTP_ROUTE": route_components_pb2.Route,
    "CLUSTER": cluster_pb2.Cluster,
    "LISTENER_FILTER": listener_components_pb2.ListenerFilter,
    "BOOTSTRAP": bootstrap_pb2.Bootstrap,
}

# The Istio sample (istio/istio samples/ratelimit/rate-limit-service.yaml and the global rate
# limit task) that values-istio.yaml must reproduce.
ISTIO_SAMPLE_DOMAIN = "ratelimit"
ISTIO_SAMPLE_LIMITS = {
    ("PATH", "/productpage"): ("minute", 1),
    ("PATH", "api"): ("minute", 2),
    ("PATH", None): ("minute", 100),
}


class Failures:
    """Collects failures so one run reports all of them."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, where: str, what: str) -> None:
        self.items.append(f"{where}: {what}")

    def __bool__(self) -> bool:
        return bool(self.items)


def rel(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


# --------------------------------------------------------------------------------------------
# Protobuf: resolving @type URLs, parsing, validation rules


def type_urls(node) -> set[str]:
    """Every `@type` (and TypedStruct `type_url`) in a YAML tree."""
    found: set[str] = set()
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("@type", "type_url") and isinstance(v, str):
                found.add(v)
            found |= type_urls(v)
    elif isinstance(node, list):
        for v in node:
            found |= type_urls(v)
    return found


def ensure_type(full_name: str) -> bool:
    """Makes `full_name` known to the default descriptor pool by importing the generated
    modules of its proto package (xds-protos lays out `envoy.a.b.v3.Msg` as the Python package
    `envoy.a.b.v3`). False when no such message exists."""
    pool = descriptor_pool.Default()
    try:
        pool.FindMessageTypeByName(full_name)
        return True
    except KeyError:
        pass
    parts = full_name.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # nested types: try ever shorter prefixes
        package = ".".join(parts[:cut])
        try:
            pkg = importlib.import_module(package)
        except ImportError:
            continue
        for mod in pkgutil.iter_modules(getattr(pkg, "__path__", [])):
            if mod.name.endswith("_pb2"):
                importlib.import_module(f"{package}.{mod.name}")
        break
    try:
        pool.FindMessageTypeByName(full_name)
        return True
    except KeyError:
        return False


def load_types(doc) -> None:
    """Imports the modules of every @type in `doc`. Unknown ones are left for ParseDict to
    reject, with its path to the offending field."""
    for url in type_urls(doc):
        if url.startswith(TYPE_PREFIX):
            ensure_type(url[len(TYPE_PREFIX):])


def parse(doc, message_cls, where: str, failures: Failures, partial: bool = False):
    """ParseDict (unknown fields, unknown enum names and unknown @types are errors), then the
    validation rules. `partial`: the value is merged into an existing object (an Istio MERGE
    patch), so its own required fields may be absent."""
    load_types(doc)
    msg = message_cls()
    try:
        json_format.ParseDict(doc, msg, ignore_unknown_fields=False)
    except json_format.ParseError as e:
        failures.add(where, f"not a valid {message_cls.DESCRIPTOR.full_name}: {e}")
        return None
    validate(msg, message_cls.DESCRIPTOR.full_name, where, failures, partial)
    return msg


def _unpack_any(any_msg):
    name = any_msg.type_url.split("/")[-1]
    desc = descriptor_pool.Default().FindMessageTypeByName(name)
    inner = message_factory.GetMessageClass(desc)()
    any_msg.Unpack(inner)
    return inner


def _duration_ns(d) -> int:
    return d.seconds * 1_000_000_000 + d.nanos


def _check_bounds(value, rules, label: str, problems: list[str]) -> None:
    for op, ok in (
        ("const", lambda v, b: v == b),
        ("lt", lambda v, b: v < b),
        ("lte", lambda v, b: v <= b),
        ("gt", lambda v, b: v > b),
        ("gte", lambda v, b: v >= b),
    ):
        if rules.HasField(op):
            bound = getattr(rules, op)
            if hasattr(bound, "seconds"):  # a Duration bound
                bound = _duration_ns(bound)
            if not ok(value, bound):
                problems.append(f"{label} must be {op} {bound}")


def validate(msg, path: str, where: str, failures: Failures, partial: bool) -> None:
    """A subset of protoc-gen-validate, which Envoy enforces on load: required message fields
    and oneofs, string lengths, list sizes, number and duration bounds; plus no deprecated
    field or enum value (Envoy warns, or refuses with disallowed_by_default)."""
    desc = msg.DESCRIPTOR
    problems: list[str] = []
    if not partial:
        for oneof in desc.oneofs:
            opts = oneof.GetOptions()
            if opts.HasExtension(validate_pb2.required) and opts.Extensions[validate_pb2.required]:
                if msg.WhichOneof(oneof.name) is None:
                    problems.append(
                        f"one of {', '.join(f.name for f in oneof.fields)} is required"
                    )
    for field in desc.fields:
        is_repeated = field.is_repeated
        is_message = field.type == FieldDescriptor.TYPE_MESSAGE
        if is_repeated:
            present = len(getattr(msg, field.name)) > 0
        elif is_message or field.containing_oneof is not None or field.has_presence:
            present = msg.HasField(field.name)
        else:
            present = getattr(msg, field.name) != field.default_value
        label = f"{path}.{field.name}"
        opts = field.GetOptions()
        if present and opts.deprecated:
            problems.append(f"{field.name} is deprecated")
        if field.enum_type is not None and present:
            values = getattr(msg, field.name) if is_repeated else [getattr(msg, field.name)]
            for v in values:
                ev = field.enum_type.values_by_number.get(v)
                if ev is not None and ev.GetOptions().deprecated:
                    problems.append(f"{field.name}: enum value {ev.name} is deprecated")
        if opts.HasExtension(validate_pb2.rules):
            rules = opts.Extensions[validate_pb2.rules]
            # A oneof member's rules apply only when it is the member set.
            in_unset_oneof = field.containing_oneof is not None and not present
            if not partial and not in_unset_oneof:
                if rules.HasField("message") and rules.message.required and not present:
                    problems.append(f"{field.name} is required")
                if rules.HasField("repeated") and rules.repeated.min_items:
                    n = len(getattr(msg, field.name))
                    if n < rules.repeated.min_items:
                        problems.append(
                            f"{field.name} needs at least {rules.repeated.min_items} item(s)"
                        )
                kind = rules.WhichOneof("type")
                if kind == "string" and not is_repeated:
                    s = getattr(msg, field.name)
                    r = rules.string
                    if r.HasField("min_len") and len(s) < r.min_len:
                        problems.append(f"{field.name} needs at least {r.min_len} character(s)")
                    if r.HasField("min_bytes") and len(s.encode()) < r.min_bytes:
                        problems.append(f"{field.name} needs at least {r.min_bytes} byte(s)")
            kind = rules.WhichOneof("type")
            if present and not is_repeated:
                value = getattr(msg, field.name)
                if kind == "duration":
                    _check_bounds(_duration_ns(value), rules.duration, field.name, problems)
                elif kind in ("uint32", "uint64", "int32", "int64", "double", "float"):
                    if is_message:  # a wrapper such as UInt32Value
                        value = value.value
                    _check_bounds(value, getattr(rules, kind), field.name, problems)
        # Recurse into what is set. Singular submessages of a merged value are merged too
        # (partial); list items are appended whole.
        if is_message and present:
            if field.message_type.GetOptions().map_entry:
                items = [
                    (f"{label}[{k!r}]", v)
                    for k, v in getattr(msg, field.name).items()
                    if hasattr(v, "DESCRIPTOR")
                ]
                sub_partial = False
            elif is_repeated:
                items = [(f"{label}[{i}]", v) for i, v in enumerate(getattr(msg, field.name))]
                sub_partial = False
            else:
                items = [(label, getattr(msg, field.name))]
                sub_partial = partial
            for sub_label, sub in items:
                if sub.DESCRIPTOR.full_name == "google.protobuf.Any":
                    inner = _unpack_any(sub)
                    validate(inner, f"{sub_label}<{inner.DESCRIPTOR.full_name}>", where,
                             failures, sub_partial)
                else:
                    validate(sub, sub_label, where, failures, sub_partial)
    for p in problems:
        failures.add(where, f"{path}: {p}")


# --------------------------------------------------------------------------------------------
# Route actions -> descriptors, and matching them against a sluice config


def descriptor_variants(rate_limit: dict, where: str, failures: Failures):
    """The descriptors one route `rate_limits` entry can produce: lists of (key, value or None
    for a per-request value). An action with skip_if_absent gives variants with and without its
    entry."""
    variants: list[list[tuple[str, str | None]]] = [[]]
    for action in rate_limit.get("actions", []):
        if len(action) != 1:
            failures.add(where, f"an action must have exactly one kind: {action}")
            continue
        (kind, spec), = action.items()
        spec = spec or {}
        optional = False
        if kind == "generic_key":
            entry = (spec.get("descriptor_key") or "generic_key", spec["descriptor_value"])
        elif kind == "request_headers":
            entry = (spec["descriptor_key"], None)
            optional = bool(spec.get("skip_if_absent"))
        elif kind == "query_parameters":
            entry = (spec["descriptor_key"], None)
            optional = bool(spec.get("skip_if_absent"))
        elif kind == "header_value_match":
            entry = (spec.get("descriptor_key") or "header_match", spec["descriptor_value"])
        elif kind in ("remote_address", "source_cluster", "destination_cluster"):
            entry = (kind, None)
        elif kind == "masked_remote_address":
            entry = ("masked_remote_address", None)
        else:
            failures.add(where, f"action {kind!r} is not understood by this checker")
            continue
        grown = [v + [entry] for v in variants]
        variants = grown + (variants if optional else [])
    return [v for v in variants if v]


def wildcard_matches(pattern: str, value: str) -> bool:
    """sluice's wildcard: `*` is any run of characters, anywhere."""
    regex = ".*".join(re.escape(part) for part in pattern.split("*"))
    return re.fullmatch(regex, value, flags=re.S) is not None


def has_limit(node: dict) -> bool:
    return "rate_limit" in node or "rate_limits" in node


def match_descriptor(config: dict, descriptor, where: str, failures: Failures) -> None:
    """Every entry of `descriptor` must reach a config node level by level (a fixed value must
    match a node's exact or wildcard value, or a bare key), and some node reached by the last
    entry must carry a limit; otherwise the descriptor would never limit anything."""
    level = [config]
    shown = ", ".join(f"({k}, {v if v is not None else '<per request>'})" for k, v in descriptor)
    for depth, (key, value) in enumerate(descriptor):
        candidates = []
        for parent in level:
            for node in parent.get("descriptors") or []:
                if node.get("key") != key:
                    continue
                node_value = node.get("value")
                if value is None or node_value is None:
                    candidates.append(node)
                elif "*" in str(node_value):
                    if wildcard_matches(str(node_value), value):
                        candidates.append(node)
                elif str(node_value) == value:
                    candidates.append(node)
        if not candidates:
            failures.add(
                where,
                f"descriptor [{shown}]: no node for entry {depth} ({key}"
                f"{', ' + value if value is not None else ''}) in domain "
                f"{config.get('domain')!r}",
            )
            return
        level = candidates
    if not any(has_limit(n) for n in level):
        failures.add(where, f"descriptor [{shown}] reaches no node with a limit")


def route_rate_limits(node, path="") -> list[tuple[str, dict]]:
    """Every `rate_limits` entry found under `node` (routes, virtual hosts), with its path."""
    found = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "rate_limits" and isinstance(v, list):
                found += [(f"{path}.rate_limits[{i}]", rl) for i, rl in enumerate(v)]
            else:
                found += route_rate_limits(v, f"{path}.{k}" if path else k)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += route_rate_limits(v, f"{path}[{i}]")
    return found


# --------------------------------------------------------------------------------------------
# config/examples/envoy/kubernetes.yaml


def load_yaml(path: Path, failures: Failures):
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        failures.add(rel(path), f"cannot read: {e}")
        return None


def http_filters_of(bootstrap: dict):
    for li, listener in enumerate(bootstrap.get("static_resources", {}).get("listeners", [])):
        for ci, chain in enumerate(listener.get("filter_chains", [])):
            for fi, f in enumerate(chain.get("filters", [])):
                if f.get("name") == HCM_FILTER:
                    yield f"listeners[{li}].filter_chains[{ci}].filters[{fi}]", f["typed_config"]


def check_bootstrap(doc: dict, sluice_cfg: dict | None, where: str, failures: Failures) -> dict:
    """Parses and cross-checks an Envoy bootstrap; returns a few facts for the summary."""
    facts = {"descriptors": 0, "domain": None}
    if parse(doc, bootstrap_pb2.Bootstrap, where, failures) is None:
        return facts
    clusters = {c.get("name"): c for c in doc.get("static_resources", {}).get("clusters", [])}
    found_filter = False
    for hcm_path, hcm in http_filters_of(doc):
        names = [f.get("name") for f in hcm.get("http_filters", [])]
        if RATELIMIT_FILTER not in names:
            continue
        found_filter = True
        if not names or names[-1] != ROUTER_FILTER:
            failures.add(where, f"{hcm_path}: the router must be the last HTTP filter")
        if ROUTER_FILTER in names and names.index(RATELIMIT_FILTER) > names.index(ROUTER_FILTER):
            failures.add(where, f"{hcm_path}: the ratelimit filter must come before the router")
        rl = next(f for f in hcm["http_filters"] if f.get("name") == RATELIMIT_FILTER)
        cfg = rl.get("typed_config", {})
        if cfg.get("@type") != RATELIMIT_TYPE:
            failures.add(where, f"{hcm_path}: ratelimit filter @type is {cfg.get('@type')!r}")
        service = cfg.get("rate_limit_service", {})
        if service.get("transport_api_version") != "V3":
            failures.add(where, "rate_limit_service.transport_api_version must be V3")
        cluster_name = service.get("grpc_service", {}).get("envoy_grpc", {}).get("cluster_name")
        cluster = clusters.get(cluster_name)
        if cluster is None:
            failures.add(where, f"rate_limit_service cluster {cluster_name!r} is not defined")
        else:
            check_sluice_cluster(cluster, where, failures)
        facts["domain"] = cfg.get("domain")
        if sluice_cfg is not None and cfg.get("domain") != sluice_cfg.get("domain"):
            failures.add(
                where,
                f"ratelimit filter domain {cfg.get('domain')!r} != {rel(ENVOY_SLUICE)} domain "
                f"{sluice_cfg.get('domain')!r}",
            )
        for rl_path, rate_limit in route_rate_limits(hcm.get("route_config", {})):
            for descriptor in descriptor_variants(rate_limit, f"{where}: {rl_path}", failures):
                facts["descriptors"] += 1
                if sluice_cfg is not None:
                    match_descriptor(sluice_cfg, descriptor, f"{where}: {rl_path}", failures)
    if not found_filter:
        failures.add(where, f"no {RATELIMIT_FILTER} filter in any http_connection_manager")
    return facts


def check_sluice_cluster(cluster: dict, where: str, failures: Failures) -> None:
    name = cluster.get("name")
    h2 = (
        cluster.get("typed_extension_protocol_options", {})
        .get("envoy.extensions.upstreams.http.v3.HttpProtocolOptions", {})
        .get("explicit_http_config", {})
    )
    if "http2_protocol_options" not in h2:
        failures.add(where, f"cluster {name!r}: gRPC needs HTTP/2 (HttpProtocolOptions "
                            "explicit_http_config.http2_protocol_options)")
    addresses = [
        ep.get("endpoint", {}).get("address", {}).get("socket_address", {})
        for group in cluster.get("load_assignment", {}).get("endpoints", [])
        for ep in group.get("lb_endpoints", [])
    ]
    if not addresses:
        failures.add(where, f"cluster {name!r} has no endpoint")
    for a in addresses:
        if (a.get("address"), a.get("port_value")) != (SERVICE_FQDN, GRPC_PORT):
            failures.add(
                where,
                f"cluster {name!r} endpoint {a.get('address')}:{a.get('port_value')} is not the "
                f"Helm Service {SERVICE_FQDN}:{GRPC_PORT}",
            )


# --------------------------------------------------------------------------------------------
# config/istio


def chart_config_files(values: dict, where: str, failures: Failures) -> dict[str, dict]:
    """values.config: file name -> domain config (a mapping, or a YAML string)."""
    out = {}
    for name, cfg in (values.get("config") or {}).items():
        if cfg is None:  # `name: null` removes a chart default
            continue
        if isinstance(cfg, str):
            try:
                cfg = yaml.safe_load(cfg)
            except yaml.YAMLError as e:
                failures.add(where, f"config[{name!r}] is not YAML: {e}")
                continue
        if not isinstance(cfg, dict) or "domain" not in cfg:
            failures.add(where, f"config[{name!r}] has no domain")
            continue
        out[name] = cfg
    return out


def check_values_istio(values: dict, configs: dict[str, dict], failures: Failures) -> None:
    where = rel(ISTIO_VALUES)
    store = values.get("store") or {}
    if store.get("type") != "redis":
        failures.add(where, f"store.type is {store.get('type')!r}, the Istio sample uses Redis")
    if (store.get("redis") or {}).get("url") != "redis:6379":
        failures.add(where, "store.redis.url must be redis:6379 (the Istio sample's REDIS_URL)")
    sample = [c for c in configs.values() if c.get("domain") == ISTIO_SAMPLE_DOMAIN]
    if len(sample) != 1:
        failures.add(where, f"expected one config with domain {ISTIO_SAMPLE_DOMAIN!r}")
        return
    got = {}
    for node in sample[0].get("descriptors") or []:
        rl = node.get("rate_limit") or {}
        got[(node.get("key"), node.get("value"))] = (
            str(rl.get("unit", "")).lower(), rl.get("requests_per_unit"))
    if got != ISTIO_SAMPLE_LIMITS:
        failures.add(where, f"domain {ISTIO_SAMPLE_DOMAIN!r} differs from the Istio sample: "
                            f"{got} != {ISTIO_SAMPLE_LIMITS}")


def check_chart_keys(values, chart, path: str, failures: Failures) -> None:
    """Every key of values-istio.yaml must exist in the chart's values.yaml (free-form maps
    such as `config` excepted), so a misspelt key cannot be silently ignored by Helm."""
    if not isinstance(values, dict) or not isinstance(chart, dict):
        return
    for k, v in values.items():
        here = f"{path}.{k}" if path else k
        if k not in chart:
            failures.add(rel(ISTIO_VALUES), f"{here} is not a key of {rel(CHART_VALUES)}")
        elif here != "config" and chart[k]:  # an empty map in the chart is free-form
            check_chart_keys(v, chart[k], here, failures)


def check_envoyfilter(doc: dict, where: str, failures: Failures, groups: dict) -> None:
    if doc.get("apiVersion") != "networking.istio.io/v1alpha3":
        failures.add(where, f"apiVersion {doc.get('apiVersion')!r}, expected "
                            "networking.istio.io/v1alpha3")
    if doc.get("kind") != "EnvoyFilter":
        failures.add(where, f"kind {doc.get('kind')!r}, expected EnvoyFilter")
        return
    meta = doc.get("metadata") or {}
    spec = doc.get("spec") or {}
    for key in set(spec) - ISTIO_SPEC_KEYS:
        failures.add(where, f"spec.{key} is not an EnvoyFilter field")
    selector = tuple(sorted(((spec.get("workloadSelector") or {}).get("labels") or {}).items()))
    group = groups.setdefault((meta.get("namespace"), selector),
                              {"domains": [], "rate_limits": [], "clusters": {}, "where": where})
    for i, patch in enumerate(spec.get("configPatches") or []):
        pw = f"{where}: configPatches[{i}]"
        for key in set(patch) - {"applyTo", "match", "patch"}:
            failures.add(pw, f"{key} is not a configPatches field")
        for key in set(patch.get("match") or {}) - ISTIO_MATCH_KEYS:
            failures.add(pw, f"match.{key} is not an EnvoyFilter match field")
        for key in set(patch.get("patch") or {}) - {"operation", "value", "filterClass"}:
            failures.add(pw, f"patch.{key} is not an EnvoyFilter patch field")
        apply_to = patch.get("applyTo")
        if apply_to not in ISTIO_APPLY_TO:
            failures.add(pw, f"unknown applyTo {apply_to!r}")
            continue
        context = (patch.get("match") or {}).get("context", "ANY")
        if context not in ISTIO_CONTEXTS:
            failures.add(pw, f"unknown match.context {context!r}")
        body = patch.get("patch") or {}
        op = body.get("operation")
        if op not in ISTIO_OPERATIONS:
            failures.add(pw, f"unknown patch.operation {op!r}")
        value = body.get("value")
        if value is None:
            continue
        cls = ISTIO_VALUE_TYPES.get(apply_to)
        if cls is None:
            failures.add(pw, f"applyTo {apply_to} is not checked by this script")
            continue
        if parse(value, cls, pw, failures, partial=(op == "MERGE")) is None:
            continue
        if apply_to == "HTTP_FILTER":
            chain = ((patch.get("match") or {}).get("listener") or {}).get("filterChain") or {}
            filt = chain.get("filter") or {}
            if filt.get("name") != HCM_FILTER:
                failures.add(pw, f"match.listener.filterChain.filter.name should be {HCM_FILTER}"
                                 f" (got {filt.get('name')!r})")
            if op == "INSERT_BEFORE" and (filt.get("subFilter") or {}).get("name") != ROUTER_FILTER:
                failures.add(pw, f"INSERT_BEFORE needs subFilter.name {ROUTER_FILTER}")
        if apply_to == "HTTP_FILTER" and value.get("name") == RATELIMIT_FILTER:
            cfg = value.get("typed_config") or {}
            if cfg.get("@type") != RATELIMIT_TYPE:
                failures.add(pw, f"ratelimit filter @type is {cfg.get('@type')!r}")
            if op not in ("INSERT_BEFORE", "INSERT_FIRST"):
                failures.add(pw, "insert the ratelimit filter before the router (INSERT_BEFORE)")
            service = cfg.get("rate_limit_service") or {}
            envoy_grpc = (service.get("grpc_service") or {}).get("envoy_grpc") or {}
            if service.get("transport_api_version") != "V3":
                failures.add(pw, "rate_limit_service.transport_api_version must be V3")
            authority = envoy_grpc.get("authority")
            if authority is not None and authority != SERVICE_FQDN:
                failures.add(pw, f"envoy_grpc.authority {authority!r} != {SERVICE_FQDN}")
            group["domains"].append((pw, cfg.get("domain"), envoy_grpc.get("cluster_name")))
        if apply_to == "CLUSTER":
            group["clusters"][value.get("name")] = value
            check_sluice_cluster(value, pw, failures)
        group["rate_limits"] += [(f"{pw}: {p}", rl) for p, rl in route_rate_limits(value)]


def check_istio(configs_by_domain: dict[str, dict], failures: Failures) -> dict:
    facts = {"files": 0, "envoyfilters": 0, "patches": 0, "descriptors": 0}
    groups: dict = {}
    for path in sorted(ISTIO_DIR.glob("*.yaml")):
        if path == ISTIO_VALUES:
            continue
        facts["files"] += 1
        try:
            docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        except yaml.YAMLError as e:
            failures.add(rel(path), f"not YAML: {e}")
            continue
        for n, doc in enumerate(docs):
            facts["envoyfilters"] += 1
            facts["patches"] += len((doc.get("spec") or {}).get("configPatches") or [])
            check_envoyfilter(doc, f"{rel(path)}[doc {n}]", failures, groups)
    if facts["envoyfilters"] == 0:
        failures.add(rel(ISTIO_DIR), "no EnvoyFilter found")
    for (namespace, selector), g in groups.items():
        label = f"EnvoyFilters in {namespace} for {dict(selector) or 'every workload'}"
        if g["rate_limits"] and not g["domains"]:
            failures.add(label, "route rate_limits without a ratelimit HTTP filter")
        for pw, domain, cluster_name in g["domains"]:
            if cluster_name != ISTIO_CLUSTER and cluster_name not in g["clusters"]:
                failures.add(pw, f"rate limit cluster {cluster_name!r} is neither Istio's "
                                 f"{ISTIO_CLUSTER!r} nor added by a CLUSTER patch")
            cfg = configs_by_domain.get(domain)
            if cfg is None:
                failures.add(pw, f"domain {domain!r} is in no config of {rel(ISTIO_VALUES)}")
                continue
            for rl_where, rate_limit in g["rate_limits"]:
                for descriptor in descriptor_variants(rate_limit, rl_where, failures):
                    facts["descriptors"] += 1
                    match_descriptor(cfg, descriptor, rl_where, failures)
    return facts


def check_chart_render(values: dict, configs: dict[str, dict], failures: Failures) -> str:
    """When helm-python-sdk (Helm's Go engine as a Python wheel, see scripts/check_helm.py) is
    installed: renders the chart with values-istio.yaml as release `sluice` in `rate-limit` and
    checks that the Service the EnvoyFilters and envoy.yaml point at is what it produces."""
    try:
        import helm_python as helm
    except ImportError:
        return "chart not rendered (pip install helm-python-sdk to render it)"
    where = f"helm template {rel(ROOT / 'helm/sluice')} -f {rel(ISTIO_VALUES)}"
    release, namespace = SERVICE_FQDN.split(".")[:2]
    try:
        with helm.Chart.load(str(ROOT / "helm/sluice")) as chart:
            out = chart.render(values, name=release, namespace=namespace, is_install=True)
    except Exception as e:  # noqa: BLE001 - any engine or schema error is a failure here
        failures.add(where, f"does not render: {e}")
        return "chart did not render"
    docs = [d for path, text in out.items() if not path.endswith("NOTES.txt")
            for d in yaml.safe_load_all(text) if d]
    services = [d for d in docs if d.get("kind") == "Service"
                and d["metadata"]["name"] == release]
    if len(services) != 1:
        failures.add(where, f"no Service named {release!r}")
    else:
        ports = {p.get("name"): p.get("port") for p in services[0]["spec"].get("ports", [])}
        if ports.get("grpc") != GRPC_PORT:
            failures.add(where, f"Service port `grpc` is {ports.get('grpc')}, not {GRPC_PORT}")
    deployments = [d for d in docs if d.get("kind") == "Deployment"]
    env = {}
    if deployments:
        container = deployments[0]["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
    if env.get("REDIS_URL") != "redis:6379":
        failures.add(where, f"REDIS_URL renders as {env.get('REDIS_URL')!r}")
    maps = [d for d in docs if d.get("kind") == "ConfigMap"]
    domains = sorted(
        (yaml.safe_load(v) or {}).get("domain") for m in maps for v in (m.get("data") or {}).values())
    if domains != sorted(c["domain"] for c in configs.values()):
        failures.add(where, f"the ConfigMap holds domains {domains}")
    return f"chart renders Service {release}.{namespace} port grpc {GRPC_PORT}, domains {domains}"


# --------------------------------------------------------------------------------------------
# Self-test: the checks must reject broken copies


def self_test(bootstrap: dict, sluice_cfg: dict, failures: Failures) -> int:
    cases = []

    def hcm_of(doc):
        return doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
            "typed_config"]

    def ratelimit_of(doc):
        return next(f for f in hcm_of(doc)["http_filters"] if f["name"] == RATELIMIT_FILTER)

    def rate_limits_of(doc):
        return next(r["route"]["rate_limits"]
                    for r in hcm_of(doc)["route_config"]["virtual_hosts"][0]["routes"]
                    if "rate_limits" in r.get("route", {}))

    broken = copy.deepcopy(bootstrap)
    broken["static_resources"]["clusters"][0]["bogus_field"] = 1
    cases.append(("an unknown field in a cluster", broken, "bogus_field"))

    broken = copy.deepcopy(bootstrap)
    ratelimit_of(broken)["typed_config"]["bogus_field"] = True
    cases.append(("an unknown field inside a typed_config Any", broken, "bogus_field"))

    broken = copy.deepcopy(bootstrap)
    ratelimit_of(broken)["typed_config"]["@type"] = RATELIMIT_TYPE.replace("RateLimit", "RateLimitt")
    cases.append(("a misspelt @type", broken, "RateLimitt"))

    broken = copy.deepcopy(bootstrap)
    ratelimit_of(broken)["typed_config"]["@type"] = RATELIMIT_TYPE.replace(".ratelimit.", ".ratelimitt.")
    cases.append(("an @type in a package that does not exist", broken, "ratelimitt"))

    broken = copy.deepcopy(bootstrap)
    ratelimit_of(broken)["typed_config"]["rate_limit_service"]["transport_api_version"] = "V4"
    cases.append(("an unknown enum name", broken, "V4"))

    broken = copy.deepcopy(bootstrap)
    del ratelimit_of(broken)["typed_config"]["domain"]
    cases.append(("a missing required field (domain)", broken, "domain"))

    broken = copy.deepcopy(bootstrap)
    broken["static_resources"]["clusters"][0]["http2_protocol_options"] = {}
    cases.append(("a deprecated field (Cluster.http2_protocol_options)", broken,
                  "http2_protocol_options is deprecated"))

    broken = copy.deepcopy(bootstrap)
    rate_limits_of(broken)[0]["actions"][0]["generic_key"]["descriptor_key"] = "resourse"
    cases.append(("a descriptor key sluice.yaml does not have", broken, "resourse"))

    broken = copy.deepcopy(bootstrap)
    ratelimit_of(broken)["typed_config"]["domain"] = "other"
    cases.append(("a domain other than sluice.yaml's", broken, "domain"))

    passed = 0
    for what, doc, needle in cases:
        local = Failures()
        check_bootstrap(doc, sluice_cfg, "self-test", local)
        if local and any(needle in item for item in local.items):
            passed += 1
        else:
            failures.add("self-test", f"{what} was NOT rejected (got: {local.items})")

    # Istio: an unknown field in a patch value, and a cluster patch with a bogus field.
    patch_cases = [
        ("HTTP_FILTER", "INSERT_BEFORE",
         {"name": RATELIMIT_FILTER,
          "typed_config": {"@type": RATELIMIT_TYPE, "domain": "d", "failure_mode_denyy": True}},
         "failure_mode_denyy"),
        ("CLUSTER", "ADD",
         {"name": "c", "type": "STRICT_DNS", "http2_protocol_optionz": {}}, "http2_protocol_optionz"),
        ("VIRTUAL_HOST", "MERGE",
         {"rate_limits": [{"actions": [{"request_header": {"header_name": ":path",
                                                           "descriptor_key": "PATH"}}]}]},
         "request_header"),
    ]
    for apply_to, op, value, needle in patch_cases:
        doc = {"apiVersion": "networking.istio.io/v1alpha3", "kind": "EnvoyFilter",
               "metadata": {"name": "t", "namespace": "t"},
               "spec": {"configPatches": [{"applyTo": apply_to, "patch": {"operation": op,
                                                                          "value": value}}]}}
        local = Failures()
        check_envoyfilter(doc, "self-test", local, {})
        if local and any(needle in item for item in local.items):
            passed += 1
        else:
            failures.add("self-test", f"Istio {apply_to} with {needle!r} was NOT rejected "
                                      f"(got: {local.items})")
    return passed


# --------------------------------------------------------------------------------------------
# sluice check


def find_sluice(explicit: str | None) -> Path | None:
    if explicit:
        return Path(explicit)
    built = [p for p in (ROOT / "target/release/sluice", ROOT / "target/debug/sluice")
             if p.is_file()]
    return max(built, key=lambda p: p.stat().st_mtime) if built else None


def run_sluice_check(binary: Path, configs: dict[str, dict], failures: Failures) -> list[str]:
    checked = []
    targets = [(rel(ENVOY_SLUICE), ENVOY_SLUICE)]
    with tempfile.TemporaryDirectory() as tmp:
        istio_dir = Path(tmp) / "istio"
        istio_dir.mkdir()
        for name, cfg in configs.items():
            (istio_dir / name).write_text(yaml.safe_dump(cfg, sort_keys=False))
        if configs:
            targets.append((f"{rel(ISTIO_VALUES)} config", istio_dir))
        for label, target in targets:
            try:
                out = subprocess.run([str(binary), "check", str(target)], capture_output=True,
                                     text=True, timeout=60)
            except OSError as e:
                failures.add("sluice check", f"cannot run {binary}: {e}")
                return checked
            if out.returncode != 0:
                failures.add(f"sluice check {label}", (out.stdout + out.stderr).strip())
            else:
                checked.append(label)
    return checked


# --------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sluice", help="sluice binary for `sluice check` (default: target/"
                                     "release/sluice or target/debug/sluice when present)")
    ap.add_argument("--no-sluice", action="store_true", help="skip `sluice check`")
    args = ap.parse_args()

    failures = Failures()
    bootstrap = load_yaml(ENVOY_BOOTSTRAP, failures)
    sluice_cfg = load_yaml(ENVOY_SLUICE, failures)
    values = load_yaml(ISTIO_VALUES, failures)
    if failures:
        print("\n".join(f"FAIL {f}" for f in failures.items))
        return 1

    envoy_facts = check_bootstrap(bootstrap, sluice_cfg, rel(ENVOY_BOOTSTRAP), failures)

    configs = chart_config_files(values, rel(ISTIO_VALUES), failures)
    by_domain: dict[str, dict] = {}
    for name, cfg in configs.items():
        if cfg["domain"] in by_domain:
            failures.add(rel(ISTIO_VALUES), f"domain {cfg['domain']!r} in two config files")
        by_domain[cfg["domain"]] = cfg
    check_values_istio(values, configs, failures)
    chart_note = "chart values.yaml not found, keys not cross-checked"
    if CHART_VALUES.is_file():
        chart = load_yaml(CHART_VALUES, failures)
        check_chart_keys(values, chart, "", failures)
        chart_note = f"keys exist in {rel(CHART_VALUES)}"
    istio_facts = check_istio(by_domain, failures)
    render_note = check_chart_render(values, configs, failures)

    rejected = self_test(bootstrap, sluice_cfg, failures)

    sluice_note = "skipped (--no-sluice)"
    if not args.no_sluice:
        binary = find_sluice(args.sluice)
        if binary is None:
            sluice_note = "skipped (no sluice binary: cargo build, or pass --sluice PATH)"
        else:
            checked = run_sluice_check(binary, configs, failures)
            sluice_note = f"{rel(binary)} check OK: {', '.join(checked) or 'nothing'}"

    if failures:
        for f in failures.items:
            print(f"FAIL {f}")
        print(f"{len(failures.items)} failure(s)")
        return 1
    print(f"OK {rel(ENVOY_BOOTSTRAP)}: valid envoy.config.bootstrap.v3.Bootstrap; domain "
          f"{envoy_facts['domain']!r}; {envoy_facts['descriptors']} descriptor shape(s) all "
          f"found in {rel(ENVOY_SLUICE)}")
    print(f"OK {rel(ISTIO_DIR)}: {istio_facts['envoyfilters']} EnvoyFilter(s) in "
          f"{istio_facts['files']} file(s), {istio_facts['patches']} patch(es) valid; "
          f"{istio_facts['descriptors']} descriptor shape(s) found in {rel(ISTIO_VALUES)}; "
          f"rate limit cluster {ISTIO_CLUSTER}")
    print(f"OK {rel(ISTIO_VALUES)}: reproduces the Istio sample; {len(configs)} config file(s); "
          f"{chart_note}; {render_note}")
    print(f"OK self-test: {rejected} deliberately broken copies rejected")
    print(f"OK sluice check: {sluice_note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
