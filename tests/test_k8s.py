"""phasewise.perf.k8s: the manifests validate against Kubernetes' own schemas (offline, with
kubernetes-validate), hang together (selectors, ports, probes, the HPA's target, the K/V
addresses), and run commands that phasewise's own CLI parses as meant."""

from __future__ import annotations

import os
import re
import socket
import stat
import subprocess
import sys
from dataclasses import replace

import kubernetes_validate
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from phasewise import cli
from phasewise.cli.args import thread_count
from phasewise.perf import k8s
from phasewise.perf.k8s import DeploySpec, RoleResources, manifests, to_yaml

K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
MODEL = "/models/qwen2-0.5b"

SPECS = [
    DeploySpec(MODEL),
    DeploySpec(MODEL, replicas=3, hpa=False, namespace="serving"),
    DeploySpec(MODEL, mode="pd", name="chat", served_model_name="qwen",
               engine_args=(("--policy", "chunked"), ("--max-num-batched-tokens", "512"),
                            ("--kv-cache-memory", "4GiB"), ("--no-prefix-caching", "")),
               disagg_threshold=256, decode=3, prefill=2,
               resources={"prefill": RoleResources("8", "32Gi", 1),
                          "decode": RoleResources("8", "64Gi", 2)},
               labels={"phasewise/plan": "pd"}, api_key_secret="chat-keys"),
    DeploySpec(MODEL, mode="pd", hpa=False, port=9000, kv_port=9100, shutdown_grace_s=12.5,
               prestop_sleep_s=0, network_policy=False),
]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in by_kind(docs, kind) if d["metadata"]["name"] == name]
    return doc


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def role(deployment: dict) -> str:
    return deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def port_of(c: dict, name: str) -> int:
    (p,) = [p["containerPort"] for p in c["ports"] if p["name"] == name]
    return p


def engine_argv(docs: list[dict], deployment: dict, tmp_path) -> list[str]:
    """What the container's ``sh -c`` really passes to ``phasewise``: run it through sh with
    a stand-in ``phasewise`` on PATH that prints its arguments, and the ConfigMap's value in
    the environment, as Kubernetes would set it."""
    c = container(deployment)
    env = {}
    for var in c["env"]:
        ref = var["valueFrom"].get("configMapKeyRef")
        env[var["name"]] = (named(docs, "ConfigMap", ref["name"])["data"][ref["key"]]
                            if ref is not None else "a key from a Secret")
    fake = tmp_path / "bin" / "phasewise"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text("#!/bin/sh\nfor a in \"$@\"; do printf '%s\\n' \"$a\"; done\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    assert c["command"][:2] == ["sh", "-c"]
    out = subprocess.run(c["command"], capture_output=True, text=True, check=True, env={
        "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}", **env})
    return out.stdout.splitlines()


def check_keys(spec: DeploySpec, dep: dict) -> None:
    """With an API key Secret, every pod (router and engines) takes the clients' key from it
    as $PHASEWISE_API_KEY and reads the fleet's internal key from it, mounted; without one,
    neither."""
    c = container(dep)
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    env = {v["name"]: v["valueFrom"] for v in c.get("env", [])}
    words = c["command"][2].split() if c["command"][0] == "sh" else c["command"]
    if spec.api_key_secret is None:
        assert "fleet-key" not in volumes and "PHASEWISE_API_KEY" not in env
        assert "--internal-key-file" not in words
        return
    assert env["PHASEWISE_API_KEY"] == {"secretKeyRef": {"name": spec.api_key_secret,
                                                         "key": "api-key"}}
    secret = volumes["fleet-key"]["secret"]
    assert secret["secretName"] == spec.api_key_secret
    (item,) = secret["items"]
    assert item["key"] == "internal-key" and secret["defaultMode"] == 0o400
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "fleet-key"]
    assert mount["readOnly"]
    path = words[words.index("--internal-key-file") + 1].strip("'")
    assert path == f"{mount['mountPath']}/{item['path']}"
    # the key never sits on a command line or in a ConfigMap
    assert "--api-key" not in words


