"""The Kubernetes manifests and the Dockerfiles, checked for structure (no kubectl, no docker here): lmrpc's
(deploy/kubernetes), SMG in front of it (deploy/smg) and the Inference Extension pool (deploy/inference-pool), which
must name the same pod labels, ports and service account.

Each rule is a `check_*` function that raises AssertionError; the tests run them on the real files, and the
`test_*_rejects_*` tests run them on broken copies to show that each rule can fail.
"""

from __future__ import annotations

import copy
import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
DOCKERFILE = ROOT / "Dockerfile"
SMG = ROOT / "deploy" / "smg"
SMG_VERSION = "1.13.0"  # the gateway version lmrpc's worker service is tested against (README "Behind SMG")
POOL = ROOT / "deploy" / "inference-pool" / "inferencepool.yaml"
SMG_SETTLE_SECONDS = 5.0  # SMG keeps listening this long after SIGTERM before it drains (1.13's fixed window)
SERVICE_NAME = "lmrpc.v1.GenerateService"
GRACE_MARGIN_SECONDS = 5.0  # what terminationGracePeriodSeconds must leave beyond the longest drain

Doc = dict[str, Any]


def load_docs(folder: Path = K8S) -> list[Doc]:
    docs: list[Doc] = []
    for path in sorted(folder.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                assert isinstance(doc, dict), f"{path.name}: a document is not a mapping"
                docs.append(doc)
    return docs


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d.get("kind") == kind]


def the_one(docs: list[Doc], kind: str) -> Doc:
    found = of_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def pod_spec(deployment: Doc) -> Doc:
    spec: Doc = deployment["spec"]["template"]["spec"]
    return spec


def server_container(deployment: Doc) -> Doc:
    containers = pod_spec(deployment)["containers"]
    assert len(containers) == 1, "expected one container"
    container: Doc = containers[0]
    return container


def grpc_port(container: Doc) -> int:
    ports = [p for p in container.get("ports", []) if p.get("name") == "grpc"]
    assert len(ports) == 1, "the container has no (or several) ports named grpc"
    number = ports[0]["containerPort"]
    assert isinstance(number, int)
    return number


def server_argv(container: Doc) -> list[str]:
    """The argv lmrpc-server gets: the container's command + args, or the image's CMD when both are unset."""
    command = [str(c) for c in container.get("command", [])]
    args = [str(a) for a in container.get("args", [])]
    if not command and not args:
        return dockerfile_cmd()
    argv = command + args if command else args
    assert argv and argv[0] == "lmrpc-server", f"the container does not run lmrpc-server: {argv}"
    return argv[1:]


