"""Kubernetes manifests for a phasewise deployment: what ``phasewise plan`` emits.

``manifests(spec)`` is a pure function from a ``DeploySpec`` to Kubernetes objects as plain
dicts; ``to_yaml`` renders them, ``write`` saves them. Nothing here talks to a cluster or
imports torch.

Topology (every name starts with ``spec.name``, written NAME below)::

    colocated   router NAME-router -> headless Service NAME-both -> Deployment NAME-both
                (--discover: one worker per ready pod)   (--role both, spec.replicas pods, HPA)

    pd          router NAME-router -> Service NAME-decode-i -> Deployment NAME-decode-i
                                      (i = 0..decode-1)        (--role decode, 1 pod each)
                                   -> Service NAME-prefill  -> Deployment NAME-prefill
                                                               (--role prefill, HPA)
                each prefill pod: --kv-connect tcp://NAME-decode-0:KV tcp://NAME-decode-1:KV ...

Why this shape:

* A decode worker is not interchangeable: it holds its streams' K/V, every prefill worker
  connects to every decode worker's K/V port, and the router lists each decode worker to send
  each request to the least loaded one. So each decode worker gets a Deployment of one pod
  and a Service of its own: a stable DNS name and ClusterIP that outlive pod restarts (the
  prefill side reconnects to the same address), and one worker rolls without the others.
* Prefill pods are interchangeable clients of the decode workers (each connects to all of
  them under its own name, ``prefill@POD``), so adding one changes no other object: the HPA
  goes on the prefill Deployment. Adding a decode worker changes the prefill workers' and the
  router's arguments, so decode workers are scaled by planning again.
* colocated: ``--role both`` pods are interchangeable, but their caches are not: the router
  must see each pod to route by prefix and to move a stream when its pod goes. Their
  Service is headless, so its name resolves to every ready pod's address, and the router
  (``--discover``) looks it up every few seconds: a new pod joins once ready, a pod that
  leaves (draining, or gone) takes no new request.

Rolling updates and disruptions: a ``both`` pod is replaced by surging one (maxSurge 1,
maxUnavailable 0); SIGTERM (after the preStop sleep) turns its ``/health`` to 503, so its
readiness drops it from the Service, and it hands its router streams over to the other pods
(``phasewise router``'s migration) instead of cutting them or waiting them out. A
PodDisruptionBudget per engine role lets a node drain evict one pod of it at a time.

Probes, from what the server does (``phasewise.server.serve`` and ``app``):

* the HTTP port opens only once the model is loaded (and, for a prefill worker, once its
  first K/V handshake succeeded; for the router, once every worker answered): while loading,
  every probe sees a refused connection, so a ``startupProbe`` of ``startup_timeout_s``
  covers loading;
* ``GET /health`` is 200 while the engine thread runs, 503 once draining (SIGTERM) or when
  the engine is down; on a prefill worker also 503 while no decode worker answers, on the
  router while no decode worker is up. It is every pod's readinessProbe.
* livenessProbe: ``/health`` for ``both`` and ``decode`` (a 503 there means the engine
  thread died, or has been in one step past ``--step-timeout``: a restart helps);
  ``/health/engine`` for prefill, whose ``/health`` also reflects its decode workers
  (restarting it would not bring one back, and would cost a model load): its own engine
  only; ``/version`` (200 while the process serves HTTP) for the router, which has none.

Prerequisites that are the operator's (``write`` puts them at the top of the file): an image
with phasewise installed (phasewise publishes none), a PersistentVolumeClaim holding the
checkpoint, the K/V Secret (pd), the key Secret (``api_key_secret``: the clients' API key
as every pod's ``$PHASEWISE_API_KEY``, the fleet's internal key mounted for
``--internal-key-file``), and for the HPA Prometheus plus prometheus-adapter (the rules are
emitted as a ConfigMap to merge into the adapter's configuration).
"""

from __future__ import annotations

import hashlib
import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from phasewise.config import (API_KEY_ENV, DEVICES, DTYPE_CHOICES, KERNEL_CHOICES, LOAD_FORMATS,
                              LOG_LEVELS, POLICIES)

MODES = ("colocated", "pd")
ROLES = ("both", "prefill", "decode", "router")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")

ENGINE_ARGS_VAR = "PHASEWISE_ENGINE_ARGS"  # the ConfigMap key and the containers' env var
KV_SECRET_KEY = "secret"  # the key in the operator's Secret
KV_SECRET_DIR = "/etc/phasewise/kv"
# DeploySpec.api_key_secret: the operator's Secret with the clients' API key (as the
# containers' $PHASEWISE_API_KEY: never in a ConfigMap, never on a command line) and the
# fleet's internal key (mounted, for --internal-key-file: the router's calls to the workers)
API_KEY_KEY, INTERNAL_KEY_KEY = "api-key", "internal-key"
FLEET_KEY_DIR = "/etc/phasewise/fleet"
ALL_INTERFACES = "0.0.0.0"  # --host, and the --kv-bind host (zmq binds IPv4 on both forms)
UVICORN_BACKSTOP_S = 10  # phasewise.server.serve gives uvicorn this long after the grace