def check_structure(spec: DeploySpec, docs: list[dict]) -> None:
    deployments = by_kind(docs, "Deployment")
    services = by_kind(docs, "Service")
    names = [d["metadata"]["name"] for d in docs]
    assert all(n.startswith(spec.name + "-") for n in names)
    assert len({(d["kind"], d["metadata"]["name"]) for d in docs}) == len(docs)
    for d in docs:
        assert d["metadata"].get("namespace") == spec.namespace
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == spec.name
        for k, v in spec.labels.items():
            assert d["metadata"]["labels"][k] == v
    for dep in deployments:
        pod_labels = dep["spec"]["template"]["metadata"]["labels"]
        assert selects(dep["spec"]["selector"]["matchLabels"], pod_labels)
        for other in deployments:  # no Deployment adopts another's pods
            if other is not dep:
                assert not selects(dep["spec"]["selector"]["matchLabels"],
                                   other["spec"]["template"]["metadata"]["labels"])
        # Some Service selects exactly this Deployment's pods, on ports the container has.
        mine = [s for s in services if selects(s["spec"]["selector"], pod_labels)]
        assert len(mine) == 1, dep["metadata"]["name"]
        svc = mine[0]
        assert svc["metadata"]["name"] == dep["metadata"]["name"]
        assert not any(selects(svc["spec"]["selector"],
                               o["spec"]["template"]["metadata"]["labels"])
                       for o in deployments if o is not dep)
        c = container(dep)
        for p in svc["spec"]["ports"]:
            assert p["port"] == port_of(c, p["targetPort"])
        assert port_of(c, "http") == spec.port
        # Probes: readiness on /health at the HTTP port; liveness and startup on /health where
        # a 503 is this pod's own engine, /health/engine on a prefill worker (whose /health
        # reflects its decode workers), /version on the router (no engine of its own).
        live = {"both": "/health", "decode": "/health", "prefill": "/health/engine"}.get(
            role(dep), "/version")
        for probe, path in (("readinessProbe", "/health"), ("livenessProbe", live),
                            ("startupProbe", live)):
            assert c[probe]["httpGet"] == {"path": path, "port": port_of(c, "http")}
        sp = c["startupProbe"]
        assert sp["periodSeconds"] * sp["failureThreshold"] >= spec.startup_timeout_s
        r = spec.role_resources(role(dep))
        assert c["resources"]["requests"] == c["resources"]["limits"]
        assert c["resources"]["limits"]["cpu"] == r.cpu
        assert c["resources"]["limits"]["memory"] == r.memory
        assert c["resources"]["limits"].get("nvidia.com/gpu") == (str(r.gpus) if r.gpus
                                                                  else None)
        pod = dep["spec"]["template"]
        ann = pod["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true"
        assert ann["prometheus.io/port"] == str(port_of(c, "http"))
        assert ann["prometheus.io/path"] == "/metrics"
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert volumes["models"]["persistentVolumeClaim"] == {
            "claimName": spec.model_pvc, "readOnly": True}
        assert mounts[spec.model_mount] == {"name": "models", "mountPath": spec.model_mount,
                                            "readOnly": True}
        assert ("kv-secret" in volumes) == (role(dep) in ("prefill", "decode"))
        if "kv-secret" in volumes:
            assert volumes["kv-secret"]["secret"]["secretName"] == spec.kv_secret
        check_keys(spec, dep)
        grace = pod["spec"]["terminationGracePeriodSeconds"]
        assert grace > spec.shutdown_grace_s + k8s.UVICORN_BACKSTOP_S + spec.prestop_sleep_s
    # pd: one NetworkPolicy, on every decode pod and nothing else; its K/V rule admits the
    # prefill pods (not the router's), its HTTP rule anyone, on ports the pods have
    policies = by_kind(docs, "NetworkPolicy")
    assert len(policies) == (spec.mode == "pd" and spec.network_policy)
    for pol in policies:
        sel = pol["spec"]["podSelector"]["matchLabels"]
        covered = [d for d in deployments
                   if selects(sel, d["spec"]["template"]["metadata"]["labels"])]
        assert covered and {role(d) for d in covered} == {"decode"}
        assert len(covered) == spec.decode
        http, kv = pol["spec"]["ingress"]
        assert "from" not in http and http["ports"] == [{"protocol": "TCP", "port": "http"}]
        assert kv["ports"] == [{"protocol": "TCP", "port": "kv"}]
        (peer,) = kv["from"]
        admitted = {role(d) for d in deployments
                    if selects(peer["podSelector"]["matchLabels"],
                               d["spec"]["template"]["metadata"]["labels"])}
        assert admitted == {"prefill"}
        for d in covered:
            port_of(container(d), "kv")
            port_of(container(d), "http")
    for hpa in by_kind(docs, "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        target = named(docs, "Deployment", ref["name"])
        assert (ref["kind"], ref["apiVersion"]) == ("Deployment", "apps/v1")
        assert "replicas" not in target["spec"]  # the HPA owns the count
        assert hpa["spec"]["maxReplicas"] == spec.hpa_max_replicas
        metrics = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
        assert metrics == {"phasewise_num_requests_waiting", "phasewise_kv_cache_usage_perc"}
        rules = yaml.safe_load(named(docs, "ConfigMap", f"{spec.name}-adapter-rules")
                               ["data"]["config.yaml"])["rules"]
        assert {r["name"]["as"] for r in rules} == metrics
        for r in rules:  # each rule turns a metric the server exports into one the HPA names
            assert r["seriesQuery"].startswith(r["name"]["as"].replace("_", ":", 1) + "{")
            assert re.fullmatch(r["name"]["matches"], r["name"]["as"].replace("_", ":", 1))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.mode}-{s.name}")
def test_every_object_validates_and_hangs_together(spec):
    docs = manifests(spec)
    for doc in docs:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
    check_structure(spec, docs)


@settings(max_examples=20, deadline=None)
@given(mode=st.sampled_from(k8s.MODES), replicas=st.integers(1, 5),
       prefill=st.integers(1, 4), decode=st.integers(1, 6), hpa=st.booleans(),
       name=st.from_regex(r"[a-z]([-a-z0-9]{0,30}[a-z0-9])?", fullmatch=True),
       gpus=st.integers(0, 8))
def test_any_counts_and_names_validate(mode, replicas, prefill, decode, hpa, name, gpus):
    spec = DeploySpec(MODEL, mode=mode, replicas=replicas, prefill=prefill, decode=decode,
                      hpa=hpa, name=name, hpa_max_replicas=8,
                      resources={r: RoleResources(gpus=gpus) for r in ("both", "decode")})
    docs = manifests(spec)
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)
    check_structure(spec, docs)
    deployments = by_kind(docs, "Deployment")
    roles = sorted(role(d) for d in deployments)
    if mode == "colocated":
        assert roles == ["both", "router"]
    else:
        assert roles == ["decode"] * decode + ["prefill", "router"]
        for d in deployments:
            if role(d) == "decode":
                assert d["spec"]["replicas"] == 1  # one worker, one stable address
    scaled = named(docs, "Deployment", f"{name}-{'both' if mode == 'colocated' else 'prefill'}")
    count = replicas if mode == "colocated" else prefill
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    if hpa:
        (h,) = hpas
        assert h["spec"]["scaleTargetRef"]["name"] == scaled["metadata"]["name"]
        assert h["spec"]["minReplicas"] == count
    else:
        assert hpas == [] and scaled["spec"]["replicas"] == count