def flag_value(argv: list[str], flag: str) -> str | None:
    """The last value given to `--flag value` or `--flag=value` (argparse's rule), or None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def prestop_sleep_seconds(container: Doc) -> float:
    pre_stop = container.get("lifecycle", {}).get("preStop")
    if pre_stop is None:
        return 0.0
    if "sleep" in pre_stop:  # the native sleep action
        return float(pre_stop["sleep"]["seconds"])
    command = [str(c) for c in pre_stop.get("exec", {}).get("command", [])]
    if command and Path(command[0]).name == "sleep":
        return float(command[1])
    raise AssertionError(f"unrecognised preStop hook {pre_stop!r}: count its duration in this check")


# --- Dockerfile ------------------------------------------------------------------------------------------------

def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerfile_cmd() -> list[str]:
    cmds = [rest for word, rest in dockerfile_instructions(DOCKERFILE.read_text()) if word == "CMD"]
    assert cmds, "the Dockerfile has no CMD"
    argv = yaml.safe_load(cmds[-1]) if cmds[-1].startswith("[") else shlex.split(cmds[-1])
    assert argv[0] == "lmrpc-server"
    return [str(a) for a in argv[1:]]


def check_dockerfile(text: str) -> None:
    instructions = dockerfile_instructions(text)
    users = [rest for word, rest in instructions if word == "USER"]
    assert users, "the Dockerfile has no USER: the server would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"the final USER is root ({users[-1]})"
    healthchecks = [rest for word, rest in instructions if word == "HEALTHCHECK"]
    assert healthchecks, "the Dockerfile has no HEALTHCHECK"
    assert healthchecks[-1].upper() != "NONE", "the HEALTHCHECK is disabled"
    assert "health" in healthchecks[-1], "the HEALTHCHECK does not ask the gRPC health service"


def dockerfile_uid(text: str) -> int:
    match = re.search(r"useradd\b[^\n]*--uid\s+(\d+)", text)
    assert match, "the Dockerfile creates no user with an explicit --uid"
    return int(match.group(1))


def dockerfile_env(text: str, name: str) -> str:
    match = re.search(rf"\b{name}=(\S+)", text)
    assert match, f"the Dockerfile sets no {name}"
    return match.group(1)


# --- manifests -------------------------------------------------------------------------------------------------

def check_kinds(docs: list[Doc]) -> None:
    for doc in docs:
        assert doc.get("apiVersion") and doc.get("kind"), f"a document lacks apiVersion/kind: {doc}"
    for kind in ("Deployment", "Service", "HorizontalPodAutoscaler"):
        assert of_kind(docs, kind), f"no {kind}"
    hpa = the_one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"


def check_probes(deployment: Doc) -> None:
    container = server_container(deployment)
    port = grpc_port(container)
    for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container.get(probe_name)
        assert probe is not None, f"no {probe_name}"
        assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, f"{probe_name} is not a gRPC probe"
        assert probe["grpc"]["port"] == port, f"{probe_name} probes port {probe['grpc']['port']}, not grpc ({port})"
        assert probe["grpc"].get("service", "") in ("", SERVICE_NAME), f"{probe_name} asks for an unknown service"
    startup = container["startupProbe"]
    budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
    assert budget >= 300, f"the startupProbe gives the first model conversion only {budget} s"


def check_service(service: Doc, deployment: Doc) -> None:
    container = server_container(deployment)
    port = grpc_port(container)
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = service["spec"]["selector"]
    assert selector, f"Service {service['metadata']['name']} selects nothing"
    assert selector.items() <= pod_labels.items(), f"Service selector {selector} does not match the pod labels"
    ports = service["spec"]["ports"]
    grpc_ports = [p for p in ports if p.get("name") == "grpc"]
    assert len(grpc_ports) == 1, "the Service has no port named grpc"
    target = grpc_ports[0].get("targetPort", grpc_ports[0]["port"])
    assert target in ("grpc", port), f"the Service targets {target!r}, not the container's grpc port ({port})"
    assert grpc_ports[0].get("appProtocol") in ("grpc", "kubernetes.io/h2c", "http2"), "appProtocol is not gRPC/h2c"


def check_selectors(docs: list[Doc]) -> None:
    deployment = the_one(docs, "Deployment")
    match_labels = deployment["spec"]["selector"]["matchLabels"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert match_labels, "the Deployment selector is empty"
    assert match_labels.items() <= pod_labels.items(), "the Deployment selector does not match its pod labels"
    for pdb in of_kind(docs, "PodDisruptionBudget"):
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items(), "the PDB selects other pods"


def check_hpa(hpa: Doc, deployment: Doc) -> None:
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"]) == ("apps/v1", "Deployment"), f"the HPA targets a {ref['kind']}"
    assert ref["name"] == deployment["metadata"]["name"], f"the HPA targets {ref['name']!r}, not the Deployment"
    assert 1 <= hpa["spec"].get("minReplicas", 1) <= hpa["spec"]["maxReplicas"]
    cpu = [m for m in hpa["spec"]["metrics"] if m["type"] == "Resource" and m["resource"]["name"] == "cpu"]
    assert cpu and cpu[0]["resource"]["target"]["type"] == "Utilization", "the HPA does not scale on CPU utilisation"
    assert "cpu" in server_container(deployment)["resources"]["requests"], "CPU utilisation needs a CPU request"


def check_termination_grace(deployment: Doc) -> None:
    container = server_container(deployment)
    argv = server_argv(container)
    drain_delay = flag_value(argv, "--drain-delay")
    shutdown_grace = flag_value(argv, "--shutdown-grace")
    assert drain_delay is not None and shutdown_grace is not None, "set --drain-delay and --shutdown-grace explicitly"
    drain = prestop_sleep_seconds(container) + float(drain_delay) + float(shutdown_grace)
    grace = pod_spec(deployment).get("terminationGracePeriodSeconds", 30)
    assert grace > drain + GRACE_MARGIN_SECONDS, (
        f"terminationGracePeriodSeconds {grace} does not exceed preStop + --drain-delay + --shutdown-grace ({drain})"
        f" by {GRACE_MARGIN_SECONDS} s: the kubelet would SIGKILL in-flight streams")


def check_non_root(deployment: Doc, uid: int, cache_dir: str) -> None:
    spec = pod_spec(deployment)
    container = server_container(deployment)
    pod_sc = spec.get("securityContext", {})
    sc = {**pod_sc, **container.get("securityContext", {})}  # the container's settings win
    assert sc.get("runAsNonRoot") is True, "runAsNonRoot is not set"
    assert sc.get("runAsUser") == uid, f"runAsUser {sc.get('runAsUser')} is not the image's user ({uid})"
    assert sc.get("allowPrivilegeEscalation") is False, "allowPrivilegeEscalation is not false"
    assert sc.get("readOnlyRootFilesystem") is True, "the root filesystem is writable"
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    empty_dirs = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
    assert mounts.get(cache_dir) in empty_dirs, f"no emptyDir mounted at the model cache {cache_dir}"
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    assert env.get("LMRPC_CACHE", cache_dir) == cache_dir, "LMRPC_CACHE does not point at the mounted cache"


def check_kustomization(names: list[str], folder: Path = K8S) -> None:
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    listed = kustomization["resources"]
    assert sorted(listed) == sorted(names), f"kustomization.yaml lists {listed}, the folder has {names}"


# --- the real files --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def docs() -> list[Doc]:
    return load_docs()


@pytest.fixture(scope="module")
def deployment(docs: list[Doc]) -> Doc:
    return the_one(docs, "Deployment")


def test_every_yaml_parses_and_the_kinds_are_there(docs: list[Doc]) -> None:
    assert list(K8S.glob("*.yml")) == [], "use .yaml: the checks read *.yaml only"
    check_kinds(docs)


def test_kustomization_lists_every_manifest() -> None:
    check_kustomization([p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"])


def test_probes_are_grpc_probes_on_the_grpc_port(deployment: Doc) -> None:
    check_probes(deployment)
    container = server_container(deployment)
    assert container["readinessProbe"]["grpc"].get("service", "") in ("", SERVICE_NAME)
    assert flag_value(server_argv(container), "--port") == str(grpc_port(container)), "the server listens elsewhere"


def test_services_target_the_grpc_port_and_select_the_pods(docs: list[Doc], deployment: Doc) -> None:
    for service in of_kind(docs, "Service"):
        check_service(service, deployment)
    check_selectors(docs)


def test_hpa_targets_the_deployment(docs: list[Doc], deployment: Doc) -> None:
    check_hpa(the_one(docs, "HorizontalPodAutoscaler"), deployment)


def test_termination_grace_exceeds_the_drain(deployment: Doc) -> None:
    check_termination_grace(deployment)


def test_container_args_are_lmrpc_server_flags(deployment: Doc) -> None:
    from lmrpc.server.__main__ import parse_args  # the real parser: a misspelt flag would crash the pod

    argv = server_argv(server_container(deployment))
    args = parse_args(argv)
    assert args.drain_delay == float(flag_value(argv, "--drain-delay") or "nan")
    assert args.shutdown_grace == float(flag_value(argv, "--shutdown-grace") or "nan")


def test_pod_runs_as_the_images_non_root_user(deployment: Doc) -> None:
    text = DOCKERFILE.read_text()
    check_non_root(deployment, dockerfile_uid(text), dockerfile_env(text, "LMRPC_CACHE"))


def test_dockerfile_has_a_non_root_user_and_a_healthcheck() -> None:
    check_dockerfile(DOCKERFILE.read_text())


# --- the checks can fail ---------------------------------------------------------------------------------------

def broken(deployment: Doc, mutate: Callable[[Doc], object]) -> Doc:
    copy_ = copy.deepcopy(deployment)
    mutate(copy_)
    return copy_


def container_of(d: Doc) -> Doc:
    container: Doc = d["spec"]["template"]["spec"]["containers"][0]
    return container


def test_probe_check_rejects_wrong_port_and_http_probe(deployment: Doc) -> None:
    with pytest.raises(AssertionError, match="not grpc"):
        check_probes(broken(deployment, lambda d: container_of(d)["livenessProbe"]["grpc"].update(port=8080)))
    with pytest.raises(AssertionError, match="not a gRPC probe"):
        check_probes(broken(deployment, lambda d: container_of(d).update(
            readinessProbe={"httpGet": {"path": "/healthz", "port": 8080}})))
    with pytest.raises(AssertionError, match="first model conversion"):
        check_probes(broken(deployment, lambda d: container_of(d)["startupProbe"].update(failureThreshold=3)))


def test_service_check_rejects_wrong_target_and_selector(docs: list[Doc], deployment: Doc) -> None:
    service = of_kind(docs, "Service")[0]
    wrong_target = copy.deepcopy(service)
    wrong_target["spec"]["ports"][0]["targetPort"] = 8080
    with pytest.raises(AssertionError, match="targets"):
        check_service(wrong_target, deployment)
    wrong_selector = copy.deepcopy(service)
    wrong_selector["spec"]["selector"] = {"app.kubernetes.io/name": "other"}
    with pytest.raises(AssertionError, match="does not match"):
        check_service(wrong_selector, deployment)


def test_hpa_check_rejects_another_target(docs: list[Doc], deployment: Doc) -> None:
    hpa = copy.deepcopy(the_one(docs, "HorizontalPodAutoscaler"))
    hpa["spec"]["scaleTargetRef"]["name"] = "not-lmrpc"
    with pytest.raises(AssertionError, match="not the Deployment"):
        check_hpa(hpa, deployment)


def test_grace_check_rejects_a_short_grace_period(deployment: Doc) -> None:
    with pytest.raises(AssertionError, match="SIGKILL"):
        check_termination_grace(broken(deployment, lambda d: d["spec"]["template"]["spec"].update(
            terminationGracePeriodSeconds=30)))
    longer = broken(deployment, lambda d: container_of(d)["args"].append("--shutdown-grace=300"))
    with pytest.raises(AssertionError, match="SIGKILL"):
        check_termination_grace(longer)


def test_non_root_check_rejects_root_and_a_writable_root(deployment: Doc) -> None:
    text = DOCKERFILE.read_text()
    uid, cache = dockerfile_uid(text), dockerfile_env(text, "LMRPC_CACHE")
    with pytest.raises(AssertionError, match="runAsNonRoot"):
        check_non_root(broken(deployment, lambda d: container_of(d)["securityContext"].update(runAsNonRoot=False)),
                       uid, cache)
    with pytest.raises(AssertionError, match="writable"):
        check_non_root(broken(deployment, lambda d: container_of(d)["securityContext"].pop("readOnlyRootFilesystem")),
                       uid, cache)


def test_dockerfile_check_rejects_root_and_a_missing_healthcheck() -> None:
    text = DOCKERFILE.read_text()
    with pytest.raises(AssertionError, match="root"):
        check_dockerfile(text + "\nUSER root\n")
    with pytest.raises(AssertionError, match="HEALTHCHECK"):
        check_dockerfile(re.sub(r"(?m)^HEALTHCHECK.*(\n\s+CMD.*)?$", "", text))
    with pytest.raises(AssertionError, match="no USER"):
        check_dockerfile(re.sub(r"(?m)^USER .*$", "", text))


# --- SMG in front (deploy/smg) and the Inference Extension pool (deploy/inference-pool) ----------------------

def named_port(container: Doc, name: str) -> int:
    ports = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == name]
    assert len(ports) == 1, f"the container has no (or several) ports named {name}"
    number = ports[0]
    assert isinstance(number, int)
    return number


def pod_labels(deployment: Doc) -> dict[str, str]:
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"]["labels"]
    return labels


def smg_args(container: Doc) -> Any:
    """SMG's own parse of the container's argv (smg.launch_router.parse_router_args: a misspelt flag fails here)."""
    launch_router = pytest.importorskip("smg.launch_router")
    argv = [str(a) for a in container.get("command", [])] + [str(a) for a in container.get("args", [])]
    assert argv[:2] == ["smg", "launch"], f"the container does not run `smg launch`: {argv}"
    return launch_router.parse_router_args(argv[2:])


def check_smg_discovery(smg: Doc, lmrpc: Doc) -> None:
    """SMG watches exactly the lmrpc pods, on their gRPC port, in its own namespace, with cache-aware routing."""
    container = server_container(smg)
    args = smg_args(container)
    assert args.service_discovery, "SMG's Kubernetes service discovery is off"
    assert args.selector, "SMG's discovery selector is empty: it would register every pod it sees"
    assert args.selector.items() <= pod_labels(lmrpc).items(), (
        f"SMG's selector {args.selector} does not match the lmrpc pod labels")
    assert args.service_discovery_port == grpc_port(server_container(lmrpc)), (
        f"SMG reaches the pods on port {args.service_discovery_port}, not lmrpc's grpc port")
    assert args.policy == "cache_aware", f"the policy is {args.policy}"
    env = {e["name"]: e for e in container.get("env", [])}
    namespace = args.service_discovery_namespace
    assert namespace is not None, "no --service-discovery-namespace: SMG would watch the whole cluster"
    match = re.fullmatch(r"\$\((\w+)\)", namespace)
    assert match and env.get(match.group(1), {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == \
        "metadata.namespace", f"--service-discovery-namespace={namespace} is not the pod's own namespace"
    assert args.port == named_port(container, "http"), "SMG listens elsewhere than the container's http port"
    assert args.prometheus_port == named_port(container, "metrics"), "SMG's metrics are not on the metrics port"


def check_smg_rbac(docs: list[Doc], smg: Doc) -> None:
    """The pod runs as the service account the RoleBinding gives list/watch on pods."""
    spec = pod_spec(smg)
    account = spec.get("serviceAccountName")
    assert account, "the SMG pod runs as the default service account"
    assert account in {a["metadata"]["name"] for a in of_kind(docs, "ServiceAccount")}, f"no ServiceAccount {account}"
    assert spec.get("automountServiceAccountToken", True) is True, "the pod mounts no token to watch pods with"
    roles = {r["metadata"]["name"]: r for r in of_kind(docs, "Role")}
    granted: set[str] = set()
    for binding in of_kind(docs, "RoleBinding"):
        if any(s["kind"] == "ServiceAccount" and s["name"] == account for s in binding["subjects"]):
            ref = binding["roleRef"]
            assert ref["kind"] == "Role" and ref["name"] in roles, f"the RoleBinding names no Role here: {ref}"
            for rule in roles[ref["name"]]["rules"]:
                if "" in rule["apiGroups"] and "pods" in rule["resources"]:
                    granted |= set(rule["verbs"])
    assert {"list", "watch"} <= granted, f"{account} may not list and watch pods (has {sorted(granted)})"


def check_smg_pod(docs: list[Doc], smg: Doc) -> None:
    container = server_container(smg)
    for probe_name in ("readinessProbe", "livenessProbe"):
        probe = container[probe_name]["httpGet"]
        assert probe["port"] in ("http", named_port(container, "http")), f"{probe_name} probes another port"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readiness"
    for service in of_kind(docs, "Service"):
        assert service["spec"]["selector"].items() <= pod_labels(smg).items(), "the SMG Service selects other pods"
        for port in service["spec"]["ports"]:
            named_port(container, port["targetPort"])
    shutdown = float(smg_args(container).shutdown_grace_period_secs)
    grace = pod_spec(smg).get("terminationGracePeriodSeconds", 30)
    assert grace > SMG_SETTLE_SECONDS + shutdown + GRACE_MARGIN_SECONDS, (
        f"terminationGracePeriodSeconds {grace} does not cover SMG's drain ({SMG_SETTLE_SECONDS} + {shutdown} s)")


def check_smg_image(smg: Doc, dockerfile: str) -> None:
    """The image the manifest runs is the one deploy/smg/Dockerfile builds: SMG 1.13.0, as a non-root user."""
    image = server_container(smg)["image"]
    kustomization = yaml.safe_load((SMG / "kustomization.yaml").read_text())
    names = {i["name"]: f"{i.get('newName', i['name'])}:{i['newTag']}" for i in kustomization.get("images", [])}
    name, _, tag = image.partition(":")
    assert names.get(name, image) == f"{name}:{tag}" == f"{name}:{SMG_VERSION}", f"{image} is not SMG {SMG_VERSION}"
    assert f"docker build -t {name}:{SMG_VERSION} deploy/smg" in dockerfile, "the Dockerfile builds another tag"
    assert re.search(rf"SMG_VERSION={re.escape(SMG_VERSION)}\b", dockerfile), "the Dockerfile pins another SMG"
    users = [rest for word, rest in dockerfile_instructions(dockerfile) if word == "USER"]
    assert users and users[-1] == str(pod_spec(smg)["securityContext"]["runAsUser"]), "runAsUser is not the USER"
    check_non_root_settings(smg)


def check_non_root_settings(deployment: Doc) -> None:
    sc = {**pod_spec(deployment).get("securityContext", {}), **server_container(deployment).get("securityContext", {})}
    assert sc.get("runAsNonRoot") is True and sc.get("allowPrivilegeEscalation") is False
    assert sc.get("readOnlyRootFilesystem") is True, "the root filesystem is writable"


def check_inference_pool(pool: Doc, lmrpc: Doc) -> None:
    """The pool selects the lmrpc pods on their gRPC port, and those pods export metrics for the picker."""
    assert (pool["apiVersion"], pool["kind"]) == ("inference.networking.k8s.io/v1", "InferencePool")
    spec = pool["spec"]
    selector = spec["selector"]["matchLabels"]
    assert selector and selector.items() <= pod_labels(lmrpc).items(), f"the pool selects {selector}, not lmrpc"
    container = server_container(lmrpc)
    assert [p["number"] for p in spec["targetPorts"]] == [grpc_port(container)], "the pool targets another port"
    assert spec.get("appProtocol") == "kubernetes.io/h2c", "lmrpc speaks gRPC: the pool must say h2c"
    assert spec["endpointPickerRef"]["name"], "the pool names no endpoint picker"
    metrics = flag_value(server_argv(container), "--metrics-port")
    assert metrics is not None, "lmrpc-server runs without --metrics-port: the picker would have nothing to read"
    assert int(metrics) == named_port(container, "metrics"), "--metrics-port is not the container's metrics port"


@pytest.fixture(scope="module")
def smg_docs() -> list[Doc]:
    return load_docs(SMG)


@pytest.fixture(scope="module")
def smg(smg_docs: list[Doc]) -> Doc:
    return the_one(smg_docs, "Deployment")


def test_smg_manifests_parse_and_the_kustomization_lists_them(smg_docs: list[Doc]) -> None:
    assert list(SMG.glob("*.yml")) == [], "use .yaml: the checks read *.yaml only"
    for doc in smg_docs:
        assert doc.get("apiVersion") and doc.get("kind"), f"a document lacks apiVersion/kind: {doc}"
    check_kustomization([p.name for p in SMG.glob("*.yaml") if p.name != "kustomization.yaml"], SMG)
    kinds = sorted(d["kind"] for d in smg_docs if d["kind"] != "Kustomization")
    assert kinds == ["Deployment", "Role", "RoleBinding", "Service", "ServiceAccount"]


def test_smg_discovers_the_lmrpc_pods(smg: Doc, deployment: Doc) -> None:
    check_smg_discovery(smg, deployment)


def test_smg_service_account_may_watch_pods(smg_docs: list[Doc], smg: Doc) -> None:
    check_smg_rbac(smg_docs, smg)


def test_smg_pod_probes_service_and_grace(smg_docs: list[Doc], smg: Doc) -> None:
    check_smg_pod(smg_docs, smg)
    check_selectors(smg_docs)


def test_smg_image_is_the_documented_build(smg: Doc) -> None:
    check_smg_image(smg, (SMG / "Dockerfile").read_text())


def test_inference_pool_selects_the_lmrpc_pods(deployment: Doc) -> None:
    check_inference_pool(yaml.safe_load(POOL.read_text()), deployment)


def test_smg_checks_reject_a_wrong_selector_port_and_account(smg_docs: list[Doc], smg: Doc, deployment: Doc) -> None:
    def with_args(mutate: Callable[[list[str]], object]) -> Doc:
        return broken(smg, lambda d: mutate(container_of(d)["args"]))

    def replace(old: str, new: str) -> Callable[[list[str]], object]:
        return lambda args: args.__setitem__(args.index(old), new)

    with pytest.raises(AssertionError, match="does not match the lmrpc pod labels"):
        check_smg_discovery(with_args(replace("app.kubernetes.io/name=lmrpc", "app.kubernetes.io/name=vllm")),
                            deployment)
    with pytest.raises(AssertionError, match="not lmrpc's grpc port"):
        check_smg_discovery(with_args(replace("--service-discovery-port=50051", "--service-discovery-port=8000")),
                            deployment)
    with pytest.raises(AssertionError, match="whole cluster"):
        check_smg_discovery(with_args(lambda args: args.remove("--service-discovery-namespace=$(POD_NAMESPACE)")),
                            deployment)
    with pytest.raises(AssertionError, match="no ServiceAccount"):
        check_smg_rbac(smg_docs, broken(smg, lambda d: pod_spec(d).update(serviceAccountName="other")))
    no_watch = copy.deepcopy(smg_docs)
    the_one(no_watch, "Role")["rules"][0]["verbs"] = ["get"]
    with pytest.raises(AssertionError, match="may not list and watch"):
        check_smg_rbac(no_watch, smg)
    with pytest.raises(AssertionError, match="SMG's drain"):
        check_smg_pod(smg_docs, broken(smg, lambda d: pod_spec(d).update(terminationGracePeriodSeconds=30)))


def test_pool_check_rejects_another_port_and_missing_metrics(deployment: Doc) -> None:
    pool = yaml.safe_load(POOL.read_text())
    wrong_port = copy.deepcopy(pool)
    wrong_port["spec"]["targetPorts"] = [{"number": 8000}]
    with pytest.raises(AssertionError, match="another port"):
        check_inference_pool(wrong_port, deployment)
    no_metrics = broken(deployment, lambda d: container_of(d)["args"].remove("--metrics-port=9090"))
    with pytest.raises(AssertionError, match="without --metrics-port"):
        check_inference_pool(pool, no_metrics)