SWITCH = "switch"  # a flag that takes no value (give "" in engine_args)
# Flags of `phasewise serve` an operator may set through engine_args, each with what its
# value must be: SWITCH, int, float, str, or a tuple of the allowed values. tests/test_k8s.py
# holds this table to phasewise.cli's parser.
ENGINE_FLAGS: dict[str, Any] = {
    "--dtype": DTYPE_CHOICES,
    "--device": str,
    "--max-model-len": int,
    "--block-size": int,
    "--kv-cache-memory": str,
    "--num-kv-blocks": int,
    "--max-num-batched-tokens": int,
    "--max-num-seqs": int,
    "--policy": POLICIES,
    "--no-prefix-caching": SWITCH,
    "--seed": int,
    "--kernels": KERNEL_CHOICES,
    "--kernel-plan": str,
    "--threads": int,
    "--load-format": LOAD_FORMATS,
    "--enforce-eager": SWITCH,
    "--quantization": ("int8",),
    "--speculative": ("ngram",),
    "--num-speculative-tokens": int,
    "--max-waiting-requests": int,
    "--slo-ttft-ms": float,
    "--slo-tpot-ms": float,
    "--max-request-size": str,
    "--log-interval": float,
    "--log-level": LOG_LEVELS,
    "--prefill-queue-limit": int,
    "--remote-prefill-timeout": float,
    "--no-access-log": SWITCH,
    "--timeout-header": float,
    "--timeout-body": float,
    "--timeout-write": float,
    "--max-connections": int,
    "--max-connections-per-address": int,
    "--send-buffer": str,
    "--step-timeout": float,
}
# Flags of `phasewise serve` the manifests set themselves, with what sets them instead.
MANAGED_FLAGS: dict[str, str] = {
    "--model": "DeploySpec.model_path",
    "--host": f"always {ALL_INTERFACES} in a pod",
    "--port": "DeploySpec.port",
    "--served-model-name": "DeploySpec.served_model_name",
    "--shutdown-grace": "DeploySpec.shutdown_grace_s (it sizes terminationGracePeriodSeconds)",
    "--role": "DeploySpec.mode",
    "--kv-bind": "DeploySpec.kv_port",
    "--kv-connect": "DeploySpec.decode (the decode workers' Services)",
    "--kv-secret-file": "DeploySpec.kv_secret (a Secret, mounted)",
    "--disagg-threshold": "DeploySpec.disagg_threshold",
    "--kv-name": "nothing: each prefill pod's default, prefill@POD, is unique",
    "--api-key": "DeploySpec.api_key_secret (a Secret's api-key, as $PHASEWISE_API_KEY)",
    "--internal-key-file": "DeploySpec.api_key_secret (its internal-key, mounted)",
}
# The flags the emitted commands pass (tests/test_k8s.py checks phasewise.cli still has them).
SERVE_FLAGS_USED = ("--model", "--host", "--port", "--shutdown-grace", "--role", "--kv-bind",
                    "--kv-connect", "--kv-secret-file", "--disagg-threshold",
                    "--served-model-name", "--threads", "--internal-key-file")
ROUTER_FLAGS_USED = ("--model", "--decode", "--prefill", "--host", "--port", "--wait",
                     "--shutdown-grace", "--served-model-name", "--discover",
                     "--internal-key-file")

_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_QUANTITY = re.compile(r"(\d+(\.\d+)?|\.\d+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")
# What a value may hold: it reaches `sh -c` unquoted (split on spaces, globbed), so nothing
# a shell would read as syntax.
_SAFE = re.compile(r"[A-Za-z0-9._:/+,@%=-]+")
_SAFE_TEXT = "letters, digits and . _ : / + , @ % = -"
_MAX_NAME = 63  # Service names and label values
WORKER_LABEL = "phasewise/worker"  # tells one decode worker's pod from the others'


def _positive(quantity: str) -> bool:
    return float(re.match(r"\d*\.?\d*", quantity).group() or 0) > 0


@dataclass(frozen=True)
class RoleResources:
    cpu: str = "2"          # requests == limits
    memory: str = "8Gi"
    gpus: int = 0           # nvidia.com/gpu limit when > 0

    def __post_init__(self) -> None:
        for f in ("cpu", "memory"):
            v = getattr(self, f)
            if not isinstance(v, str) or not _QUANTITY.fullmatch(v) or not _positive(v):
                raise ValueError(f"RoleResources.{f} must be a positive Kubernetes quantity "
                                 f"such as '2', '500m', '8Gi'; got {v!r}")
        if not isinstance(self.gpus, int) or isinstance(self.gpus, bool) or self.gpus < 0:
            raise ValueError(f"RoleResources.gpus must be an integer >= 0; got {self.gpus!r}")


DEFAULT_RESOURCES = {"both": RoleResources(), "prefill": RoleResources(),
                     "decode": RoleResources(), "router": RoleResources(cpu="1", memory="2Gi")}