@pytest.mark.parametrize("spec", [s for s in SPECS if s.mode == "pd"], ids=lambda s: s.name)
def test_pd_commands_wire_every_decode_worker(spec, tmp_path):
    docs = manifests(spec)
    decode_svcs = [s for s in by_kind(docs, "Service")
                   if s["spec"]["selector"]["app.kubernetes.io/component"] == "decode"]
    assert [s["metadata"]["name"] for s in decode_svcs] == [
        f"{spec.name}-decode-{i}" for i in range(spec.decode)]

    def svc_port(svc: dict, name: str) -> int:
        (p,) = [p["port"] for p in svc["spec"]["ports"] if p["name"] == name]
        return p

    kv_urls = [f"tcp://{s['metadata']['name']}:{svc_port(s, 'kv')}" for s in decode_svcs]
    http_urls = [f"http://{s['metadata']['name']}:{svc_port(s, 'http')}" for s in decode_svcs]

    prefill = named(docs, "Deployment", f"{spec.name}-prefill")
    argv = engine_argv(docs, prefill, tmp_path)
    assert argv[0] == "serve"
    a = cli.parse_args(argv)
    assert a.role == "prefill" and a.model == spec.model_path
    assert a.kv_connect == kv_urls  # every decode worker's K/V Service, in order
    assert (a.host, a.port) == ("0.0.0.0", spec.port)
    assert a.served_model_name == spec.served_model_name
    assert a.shutdown_grace == spec.shutdown_grace_s
    pod = prefill["spec"]["template"]["spec"]
    (secret,) = [v["secret"] for v in pod["volumes"] if v["name"] == "kv-secret"]
    (mount,) = [m for m in container(prefill)["volumeMounts"] if m["name"] == "kv-secret"]
    assert secret["secretName"] == spec.kv_secret and mount["readOnly"]
    assert a.kv_secret_file == f"{mount['mountPath']}/{secret['items'][0]['path']}"
    assert secret["items"][0]["key"] == "secret"
    for flag, value in spec.engine_args:  # the ConfigMap's flags reach the engine
        got = getattr(a, flag[2:].replace("-", "_"))
        assert got is True if value == "" else str(got) == value

    for svc in decode_svcs:
        dep = named(docs, "Deployment", svc["metadata"]["name"])
        a = cli.parse_args(engine_argv(docs, dep, tmp_path))
        assert a.role == "decode" and a.disagg_threshold == spec.disagg_threshold
        assert a.kv_bind == f"tcp://0.0.0.0:{port_of(container(dep), 'kv')}"
        assert a.kv_secret_file is not None and a.kv_connect is None

    # one decode worker evicted at a time (its streams move to the others): the budget
    # selects every decode worker's pods
    pdb = named(docs, "PodDisruptionBudget", f"{spec.name}-decode")
    assert pdb["spec"]["maxUnavailable"] == 1
    for d in (x for x in by_kind(docs, "Deployment")
              if x["metadata"]["name"].startswith(f"{spec.name}-decode-")):
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    router = named(docs, "Deployment", f"{spec.name}-router")
    cmd = container(router)["command"]
    assert cmd[:2] == ["phasewise", "router"]
    a = cli.parse_args(cmd[1:])
    assert a.decode == http_urls  # the router lists every decode worker
    assert a.prefill == [f"http://{spec.name}-prefill:{spec.port}"]
    assert a.wait >= spec.startup_timeout_s
    assert a.model == spec.model_path and (a.host, a.port) == ("0.0.0.0", spec.port)
    assert not any(v.get("secret", {}).get("secretName") == spec.kv_secret
                   for v in router["spec"]["template"]["spec"]["volumes"])
    assert (a.internal_key_file is not None) == (spec.api_key_secret is not None)