@dataclass(frozen=True)
class DeploySpec:
    """What to deploy. Every field is checked on construction (``ValueError`` names the field
    and what is allowed)."""

    model_path: str                    # checkpoint folder inside the container, under model_mount
    mode: str = "colocated"            # "colocated" or "pd"
    replicas: int = 1                  # colocated: number of role-`both` pods
    prefill: int = 1                   # pd: prefill workers
    decode: int = 1                    # pd: decode workers
    name: str = "phasewise"            # prefix of every object name; a DNS-1035 label
    namespace: str | None = None
    image: str = "phasewise:latest"    # phasewise publishes no image: build one
    model_pvc: str = "phasewise-models"  # PersistentVolumeClaim holding the checkpoints
    served_model_name: str | None = None
    engine_args: tuple[tuple[str, str], ...] = ()  # (flag, value); value "" for a switch
    disagg_threshold: int = 0
    resources: dict[str, RoleResources] = field(default_factory=dict)  # by role (ROLES)
    port: int = 8000
    kv_port: int = 8100
    kv_secret: str = "phasewise-kv"    # a Secret the operator creates (key "secret")
    # None: no API key. Else a Secret the operator creates with keys "api-key" (what clients
    # send as their bearer token) and "internal-key" (32+ characters: the router's key to
    # the workers' /internal/* routes)
    api_key_secret: str | None = None
    hpa: bool = True
    hpa_max_replicas: int = 8
    hpa_waiting_per_pod: float = 4.0   # target average phasewise:num_requests_waiting per pod
    hpa_kv_usage: float = 0.85         # target average phasewise:kv_cache_usage_perc
    labels: dict[str, str] = field(default_factory=dict)  # extra labels on every object
    model_mount: str = "/models"       # where the PVC is mounted (read-only)
    image_pull_policy: str = "IfNotPresent"  # a locally built image has no registry to pull
    startup_timeout_s: int = 1800      # model loading (and the router's --wait for workers)
    shutdown_grace_s: float = 30.0     # --shutdown-grace: running streams' time after SIGTERM
    prestop_sleep_s: int = 5           # after SIGTERM is due, while endpoints drop the pod
    network_policy: bool = True        # pd: a NetworkPolicy on the decode pods' K/V port

    def __post_init__(self) -> None:
        _check_spec(self)

    def role_resources(self, role: str) -> RoleResources:
        return self.resources.get(role, DEFAULT_RESOURCES[role])


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_count(spec: DeploySpec, f: str) -> None:
    v = getattr(spec, f)
    if not _is_int(v) or v < 1:
        raise ValueError(f"DeploySpec.{f} must be an integer >= 1; got {v!r}")


def _check_spec(s: DeploySpec) -> None:
    if s.mode not in MODES:
        raise ValueError(f"DeploySpec.mode must be one of {', '.join(MODES)}; got {s.mode!r}")
    for f in ("replicas", "prefill", "decode", "hpa_max_replicas", "startup_timeout_s"):
        _check_count(s, f)
    if not isinstance(s.name, str) or not _DNS1035.fullmatch(s.name):
        raise ValueError("DeploySpec.name must be a DNS-1035 label (lower-case letters, digits "
                         f"and '-', starting with a letter, not ending with '-'); got {s.name!r}")
    longest = max(_names(s), key=len)
    if len(longest) > _MAX_NAME:
        raise ValueError(f"DeploySpec.name {s.name!r} is too long: the object name {longest!r} "
                         f"would exceed {_MAX_NAME} characters; use at most "
                         f"{_MAX_NAME - len(longest) + len(s.name)}")
    if s.namespace is not None and (not isinstance(s.namespace, str) or len(s.namespace) > 63
                                    or not _DNS1123_LABEL.fullmatch(s.namespace)):
        raise ValueError("DeploySpec.namespace must be None or a DNS-1123 label (lower-case "
                         f"letters, digits and '-', at most 63); got {s.namespace!r}")
    for f in ("model_pvc", "kv_secret", "api_key_secret"):
        v = getattr(s, f)
        if f == "api_key_secret" and v is None:
            continue
        if not isinstance(v, str) or len(v) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(v):
            raise ValueError(f"DeploySpec.{f} must name a Kubernetes object (a DNS-1123 "
                             f"subdomain: lower-case letters, digits, '-' and '.'); got {v!r}")
    for f in ("port", "kv_port"):
        v = getattr(s, f)
        if not _is_int(v) or not 1 <= v <= 65535:
            raise ValueError(f"DeploySpec.{f} must be a port in 1..65535; got {v!r}")
    if s.mode == "pd" and s.port == s.kv_port:
        raise ValueError(f"DeploySpec.kv_port must differ from DeploySpec.port ({s.port}): a "
                         "decode worker listens on both")
    mount = s.model_mount
    if (not isinstance(mount, str) or not mount.startswith("/") or mount == "/"
            or not _SAFE.fullmatch(mount) or ".." in mount.split("/")):
        raise ValueError("DeploySpec.model_mount must be an absolute path other than / made of "
                         f"{_SAFE_TEXT}; got {mount!r}")
    m = s.model_path
    if (not isinstance(m, str) or not m.startswith(mount.rstrip("/") + "/")
            or not _SAFE.fullmatch(m) or ".." in m.split("/")):
        raise ValueError(f"DeploySpec.model_path must be a folder under model_mount "
                         f"({mount}, where the PVC {s.model_pvc!r} is mounted), made of "
                         f"{_SAFE_TEXT}, without '..'; got {m!r}")
    if s.served_model_name is not None and (not isinstance(s.served_model_name, str)
                                            or not _SAFE.fullmatch(s.served_model_name)):
        raise ValueError(f"DeploySpec.served_model_name must be None or made of {_SAFE_TEXT}; "
                         f"got {s.served_model_name!r}")
    if not isinstance(s.image, str) or not s.image or any(c.isspace() for c in s.image):
        raise ValueError(f"DeploySpec.image must be an image reference without spaces; "
                         f"got {s.image!r}")
    if not isinstance(s.network_policy, bool):
        raise ValueError(f"DeploySpec.network_policy must be True or False; got "
                         f"{s.network_policy!r}")
    if s.image_pull_policy not in PULL_POLICIES:
        raise ValueError(f"DeploySpec.image_pull_policy must be one of "
                         f"{', '.join(PULL_POLICIES)}; got {s.image_pull_policy!r}")
    if not _is_int(s.disagg_threshold) or s.disagg_threshold < 0:
        raise ValueError(f"DeploySpec.disagg_threshold must be an integer >= 0; "
                         f"got {s.disagg_threshold!r}")
    if not isinstance(s.resources, dict) or not set(s.resources) <= set(ROLES):
        got = sorted(s.resources) if isinstance(s.resources, dict) else s.resources
        raise ValueError(f"DeploySpec.resources keys must be among {', '.join(ROLES)}; "
                         f"got {got!r}")
    for role, r in s.resources.items():
        if not isinstance(r, RoleResources):
            raise ValueError(f"DeploySpec.resources[{role!r}] must be a RoleResources; got {r!r}")
    if not isinstance(s.hpa, bool):
        raise ValueError(f"DeploySpec.hpa must be True or False; got {s.hpa!r}")
    scaled = "replicas" if s.mode == "colocated" else "prefill"
    if s.hpa and s.hpa_max_replicas < getattr(s, scaled):
        raise ValueError(f"DeploySpec.hpa_max_replicas ({s.hpa_max_replicas}) must be >= "
                         f"DeploySpec.{scaled} ({getattr(s, scaled)}), the HPA's minimum")
    for f in ("hpa_waiting_per_pod", "hpa_kv_usage"):
        v = getattr(s, f)
        if not _is_number(v) or not v >= 0.001:
            raise ValueError(f"DeploySpec.{f} must be a number >= 0.001; got {v!r}")
    if s.hpa_kv_usage > 1:
        raise ValueError(f"DeploySpec.hpa_kv_usage is a fraction of the KV blocks: it must be "
                         f"in (0, 1]; got {s.hpa_kv_usage!r}")
    if not _is_number(s.shutdown_grace_s) or not 0 <= s.shutdown_grace_s < 3600:
        raise ValueError(f"DeploySpec.shutdown_grace_s must be in [0, 3600) seconds; "
                         f"got {s.shutdown_grace_s!r}")
    if not _is_int(s.prestop_sleep_s) or not 0 <= s.prestop_sleep_s <= 60:
        raise ValueError(f"DeploySpec.prestop_sleep_s must be an integer in 0..60; "
                         f"got {s.prestop_sleep_s!r}")
    _check_labels(s.labels)
    engine_args_text(s.engine_args)


def _check_labels(labels: dict[str, str]) -> None:
    if not isinstance(labels, dict):
        raise ValueError(f"DeploySpec.labels must be a dict of str to str; got {labels!r}")
    for k, v in labels.items():
        prefix, _, name = k.rpartition("/") if isinstance(k, str) else ("", "", "")
        if (not isinstance(k, str) or not name or len(name) > 63
                or not _LABEL_NAME.fullmatch(name)
                or (prefix and (len(prefix) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(prefix)))):
            raise ValueError(f"DeploySpec.labels key {k!r} is not a Kubernetes label key "
                             "([prefix/]name: a name of at most 63 letters, digits, '-', '_', "
                             "'.', starting and ending alphanumeric)")
        if k == WORKER_LABEL or k.startswith("app.kubernetes.io/"):
            raise ValueError(f"DeploySpec.labels key {k!r} is set by the manifests themselves; "
                             "choose another (e.g. phasewise/plan)")
        if not isinstance(v, str) or len(v) > 63 or (v and not _LABEL_NAME.fullmatch(v)):
            raise ValueError(f"DeploySpec.labels[{k!r}] must be a label value: at most 63 "
                             "letters, digits, '-', '_', '.', starting and ending alphanumeric "
                             f"(or empty); got {v!r}")


def engine_args_text(engine_args: Any) -> str:
    """The ConfigMap's ``PHASEWISE_ENGINE_ARGS``: ``engine_args`` checked against
    ``ENGINE_FLAGS`` and joined with spaces (it is expanded unquoted by ``sh``)."""
    if not isinstance(engine_args, (tuple, list)):
        raise ValueError("DeploySpec.engine_args must be a tuple of (flag, value) pairs; "
                         f"got {engine_args!r}")
    words: list[str] = []
    seen: set[str] = set()
    for pair in engine_args:
        if (not isinstance(pair, (tuple, list)) or len(pair) != 2
                or not all(isinstance(x, str) for x in pair)):
            raise ValueError("DeploySpec.engine_args must hold (flag, value) pairs of strings "
                             f"(value '' for a switch); got {pair!r}")
        flag, value = pair
        if flag in MANAGED_FLAGS:
            raise ValueError(f"DeploySpec.engine_args: {flag} is set by the manifests; use "
                             f"{MANAGED_FLAGS[flag]}")
        if flag not in ENGINE_FLAGS:
            raise ValueError(f"DeploySpec.engine_args: unknown flag {flag!r}; the engine flags "
                             f"of phasewise serve that can be set here: "
                             f"{', '.join(sorted(ENGINE_FLAGS))}")
        if flag in seen:
            raise ValueError(f"DeploySpec.engine_args: {flag} is given twice")
        seen.add(flag)
        kind = ENGINE_FLAGS[flag]
        if kind == SWITCH:
            if value != "":
                raise ValueError(f"DeploySpec.engine_args: {flag} is a switch and takes no "
                                 f"value; give ({flag!r}, ''); got {value!r}")
            words.append(flag)
            continue
        if not _SAFE.fullmatch(value):
            raise ValueError(f"DeploySpec.engine_args: the value of {flag} ({value!r}) goes "
                             f"through sh; it may hold only {_SAFE_TEXT}")
        if isinstance(kind, tuple) and value not in kind:
            raise ValueError(f"DeploySpec.engine_args: {flag} must be one of "
                             f"{', '.join(kind)}; got {value!r}")
        if flag == "--device" and value not in DEVICES and not re.fullmatch(r"cuda:\d+", value):
            raise ValueError(f"DeploySpec.engine_args: --device must be one of "
                             f"{', '.join(DEVICES)} or cuda:N; got {value!r}")
        if kind in (int, float):
            try:
                kind(value)
            except ValueError:
                raise ValueError(f"DeploySpec.engine_args: {flag} takes "
                                 f"{'an integer' if kind is int else 'a number'}; "
                                 f"got {value!r}") from None
        words += [flag, value]
    return " ".join(words)