def test_the_server_accepts_the_kv_bind_form(tmp_path):
    """``phasewise serve --role decode`` checks --kv-bind (its form, then that the port can be
    bound) before it loads anything: the emitted form passes, on a free port; a form it
    refuses is told apart."""
    from phasewise.config import EngineConfig
    from phasewise.launch.serve import build_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    docs = manifests(DeploySpec(MODEL, mode="pd", kv_port=free))
    a = cli.parse_args(engine_argv(docs, named(docs, "Deployment", "phasewise-decode-0"),
                                   tmp_path))
    # a bad --disagg-threshold is the next check: reaching it means --kv-bind passed
    for bind, refusal in ((a.kv_bind, "--disagg-threshold"), ("0.0.0.0:1", "K/V address")):
        with pytest.raises(ValueError, match=refusal):
            build_server(EngineConfig(model=str(tmp_path / "none")), role="decode",
                         kv_bind=bind, disagg_threshold=-1)


def test_colocated_router_fronts_the_both_service(tmp_path):
    spec = DeploySpec(MODEL, replicas=2, engine_args=(("--policy", "prefill-first"),
                                                      ("--max-num-seqs", "64")))
    docs = manifests(spec)
    both = named(docs, "Deployment", "phasewise-both")
    a = cli.parse_args(engine_argv(docs, both, tmp_path))
    assert a.role == "both" and a.policy == "prefill-first" and a.max_num_seqs == 64
    assert a.kv_secret_file is None
    cm = named(docs, "ConfigMap", "phasewise-engine")
    assert cm["data"][k8s.ENGINE_ARGS_VAR] == "--policy prefill-first --max-num-seqs 64"
    router = cli.parse_args(container(named(docs, "Deployment", "phasewise-router"))
                            ["command"][1:])
    assert router.decode == ["http://phasewise-both:8000"] and router.prefill == []
    # the router sees every pod: the Service is headless and the router looks its name up
    assert router.discover and named(docs, "Service", "phasewise-both")["spec"][
        "clusterIP"] == "None"
    # a rolling update surges a pod before one drains; a node drain evicts one at a time
    assert both["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    pdb = named(docs, "PodDisruptionBudget", "phasewise-both")
    assert pdb["spec"]["maxUnavailable"] == 1
    labels = both["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # readiness is /health, which turns 503 as the pod drains (it leaves the Service)
    assert container(both)["readinessProbe"]["httpGet"]["path"] == "/health"


def test_engine_args_change_rolls_the_pods():
    a = manifests(DeploySpec(MODEL, engine_args=(("--max-num-seqs", "64"),)))
    b = manifests(DeploySpec(MODEL, engine_args=(("--max-num-seqs", "32"),)))

    def digest(docs):
        pod = named(docs, "Deployment", "phasewise-both")["spec"]["template"]
        return pod["metadata"]["annotations"]["phasewise/engine-args-sha256"]

    assert digest(a) != digest(b)
    assert digest(a) == digest(manifests(DeploySpec(MODEL, engine_args=(("--max-num-seqs",
                                                                         "64"),))))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.mode}-{s.name}")
def test_yaml_round_trips_and_is_stable(spec, tmp_path):
    docs = manifests(spec)
    text = to_yaml(docs)
    assert list(yaml.safe_load_all(text)) == docs
    assert text == to_yaml(manifests(replace(spec)))
    assert text.startswith("---\napiVersion: ")
    assert text.count("\n---\n") == len(docs) - 1
    (path,) = k8s.write(spec, tmp_path / "out")
    written = path.read_text()
    assert path.name == f"{spec.name}.yaml" and written.endswith(text)
    assert list(yaml.safe_load_all(written)) == docs
    assert ("kubectl" in written and "create secret generic" in written) == (spec.mode == "pd")


def test_hpa_targets_are_kubernetes_quantities():
    assert [k8s._quantity(v) for v in (4.0, 0.85, 2.5, 0.001, 12)] == [
        "4", "850m", "2500m", "1m", "12"]
    docs = manifests(DeploySpec(MODEL, hpa_waiting_per_pod=1.5, hpa_kv_usage=0.9))
    (hpa,) = by_kind(docs, "HorizontalPodAutoscaler")
    targets = {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in hpa["spec"]["metrics"]}
    assert targets["phasewise_num_requests_waiting"] == {"type": "AverageValue",
                                                         "averageValue": "1500m"}
    assert targets["phasewise_kv_cache_usage_perc"]["averageValue"] == "900m"


BAD = [
    (dict(mode="x"), "DeploySpec.mode must be one of colocated, pd"),
    (dict(mode="pd", decode=0), "DeploySpec.decode must be an integer >= 1"),
    (dict(prefill=0), "DeploySpec.prefill must be an integer >= 1"),
    (dict(replicas=True), "DeploySpec.replicas must be an integer >= 1"),
    (dict(name="Phasewise"), "DeploySpec.name must be a DNS-1035 label"),
    (dict(name="1abc"), "DeploySpec.name must be a DNS-1035 label"),
    (dict(name="a_b"), "DeploySpec.name must be a DNS-1035 label"),
    (dict(name="ab-"), "DeploySpec.name must be a DNS-1035 label"),
    (dict(name="a" * 60), "would exceed 63 characters; use at most"),
    (dict(name="a" * 55, mode="pd", decode=12), "-decode-10' would exceed 63 characters; "
     "use at most 53"),
    (dict(namespace="Prod"), "DeploySpec.namespace must be None or a DNS-1123 label"),
    (dict(port=0), "DeploySpec.port must be a port in 1..65535"),
    (dict(kv_port=70000), "DeploySpec.kv_port must be a port in 1..65535"),
    (dict(mode="pd", kv_port=8000), "DeploySpec.kv_port must differ from DeploySpec.port"),
    (dict(hpa_waiting_per_pod=0), "DeploySpec.hpa_waiting_per_pod must be a number >= 0.001"),
    (dict(hpa_kv_usage=-1.0), "DeploySpec.hpa_kv_usage must be a number >= 0.001"),
    (dict(hpa_kv_usage=1.5), "DeploySpec.hpa_kv_usage is a fraction"),
    (dict(hpa_max_replicas=2, replicas=3), "hpa_max_replicas (2) must be >= "
     "DeploySpec.replicas (3)"),
    (dict(disagg_threshold=-1), "DeploySpec.disagg_threshold must be an integer >= 0"),
    (dict(model_path="/data/m"), "DeploySpec.model_path must be a folder under model_mount"),
    (dict(model_path="/models/../etc"), "without '..'"),
    (dict(model_path="/models/a b"), "DeploySpec.model_path"),
    (dict(served_model_name="a;b"), "DeploySpec.served_model_name must be None or made of"),
    (dict(resources={"gpu": RoleResources()}), "DeploySpec.resources keys must be among "
     "both, prefill, decode, router"),
    (dict(labels={"app.kubernetes.io/name": "x"}), "is set by the manifests themselves"),
    (dict(labels={"phasewise/plan": "not ok!"}), "must be a label value"),
    (dict(image_pull_policy="always"), "must be one of Always, IfNotPresent, Never"),
    (dict(kv_secret="My_Secret"), "DeploySpec.kv_secret must name a Kubernetes object"),
    (dict(network_policy="yes"), "DeploySpec.network_policy must be True or False"),
    # engine_args
    (dict(engine_args=(("--frobnicate", "1"),)), "unknown flag '--frobnicate'; the engine "
     "flags of phasewise serve that can be set here:"),
    (dict(engine_args=(("--max-num-seqs", "8; rm -rf /"),)), "the value of --max-num-seqs"),
    (dict(engine_args=(("--kv-cache-memory", "$(id)"),)), "goes through sh; it may hold "
     "only letters, digits"),
    (dict(engine_args=(("--kv-cache-memory", "4 GiB"),)), "the value of --kv-cache-memory"),
    (dict(engine_args=(("--kv-cache-memory", "*"),)), "the value of --kv-cache-memory"),
    (dict(engine_args=(("--kv-cache-memory", ""),)), "the value of --kv-cache-memory"),
    (dict(engine_args=(("--policy", "fifo"),)), "--policy must be one of chunked, "
     "prefill-first"),
    (dict(engine_args=(("--max-num-seqs", "lots"),)), "--max-num-seqs takes an integer"),
    (dict(engine_args=(("--device", "tpu"),)), "--device must be one of auto, cpu, cuda "
     "or cuda:N"),
    (dict(engine_args=(("--no-prefix-caching", "true"),)), "is a switch and takes no value"),
    (dict(engine_args=(("--port", "9000"),)), "--port is set by the manifests; use "
     "DeploySpec.port"),
    (dict(engine_args=(("--api-key", "k"),)), "use DeploySpec.api_key_secret (a Secret"),
    (dict(api_key_secret="Keys"), "DeploySpec.api_key_secret must name a Kubernetes object"),
    (dict(engine_args=(("--seed", "1"), ("--seed", "2"))), "--seed is given twice"),
    (dict(engine_args=("--seed",)), "(flag, value) pairs"),
]


@pytest.mark.parametrize("over,message", BAD, ids=[m for _, m in BAD])
def test_bad_specs_say_what_is_wrong(over, message):
    with pytest.raises(ValueError) as e:
        DeploySpec(over.pop("model_path", MODEL), **over)
    assert message in str(e.value)


def test_long_names_fit_where_their_objects_do():
    # 55 + "-router" and "-decode-9" fit in 63; "-decode-11" (above) does not
    for spec in (DeploySpec(MODEL, name="a" * 55), DeploySpec(MODEL, name="a" * 54,
                                                               mode="pd", decode=10)):
        for doc in manifests(spec):
            kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)