# ----------------------------------------------------------------------------- names, labels


def _names(s: DeploySpec) -> list[str]:
    """The Deployment and Service names (Service names and label values: at most 63
    characters; the ConfigMaps' may be longer)."""
    roles = ["both"] if s.mode == "colocated" else \
        ["prefill"] + [f"decode-{i}" for i in range(s.decode)]
    return [f"{s.name}-{r}" for r in roles + ["router"]]


def _decode_names(s: DeploySpec) -> list[str]:
    return [f"{s.name}-decode-{i}" for i in range(s.decode)]


def _selector(s: DeploySpec, role: str, index: int | None = None) -> dict[str, str]:
    """The labels a Deployment selects its pods by, and its Service selects them by."""
    sel = {"app.kubernetes.io/name": "phasewise", "app.kubernetes.io/part-of": s.name,
           "app.kubernetes.io/component": role}
    if index is not None:  # one decode worker: its own Deployment and Service
        sel[WORKER_LABEL] = f"{s.name}-decode-{index}"
    return sel


def _labels(s: DeploySpec, role: str, index: int | None = None) -> dict[str, str]:
    return {**_selector(s, role, index), "app.kubernetes.io/managed-by": "phasewise-plan",
            **s.labels}


def _meta(s: DeploySpec, name: str, labels: dict[str, str],
          annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if s.namespace is not None:
        meta["namespace"] = s.namespace
    meta["labels"] = dict(labels)
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def _quantity(v: float) -> str:
    """A Kubernetes quantity string: whole numbers as they are, the rest in milli-units."""
    milli = round(v * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


# ----------------------------------------------------------------------------- pods


def _probe(path: str, port: int, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period,
            "timeoutSeconds": 5, "failureThreshold": failures}


def _container(s: DeploySpec, role: str, command: list[str], ports: dict[str, int],
               env: list[dict[str, Any]], mounts: list[dict[str, Any]]) -> dict[str, Any]:
    r = s.role_resources(role)
    amount = {"cpu": r.cpu, "memory": r.memory}
    if r.gpus:
        amount["nvidia.com/gpu"] = str(r.gpus)
    # /health reflects other pods on prefill workers and the router: liveness there asks only
    # about the pod's own engine, or (the router, which has none) whether it still serves
    # (see the module docstring).
    live = {"both": "/health", "decode": "/health", "prefill": "/health/engine"}.get(
        role, "/version")
    c: dict[str, Any] = {
        "name": "router" if role == "router" else "engine",
        "image": s.image,
        "imagePullPolicy": s.image_pull_policy,
        "command": command,
        "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports.items()],
    }
    if env:
        c["env"] = env
    c["resources"] = {"requests": dict(amount), "limits": dict(amount)}
    c["volumeMounts"] = mounts
    c["startupProbe"] = _probe(live, s.port, 10, math.ceil(s.startup_timeout_s / 10))
    c["readinessProbe"] = _probe("/health", s.port, 5, 3)
    c["livenessProbe"] = _probe(live, s.port, 10, 6)
    if s.prestop_sleep_s:
        # kube-proxy and the endpoints drop a terminating pod asynchronously: keep listening
        # a moment so that connections routed here meanwhile are not refused.
        c["lifecycle"] = {"preStop": {"exec": {"command": [
            "sh", "-c", f"sleep {s.prestop_sleep_s}"]}}}
    c["securityContext"] = {"allowPrivilegeEscalation": False}
    return c


def _pod_template(s: DeploySpec, role: str, index: int | None, container: dict[str, Any],
                  config_hash: str) -> dict[str, Any]:
    volumes: list[dict[str, Any]] = [{"name": "models", "persistentVolumeClaim": {
        "claimName": s.model_pvc, "readOnly": True}}]
    if role in ("prefill", "decode"):
        volumes.append({"name": "kv-secret", "secret": {
            "secretName": s.kv_secret, "items": [{"key": KV_SECRET_KEY, "path": KV_SECRET_KEY}],
            "defaultMode": 0o400}})
    if s.api_key_secret is not None:
        volumes.append({"name": "fleet-key", "secret": {
            "secretName": s.api_key_secret,
            "items": [{"key": INTERNAL_KEY_KEY, "path": INTERNAL_KEY_KEY}],
            "defaultMode": 0o400}})
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(s.port),
                   "prometheus.io/path": "/metrics"}
    if role != "router":  # a changed ConfigMap rolls the engine pods (they read it at start)
        annotations["phasewise/engine-args-sha256"] = config_hash
    pod: dict[str, Any] = {
        "enableServiceLinks": False,  # no *_SERVICE_HOST variables for every Service around
        "terminationGracePeriodSeconds": (s.prestop_sleep_s + math.ceil(s.shutdown_grace_s)
                                          + UVICORN_BACKSTOP_S + 5),
        "containers": [container],
        "volumes": volumes,
    }
    if s.role_resources(role).gpus:
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists",
                               "effect": "NoSchedule"}]
    return {"metadata": {"labels": _labels(s, role, index), "annotations": annotations},
            "spec": pod}


def _model_mount(s: DeploySpec) -> dict[str, Any]:
    return {"name": "models", "mountPath": s.model_mount, "readOnly": True}


def cpu_threads(r: RoleResources) -> int | None:
    """``--threads`` for a CPU pod: its CPU limit, whole (at least 1). A container sees every
    core of its node, and torch starts as many threads; under a limit of a few CPUs they take
    turns on them, and each kernel waits for the one that lost its turn. None for a GPU pod
    (the kernels run on the GPU)."""
    if r.gpus:
        return None
    m = re.fullmatch(r"(\d*\.?\d*)(m?)", r.cpu)
    if m is None:
        return 1
    value = float(m.group(1)) / (1000 if m.group(2) else 1)
    return max(1, math.floor(value))


def _engine_command(s: DeploySpec, role: str) -> list[str]:
    """``sh -c 'exec phasewise serve ... $PHASEWISE_ENGINE_ARGS ...'``: the variable is
    expanded unquoted, so that it splits into flags (its values were checked for that);
    every fixed argument is quoted."""
    tail = ["--host", ALL_INTERFACES, "--port", str(s.port),
            "--shutdown-grace", f"{s.shutdown_grace_s:g}", "--role", role]
    if s.served_model_name is not None:
        tail += ["--served-model-name", s.served_model_name]
    if role == "decode":
        tail += ["--kv-bind", f"tcp://{ALL_INTERFACES}:{s.kv_port}",
                 "--disagg-threshold", str(s.disagg_threshold)]
    if role == "prefill":
        tail += ["--kv-connect", *(f"tcp://{d}:{s.kv_port}" for d in _decode_names(s))]
    if role in ("prefill", "decode"):
        tail += ["--kv-secret-file", f"{KV_SECRET_DIR}/{KV_SECRET_KEY}"]
    tail += _fleet_key_args(s)
    threads = cpu_threads(s.role_resources(role))
    if threads is not None and not any(f == "--threads" for f, _ in s.engine_args):
        tail += ["--threads", str(threads)]
    script = (f"exec phasewise serve --model {shlex.quote(s.model_path)} ${ENGINE_ARGS_VAR} "
              + " ".join(shlex.quote(a) for a in tail))
    return ["sh", "-c", script]


def _engine_deployment(s: DeploySpec, role: str, name: str, index: int | None,
                       replicas: int | None, config_hash: str,
                       annotations: dict[str, str]) -> dict[str, Any]:
    ports = {"http": s.port, **({"kv": s.kv_port} if role == "decode" else {})}
    mounts = [_model_mount(s), *_fleet_key_mount(s)]
    if role in ("prefill", "decode"):
        mounts.append({"name": "kv-secret", "mountPath": KV_SECRET_DIR, "readOnly": True})
    env = [{"name": ENGINE_ARGS_VAR, "valueFrom": {"configMapKeyRef": {
        "name": f"{s.name}-engine", "key": ENGINE_ARGS_VAR}}}, *_api_key_env(s)]
    container = _container(s, role, _engine_command(s, role), ports, env, mounts)
    return _deployment(s, role, name, index, replicas,
                       _pod_template(s, role, index, container, config_hash), annotations)


def _api_key_env(s: DeploySpec) -> list[dict[str, Any]]:
    """$PHASEWISE_API_KEY from the Secret (serve and router read it when --api-key is not
    given), or nothing."""
    if s.api_key_secret is None:
        return []
    return [{"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {
        "name": s.api_key_secret, "key": API_KEY_KEY}}}]


def _fleet_key_mount(s: DeploySpec) -> list[dict[str, Any]]:
    return ([] if s.api_key_secret is None else
            [{"name": "fleet-key", "mountPath": FLEET_KEY_DIR, "readOnly": True}])


def _fleet_key_args(s: DeploySpec) -> list[str]:
    return ([] if s.api_key_secret is None else
            ["--internal-key-file", f"{FLEET_KEY_DIR}/{INTERNAL_KEY_KEY}"])


def _deployment(s: DeploySpec, role: str, name: str, index: int | None, replicas: int | None,
                template: dict[str, Any], annotations: dict[str, str]) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if replicas is not None:  # left out where an HPA owns the count (kubectl apply keeps it)
        spec["replicas"] = replicas
    spec["selector"] = {"matchLabels": _selector(s, role, index)}
    if role == "both":  # a new pod is up before an old one drains (its streams move to it)
        spec["strategy"] = {"type": "RollingUpdate",
                            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    spec["template"] = template
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": _meta(s, name, _labels(s, role, index), annotations), "spec": spec}


def _service(s: DeploySpec, role: str, name: str, index: int | None,
             annotations: dict[str, str] | None = None,
             headless: bool = False) -> dict[str, Any]:
    ports = [{"name": "http", "port": s.port, "targetPort": "http", "protocol": "TCP"}]
    if role == "decode":
        ports.append({"name": "kv", "port": s.kv_port, "targetPort": "kv", "protocol": "TCP"})
    spec: dict[str, Any] = {"type": "ClusterIP", "selector": _selector(s, role, index),
                            "ports": ports}
    if headless:  # its name resolves to each ready pod's address (the router's --discover)
        spec["clusterIP"] = "None"
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(s, name, _labels(s, role, index), annotations), "spec": spec}