@pytest.mark.parametrize("over,message", [
    (dict(cpu="two"), "RoleResources.cpu must be a positive Kubernetes quantity"),
    (dict(memory="0"), "RoleResources.memory must be a positive Kubernetes quantity"),
    (dict(gpus=-1), "RoleResources.gpus must be an integer >= 0"),
])
def test_bad_resources_say_what_is_wrong(over, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        RoleResources(**over)


def _options(command: str) -> dict[str, object]:
    parser = cli.parse_args([command] + (["--decode", "u"] if command == "router" else [])
                            ).parser
    return {s: a for a in parser._actions for s in a.option_strings}


def test_flags_the_manifests_pass_exist_in_the_cli():
    serve, router = _options("serve"), _options("router")
    for flag in k8s.SERVE_FLAGS_USED:
        assert flag in serve, f"phasewise serve lost {flag}, which the manifests pass"
    for flag in k8s.ROUTER_FLAGS_USED:
        assert flag in router, f"phasewise router lost {flag}, which the manifests pass"
    # and those lists are the whole truth about the emitted commands
    docs = manifests(SPECS[2]) + manifests(SPECS[0])
    for dep in by_kind(docs, "Deployment"):
        cmd = container(dep)["command"]
        words = cmd[2].split() if cmd[0] == "sh" else cmd
        used = k8s.ROUTER_FLAGS_USED if role(dep) == "router" else k8s.SERVE_FLAGS_USED
        assert {w for w in words if w.startswith("--")} <= set(used)


def test_engine_flag_table_matches_the_serve_parser():
    serve = _options("serve")
    for flag, kind in k8s.ENGINE_FLAGS.items():
        action = serve.get(flag)
        assert action is not None, f"phasewise serve has no {flag}"
        if kind == k8s.SWITCH:
            assert action.nargs == 0, flag
            continue
        assert action.nargs is None, flag  # one value
        if isinstance(kind, tuple):
            assert tuple(action.choices) == kind, flag
        else:
            assert action.choices is None, flag
            # (--threads: an int the parser also bounds by the cores, checked in the pod)
            typed = {"--threads": thread_count}.get(flag, kind)
            assert (action.type or str) is typed, flag
    # Every flag of serve is either settable through engine_args or set by the manifests: a
    # new flag has to be placed in one of the two tables.
    known = set(k8s.ENGINE_FLAGS) | set(k8s.MANAGED_FLAGS) | {"-h", "--help", "--debug"}
    assert set(serve) - known == set()
    assert set(k8s.MANAGED_FLAGS) <= set(serve)


def test_imports_no_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from phasewise.perf.k8s import DeploySpec, manifests, to_yaml\n"
            "print(len(to_yaml(manifests(DeploySpec('/models/m', mode='pd', decode=2)))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 1000


def test_a_cpu_pod_runs_as_many_threads_as_its_cpu_limit():
    """A container sees every core of its node and torch would start as many threads; under
    a limit of a few CPUs they take turns, and every kernel waits for the slowest. So a CPU
    pod's serve gets --threads at its limit, unless engine_args set it; a GPU pod none."""
    assert [k8s.cpu_threads(RoleResources(cpu=c)) for c in ("2", "500m", "3.5", "16")] == \
        [2, 1, 3, 16]
    assert k8s.cpu_threads(RoleResources(cpu="8", gpus=1)) is None

    def threads_of(spec, name):
        (script,) = [c for c in container(named(manifests(spec), "Deployment", name))
                     ["command"] if "exec phasewise serve" in c]
        words = script.split()
        return [words[i + 1] for i, w in enumerate(words) if w == "--threads"]

    cpu = DeploySpec("/models/m", resources={"both": RoleResources(cpu="1500m")})
    assert threads_of(cpu, "phasewise-both") == ["1"]
    own = DeploySpec("/models/m", engine_args=(("--threads", "1"),),
                     resources={"both": RoleResources(cpu="4")})
    assert threads_of(own, "phasewise-both") == []  # theirs, from the ConfigMap
    assert "--threads 1" in named(manifests(own), "ConfigMap", "phasewise-engine")["data"][
        k8s.ENGINE_ARGS_VAR]
    gpu = DeploySpec("/models/m", resources={"both": RoleResources(cpu="8", gpus=1)})
    assert threads_of(gpu, "phasewise-both") == []