def _pdb(s: DeploySpec, role: str, note: str) -> dict[str, Any]:
    """At most one pod of ``role`` evicted at a time (a node drain waits for the next)."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(s, f"{s.name}-{role}", _labels(s, role), {"phasewise/note": note}),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _selector(s, role)}}}


def _router(s: DeploySpec) -> list[dict[str, Any]]:
    if s.mode == "colocated":
        decode = [f"http://{s.name}-both:{s.port}"]
        prefill: list[str] = []
    else:
        decode = [f"http://{d}:{s.port}" for d in _decode_names(s)]
        prefill = [f"http://{s.name}-prefill:{s.port}"]
    command = ["phasewise", "router", "--model", s.model_path, "--decode", *decode]
    if prefill:
        command += ["--prefill", *prefill]
    if s.mode == "colocated":
        command += ["--discover"]
    command += ["--host", ALL_INTERFACES, "--port", str(s.port),
                "--wait", str(s.startup_timeout_s), "--shutdown-grace", f"{s.shutdown_grace_s:g}"]
    if s.served_model_name is not None:
        command += ["--served-model-name", s.served_model_name]
    command += _fleet_key_args(s)
    container = _container(s, "router", command, {"http": s.port}, _api_key_env(s),
                           [_model_mount(s), *_fleet_key_mount(s)])
    name = f"{s.name}-router"
    note = {"phasewise/note": "the OpenAI API; it waits for the workers at start (--wait), "
            "routes each request by --routing (default: the prompt blocks a worker holds "
            "against its load) and moves a stream whose worker dies or drains"}
    return [_deployment(s, "router", name, None, 1,
                        _pod_template(s, "router", None, container, ""), note),
            _service(s, "router", name, None)]


def _hpa(s: DeploySpec, role: str, target: str, minimum: int, note: str) -> dict[str, Any]:
    def pods_metric(name: str, value: float) -> dict[str, Any]:
        return {"type": "Pods", "pods": {"metric": {"name": name}, "target": {
            "type": "AverageValue", "averageValue": _quantity(value)}}}

    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": _meta(s, target, _labels(s, role),
                              {"phasewise/note": note}),
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                   "name": target},
                "minReplicas": minimum, "maxReplicas": s.hpa_max_replicas,
                "metrics": [pods_metric("phasewise_num_requests_waiting",
                                        s.hpa_waiting_per_pod),
                            pods_metric("phasewise_kv_cache_usage_perc", s.hpa_kv_usage)],
                # A new pod loads a model for minutes: give up loaded ones slowly.
                "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300, "policies": [
                    {"type": "Pods", "value": 1, "periodSeconds": 120}]}},
            }}


def adapter_rules() -> dict[str, Any]:
    """prometheus-adapter rules that expose ``phasewise:num_requests_waiting`` and
    ``phasewise:kv_cache_usage_perc`` per pod as the custom metrics the HPA names. They need
    Prometheus to label each scraped series with ``namespace`` and ``pod`` (the usual
    ``kubernetes-pods`` job, which follows the ``prometheus.io/*`` pod annotations, does)."""
    def rule(metric: str, agg: str) -> dict[str, Any]:
        return {"seriesQuery": f'phasewise:{metric}{{namespace!="",pod!=""}}',
                "resources": {"overrides": {"namespace": {"resource": "namespace"},
                                            "pod": {"resource": "pod"}}},
                "name": {"matches": f"^phasewise:{metric}$", "as": f"phasewise_{metric}"},
                "metricsQuery": f"{agg}(<<.Series>>{{<<.LabelMatchers>>}}) by (<<.GroupBy>>)"}

    return {"rules": [rule("num_requests_waiting", "sum"),
                      rule("kv_cache_usage_perc", "max")]}


# ----------------------------------------------------------------------------- the whole


def _kv_policy(s: DeploySpec) -> dict[str, Any]:
    """pd: the decode pods' K/V port admits this deployment's prefill pods only; their HTTP
    port stays open inside the cluster (the router, the metrics scraper), as their Services
    are ClusterIP. The channel is authenticated (the K/V Secret) either way: this keeps
    strangers from reaching its handshake at all, where the cluster's network enforces
    NetworkPolicies."""
    decode = {"app.kubernetes.io/name": "phasewise", "app.kubernetes.io/part-of": s.name,
              "app.kubernetes.io/component": "decode"}
    note = ("the decode workers' K/V port admits only this deployment's prefill pods; their "
            "HTTP port stays open inside the cluster (the router, the metrics scraper); "
            "enforced where the cluster's network plugin enforces NetworkPolicies")
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(s, f"{s.name}-decode-kv", _labels(s, "decode"),
                              {"phasewise/note": note}),
            "spec": {"podSelector": {"matchLabels": decode}, "policyTypes": ["Ingress"],
                     "ingress": [
                         {"ports": [{"protocol": "TCP", "port": "http"}]},
                         {"from": [{"podSelector": {"matchLabels": _selector(s, "prefill")}}],
                          "ports": [{"protocol": "TCP", "port": "kv"}]}]}}


def manifests(spec: DeploySpec) -> list[dict]:
    """The Kubernetes objects for ``spec``, in apply order: ConfigMaps, engine Deployments and
    Services (decode workers first), PodDisruptionBudgets, the HPA, the decode workers'
    NetworkPolicy (pd), the router."""
    s = spec
    args = engine_args_text(s.engine_args)
    config_hash = hashlib.sha256(args.encode()).hexdigest()[:16]
    docs: list[dict[str, Any]] = [{
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": _meta(s, f"{s.name}-engine", _labels(s, "engine"), {
            "phasewise/note": f"engine flags every phasewise serve container expands from "
                              f"${ENGINE_ARGS_VAR}; a change rolls the pods (their template "
                              "carries its hash)"}),
        "data": {ENGINE_ARGS_VAR: args}}]
    if s.hpa:
        docs.append({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(s, f"{s.name}-adapter-rules", _labels(s, "metrics"), {
                "phasewise/note": "rules for prometheus-adapter (the operator's, as is "
                                  "Prometheus): merge config.yaml's rules into the adapter's "
                                  "configuration (its Helm chart: rules.custom) so that the "
                                  "HPA finds its pods metrics"}),
            "data": {"config.yaml": yaml.safe_dump(adapter_rules(), sort_keys=False)}})
    if s.mode == "colocated":
        name = f"{s.name}-both"
        docs.append(_engine_deployment(
            s, "both", name, None, None if s.hpa else s.replicas, config_hash, {
                "phasewise/note": "interchangeable --role both pods"
                + (", scaled by the HPA" if s.hpa else "")}))
        docs.append(_service(s, "both", name, None, {
            "phasewise/note": "headless: its name resolves to every ready pod, which the "
                              "router (--discover) routes to one by one"}, headless=True))
        docs.append(_pdb(s, "both", "a node drain evicts one --role both pod at a time: its "
                         "streams move to the others"))
        if s.hpa:
            docs.append(_hpa(s, "both", name, s.replicas,
                             "scales the interchangeable --role both pods"))
    else:
        for i, d in enumerate(_decode_names(s)):
            docs.append(_engine_deployment(s, "decode", d, i, 1, config_hash, {
                "phasewise/note": "one decode worker: its own Deployment and Service give it "
                                  "the stable address that every prefill worker and the "
                                  "router list; add or remove decode workers by planning "
                                  "again, not by scaling this Deployment"}))
            docs.append(_service(s, "decode", d, i))
        name = f"{s.name}-prefill"
        docs.append(_engine_deployment(
            s, "prefill", name, None, None if s.hpa else s.prefill, config_hash, {
                "phasewise/note": "interchangeable prefill workers, each connected to every "
                                  "decode worker's K/V port"
                                  + (", scaled by the HPA" if s.hpa else "")}))
        docs.append(_service(s, "prefill", name, None, {
            "phasewise/note": "the router watches prefill workers' /health and /metrics "
                              "here; K/V goes from each prefill pod to the decode workers"}))
        if s.hpa:
            docs.append(_hpa(s, "prefill", name, s.prefill,
                             "prefill pods are interchangeable clients of the decode "
                             "workers; decode workers are scaled by planning again"))
        docs.append(_pdb(s, "decode", "a node drain evicts one decode worker at a time: its "
                         "streams move to the other decode workers"))
        docs.append(_pdb(s, "prefill", "a node drain evicts one prefill worker at a time"))
        if s.network_policy:
            docs.append(_kv_policy(s))
    docs += _router(s)
    return docs


class _Dumper(yaml.SafeDumper):
    """SafeDumper that writes multi-line strings (the adapter rules) as literal blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(docs: list[dict]) -> str:
    """Multi-document YAML, each document after ``---``, keys in the order the objects were
    built (apiVersion, kind, metadata, then the rest); ``yaml.safe_load_all`` reads back
    exactly ``docs``."""
    return yaml.dump_all(docs, Dumper=_Dumper, explicit_start=True, sort_keys=False,
                         default_flow_style=False, width=1 << 16, allow_unicode=True)


def header(spec: DeploySpec) -> str:
    """The prerequisites, as YAML comments, for the top of the written file."""
    s = spec
    ns = f" -n {s.namespace}" if s.namespace else ""
    lines = [
        f"phasewise {s.mode} deployment {s.name!r}, written by phasewise.perf.k8s.",
        "Before kubectl apply -f this file:",
        f"- an image {s.image!r} with phasewise installed and on PATH (phasewise publishes "
        "none: build one from this repository, docs/predicting.md#an-image);",
        f"- a PersistentVolumeClaim {s.model_pvc!r}{' in ' + s.namespace if s.namespace else ''}"
        f" holding the checkpoint at {s.model_path} (mounted read-only at {s.model_mount}; "
        "ReadOnlyMany or ReadWriteMany where pods land on several nodes);",
    ]
    if s.mode == "pd":
        lines.append(f"- the K/V secret (at least 16 bytes): kubectl{ns} create secret generic "
                     f"{s.kv_secret} --from-literal={KV_SECRET_KEY}=\"$(head -c 32 "
                     "/dev/urandom | base64)\";")
    if s.api_key_secret is not None:
        lines.append(f"- the API key and the fleet's internal key: kubectl{ns} create secret "
                     f"generic {s.api_key_secret} --from-literal={API_KEY_KEY}=YOUR_KEY "
                     f"--from-literal={INTERNAL_KEY_KEY}=\"$(openssl rand -hex 32)\" (clients "
                     "send YOUR_KEY as 'Authorization: Bearer YOUR_KEY'; /health, /metrics and "
                     "/version stay open for the probes and Prometheus);")
    if s.hpa:
        lines.append("- for the HPA: Prometheus scraping pods by their prometheus.io/* "
                     "annotations (series labelled namespace and pod) and prometheus-adapter "
                     f"with the rules in ConfigMap {s.name}-adapter-rules.")
    lines.append(f"Clients: the Service {s.name}-router, port {s.port} (OpenAI API).")
    return "".join(f"# {line}\n" for line in lines)


def write(spec: DeploySpec, folder: str | Path) -> list[Path]:
    """Write every object into one file, ``folder/NAME.yaml`` (``kubectl apply -f`` it), the
    prerequisites at its top as comments; returns ``[that path]``."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{spec.name}.yaml"
    path.write_text(header(spec) + to_yaml(manifests(spec)))
    return [path]
